"""Hugging Face safetensors checkpoints: a lazy, validated reader and a streaming writer.

Reader: parses every shard header (no tensor data) and checks the whole index against the
model table before any work starts; tensors are read one at a time through ``safe_open``.
Writer: plans the shards from the tensor inventory up front (``huggingface_hub`` splits them),
writes each shard's header first and then every tensor at its offset as it arrives, so memory
is bounded by one tensor, not one shard; a shard counts as finished only once complete.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections import OrderedDict
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Mapping, Protocol, Sequence

import torch
from huggingface_hub import split_state_dict_into_shards_factory
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointError, ConfigError, OutputError
from ..model.config import InklingConfig, read_json
from ..model.inventory import FLOAT_DTYPES, Category, Scope, TensorSpec, detect_plan, inventory, is_vision, match_name, nbytes
from ..model.precision import PrecisionPlan
from ..model.quant_config import check_quant_config
from .lane import Lane
from .limits import check_config_bounds, config_from_dict
from .paths import check_name, check_regular, copy_new, inside, open_regular, pass_through
from .pread import read_exact, write_from
from .hub import hub_access, resolve_source, split_repo_id
from .staging import DONE_FILE, JOB_FILE, write_new

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SHARD_PATTERN = "model{suffix}.safetensors"
DEFAULT_MAX_SHARD = "5GB"

DTYPE_TO_ST = {
    torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
    torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
ST_TO_DTYPE = {v: k for k, v in DTYPE_TO_ST.items()}
# Files a writer produces itself; everything else at the top of a source folder is copied through.
# hf_quant_config.json is not part of the Inkling 2 release layout (nothing that loads it reads it): never copied.
_OWN_FILES = {INDEX, SINGLE, "config.json", "hf_quant_config.json", DONE_FILE, JOB_FILE}


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor lives in a checkpoint and what its header says."""

    name: str
    file: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int = 0  # absolute byte offset of the data in the file

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)


def looks_like_repo_id(text: str) -> bool:
    """``org/name``: a hub repo id (used when no local path of that name exists)."""
    return text.count("/") == 1 and not text.startswith((".", "/"))


