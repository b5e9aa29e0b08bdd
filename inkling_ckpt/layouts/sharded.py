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
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, TypeVar

import torch

from ..errors import CheckpointError, IntegrityError
from ..model.config import InklingConfig, read_json
from ..model.inventory import Category, TensorSpec, detect_plan, inventory, is_vision, nbytes
from ..model.precision import PrecisionPlan
from ..pipeline import Executor, Options, Result, Stage, Unit, World, all_ok, assign, current_world, run_staged
from ..plan import Cut, Placement, ShardPlan
from ..plan.rules import EXPERT_PARTS, SPLITS
from ..progress import ByteProgress
from .hf import DTYPE_TO_ST, INDEX, ST_TO_DTYPE, HFCheckpoint, HFWriter, read_header
from .lane import Lane
from .paths import check_name, copy_new, inside, open_regular, pass_through
from .pread import read_exact

MANIFEST = "inkling-shard.json"
FORMAT = "inkling-ckpt/sharded"
VERSION = 2  # 2: release layout (stacked experts, 'inner' moe-TP cuts, local shapes)
SOURCE_DIR = "source"
HEADERS_DIR = f"{SOURCE_DIR}/headers"
_HASH_CHUNK = 1 << 20  # a hashing thread's read buffer (reused): 16 MiB ones cost the checks of shard --merge ~100 MiB of RSS
HASH_HOLD_BYTES = 512 << 20  # blocks waiting for the source hash, at most
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


def sha256_file(path: Path, stop: threading.Event | None = None) -> str:
    """sha256 of a file's bytes (read into one reused buffer); ``stop`` set: give up at the next chunk."""
    h: list[Any] = [hashlib.sha256(), 0]
    _hash_to(path, h, None, stop)
    return str(h[0].hexdigest())


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

    def __init__(self, st: Any, sub: str, hasher: _Hasher | None = None):
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
class ShardResult(Result):
    """What ``shard`` did: the pipeline's figures, the source's bytes and each rank folder's."""

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


@dataclass(frozen=True)
class _ShardStep:
    """One unit of ``shard`` (its ``data``): rows ``lo:hi`` of source tensor ``tensor`` of ``file``
    (``kind`` "rows"; "empty" for a tensor of no bytes), or the ``end`` of a source file (the
    bytes after its last tensor, then its sha256)."""

    kind: str
    file: str
    tensor: str = ""
    lo: int = 0
    hi: int = 0


