"""The TP/EP-sharded layout: one HF-named folder per rank, a manifest, and an exact way back.

On disk (``inkling-ckpt shard SRC DST --tp N --ep M``)::

    DST/inkling-shard.json       the manifest (below)
    DST/rank-00/ ... rank-NN/    HF-named safetensors with each rank's *local* shapes, and an
                                 index (model.safetensors.index.json) whose metadata names the rank
    DST/source/                  the source's own small files byte for byte (config.json, index,
                                 hf_quant_config.json, tokenizer, ...) and headers/<shard>.header:
                                 each source shard's header bytes, so a merge rebuilds it exactly

Manifest (``format: inkling-ckpt/sharded``, ``version: 2``): ``plan`` (tp, ep, moe_tp),
``model`` (variant, precision plan), ``ranks`` (per rank: folder, EP rank, moe-TP rank, tensors,
bytes), ``experts`` (EP rank -> [first, stop) experts and the TP ranks holding them), ``rules``
(inventory row pattern -> split and dim), ``expert_parts`` (how each stored part of a stacked
expert follows: EP slice, moe-TP cut), ``tensors`` (name -> global shape, local shape, dtype,
split, stored dim cut or null, pieces, ``holders``: the piece each rank holds or null, and for
stacked experts split over moe_tp too an ``inner`` cut {dim, pieces, holders} inside each EP
piece), ``source`` (each source file: bytes, sha256, and for shards the header copy) and
``files`` (every file under DST: bytes, sha256).

Piece ``p`` of a tensor cut along ``dim`` into ``n`` pieces is the contiguous range
``[p·size/n, (p+1)·size/n)``. Stacked experts are EP-sliced on dim 0 (the expert axis); with
moe_tp > 1, ``w13`` rows are then cut in whole interleaved (gate, up) pairs and ``w2`` columns,
their block scales alike. Both ways tensors move in blocks of dim-0 rows (:data:`CHUNK_BYTES`):
an EP slice of a layer's experts is never whole in memory. A merge reads each piece from the
lowest rank holding it, concatenates and writes it at its original offset under the original
header, then checks the file against the source's sha256.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import torch

from ..errors import CheckpointError, IntegrityError
from ..model.config import InklingConfig, read_json
from ..model.inventory import Category, TensorSpec, detect_plan, inventory, is_vision, nbytes
from ..model.precision import PrecisionPlan
from ..plan import Cut, Placement, ShardPlan
from ..plan.rules import EXPERT_PARTS, SPLITS
from ..progress import ByteProgress
from .hf import DTYPE_TO_ST, INDEX, ST_TO_DTYPE, HFCheckpoint, HFWriter, read_header
from .paths import check_name, copy_new, inside, open_regular, pass_through
from .staging import DONE_FILE, JOB_FILE, Staging

MANIFEST = "inkling-shard.json"
FORMAT = "inkling-ckpt/sharded"
VERSION = 2  # 2: release layout (stacked experts, 'inner' moe-TP cuts, local shapes)
SOURCE_DIR = "source"
HEADERS_DIR = f"{SOURCE_DIR}/headers"
_HASH_CHUNK = 16 << 20
#: Tensors move in blocks of dim-0 rows of about this size (at least one row): one expert of a
#: stacked [E, 2F, H] tensor is 21 MB in MXFP8 on the full model, the whole layer 8 GB.
CHUNK_BYTES = 64 << 20
#: Never passed through from a source folder (nothing that loads Inkling 2 reads it).
QUANT_CONFIG = "hf_quant_config.json"


def rank_dir(rank: int) -> str:
    return f"rank-{rank:02d}"


# ---- raw safetensors access ---------------------------------------------------------------

@dataclass(frozen=True)
class RawHeader:
    """A safetensors file's header bytes (with the 8-byte length) and each tensor's data range."""

    blob: bytes
    entries: dict[str, tuple[tuple[int, ...], torch.dtype, int, int]]  # name -> shape, dtype, start, stop

    @property
    def data_start(self) -> int:
        return len(self.blob)

    def in_offset_order(self) -> list[str]:
        return sorted(self.entries, key=lambda n: self.entries[n][2])


def raw_header(path: Path) -> RawHeader:
    """Parse a safetensors header keeping its exact bytes; validated by :func:`read_header` first."""
    read_header(path)  # size, truncation and shape/dtype checks, with one-line errors
    with open_regular(path) as f:
        head = f.read(8)
        (n,) = struct.unpack("<Q", head)
        blob = head + f.read(n)
    header = json.loads(blob[8:])
    header.pop("__metadata__", None)
    entries = {name: (tuple(int(s) for s in info["shape"]), ST_TO_DTYPE[info["dtype"]],
                      int(info["data_offsets"][0]), int(info["data_offsets"][1]))
               for name, info in header.items()}
    return RawHeader(blob, entries)


def bytes_to_tensor(buf: bytearray, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    t = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
    return t.view(dtype).reshape(shape)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as uint8 of shape ``(*shape, itemsize)`` (slicing works alike for every dtype)."""
    return t.contiguous().reshape(-1).view(torch.uint8).reshape(*t.shape, t.dtype.itemsize)