def fetch_config(repo_id: str) -> Path:
    """A hub repo's ``config.json`` alone (from the local cache when there): for planning before a download."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(repo_id, "config.json"))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as e:
        raise CheckpointError(f"{repo_id}: not a local path and its config.json is not fetchable from the hub "
                              f"({type(e).__name__})") from None


class HFCheckpoint:
    """A Hugging Face checkpoint of Inkling 2, opened lazily. Use :meth:`open`."""

    layout = "hf"

    def __init__(self, root: Path, config: dict[str, Any], cfg: InklingConfig, plan: PrecisionPlan,
                 tensors: dict[str, StoredTensor]):
        self.root = root
        self.config = config
        self.cfg = cfg
        self.plan = plan
        self.tensors = tensors
        self._handles: OrderedDict[str, Any] = OrderedDict()

    @classmethod
    def open(cls, source: str | Path, *, validate: bool = True) -> "HFCheckpoint":
        """Read the config and every shard header; each layer's expert format comes from the tensors present."""
        root = resolve_source(source)
        from .detect import HF, detect_layout, not_hf_hint  # detect imports this module

        kind = detect_layout(root)
        if kind != HF:
            raise CheckpointError(f"{root}: {not_hf_hint(kind)}")
        config = read_json(inside(root, "config.json", str(root)))
        files = _weight_map(root)
        check_config_bounds(config, root / "config.json", tensors=len(files))
        cfg = config_from_dict(config, root / "config.json")
        tensors: dict[str, StoredTensor] = {}
        by_file: dict[str, list[str]] = {}
        for name, f in files.items():
            by_file.setdefault(f, []).append(name)
        for f, names in by_file.items():
            header = read_header(root / f)
            for name in names:
                if name not in header:
                    raise CheckpointError(f"{root / f}: index lists {name} but the shard does not hold it")
            for name, st in header.items():
                if name not in files:
                    raise CheckpointError(f"{root / f}: holds {name}, which the index does not list")
                if files[name] != f:  # the index names one file; a second copy elsewhere is ambiguous
                    raise CheckpointError(f"{root / f}: holds {name}, which the index places in {files[name]}; "
                                          f"duplicate tensors across shards are refused")
                tensors[name] = StoredTensor(name, f, *st)
        plan = detect_plan(cfg, {n: t.dtype for n, t in tensors.items()}, str(root))
        check_quant_config(config, plan, str(root))
        ckpt = cls(root, config, cfg, plan, tensors)
        if validate:
            ckpt.validate()
        return ckpt

    def expected(self) -> list[TensorSpec]:
        """The inventory this checkpoint holds: its config and plan, with its own non-expert dtypes and vision tensors."""
        return inventory(self.cfg, self.plan, dtypes=self.dtypes(), vision=self.vision_specs())

    def dtypes(self) -> dict[str, torch.dtype]:
        """Stored dtypes of the non-expert tensors (kept as they are by every writer)."""
        return {n: t.dtype for n, t in self.tensors.items() if t.dtype in FLOAT_DTYPES}

    def vision_specs(self) -> list[TensorSpec]:
        """The vision tower's tensors as stored (passed through by prefix), in name order."""
        return [TensorSpec(n, t.shape, t.dtype, Category.VISION, None) for n, t in sorted(self.tensors.items())
                if is_vision(n)]

    def validate(self) -> None:
        """Every expected tensor present with the right shape and dtype, nothing unexpected."""
        check_against_inventory(self.tensors, self.expected(), where=str(self.root))
        for n, t in self.tensors.items():
            hit = match_name(n) if t.dtype not in FLOAT_DTYPES else None
            if hit is not None and hit.row.scope is not Scope.EXPERTS:
                raise CheckpointError(f"{self.root}: {n} is stored as {DTYPE_TO_ST.get(t.dtype, t.dtype)}; non-expert "
                                      "tensors must be BF16, F16 or F32")

    #: read_rows and get take ``device=``: a GPU gets the bytes through small pinned buffers, not a host copy.
    reads_to_device = True

    def get(self, name: str, *, device: torch.device | str | None = None) -> torch.Tensor:
        """Read one whole tensor into a fresh tensor (on ``device``, default the CPU).

        Plain positional reads rather than safetensors' memory map: a mapped file's touched
        pages count towards the process's resident memory until unmapped, which would make
        memory grow with the checkpoint instead of staying at a few tensors.
        """
        st = self.tensors.get(name)
        if st is None:
            raise CheckpointError(f"{self.root}: no tensor {name}")
        return self.read_rows(name, 0, st.shape[0] if st.shape else 1, device=device)

    def read_rows(self, name: str, start: int, stop: int, *, device: torch.device | str | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of a tensor (along dim 0), reading only their bytes (onto ``device``)."""
        st = self.tensors[name]
        path, offset, count = self._span(st, start, stop)
        try:
            with open_regular(path, buffering=0) as f:
                buf = read_exact(f.fileno(), offset, count, f"{path}: truncated while reading {name}", device=device)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read {name} ({e.strerror})") from None
        shape = (stop - start, *st.shape[1:]) if st.shape else ()
        return buf.view(st.dtype).reshape(shape)

    def extents(self, name: str, start: int, stop: int) -> list[tuple[Path, int, int]]:
        """The bytes :meth:`read_rows` of the same rows reads, as ``[(file, offset, length)]`` (for the
        executor's read-ahead; an unknown tensor gives none)."""
        st = self.tensors.get(name)
        return [] if st is None else [self._span(st, start, stop)]

    def _span(self, st: StoredTensor, start: int, stop: int) -> tuple[Path, int, int]:
        """``(file, offset, length)`` of rows ``start:stop`` of a stored tensor (a scalar: its bytes)."""
        row = st.nbytes // st.shape[0] if st.shape and st.shape[0] else st.nbytes
        return self.root / st.file, st.offset + start * row, (stop - start) * row

    def read_expert_rows(self, name: str, expert: int, start: int, stop: int, *,
                         device: torch.device | str | None = None) -> torch.Tensor:
        """Rows ``start:stop`` (along dim 1) of one expert of a stacked ``[E, rows, ...]`` tensor, as
        ``[1, stop - start, ...]``, reading only their bytes (contiguous on disk; onto ``device``)."""
        st = self.tensors[name]
        if len(st.shape) < 2:
            raise CheckpointError(f"{self.root}: {name} has no rows inside an expert (shape {list(st.shape)})")
        row = st.nbytes // (st.shape[0] * st.shape[1]) if st.shape[0] and st.shape[1] else 0
        path = self.root / st.file
        try:
            with open_regular(path, buffering=0) as f:
                buf = read_exact(f.fileno(), st.offset + (expert * st.shape[1] + start) * row, (stop - start) * row,
                                 f"{path}: truncated while reading {name}", device=device)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read {name} ({e.strerror})") from None
        return buf.view(st.dtype).reshape(1, stop - start, *st.shape[2:])

    def get_slice(self, name: str):
        """A lazy slice handle (``[a:b]`` reads only those rows)."""
        st = self.tensors[name]
        return self._handle(st.file).get_slice(name)

    def parts(self, module: str, part_names: Iterable[str]) -> dict[str, torch.Tensor]:
        return {p: self.get(f"{module}.{p}") for p in part_names}

    def _handle(self, file: str):
        h = self._handles.get(file)
        if h is None:
            try:
                h = safe_open(str(check_regular(self.root / file)), framework="pt")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{self.root / file}: cannot open ({e})") from None
            self._handles[file] = h
            # A handle maps its file; keep a few open so memory stays bounded by the OS page cache.
            while len(self._handles) > 4:
                self._handles.popitem(last=False)
        else:
            self._handles.move_to_end(file)
        return h

    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def extra_files(self) -> dict[str, Path]:
        """Top-level files a writer copies through (tokenizer, generation config, ...), as paths:
        :func:`write_extra_files` streams them. One rule for every pass-through copy
        (:func:`~inkling_ckpt.layouts.paths.pass_through`): links leaving the folder and special
        files are refused, hidden names (``.git``, ``.cache``) are not checkpoint files."""
        return pass_through(self.root, skip=lambda rel: rel in _OWN_FILES or rel.endswith(".safetensors"))

    def storage(self) -> dict[str, Any]:
        """How the folder stores the tensors (for ``inspect``)."""
        return {"layout": self.layout, "files": len({t.file for t in self.tensors.values()})}

    def describe(self) -> dict[str, Any]:
        """What identifies this source for resume fingerprints: its tensor layout and file sizes."""
        files = sorted({t.file for t in self.tensors.values()})
        return {"root": str(self.root.resolve()), "plan": str(self.plan),
                "files": {f: (self.root / f).stat().st_size for f in files}}

    def close(self) -> None:
        self._handles.clear()


def check_against_inventory(tensors: Mapping[str, StoredTensor], expected: Sequence[TensorSpec], where: str) -> None:
    """Raise CheckpointError naming the first missing, unexpected or mis-shaped tensor."""
    want = {s.name: s for s in expected}
    extra = sorted(set(tensors) - set(want))
    if extra:
        known = match_name(extra[0])
        why = "not part of the Inkling 2 tensor table" if known is None else "not expected under this config and precision plan"
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(f"{where}: unexpected tensor {extra[0]}{more}: {why}")
    missing = [n for n in want if n not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{where}: missing tensor {missing[0]}{more}")
    for name, spec in want.items():
        st = tensors[name]
        if st.shape != spec.shape or st.dtype != spec.dtype:
            raise CheckpointError(
                f"{where}: {name} is {DTYPE_TO_ST.get(st.dtype, st.dtype)} {list(st.shape)}, the config and plan "
                f"say {DTYPE_TO_ST.get(spec.dtype, spec.dtype)} {list(spec.shape)}"
            )


def _weight_map(root: Path) -> dict[str, str]:
    index = root / INDEX
    if index.is_file():
        data = read_json(inside(root, INDEX, str(root)))
        wm = data.get("weight_map")
        if not isinstance(wm, dict) or not wm:
            raise CheckpointError(f"{index}: no weight_map")
        checked: set[str] = set()
        for name, f in wm.items():
            check_tensor_name(name, str(index))
            if f in checked:
                continue
            target = inside(root, f, f"{index}: {str(name)[:80]}", "shard")
            if not target.is_file():
                raise CheckpointError(f"{index}: {name} is in {f}, which is missing")
            checked.add(f)
        return dict(wm)
    if (root / SINGLE).is_file():
        return {name: SINGLE for name in read_header(inside(root, SINGLE, str(root)))}
    raise CheckpointError(f"{root}: neither {INDEX} nor {SINGLE}")


def read_header(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype, int]]:
    """Names, shapes, dtypes and absolute data offsets of a safetensors file, from its header only.

    The header's offsets are checked against the file size so a truncated shard is caught
    before any tensor is read.
    """
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, 100 * 2**20):
                raise CheckpointError(f"{path}: corrupted safetensors header (length {n})")
            header = json.loads(f.read(n))
    except RecursionError:
        raise CheckpointError(f"{path}: corrupted safetensors header (nested too deeply)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        if isinstance(e, OSError):
            raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
        raise CheckpointError(f"{path}: corrupted safetensors header") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupted safetensors header")
    header.pop("__metadata__", None)
    data_len = size - 8 - n
    out: dict[str, tuple[tuple[int, ...], torch.dtype, int]] = {}
    end = 0
    ranges: list[tuple[int, int, str]] = []
    for name, info in header.items():
        check_tensor_name(name, str(path))
        try:
            dtype = ST_TO_DTYPE[info["dtype"]]
            shape = tuple(_int(s) for s in info["shape"])
            a, b = (_int(x) for x in info["data_offsets"])
            if len(info["data_offsets"]) != 2 or len(shape) > 8 or any(d < 0 for d in shape):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupted safetensors header entry {name[:120]}") from None
        if a < 0 or b - a != nbytes(shape, dtype):
            raise CheckpointError(f"{path}: header of {name} disagrees with its shape and dtype")
        end = max(end, b)
        out[name] = (shape, dtype, 8 + n + a)
        ranges.append((a, b, name))
    if end > data_len:
        raise CheckpointError(f"{path}: truncated: header promises {end} data bytes, file has {data_len}")
    ranges.sort()
    for (a1, b1, n1), (a2, b2, n2) in pairwise(ranges):
        if a2 < b1:  # two tensors sharing bytes: writing one would change the other
            raise CheckpointError(f"{path}: data_offsets of {n1} [{a1}, {b1}) and {n2} [{a2}, {b2}) overlap")
    return out


def _int(x: Any) -> int:
    if not isinstance(x, int) or isinstance(x, bool):
        raise ValueError(x)
    return x


MAX_TENSOR_NAME = 1024


def check_tensor_name(name: Any, where: str) -> None:
    """A tensor name from a header or index: a string, printable, of sane length."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{where}: tensor name {name!r} is not a string")
    if len(name) > MAX_TENSOR_NAME:
        raise CheckpointError(f"{where}: tensor name {name[:60]!r}… is longer than {MAX_TENSOR_NAME} characters")
    if not name.isprintable():
        raise CheckpointError(f"{where}: tensor name {name[:80]!r} holds control characters (NUL?)")


# ---- writer -------------------------------------------------------------------------------


def _st_header(entries: Sequence[tuple[str, tuple[int, ...], torch.dtype]]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offsets: dict[str, tuple[int, int]] = {}
    pos = 0
    for name, shape, dtype in entries:
        n = nbytes(shape, dtype)
        header[name] = {"dtype": DTYPE_TO_ST[dtype], "shape": list(shape), "data_offsets": [pos, pos + n]}
        offsets[name] = (pos, pos + n)
        pos += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors aligns the data section to 8 bytes
    return struct.pack("<Q", len(blob)) + blob, offsets


class _Shard:
    def __init__(self, file: str, names: list[str], specs: Mapping[str, TensorSpec]):
        self.file = file
        self.entries = [(n, specs[n].shape, specs[n].dtype) for n in names]
        self.header, self.offsets = _st_header(self.entries)
        self.size = len(self.header) + sum(b - a for a, b in self.offsets.values())
        self.remaining = set(names)
        self.fh: BinaryIO | None = None
        self.journal: list[str] = []  # pieces written since the last checkpoint ("name start stop")
        self.reused_bytes = 0  # bytes an interrupted run had written (finished shard or journaled pieces)


class StagingFolder(Protocol):
    """Where :class:`HFWriter` puts its files: a :class:`Staging` folder or a rank's sub-folder of one."""

    @property
    def path(self) -> Path: ...
    def is_finished(self, rel: str) -> bool: ...
    def partial(self, rel: str) -> Path: ...
    def finish(self, rel: str) -> None: ...


#: A resumed job keeps the pieces of an unfinished shard that were on disk at the last checkpoint;
#: one is taken (fdatasync, then the piece list appended to ``<shard>.partial.pieces``) every this
#: many bytes written, so an interruption loses at most about this much work.
CHECKPOINT_BYTES = 512 * 2**20
PIECES_SUFFIX = ".pieces"


class HFWriter:
    """Writes a planned set of tensors as sharded safetensors into a :class:`Staging` folder.

    Tensors may arrive in any order, whole or as row ranges ("pieces"); each must match its
    planned shape and dtype exactly. The shard files follow from the plan alone; with
    ``ranks > 1`` each rank writes the shards :meth:`owns` says are its (whole files, assigned
    by size), so N ranks write the files one process would. On resume, finished shards are
    kept, and so are the pieces of an unfinished shard recorded at its last checkpoint:
    :meth:`needed` / :meth:`piece_needed` say what still has to be produced.
    """

    def __init__(self, staging: StagingFolder, specs: Sequence[TensorSpec], max_shard_size: int | str = DEFAULT_MAX_SHARD,
                 files: Mapping[str, str] | None = None, *, rank: int = 0, ranks: int = 1):
        """``files``: tensor → file name, in file order (see :func:`reference_sharding`); else split by size.
        ``rank`` of ``ranks`` writes the shard files it owns (whole files, assigned by size)."""
        self.staging = staging
        self.specs = {s.name: s for s in specs}
        if files is not None:
            by_file: dict[str, list[str]] = {}
            for name, f in files.items():
                by_file.setdefault(f, []).append(name)
            self.is_sharded = set(by_file) != {SINGLE}
            self.weight_map = dict(files)
        else:
            split = split_state_dict_into_shards_factory(
                dict(self.specs), get_storage_size=lambda s: s.nbytes, filename_pattern=SHARD_PATTERN,
                max_shard_size=max_shard_size,
            )
            self.is_sharded = split.is_sharded
            self.weight_map = dict(split.tensor_to_filename)
            by_file = split.filename_to_tensors
        if set(self.weight_map) != set(self.specs):
            raise CheckpointError("writer: the file assignment does not cover exactly the planned tensors")
        self.shards = {f: _Shard(f, names, self.specs) for f, names in by_file.items()}
        self.rank, self.ranks = rank, ranks
        self.owner = _assign({f: sh.size for f, sh in self.shards.items()}, ranks)
        self._pieces: dict[str, list[tuple[int, int]]] = {}  # disjoint sorted row ranges done, of tensors not complete
        self._since_checkpoint = 0
        # Making pieces durable (fdatasync, then their list) and finishing shards (fsync, rename) run
        # on one background thread, in order, so writing never stops while the disk catches up.
        self._lane = Lane("inkling-fsync")
        for f, shard in self.shards.items():
            if self.owner[f] != rank:
                shard.remaining.clear()  # another rank's file
            elif staging.is_finished(f):
                shard.reused_bytes = sum(b - a for a, b in shard.offsets.values())
                shard.remaining.clear()
            elif getattr(staging, "resumed", False):
                self._load_pieces(shard)

    # ---- what is left ------------------------------------------------------------------------

    def owns(self, name: str) -> bool:
        """Whether ``name`` lies in a shard this rank writes."""
        return self.owner[self.weight_map[name]] == self.rank

    def needed(self, name: str) -> bool:
        """Whether any row of ``name`` still has to be written by this rank."""
        return name in self.shards[self.weight_map[name]].remaining

    def piece_needed(self, name: str, start: int, stop: int) -> bool:
        """Whether rows ``start:stop`` of ``name`` still have to be written by this rank."""
        return self.needed(name) and not _covers(self._pieces.get(name, []), start, stop)

    def pending(self) -> list[str]:
        return [n for n in self.specs if self.needed(n)]

    def reused_bytes(self) -> int:
        """Bytes of this rank's shards an interrupted run had already written."""
        return sum(sh.reused_bytes for f, sh in self.shards.items() if self.owner[f] == self.rank)

    def owned_files(self) -> list[str]:
        return [f for f in self.shards if self.owner[f] == self.rank]

    # ---- writing -----------------------------------------------------------------------------

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write a whole planned tensor."""
        spec = self._spec(name)
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise CheckpointError(
                f"writer: {name} is {tensor.dtype} {list(tensor.shape)}, planned {spec.dtype} {list(spec.shape)}"
            )
        self._put(name, 0, tensor, spec.shape[0] if spec.shape else 1)

    def write_rows(self, name: str, start: int, tensor: torch.Tensor) -> None:
        """Write rows ``start:start+len(tensor)`` (along dim 0) of a planned tensor.

        Stacked experts arrive a few experts at a time, so memory stays bounded by a slice, not
        a layer. The tensor counts as written once every row has been.
        """
        spec = self._spec(name)
        n = tensor.shape[0] if tensor.dim() else 0
        if (not spec.shape or tensor.dtype != spec.dtype or tuple(tensor.shape[1:]) != spec.shape[1:]
                or start < 0 or start + n > spec.shape[0]):
            raise CheckpointError(
                f"writer: rows {start}:{start + n} of {name} as {tensor.dtype} {list(tensor.shape)} do not fit the "
                f"planned {spec.dtype} {list(spec.shape)}"
            )
        self._put(name, start, tensor, n)

    def _spec(self, name: str) -> TensorSpec:
        spec = self.specs.get(name)
        if spec is None:
            raise CheckpointError(f"writer: {name} is not part of the planned output")
        return spec

    def _open(self, shard: _Shard) -> Any:
        if shard.fh is None:
            path = self.staging.partial(shard.file)
            if shard.reused_bytes and path.is_file():
                shard.fh = open(path, "r+b")  # keep the pieces an interrupted run wrote
            else:
                shard.fh = open(path, "wb")
                shard.fh.write(shard.header)
                shard.fh.truncate(shard.size)
        return shard.fh

    def _put(self, name: str, start: int, tensor: torch.Tensor, rows: int) -> None:
        spec = self.specs[name]
        shard = self.shards[self.weight_map[name]]
        if name not in shard.remaining or _covers(self._pieces.get(name, []), start, start + rows):
            return
        fh = self._open(shard)
        a, _ = shard.offsets[name]
        row_bytes = spec.nbytes // spec.shape[0] if spec.shape and spec.shape[0] else spec.nbytes
        fh.seek(len(shard.header) + a + start * row_bytes)
        # A GPU result comes down piece by piece through small pinned buffers: never whole on the host.
        self._since_checkpoint += write_from(fh, tensor)
        shard.journal.append(f"{name} {start} {start + rows}")
        self._done_rows(shard, name, start, rows)
        if not shard.remaining:
            fh.close()
            shard.fh = None
            shard.journal.clear()
            self._lane.submit(self._complete, shard)
        elif self._since_checkpoint >= CHECKPOINT_BYTES:
            self.checkpoint()

    def _complete(self, shard: _Shard) -> None:
        self.staging.finish(shard.file)  # fsync, then the rename that marks it complete
        pieces = self._pieces_path(shard)
        if pieces.exists():
            pieces.unlink()

    def _done_rows(self, shard: _Shard, name: str, start: int, rows: int) -> None:
        spec = self.specs[name]
        total = spec.shape[0] if spec.shape else 1
        done = _merge(self._pieces.get(name, []), start, start + rows)
        if done == [(0, total)]:
            self._pieces.pop(name, None)
            shard.remaining.discard(name)
        else:
            self._pieces[name] = done

    # ---- unit-grain resume -------------------------------------------------------------------

    def _pieces_path(self, shard: _Shard) -> Path:
        return self.staging.path / (shard.file + ".partial" + PIECES_SUFFIX)

    def checkpoint(self) -> None:
        """Make the pieces written so far survive an interruption: data to disk, then their list."""
        for shard in self.shards.values():
            if shard.fh is None or not shard.journal:
                continue
            shard.fh.flush()  # into the kernel here; to the disk on the syncing thread, through its own descriptor
            fd = os.dup(shard.fh.fileno())
            lines = "".join(line + "\n" for line in shard.journal)
            shard.journal.clear()
            self._lane.submit(self._sync_pieces, fd, self._pieces_path(shard), lines)
        self._since_checkpoint = 0

    @staticmethod
    def _sync_pieces(fd: int, listed: Path, lines: str) -> None:
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)
        with open(listed, "a") as j:
            j.write(lines)
            j.flush()

    def _load_pieces(self, shard: _Shard) -> None:
        """Take back the pieces of a partial shard listed at its last checkpoint (if the file is whole)."""
        partial = self.staging.path / (shard.file + ".partial")
        listed = self._pieces_path(shard)
        try:
            if not partial.is_file() or partial.stat().st_size != shard.size or not listed.is_file():
                return
            with open(partial, "rb") as f:
                if f.read(len(shard.header)) != shard.header:
                    return
            lines = listed.read_text().splitlines()
        except OSError:
            return
        seen: set[tuple[str, int, int]] = set()
        for line in lines:
            fields = line.rsplit(" ", 2)
            if len(fields) != 3 or fields[0] not in shard.offsets or not (fields[1].isdigit() and fields[2].isdigit()):
                continue  # a line cut short by the interruption
            name, a, b = fields[0], int(fields[1]), int(fields[2])
            spec = self.specs[name]
            total = spec.shape[0] if spec.shape else 1
            if (name, a, b) in seen or not 0 <= a < b <= total or name not in shard.remaining \
                    or _covers(self._pieces.get(name, []), a, b):
                continue
            seen.add((name, a, b))
            row_bytes = spec.nbytes // total if total else spec.nbytes
            shard.reused_bytes += (b - a) * row_bytes
            self._done_rows(shard, name, a, b - a)

    # ---- the end -----------------------------------------------------------------------------

    def close(self, *, index: bool | None = None) -> None:
        """Check this rank wrote everything it owns; write the index (rank 0 by default)."""
        self._lane.settle()  # a failure there (fsync, rename) is this writer's failure
        self._lane.close()
        left = self.pending()
        if left:
            raise CheckpointError(f"writer: {len(left)} planned tensors were never written (first: {left[0]})")
        if (self.rank == 0 if index is None else index):
            self.write_index()

    def write_index(self) -> None:
        """The index of a sharded output (it follows from the plan: any rank may write it)."""
        if self.is_sharded:
            total = sum(s.nbytes for s in self.specs.values())
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(self.weight_map.items()))}
            (self.staging.path / INDEX).write_text(json.dumps(index, indent=2) + "\n")

    def abort(self) -> None:
        """Close the open files, recording the pieces written so far (a rerun resumes from them)."""
        try:
            self.checkpoint()
        except OSError:
            pass
        try:
            self._lane.settle(raise_errors=False)  # what was handed to the syncing thread reaches the disk first
        finally:
            for shard in self.shards.values():
                if shard.fh is not None:
                    shard.fh.close()
                    shard.fh = None


def _merge(ranges: list[tuple[int, int]], a: int, b: int) -> list[tuple[int, int]]:
    """Disjoint sorted ranges with ``[a, b)`` added (touching ranges join)."""
    out: list[tuple[int, int]] = []
    for x, y in sorted([*ranges, (a, b)]):
        if out and x <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], y))
        else:
            out.append((x, y))
    return out


def _covers(ranges: list[tuple[int, int]], a: int, b: int) -> bool:
    """Whether ``[a, b)`` lies inside one of the (merged) ``ranges``."""
    return any(x <= a and b <= y for x, y in ranges)


def _assign(sizes: Mapping[str, int], ranks: int) -> dict[str, int]:
    """Shard file → rank: largest first onto the least-loaded rank (deterministic)."""
    load = [0] * max(1, ranks)
    owner: dict[str, int] = {}
    for f, n in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        r = min(range(len(load)), key=lambda i: (load[i], i))
        owner[f] = r
        load[r] += n
    return owner
def reference_sharding(ref: Any, specs: Sequence[TensorSpec]) -> dict[str, str] | None:
    """The files of HF checkpoint ``ref`` (tensor → file, each file's tensors in stored order) when the
    output holds exactly its tensors (names, shapes, dtypes), so an unchanged checkpoint comes back file
    for file; None otherwise (the output is then split by size)."""
    tensors = getattr(ref, "tensors", None)
    if not isinstance(tensors, Mapping) or set(tensors) != {s.name for s in specs}:
        return None
    for s in specs:
        t = tensors[s.name]
        if not isinstance(t, StoredTensor) or (t.shape, t.dtype) != (s.shape, s.dtype):
            return None
    if any(Path(t.file).name != t.file or not t.file.endswith(".safetensors") for t in tensors.values()):
        return None  # only plain shard names are reproduced
    order = sorted(tensors.values(), key=lambda t: (t.file, t.offset))
    return {t.name: t.file for t in order}


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def write_extra_files(files: Mapping[str, bytes | Path], dst: Path) -> None:
    """Write the pass-through files (tokenizer, generation config, ...) into ``dst``; paths are
    copied streaming (never read whole, regular files only), bytes written as they are; every
    target is created new (:func:`~inkling_ckpt.layouts.paths.copy_new`), never through a link."""
    for name, data in files.items():
        check_name(name, str(dst), "pass-through file")
        try:
            if isinstance(data, Path):
                copy_new(data, dst / name)
            else:
                if os.path.lexists(dst / name):
                    (dst / name).unlink()
                write_new(dst / name, data)
        except OSError as e:
            raise OutputError(f"cannot write {name} into {dst}: {e.strerror}") from None


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: str | int) -> int:
    """'5GB', '500MB', '2MiB' or an int, in bytes."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", size)
    unit = m.group(2).upper() if m else ""
    if not m or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ConfigError(f"cannot read size {size!r} (use e.g. 5GB, 500MB, 2MiB)")
    return int(float(m.group(1)) * _UNITS[unit])


__all__ = [
    "HFCheckpoint", "HFWriter", "StoredTensor", "read_header", "resolve_source", "hub_access", "split_repo_id", "check_against_inventory",
    "DTYPE_TO_ST", "ST_TO_DTYPE", "INDEX", "reference_sharding",
]