def shard(src: str | Path, dst: str | Path, tp: int, ep: int, *, max_shard_size: int | str = "5GB",
          force: bool = False, progress: bool = True, options: Options | None = None) -> ShardResult:
    """Split the HF checkpoint ``src`` for ``(tp, ep)`` into ``dst`` (atomic; resumable).

    Runs through :mod:`inkling_ckpt.pipeline`: one unit per block of dim-0 rows of each source
    tensor, read on ``--workers`` threads and handed in file order to every rank folder holding a
    piece of it. Under torchrun each process writes whole rank folders, and one process per source
    file hashes it for the manifest (written by rank 0)."""
    t0 = time.perf_counter()
    ckpt = HFCheckpoint.open(src)
    plan = plan_checkpoint(ckpt, tp, ep)
    shards, small = _source_files(ckpt)
    headers = {f: raw_header(ckpt.root / f) for f in shards}
    result = ShardResult(Path(dst), tensors=len(plan.placements))
    job = {"command": "shard", "source": ckpt.describe(), "tp": tp, "ep": ep, "max_shard_size": str(max_shard_size)}
    ex = Executor(options or Options(progress=progress), desc=f"shard tp{tp} ep{ep}")
    rank_bytes = plan.rank_bytes()
    folder_of = assign({r: rank_bytes[r] for r in plan.parallel.ranks}, ex.world.size)  # rank folder -> process
    hasher_of = assign({f: (ckpt.root / f).stat().st_size for f in shards}, ex.world.size)  # source file -> process
    units = _shard_units(headers)
    by_name = {p.name: p for p in plan.placements}

    def transform(unit: Unit) -> torch.Tensor | None:
        s: _ShardStep = unit.data
        return as_bytes(ckpt.read_rows(s.tensor, s.lo, s.hi)) if s.kind == "rows" else None

    def reads(unit: Unit) -> list[tuple[Path, int, int]]:  # what transform reads, for the read-ahead
        s: _ShardStep = unit.data
        return ckpt.extents(s.tensor, s.lo, s.hi) if s.kind == "rows" else []

    def work(stage: Stage) -> None:
        me = stage.rank
        hasher = _Hasher(stage.path)
        try:
            writers: dict[int, HFWriter] = {}
            for r in plan.parallel.ranks:
                if folder_of[r] == me:
                    local = [dataclasses.replace(p.spec, shape=p.local_shape) for p in plan.for_rank(r)]
                    writers[r] = HFWriter(_RankStaging(stage, rank_dir(r), hasher), local, max_shard_size)
            wanted = {p.name: [r for r in p.ranks() if r in writers and writers[r].needed(p.name)]
                      for p in plan.placements}
            todo = [u for u in units if hasher_of[u.data.file] == me or (u.data.kind != "end" and wanted[u.data.tensor])]
            source_info: dict[str, dict[str, Any]] = {}
            hashes: dict[str, Any] = {}  # source file -> [sha256, position hashed up to], for the files this process hashes

            # the source's sha256, off the writing thread, in the order of its bytes
            lane = Lane("inkling-hash", hold_limit=HASH_HOLD_BYTES)

            def hash_step(s: _ShardStep, block: torch.Tensor | None) -> None:
                f = s.file
                header = headers[f]
                if f not in hashes:
                    hashes[f] = _shard_file(ckpt, f, header)
                h = hashes[f]
                if s.kind == "end":
                    _hash_to(ckpt.root / f, h, None)
                    source_info[f] = {"bytes": (ckpt.root / f).stat().st_size, "sha256": h[0].hexdigest()}
                    return
                if s.lo == 0:  # bytes between tensors (not written by our writers, kept by the hash)
                    _hash_to(ckpt.root / f, h, header.data_start + header.entries[s.tensor][2])
                if block is not None:
                    h[0].update(memoryview(block.reshape(-1).numpy()))  # type: ignore[arg-type]  # numpy types ndarray as a Buffer on 3.12+ only
                    h[1] += block.numel()

            def sink(unit: Unit, block: torch.Tensor | None) -> None:
                s: _ShardStep = unit.data
                if hasher_of[s.file] == me:
                    lane.submit(hash_step, s, block, hold=0 if block is None else block.numel())
                if s.kind == "end":
                    return
                p = by_name[s.tensor]
                handed = 0
                for rank in wanted[s.tensor]:
                    if s.kind == "empty":
                        writers[rank].write(s.tensor, torch.empty(p.local_shape, dtype=p.spec.dtype))
                    elif block is not None:
                        handed += _hand_rows(p, rank, block, s.lo, s.hi, writers[rank])
                # a unit's write_bytes is its block (what it holds); the bytes written are its pieces in
                # this process's rank folders: a replicated tensor once per rank, none for a unit read
                # only to be hashed
                ex.stats.bytes_written += handed - unit.write_bytes

            try:
                ex.run(todo, transform, sink, extents=reads)
                lane.settle()
            finally:
                lane.close(cancel=True)
                for w in writers.values():
                    w.abort()
            for r, w in writers.items():
                w.close()
                _write_rank_index(w, plan, r)
            rels = sorted(str(q.relative_to(stage.path)) for r in writers for q in (stage.path / rank_dir(r)).rglob("*")
                          if q.is_file() and not q.name.endswith(".partial"))
            (stage.path / f".shard-{me}.json").write_text(json.dumps({"source": source_info,
                                                                      "files": hasher.results(rels)}))
        finally:
            hasher.close()

    def finish(stage: Stage, _: None) -> None:
        source_info: dict[str, dict[str, Any]] = {}
        files: dict[str, Any] = {}
        for proc in range(ex.world.size):  # what every process wrote and hashed (one shared folder)
            got = json.loads((stage.path / f".shard-{proc}.json").read_text())
            source_info.update(got["source"])
            files.update(got["files"])
        for part in stage.path.glob(".shard-*.json"):  # (an interrupted run on more processes left more)
            part.unlink()
        (stage.path / HEADERS_DIR).mkdir(parents=True, exist_ok=True)
        for f in shards:
            (stage.path / HEADERS_DIR / f"{f}.header").write_bytes(headers[f].blob)
            files[f"{HEADERS_DIR}/{f}.header"] = {"bytes": len(headers[f].blob),
                                                   "sha256": hashlib.sha256(headers[f].blob).hexdigest()}
            source_info[f]["header"] = f"{HEADERS_DIR}/{f}.header"
        for name in small:
            copy_new(ckpt.root / name, stage.path / SOURCE_DIR / name)
            source_info[name] = {"bytes": (ckpt.root / name).stat().st_size,
                                 "sha256": sha256_file(ckpt.root / name)}
            files[f"{SOURCE_DIR}/{name}"] = dict(source_info[name])
        # the rank folders' tensor files first, then the rest (indexes, header copies, source files)
        ordered = sorted(files, key=lambda rel: (not (rel.startswith("rank-") and rel.endswith(".safetensors")), rel))
        manifest = build_manifest(ckpt, plan, {f: source_info[f] for f in [*shards, *small]},
                                  {rel: files[rel] for rel in ordered}, headers)
        (stage.path / MANIFEST).write_text(dump_manifest(manifest))

    outcome = run_staged(dst, job, ex.world, work, finish, force=force)
    result.skipped = outcome.skipped
    if not outcome.skipped:
        result.add_ranks(ex.finish(), seconds=time.perf_counter() - t0)
        result.resumed = bool(outcome.stage and outcome.stage.resumed)
        result.source_bytes = sum(p.spec.nbytes for p in plan.placements)
        result.rank_bytes = [rank_bytes[r] for r in plan.parallel.ranks]
        result.written_bytes = sum(result.rank_bytes)
        result.bytes = result.written_bytes
    return result