def from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`as_bytes`."""
    return b.contiguous().reshape(-1).view(dtype).reshape(b.shape[:-1])


def row_blocks(shape: tuple[int, ...], dtype: torch.dtype, limit: int | None = None) -> list[tuple[int, int]]:
    """``[start, stop)`` blocks of dim-0 rows of about ``limit`` bytes (default :data:`CHUNK_BYTES`;
    at least one row); a scalar is one block of one "row"."""
    if not shape:
        return [(0, 1)]
    row = max(1, nbytes(shape[1:], dtype))
    step = max(1, (limit or CHUNK_BYTES) // row)
    return [(a, min(a + step, shape[0])) for a in range(0, shape[0], step)]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open_regular(path) as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _hash_files(root: Path, rels: list[str], workers: int | None = None) -> dict[str, dict[str, Any]]:
    """sha256 and size of each file (threads: hashlib releases the GIL on large buffers)."""
    def one(rel: str) -> tuple[str, dict[str, Any]]:
        p = root / rel
        return rel, {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
    with ThreadPoolExecutor(max_workers=workers or min(8, os.cpu_count() or 1)) as pool:
        return dict(pool.map(one, rels))


class _Hasher:
    """Hashes finished output files on background threads while the next ones are written."""

    def __init__(self, root: Path):
        self.root = root
        self.pool = ThreadPoolExecutor(max_workers=2)
        self.futures: dict[str, Any] = {}

    def submit(self, rel: str) -> None:
        self.futures[rel] = self.pool.submit(lambda: {"bytes": (self.root / rel).stat().st_size,
                                                      "sha256": sha256_file(self.root / rel)})

    def results(self, rels: list[str]) -> dict[str, dict[str, Any]]:
        """Hashes of ``rels``: those already done in the background, the rest now."""
        done = {rel: self.futures[rel].result() for rel in rels if rel in self.futures}
        done.update(_hash_files(self.root, [rel for rel in rels if rel not in done]))
        return done

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class _RankStaging:
    """A rank's sub-folder of the job's staging folder, shaped like :class:`Staging` for HFWriter."""

    def __init__(self, st: Staging, sub: str, hasher: _Hasher | None = None):
        self.st, self.sub, self.hasher = st, sub, hasher
        self.path = st.path / sub
        self.path.mkdir(parents=True, exist_ok=True)

    def is_finished(self, rel: str) -> bool:
        return self.st.is_finished(f"{self.sub}/{rel}")

    def partial(self, rel: str) -> Path:
        return self.st.partial(f"{self.sub}/{rel}")

    def finish(self, rel: str) -> None:
        self.st.finish(f"{self.sub}/{rel}")
        if self.hasher is not None:
            self.hasher.submit(f"{self.sub}/{rel}")


# ---- shard --------------------------------------------------------------------------------

@dataclass
class ShardResult:
    dst: Path
    skipped: bool = False
    resumed: bool = False
    tensors: int = 0
    source_bytes: int = 0
    written_bytes: int = 0
    rank_bytes: list[int] = dataclasses.field(default_factory=list)


def plan_checkpoint(ckpt: HFCheckpoint, tp: int, ep: int) -> ShardPlan:
    """The shard plan of an opened checkpoint (validates the plan; reads no tensor data)."""
    return ShardPlan.build(ckpt.cfg, ckpt.plan, tp, ep, ckpt.expected())


def _source_files(ckpt: HFCheckpoint) -> tuple[list[str], list[str]]:
    """(safetensors shards in use, other top-level files to keep verbatim)."""
    shards = sorted({t.file for t in ckpt.tensors.values()})
    small = list(pass_through(ckpt.root, skip=lambda rel: rel in shards or rel.endswith(".safetensors")))
    return shards, small


def shard(src: str | Path, dst: str | Path, tp: int, ep: int, *, max_shard_size: int | str = "5GB",
          force: bool = False, progress: bool = True) -> ShardResult:
    """Split the HF checkpoint ``src`` for ``(tp, ep)`` into ``dst`` (atomic; resumable)."""
    ckpt = HFCheckpoint.open(src)
    plan = plan_checkpoint(ckpt, tp, ep)
    shards, small = _source_files(ckpt)
    headers = {f: raw_header(ckpt.root / f) for f in shards}
    result = ShardResult(Path(dst), tensors=len(plan.placements))
    job = {"command": "shard", "source": ckpt.describe(), "tp": tp, "ep": ep, "max_shard_size": str(max_shard_size)}
    with Staging(dst, job, force=force) as st:
        if st.done:
            result.skipped = True
            return result
        result.resumed = st.resumed
        hasher = _Hasher(st.path)
        try:
            _shard_into(st, ckpt, plan, shards, small, headers, hasher, max_shard_size, progress, result)
        finally:
            hasher.close()
    return result


def _shard_into(st: Staging, ckpt: HFCheckpoint, plan: ShardPlan, shards: list[str], small: list[str],
                headers: dict[str, RawHeader], hasher: _Hasher, max_shard_size: int | str, progress: bool,
                result: ShardResult) -> None:
    tp, ep = plan.tp, plan.parallel.ep
    writers = []
    for r in plan.parallel.ranks:
        local = [dataclasses.replace(p.spec, shape=p.local_shape) for p in plan.for_rank(r)]
        writers.append(HFWriter(_RankStaging(st, rank_dir(r), hasher), local, max_shard_size))
    by_name = {p.name: p for p in plan.placements}
    total = sum(p.spec.nbytes for p in plan.placements)
    source_info: dict[str, dict[str, Any]] = {}
    with ByteProgress(total, desc=f"shard tp{tp} ep{ep}", enabled=progress) as bar:
        try:
            for f in shards:
                source_info[f] = _shard_file(ckpt, f, headers[f], by_name, writers, bar.advance)
        finally:
            for w in writers:
                w.abort()
        for r, w in enumerate(writers):
            w.close()
            _write_rank_index(w, plan, r)
    (st.path / HEADERS_DIR).mkdir(parents=True, exist_ok=True)
    for f in shards:
        (st.path / HEADERS_DIR / f"{f}.header").write_bytes(headers[f].blob)
        source_info[f]["header"] = f"{HEADERS_DIR}/{f}.header"
    for name in small:
        copy_new(ckpt.root / name, st.path / SOURCE_DIR / name)
        source_info[name] = {"bytes": (ckpt.root / name).stat().st_size,
                             "sha256": sha256_file(ckpt.root / name)}
    rels = sorted(str(p.relative_to(st.path)) for p in st.path.rglob("*")
                  if p.is_file() and p.name not in (JOB_FILE, DONE_FILE, MANIFEST))
    manifest = build_manifest(ckpt, plan, source_info, hasher.results(rels), headers)
    (st.path / MANIFEST).write_text(dump_manifest(manifest))
    result.source_bytes = total
    result.rank_bytes = [r["bytes"] for r in manifest["ranks"]]
    result.written_bytes = sum(result.rank_bytes)


def _shard_file(ckpt: HFCheckpoint, file: str, header: RawHeader, by_name: dict[str, Placement],
                writers: list[HFWriter], advance: Callable[[int], None]) -> dict[str, Any]:
    """Stream one source shard in file order, in blocks of rows: hash every byte, hand each
    block's part of every rank's piece to that rank."""
    path = ckpt.root / file
    h = hashlib.sha256(header.blob)
    pos = header.data_start
    # The hash of block i runs on a helper thread while block i is written (one in flight).
    pool = ThreadPoolExecutor(max_workers=1)
    pending = None
    with open(path, "rb") as f, pool:
        for name in header.in_offset_order():
            shape, dtype, a, b = header.entries[name]
            start = header.data_start + a
            if start > pos:  # bytes between tensors (not written by our writers, kept by the hash)
                if pending is not None:
                    pending.result()
                    pending = None
                f.seek(pos)
                h.update(f.read(start - pos))
            p = by_name[name]
            wanted = [r for r in p.ranks() if writers[r].needed(name)]
            for r0, r1 in row_blocks(shape, dtype) if b > a else []:
                block = as_bytes(ckpt.read_rows(name, r0, r1))
                if pending is not None:
                    pending.result()
                pending = pool.submit(h.update, memoryview(block.reshape(-1).numpy()))  # type: ignore[arg-type]  # numpy types ndarray as a Buffer on 3.12+ only
                for rank in wanted:
                    _hand_rows(p, rank, block, r0, r1, writers[rank])
                advance(block.numel())
            if b == a:  # an empty tensor has no rows to stream
                for rank in wanted:
                    writers[rank].write(name, torch.empty(p.local_shape, dtype=dtype))
            pos = header.data_start + b
        if pending is not None:
            pending.result()
        f.seek(pos)
        while chunk := f.read(_HASH_CHUNK):  # anything after the last tensor
            h.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": h.hexdigest()}


def _hand_rows(p: Placement, rank: int, block: torch.Tensor, r0: int, r1: int, writer: HFWriter) -> None:
    """Give ``writer`` the part of global rows ``[r0, r1)`` (``block``, as bytes) in ``rank``'s piece."""
    if not p.spec.shape:
        writer.write(p.name, from_bytes(block, p.spec.dtype))
        return
    piece = p.holders[rank]
    if piece is None:  # the rank holds none of it (callers pass only Placement.ranks())
        return
    local_start = r0
    for dim, lo, hi in p.region(piece):
        if dim == 0:
            a, b = max(r0, lo), min(r1, hi)
            if a >= b:
                return
            block = block[a - r0:b - r0]
            local_start = a - lo
            r0 = a
        else:
            block = block.narrow(dim, lo, hi - lo)
    writer.write_rows(p.name, local_start, from_bytes(block, p.spec.dtype))