def _shard_units(headers: dict[str, RawHeader]) -> list[Unit]:
    """Every source file's tensors in file order, in blocks of rows, then the file's end."""
    units: list[Unit] = []
    for f, header in headers.items():
        for name in header.in_offset_order():
            shape, dtype, a, b = header.entries[name]
            if b == a:  # an empty tensor has no rows to stream
                units.append(Unit(f"{f}:{name}", f, 0, 0, (), _ShardStep("empty", f, name)))
                continue
            row = (b - a) // shape[0] if shape and shape[0] else b - a
            for r0, r1 in row_blocks(shape, dtype):
                n = row * (r1 - r0) if shape else b - a
                units.append(Unit(f"{f}:{name}[{r0}:{r1}]", f, n, n, (), _ShardStep("rows", f, name, r0, r1)))
        units.append(Unit(f"{f}:end", f, 0, 0, (), _ShardStep("end", f)))
    return units


def _shard_file(ckpt: HFCheckpoint, file: str, header: RawHeader) -> list[Any]:
    """Start hashing source shard ``file``: [its sha256 so far (the header), the position hashed up to]."""
    return [hashlib.sha256(header.blob), header.data_start]


_hash_buffers = threading.local()


def _hash_to(path: Path, h: list[Any], stop: int | None, cancel: threading.Event | None = None) -> None:
    """Hash the bytes of ``path`` from where ``h`` ([sha256, position]) stands up to ``stop`` (None:
    the end of the file), through this thread's one reused buffer (no fresh 16 MiB per chunk).
    ``cancel`` set: return at the next chunk, the hash unfinished."""
    if stop is not None and stop <= h[1]:
        return
    buf = getattr(_hash_buffers, "buf", None)
    if buf is None:
        buf = _hash_buffers.buf = memoryview(bytearray(_HASH_CHUNK))
    with open_regular(path) as f:
        f.seek(h[1])
        while cancel is None or not cancel.is_set():
            n = f.readinto(buf if stop is None else buf[:min(_HASH_CHUNK, stop - h[1])])
            if not n:
                break
            h[0].update(buf[:n])
            h[1] += n
            if stop is not None and h[1] >= stop:
                break


def _hand_rows(p: Placement, rank: int, block: torch.Tensor, r0: int, r1: int, writer: HFWriter) -> int:
    """Give ``writer`` the part of global rows ``[r0, r1)`` (``block``, as bytes) in ``rank``'s piece;
    the bytes handed."""
    if not p.spec.shape:
        writer.write(p.name, from_bytes(block, p.spec.dtype))
        return block.numel()
    piece = p.holders[rank]
    if piece is None:  # the rank holds none of it (callers pass only Placement.ranks())
        return 0
    local_start = r0
    for dim, lo, hi in p.region(piece):
        if dim == 0:
            a, b = max(r0, lo), min(r1, hi)
            if a >= b:
                return 0
            block = block[a - r0:b - r0]
            local_start = a - lo
            r0 = a
        else:
            block = block.narrow(dim, lo, hi - lo)
    writer.write_rows(p.name, local_start, from_bytes(block, p.spec.dtype))
    return block.numel()


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
        self._lock = threading.Lock()

    @classmethod
    def open(cls: type[_Ckpt], root: str | Path, *, verify_checksums: bool = True, progress: bool = False,
             world: World | None = None) -> _Ckpt:
        """Check the folder (manifest, every file's size and sha256) and open it.

        ``world``: the ranks opening it together (collective; every rank must call): each
        checks the sha256 of its share of the files, and a mismatch fails every rank.
        """
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
        check_files(root, manifest["files"], verify_checksums=verify_checksums, progress=progress, world=world)
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
        with self._lock:  # the merge's workers read from several threads
            fd = self._fds.get(rel)
            if fd is None:
                fd = self._fds[rel] = os.open(self.root / rel, os.O_RDONLY)
        buf = read_exact(fd, a + start * row, count, f"{self.root / rel}: truncated inside {name}")
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


def checked_by(files: dict[str, dict[str, Any]], world: World) -> list[str]:
    """The files whose sha256 this rank checks: a share by bytes (every file checked by one rank)."""
    owner = assign({rel: int(info["bytes"]) for rel, info in files.items()}, world.size)
    return sorted(rel for rel, rank in owner.items() if rank == world.rank)


def check_files(root: Path, files: dict[str, dict[str, Any]], *, verify_checksums: bool = True,
                progress: bool = False, world: World | None = None) -> None:
    """Every file the manifest lists is there, whole, and (optionally) has its sha256.

    With a distributed ``world`` (collective) each rank hashes only :func:`checked_by` its share;
    sizes are checked by every rank (cheap), and a failing rank fails them all.
    """
    world = world or World()
    if world.distributed and verify_checksums:
        err: BaseException | None = None
        try:
            check_files(root, files, verify_checksums=False)
            mine = checked_by(files, world)
            _check_sums(root, {rel: files[rel] for rel in mine}, progress and world.rank == 0)
        except Exception as e:  # handed to every rank by all_ok, raised here as it is
            err = e
        all_ok(err, world)
        return
    for rel, info in sorted(files.items()):
        p = root / rel
        if not p.is_file():
            raise CheckpointError(f"{p}: missing (the manifest lists it; the sharded folder is incomplete)")
        size = p.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(f"{p}: truncated or altered: {size} bytes, the manifest says {info['bytes']}")
    if verify_checksums:
        _check_sums(root, files, progress)