def _write_rank_index(writer: HFWriter, plan: ShardPlan, rank: int) -> None:
    """Every rank folder gets an index (HFWriter writes one only when it split into several files)."""
    par = plan.parallel
    total = sum(s.nbytes for s in writer.specs.values())
    index = {
        "metadata": {"total_size": total, "tp_size": par.tp, "tp_rank": rank, "ep_size": par.ep,
                     "ep_rank": par.ep_rank(rank), "moe_tp_size": par.moe_tp, "moe_tp_rank": par.moe_tp_rank(rank)},
        "weight_map": dict(sorted(writer.weight_map.items())),
    }
    (writer.staging.path / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def build_manifest(ckpt: HFCheckpoint, plan: ShardPlan, source_info: dict[str, Any],
                   files: dict[str, Any], headers: dict[str, RawHeader]) -> dict[str, Any]:
    par = plan.parallel
    rank_bytes = plan.rank_bytes()
    counts = [0] * par.tp
    for p in plan.placements:
        for r in p.ranks():
            counts[r] += 1
    where = {name: f for f, hd in headers.items() for name in hd.entries}
    return {
        "format": FORMAT,
        "version": VERSION,
        "plan": {"tp": par.tp, "ep": par.ep, "moe_tp": par.moe_tp,
                 "rank_order": "rank r is EP rank r // moe_tp, moe-TP rank r % moe_tp"},
        "model": {"variant": ckpt.plan.variant, "precision_plan": str(ckpt.plan),
                  "config": f"{SOURCE_DIR}/config.json"},
        "ranks": [{"rank": r, "dir": rank_dir(r), "ep_rank": par.ep_rank(r), "moe_tp_rank": par.moe_tp_rank(r),
                   "tensors": counts[r], "bytes": rank_bytes[r]} for r in par.ranks],
        "experts": {str(e): v for e, v in plan.expert_ownership().items()},
        "rules": {pattern: {**rule.to_json(), "describe": rule.describe()} for pattern, rule in SPLITS.items()},
        "expert_parts": {suffix or "(weight)": {"ep": r.ep, "moe_tp": r.moe_tp} for suffix, r in EXPERT_PARTS.items()},
        "tensors": {p.name: {**placement_entry(p), "source_file": where[p.name]} for p in plan.placements},
        "source": source_info,
        "files": files,
    }


def placement_entry(p: Placement) -> dict[str, Any]:
    """A placement as a manifest entry: the first cut as ``dim``/``pieces``/``holders`` (null dim:
    uncut), a second (the moe-TP cut inside an EP piece) as ``inner``."""
    def cut(i: int) -> dict[str, Any]:
        c = p.cuts[i]
        return {"dim": c.dim, "pieces": c.pieces, "holders": [None if h is None else h[i] for h in p.holders]}

    entry: dict[str, Any] = {"shape": list(p.spec.shape), "local_shape": list(p.local_shape),
                             "dtype": DTYPE_TO_ST[p.spec.dtype], "split": p.rule.split.value}
    entry.update(cut(0) if p.cuts else {"dim": None, "pieces": 1, "holders": [None if h is None else 0 for h in p.holders]})
    if len(p.cuts) > 1:
        entry["inner"] = cut(1)
    return entry


def entry_cuts(t: dict[str, Any]) -> tuple[tuple[Cut, ...], tuple[tuple[int, ...] | None, ...]]:
    """Inverse of :func:`placement_entry` (after :func:`_check_manifest` and :func:`_check_inner`)."""
    if t["dim"] is None:
        return (), tuple(None if h is None else () for h in t["holders"])
    cuts = [Cut(t["dim"], t["pieces"])]
    holders: list[tuple[int, ...] | None] = [None if h is None else (h,) for h in t["holders"]]
    inner = t.get("inner")
    if inner is not None:
        cuts.append(Cut(inner["dim"], inner["pieces"]))
        holders = [None if h is None else h + (i,) for h, i in zip(holders, inner["holders"], strict=True)]
    return tuple(cuts), tuple(holders)


def dump_manifest(manifest: dict[str, Any]) -> str:
    """The manifest as JSON: indented, but one line per tensor and per file (it lists every tensor)."""
    def table(d: dict[str, Any]) -> str:
        rows = [f"  {json.dumps(k)}: {json.dumps(v, separators=(', ', ': '))}" for k, v in d.items()]
        return "{\n" + ",\n".join(rows) + "\n }"

    parts = []
    for key, value in manifest.items():
        body = table(value) if key in ("tensors", "files", "rules", "source", "experts") else json.dumps(value, indent=2)
        parts.append(f" {json.dumps(key)}: {body}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


# ---- reading a sharded folder ---------------------------------------------------------------

_Ckpt = TypeVar("_Ckpt", bound="ShardedCheckpoint")  # open() returns the subclass it is called on


class ShardedCheckpoint:
    """A sharded folder opened for reading: checks it, then hands out global tensors (whole, or
    blocks of dim-0 rows read only from the ranks that hold them)."""

    def __init__(self, root: Path, manifest: dict[str, Any]):
        self.root = root
        self.manifest = manifest
        if "config.json" not in manifest["source"]:  # only files the manifest lists (and hashes) are read
            raise CheckpointError(f"{root / MANIFEST}: damaged manifest: the source's config.json is not listed")
        self.config = read_json(inside(root / SOURCE_DIR, "config.json", str(root / MANIFEST), "source file"))
        self.cfg = InklingConfig.from_dict(self.config)
        self.tensors: dict[str, dict[str, Any]] = manifest["tensors"]
        _check_inner(manifest, root / MANIFEST)
        self.cuts = {name: entry_cuts(t) for name, t in self.tensors.items()}
        # Each layer's expert format, read from the stored parts as for an HF checkpoint.
        self.plan: PrecisionPlan = detect_plan(self.cfg, {n: ST_TO_DTYPE[t["dtype"]] for n, t in self.tensors.items()},
                                               str(root))
        self._where: dict[tuple[int, str], tuple[str, int, int]] = {}  # (rank, name) -> file, start, stop
        self._fds: dict[str, int] = {}

    @classmethod
    def open(cls: type[_Ckpt], root: str | Path, *, verify_checksums: bool = True, progress: bool = False) -> _Ckpt:
        root = Path(root)
        man_path = root / MANIFEST
        if not man_path.is_file():
            raise CheckpointError(f"{root}: no {MANIFEST}; not a sharded checkpoint")
        try:
            with open_regular(man_path, limit=1 << 30) as f:
                manifest = json.loads(f.read())
        except RecursionError:
            raise CheckpointError(f"{man_path}: cannot read (nested too deeply)") from None
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{man_path}: cannot read ({str(e)[:160]})") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
            raise CheckpointError(f"{man_path}: not an {FORMAT} v{VERSION} manifest")
        _check_manifest(manifest, man_path)
        check_files(root, manifest["files"], verify_checksums=verify_checksums, progress=progress)
        ckpt = cls(root, manifest)
        ckpt._index_ranks()
        return ckpt

    def _index_ranks(self) -> None:
        for r in self.manifest["ranks"]:
            d = inside(self.root, r["dir"], str(self.root / MANIFEST), "rank folder")
            weight_map = read_json(inside(d, INDEX, str(d))).get("weight_map", {})
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{d / INDEX}: weight_map is not an object")
            headers: dict[str, RawHeader] = {}
            for name, f in weight_map.items():
                if f not in headers:
                    headers[f] = raw_header(inside(d, f, f"{d / INDEX}: {str(name)[:80]}", "shard"))
                entry = headers[f].entries.get(name)
                if entry is None:
                    raise CheckpointError(f"{d / f}: index lists {name} but the file does not hold it")
                self._where[(r["rank"], name)] = (f"{r['dir']}/{f}", headers[f].data_start + entry[2],
                                                  headers[f].data_start + entry[3])
        for name, t in self.tensors.items():
            for rank, piece in enumerate(t["holders"]):
                if piece is not None and (rank, name) not in self._where:
                    raise CheckpointError(f"{self.root / rank_dir(rank)}: missing {name}")

    def _local_rows(self, rank: int, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``rank``'s piece of ``name``, as bytes (:func:`as_bytes` shape)."""
        t = self.tensors[name]
        dtype = ST_TO_DTYPE[t["dtype"]]
        local = tuple(t["shape"])
        for c in self.cuts[name][0]:
            local = (*local[:c.dim], local[c.dim] // c.pieces, *local[c.dim + 1:])
        rel, a, b = self._where[(rank, name)]
        if b - a != nbytes(local, dtype):
            raise CheckpointError(f"{self.root / rel}: {name} holds {b - a} bytes, the manifest's local shape "
                                  f"{list(local)} {t['dtype']} needs {nbytes(local, dtype)}")
        row = nbytes(local[1:], dtype) if local else b - a
        count = (stop - start) * row
        fd = self._fds.get(rel)
        if fd is None:
            fd = self._fds[rel] = os.open(self.root / rel, os.O_RDONLY)
        buf = torch.empty(count, dtype=torch.uint8)
        got = os.preadv(fd, [memoryview(buf.numpy())], a + start * row) if count else 0  # type: ignore[arg-type]  # numpy types ndarray as a Buffer on 3.12+ only
        if got != count:
            raise CheckpointError(f"{self.root / rel}: truncated inside {name}")
        shape = (stop - start, *local[1:]) if local else ()
        return buf.reshape(*shape, dtype.itemsize)

    def _rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Global rows ``[start, stop)`` of ``name`` as bytes, from the lowest rank holding each piece."""
        cuts, holders = self.cuts[name]
        shape = self.tensors[name]["shape"]
        row_cut = next((i for i, c in enumerate(cuts) if c.dim == 0), None)
        inner = [i for i, c in enumerate(cuts) if c.dim != 0]
        out = []
        for rp in range(cuts[row_cut].pieces) if row_cut is not None else [None]:
            lo, hi = cuts[row_cut].bounds(shape[0], rp) if rp is not None and row_cut is not None else (0, shape[0] if shape else 1)
            a, b = max(start, lo), min(stop, hi)
            if a >= b:
                continue

            def assemble(k: int, piece: dict[int, int], rp: int | None = rp, a: int = a, b: int = b,
                         lo: int = lo) -> torch.Tensor:
                # The last cut varies fastest: concatenate its pieces, then the enclosing cut's.
                # (This iteration's row piece and range bound as defaults: no late binding.)
                if k == len(inner):
                    key = tuple(rp if i == row_cut else piece[i] for i in range(len(cuts)))
                    return self._local_rows(holders.index(key), name, a - lo, b - lo)
                i = inner[k]
                return torch.cat([assemble(k + 1, {**piece, i: j}) for j in range(cuts[i].pieces)], dim=cuts[i].dim)

            out.append(assemble(0, {}))
        if not out:  # an empty row range
            return torch.empty((0, *shape[1:], ST_TO_DTYPE[self.tensors[name]["dtype"]].itemsize), dtype=torch.uint8)
        return out[0] if len(out) == 1 else torch.cat(out, dim=0)

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` (dim 0) of a global tensor, reading only the ranks' bytes they need:
        an EP slice of a stacked expert comes from its EP rank alone."""
        t = self.tensors.get(name)
        if t is None:
            raise CheckpointError(f"{self.root}: no tensor {name}")
        rows = t["shape"][0] if t["shape"] else 1
        if not 0 <= start <= stop <= rows:
            raise CheckpointError(f"{name}: rows {start}:{stop} outside its {rows} rows")
        return from_bytes(self._rows(name, start, stop), ST_TO_DTYPE[t["dtype"]])

    def iter_raw(self, name: str, limit: int | None = None) -> Iterator[memoryview]:
        """The global tensor's bytes in blocks of dim-0 rows."""
        t = self.tensors[name]
        for a, b in row_blocks(tuple(t["shape"]), ST_TO_DTYPE[t["dtype"]], limit):
            yield memoryview(self._rows(name, a, b).contiguous().reshape(-1).numpy())  # type: ignore[arg-type]  # numpy types ndarray as a Buffer on 3.12+ only

    def raw(self, name: str) -> bytes:
        """The global tensor's bytes, reassembled from the lowest rank holding each piece."""
        return b"".join(self.iter_raw(name))

    def get(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise CheckpointError(f"{self.root}: no tensor {name}")
        t = self.tensors[name]
        return self.read_rows(name, 0, t["shape"][0] if t["shape"] else 1)

    def dtypes(self) -> dict[str, torch.dtype]:
        """Stored dtype of every tensor."""
        return {n: ST_TO_DTYPE[t["dtype"]] for n, t in self.tensors.items()}

    def vision_specs(self) -> list[TensorSpec]:
        """The vision tower's tensors as stored (passed through by prefix), in name order."""
        return [TensorSpec(n, tuple(t["shape"]), ST_TO_DTYPE[t["dtype"]], Category.VISION, None)
                for n, t in sorted(self.tensors.items()) if is_vision(n)]

    def expected(self) -> list[TensorSpec]:
        """The tensors of the source checkpoint, as :meth:`HFCheckpoint.expected` gives them."""
        return inventory(self.cfg, self.plan, dtypes=self.dtypes(), vision=self.vision_specs())

    def extra_files(self) -> dict[str, Path]:
        """The source's pass-through files (tokenizer, generation config, ...), as HFCheckpoint gives them."""
        own = {"config.json", INDEX, QUANT_CONFIG}
        src = self.root / SOURCE_DIR
        return {name: inside(src, name, str(self.root / MANIFEST), "source file")
                for name, info in sorted(self.manifest["source"].items()) if "header" not in info and name not in own}

    def describe(self) -> dict[str, Any]:
        """What identifies this source for resume fingerprints."""
        return {"root": str(self.root.resolve()), "plan": str(self.plan),
                "manifest": {"bytes": (self.root / MANIFEST).stat().st_size,
                             "files": {rel: info["sha256"] for rel, info in sorted(self.manifest["files"].items())}}}

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _is_int(x: Any, lo: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= lo


def _is_sha(x: Any) -> bool:
    return isinstance(x, str) and len(x) == 64 and all(c in "0123456789abcdef" for c in x)


def _check_manifest(man: dict[str, Any], where: Path) -> None:
    """The manifest's structure and types, so a damaged one fails with a line naming what is wrong.

    Every name in it becomes a path: rank folders, listed files and header copies must resolve
    inside the sharded folder, and source names (a merge's output files) must be plain names.
    """
    root = where.parent
    for key, kind in (("plan", dict), ("ranks", list), ("tensors", dict), ("source", dict), ("files", dict)):
        if not isinstance(man.get(key), kind):
            raise CheckpointError(f"{where}: damaged manifest: '{key}' is missing or not a {kind.__name__}")
    tp = man["plan"].get("tp")
    if not _is_int(tp, 1) or len(man["ranks"]) != tp:
        raise CheckpointError(f"{where}: damaged manifest: {len(man['ranks'])} ranks listed for tp {tp!r}")
    for i, r in enumerate(man["ranks"]):
        if not isinstance(r, dict) or r.get("rank") != i or not _is_int(r.get("rank")):
            raise CheckpointError(f"{where}: damaged manifest: rank entry {i} is not {{'rank': {i}, 'dir': ...}}")
        inside(root, r.get("dir"), f"{where}: rank {i}", "rank folder")
    for name, t in man["tensors"].items():
        try:
            holders, pieces, dim, shape = t["holders"], t["pieces"], t["dim"], t["shape"]
            ok = (isinstance(shape, list) and all(_is_int(d) for d in shape) and _is_int(pieces, 1)
                  and isinstance(holders, list) and all(h is None or _is_int(h) for h in holders)
                  and (dim is None or _is_int(dim))
                  and len(holders) == tp and {h for h in holders if h is not None} == set(range(pieces))
                  and isinstance(t["dtype"], str) and t["dtype"] in ST_TO_DTYPE
                  and (pieces == 1 if dim is None else 0 <= dim < len(shape) and shape[dim] % pieces == 0))
        except (KeyError, TypeError):
            ok = False
        if not ok:
            raise CheckpointError(f"{where}: damaged manifest: entry of {str(name)[:120]} is inconsistent")
    for name, info in man["source"].items():
        check_name(name, f"{where}: source", "source file")
        if "/" in name:
            raise CheckpointError(f"{where}: damaged manifest: source file {name!r} is not a top-level name")
        if not isinstance(info, dict) or not _is_sha(info.get("sha256")) or not _is_int(info.get("bytes")):
            raise CheckpointError(f"{where}: damaged manifest: source entry {name}")
        if "header" in info:
            inside(root, info["header"], f"{where}: source {name}", "header copy")
    for rel, info in man["files"].items():
        inside(root, rel, f"{where}: files", "file")
        if not isinstance(info, dict) or not _is_sha(info.get("sha256")) or not _is_int(info.get("bytes")):
            raise CheckpointError(f"{where}: damaged manifest: file entry {rel}")


def _check_inner(man: dict[str, Any], where: Path) -> None:
    """The second (moe-TP) cut of stacked experts: a cut of another dim that, with the first,
    gives every rank one piece and covers every piece."""
    tp = man["plan"]["tp"]
    for name, t in man["tensors"].items():
        inner = t.get("inner")
        if inner is None:
            continue
        try:
            dim, pieces, holders, shape = inner["dim"], inner["pieces"], inner["holders"], t["shape"]
            ok = (type(dim) is int and type(pieces) is int and pieces >= 1 and isinstance(holders, list)
                  and len(holders) == tp and t["dim"] is not None and 0 <= dim < len(shape) and dim != t["dim"]
                  and shape[dim] % pieces == 0
                  and all((h is None) == (o is None) and (h is None or (type(h) is int and 0 <= h < pieces))
                          for h, o in zip(holders, t["holders"], strict=True))
                  and {(o, h) for o, h in zip(t["holders"], holders, strict=True) if o is not None}
                  == {(o, h) for o in range(t["pieces"]) for h in range(pieces)})
        except (KeyError, TypeError):
            ok = False
        if not ok:
            raise CheckpointError(f"{where}: damaged manifest: inner cut of {str(name)[:120]} is inconsistent")


def check_files(root: Path, files: dict[str, dict[str, Any]], *, verify_checksums: bool = True,
                progress: bool = False) -> None:
    """Every file the manifest lists is there, whole, and (optionally) has its sha256."""
    for rel, info in sorted(files.items()):
        p = root / rel
        if not p.is_file():
            raise CheckpointError(f"{p}: missing (the manifest lists it; the sharded folder is incomplete)")
        size = p.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(f"{p}: truncated or altered: {size} bytes, the manifest says {info['bytes']}")
    if not verify_checksums:
        return
    total = sum(info["bytes"] for info in files.values())
    with ByteProgress(total, desc="checksums", enabled=progress) as bar:
        for rel, got in _hash_files(root, sorted(files)).items():
            if got["sha256"] != files[rel]["sha256"]:
                raise IntegrityError(f"{root / rel}: sha256 {got['sha256'][:16]}… does not match the manifest's "
                                     f"{files[rel]['sha256'][:16]}…; the file is corrupted")
            bar.advance(got["bytes"])


# ---- merge --------------------------------------------------------------------------------

@dataclass
class MergeResult:
    out: Path
    skipped: bool = False
    files: int = 0
    bytes: int = 0


def merge(dst: str | Path, out: str | Path, *, force: bool = False, progress: bool = True) -> MergeResult:
    """Reassemble the source checkpoint of the sharded folder ``dst`` into ``out``, byte for byte."""
    sharded = ShardedCheckpoint.open(dst, progress=progress)
    man = sharded.manifest
    root = sharded.root
    sources = man["source"]
    job = {"command": "merge", "manifest_sha256": sha256_file(root / MANIFEST)}
    result = MergeResult(Path(out), files=len(sources))
    try:
        with Staging(out, job, force=force, inputs=[root]) as st:
            if st.done:
                result.skipped = True
                return result
            total = sum(info["bytes"] for info in sources.values())
            with ByteProgress(total, desc="merge", enabled=progress) as bar:
                for name, info in sorted(sources.items()):
                    if st.is_finished(name):  # resumed: this file was rebuilt and checked already
                        bar.advance(info["bytes"])
                    elif "header" in info:
                        _merge_file(sharded, name, info, st, bar.advance)
                    else:
                        tmp = st.partial(name)
                        copy_new(inside(root / SOURCE_DIR, name, str(root / MANIFEST), "source file"), tmp)
                        if sha256_file(tmp) != info["sha256"]:
                            raise IntegrityError(f"{root / SOURCE_DIR / name}: does not match the source's sha256")
                        st.finish(name)
                        bar.advance(info["bytes"])
            result.bytes = total
    finally:
        sharded.close()
    return result


def _merge_file(sharded: ShardedCheckpoint, name: str, info: dict[str, Any], st: Staging,
                advance: Callable[[int], None]) -> None:
    header_path = sharded.root / info["header"]
    with open_regular(header_path, limit=100 * 2**20 + 8) as f:
        blob = f.read()
    try:
        (n,) = struct.unpack("<Q", blob[:8])
        entries = json.loads(blob[8:8 + n])
        entries.pop("__metadata__", None)
        order = sorted(entries, key=lambda k: int(entries[k]["data_offsets"][0]))
        for k in order:
            a, b = entries[k]["data_offsets"]
            int(a), int(b)
    except (struct.error, ValueError, RecursionError, KeyError, TypeError, AttributeError, IndexError):
        raise CheckpointError(f"{header_path}: not a safetensors header copy") from None
    h = hashlib.sha256(blob)
    path = st.partial(name)
    pool = ThreadPoolExecutor(max_workers=1)  # hash tensor i while it is written (one in flight)
    pending = None
    with open(path, "wb") as f, pool:
        f.write(blob)
        pos = 0
        for tname in order:
            a, b = entries[tname]["data_offsets"]
            if a != pos:
                raise CheckpointError(f"{header_path}: {tname} does not follow the previous tensor; cannot rebuild")
            if tname not in sharded.tensors:
                raise CheckpointError(f"{header_path}: {tname} is not in the manifest")
            got = 0
            for data in sharded.iter_raw(tname):
                got += len(data)
                if got > b - a:
                    break
                if pending is not None:
                    pending.result()
                pending = pool.submit(h.update, data)
                f.write(data)
            if got != b - a:
                raise CheckpointError(f"{sharded.root}: {tname} reassembles to {got} bytes, expected {b - a}")
            pos = b
            advance(b - a)
        if pending is not None:
            pending.result()
    if h.hexdigest() != info["sha256"]:
        raise IntegrityError(f"merged {name} does not match the source's sha256 {info['sha256'][:16]}…")
    st.finish(name)


def describe_plan(plan: ShardPlan) -> dict[str, Any]:
    """The plan as JSON-ready data for ``--dry-run`` (no I/O)."""
    rules: dict[str, dict[str, Any]] = {}
    for p in plan.placements:
        key = p.spec.row.pattern if p.spec.row is not None else "model.visual.* (passed through)"
        if key not in rules:
            rules[key] = {**p.rule.to_json(), "describe": p.rule.describe(), "tensors": 0}
        rules[key]["tensors"] += 1
    return {"parallel_plan": {"tp": plan.tp, "ep": plan.parallel.ep, "moe_tp": plan.parallel.moe_tp},
            "experts": plan.expert_ownership(), "rules": rules}


def open_any(path: str | Path, **kw: Any) -> Any:
    """A sharded folder (with a manifest) or an HF checkpoint."""
    p = Path(path)
    if (p / MANIFEST).is_file():
        return ShardedCheckpoint.open(p, **kw)
    return HFCheckpoint.open(path)


__all__ = ["shard", "merge", "ShardedCheckpoint", "MANIFEST", "plan_checkpoint", "describe_plan", "open_any",
           "check_files", "rank_dir", "raw_header"]