def _check_sums(root: Path, files: dict[str, dict[str, Any]], progress: bool) -> None:
    """Every file's sha256 against the manifest, files in parallel; the first damaged one by name raised."""
    checks = SumChecks(root, files)
    try:
        checks.result(progress)
    finally:
        checks.close()


def _corrupted(root: Path, rel: str, got: str, want: str) -> IntegrityError:
    return IntegrityError(f"{root / rel}: sha256 {got[:16]}… does not match the manifest's {want[:16]}…; "
                          "the file is corrupted")


class SumChecks:
    """The manifest's sha256s of a sharded folder, checked on background threads while a merge copies.

    Files are hashed in parallel, largest first (the merge reads the same bytes: each is read
    from the disk once, by whichever comes first). :meth:`failed` says at once whether a finished
    check has failed; :meth:`result` waits for all of them and raises the first corrupted file
    by name; :meth:`close` stops the hashing at its next chunk."""

    def __init__(self, root: Path, files: dict[str, dict[str, Any]], workers: int | None = None):
        self.root, self.files = root, files
        self._cancel = threading.Event()
        self._error: IntegrityError | None = None
        self._pool = ThreadPoolExecutor(max_workers=workers or min(8, os.cpu_count() or 1),
                                        thread_name_prefix="inkling-check")
        order = sorted(files, key=lambda rel: (-int(files[rel]["bytes"]), rel))
        self._futures = {rel: self._pool.submit(self._one, rel) for rel in order}

    def _one(self, rel: str) -> str:
        got = sha256_file(self.root / rel, self._cancel)
        if not self._cancel.is_set() and got != self.files[rel]["sha256"] and self._error is None:
            self._error = _corrupted(self.root, rel, got, self.files[rel]["sha256"])
        return got

    def failed(self) -> None:
        """Raise a failure found so far (without waiting for the rest)."""
        if self._error is not None:
            raise self._error

    def result(self, progress: bool = False) -> None:
        """Wait for every check (``progress``: a bar of the files still being checked, for a copy
        that ran ahead of them); raise the first corrupted file in name order."""
        size = {f: int(self.files[rel]["bytes"]) for rel, f in self._futures.items() if not f.done()}
        if size:
            with ByteProgress(sum(size.values()), desc="checksums", enabled=progress) as bar:
                for f in as_completed(size):
                    bar.advance(size[f])
        for rel in sorted(self._futures):
            got = self._futures[rel].result()
            if got != self.files[rel]["sha256"]:
                raise _corrupted(self.root, rel, got, self.files[rel]["sha256"])

    def close(self) -> None:
        self._cancel.set()
        self._pool.shutdown(wait=True, cancel_futures=True)


# ---- merge --------------------------------------------------------------------------------

@dataclass
class MergeResult(Result):
    """What ``shard --merge`` did: the pipeline's figures, and how many source files it rebuilt."""

    files: int = 0

    @property
    def out(self) -> Path:
        return self.dst


@dataclass(frozen=True)
class _MergeStep:
    """One unit of a merge (its ``data``): ``open`` a rebuilt file (its header), copy ``rows``
    ``lo:hi`` of tensor ``tensor`` into it, or ``copy`` a small source file as it is. ``last``:
    the file's last unit (the sink checks its sha256 and marks it finished)."""

    kind: str
    file: str
    tensor: str = ""
    lo: int = 0
    hi: int = 0
    last: bool = False


def merge(dst: str | Path, out: str | Path, *, force: bool = False, progress: bool = True,
          options: Options | None = None) -> MergeResult:
    """Reassemble the source checkpoint of the sharded folder ``dst`` into ``out``, byte for byte.

    Runs through :mod:`inkling_ckpt.pipeline`: one unit per block of dim-0 rows of each tensor
    (read from the lowest rank holding each piece on ``--workers`` threads, written in order).
    Each rebuilt file is hashed (read back from the page cache) and, once it matches the source's
    sha256, made durable and renamed, on a background thread while the next one is written. The
    manifest's sha256s of the sharded folder: in one process checked on background threads
    beside the copy (each byte read from the disk once; nothing is published until every check
    has passed, and a damaged rank file is what a failure names); under torchrun the ranks split
    those checks before anything is written, and split the source files, each rebuilt and
    checked by one rank.
    """
    t0 = time.perf_counter()
    world = current_world()
    beside = not world.distributed  # one process: the checksums run beside the copy
    try:
        sharded = ShardedCheckpoint.open(dst, progress=progress, world=world, verify_checksums=not beside)
    except CheckpointError as e:
        raise (_damage_first(Path(dst), e) if beside else e) from None
    checks = SumChecks(sharded.root, sharded.manifest["files"]) if beside else None
    man = sharded.manifest
    root = sharded.root
    sources = man["source"]
    job = {"command": "merge", "manifest_sha256": sha256_file(root / MANIFEST)}
    result = MergeResult(Path(out), files=len(sources))
    try:
        blobs: dict[str, bytes] = {}
        units: list[Unit] = []
        try:
            for name, info in sorted(sources.items()):  # every header checked before anything is written
                if "header" in info:
                    blobs[name], steps = _merge_steps(sharded, name, info)
                    units += steps
                else:
                    units.append(Unit(f"{name}:copy", name, int(info["bytes"]), int(info["bytes"]), (),
                                      _MergeStep("copy", name, last=True)))
        except CheckpointError as e:
            raise (_damage_first(root, e) if beside else e) from None
        ex = Executor(options or Options(progress=progress), desc="merge")
        owner = assign({name: int(info["bytes"]) for name, info in sources.items()}, ex.world.size)

        def transform(unit: Unit) -> memoryview | None:
            s: _MergeStep = unit.data
            if s.kind != "rows":
                return None
            return memoryview(sharded._rows(s.tensor, s.lo, s.hi).contiguous().reshape(-1).numpy())  # type: ignore[arg-type]  # numpy types ndarray as a Buffer on 3.12+ only

        def work(stage: Stage) -> None:
            mine = [u for u in units if owner[u.data.file] == stage.rank]
            todo = [u for u in mine if not stage.is_finished(u.data.file)]  # a resume keeps checked files
            reused = [u for u in mine if stage.is_finished(u.data.file)]
            cur: list[Any] = []  # [file handle, [sha256, position hashed up to], path] of the file being rebuilt
            lane = Lane("inkling-hash")  # hashing what was written, checking and finishing files, in order

            def check_and_finish(name: str, path: Path, h: list[Any]) -> None:
                _hash_to(path, h, None)
                if h[0].hexdigest() != sources[name]["sha256"]:
                    if checks is not None:
                        checks.result()  # a damaged rank file is the cause: name it
                    if "header" not in sources[name]:
                        raise IntegrityError(f"{root / SOURCE_DIR / name}: does not match the source's sha256")
                    raise IntegrityError(f"merged {name} does not match the source's sha256 "
                                         f"{sources[name]['sha256'][:16]}…")
                stage.finish(name)

            def sink(unit: Unit, data: memoryview | None) -> None:
                if checks is not None:
                    checks.failed()  # stop early on a damaged rank file
                s: _MergeStep = unit.data
                if s.kind == "copy":
                    tmp = stage.partial(s.file)
                    copy_new(inside(root / SOURCE_DIR, s.file, str(root / MANIFEST), "source file"), tmp)
                    lane.submit(check_and_finish, s.file, tmp, [hashlib.sha256(), 0])
                    return
                if s.kind == "open":
                    cur[:] = _merge_file(stage, s.file, blobs[s.file])
                elif data is not None:
                    cur[0].write(data)
                if s.last:
                    fh, h, path = cur
                    cur.clear()
                    fh.close()
                    lane.submit(check_and_finish, s.file, path, h)
                elif data is not None:
                    cur[0].flush()  # the lane reads it back from the page cache
                    lane.submit(_hash_to, cur[2], cur[1], cur[0].tell())

            try:
                ex.run(todo, transform, sink, reused=reused)
                lane.settle()
                if checks is not None:
                    checks.result(progress)  # every manifest check passed before anything is published
            except CheckpointError:
                if checks is not None:
                    checks.result()  # data that does not read right: a damaged file is the cause to name
                raise
            finally:
                lane.close(cancel=True)
                if cur:
                    cur[0].close()

        outcome = run_staged(out, job, ex.world, work, lambda stage, _: None, force=force, inputs=[root])
        result.skipped = outcome.skipped
        if not outcome.skipped:
            result.add_ranks(ex.finish(), seconds=time.perf_counter() - t0)
        result.bytes = sum(int(info["bytes"]) for info in sources.values())
        result.tensors = len(sharded.tensors)
    finally:
        if checks is not None:
            checks.close()
        sharded.close()
    return result


def _damage_first(root: Path, err: CheckpointError) -> CheckpointError:
    """What to report when a sharded folder whose checksums were to run beside the merge fails to
    open or plan: a file the manifest's sha256 finds damaged (a header that no longer parses, say)
    is the cause; else ``err``. Checks the folder in full, as an open before writing does."""
    if isinstance(err, IntegrityError):
        return err
    try:
        ShardedCheckpoint.open(root, verify_checksums=True).close()
    except IntegrityError as e:
        return e
    except CheckpointError:
        pass
    return err


def _merge_steps(sharded: ShardedCheckpoint, name: str, info: dict[str, Any]) -> tuple[bytes, list[Unit]]:
    """The header copy of source shard ``name`` (checked) and the units rebuilding it, in file order."""
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
    units = [Unit(f"{name}:open", name, 0, 0, (), _MergeStep("open", name))]
    pos = 0
    for tname in order:
        a, b = entries[tname]["data_offsets"]
        if a != pos:
            raise CheckpointError(f"{header_path}: {tname} does not follow the previous tensor; cannot rebuild")
        if tname not in sharded.tensors:
            raise CheckpointError(f"{header_path}: {tname} is not in the manifest")
        t = sharded.tensors[tname]
        shape, dtype = tuple(t["shape"]), ST_TO_DTYPE[t["dtype"]]
        got = nbytes(shape, dtype)
        if got != b - a:
            raise CheckpointError(f"{sharded.root}: {tname} reassembles to {got} bytes, expected {b - a}")
        row = got // shape[0] if shape and shape[0] else got
        for lo, hi in row_blocks(shape, dtype):
            size = row * (hi - lo) if shape else got
            units.append(Unit(f"{name}:{tname}[{lo}:{hi}]", name, size, size, (), _MergeStep("rows", name, tname, lo, hi)))
        pos = b
    units[-1] = dataclasses.replace(units[-1], data=dataclasses.replace(units[-1].data, last=True))
    return blob, units


def _merge_file(stage: Stage, name: str, blob: bytes) -> list[Any]:
    """Start rebuilding source shard ``name``: its partial file with the header written, [the sha256
    so far (the header), the position hashed up to], and its path."""
    path = stage.partial(name)
    fh = open(path, "wb")
    fh.write(blob)
    return [fh, [hashlib.sha256(blob), len(blob)], path]


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


__all__ = ["shard", "merge", "ShardedCheckpoint", "SumChecks", "MANIFEST", "plan_checkpoint", "describe_plan", "open_any",
           "check_files", "checked_by", "rank_dir", "raw_header"]
