"""Megatron-Core ``torch_dist`` checkpoints: a streaming writer and a Megatron-free reader.

The folder (``shared/spec/megatron.md``; facts in ``shared/reference/megatron.md`` §1)::

    DST/latest_checkpointed_iteration.txt      "release"
    DST/release/.metadata                      torch.distributed.checkpoint Metadata (pickle)
    DST/release/__U_0.distcp                   data: one file per conversion unit (U = unit number)
    DST/release/common.pt                      plain Python types; loads with weights_only=True
    DST/release/metadata.json                  the 4-key backend description, written LAST

A ``.distcp`` file is a sequence of independent ``torch.save`` blobs, one per stored chunk or
object; ``.metadata`` maps ``MetadataIndex(key, chunk offsets)`` to ``(file, offset, length)``.
The writer (:mod:`.megatron_writer`) builds the chunks lazily, as they are written, and puts each
unit's chunks into its own file, finished by an atomic rename and recorded in a small sidecar so an
interrupted conversion resumes unit by unit; then ``torch.distributed.checkpoint``'s
:func:`dcp.save` (:mod:`.megatron_dcp`, the one module that imports it) runs the (collective, under
torchrun) planning over what was written and writes ``.metadata``. File
names depend on the unit, not on the rank, and ``.metadata`` is written in a canonical order, so a
one-process and an N-process conversion write the same bytes. Blobs are saved without zip CRC32s
(``torch.load`` never checks them; computing them cost more than the writing); instead each data
file gets a sidecar ``__U_0.distcp.sha256`` ("offset length sha256" per blob) that the reader
checks on every read, so a flipped bit is an error, not a silently different weight. Saves from
elsewhere (no sidecar) are read unchecked.

``_extra_state`` objects (``ShardedObject``\\ s in Megatron) are stored as the bytes of
``torch.save([torch.empty(0, dtype=torch.uint8)])`` — what Transformer Engine writes with no FP8
state (reference §2.6); Megatron's default load strictness fails without them.

The reader never imports Megatron, nor ``torch.distributed.checkpoint`` (DTensor, sympy: seconds):
it unpickles ``.metadata`` through an allow-list of exact (module, name) pairs (DCP's dataclass and
enum names, each resolved to the toolkit's own record of that name in :mod:`.dcp_records`; legacy
``megatron.*`` classes become inert stand-ins; no dotted-name traversal), checks every entry's
types, that data files resolve inside the folder and that each tensor's chunks tile it (inside,
disjoint, covering) and ``common.pt`` with ``weights_only=True`` plus what Megatron-LM itself
allows there (its argparse run arguments and enums, again as stand-ins); anything else is refused.
It reads chunk blobs by offset, assembles any region from any chunking (Megatron's TP/EP saves
split tensors), and can present stacked ``decoder.layers.<name>`` keys (leading layer axis) as
per-layer keys.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import bisect
import dataclasses
import functools
import pickle
import re
import threading
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Mapping, Sequence

import torch

from ..errors import CheckpointError, ConfigError, IntegrityError
from ..model.inventory import nbytes
from .paths import check_regular, inside, open_regular
from .pread import off_host, read_exact
from .megatron_names import COMMON, DCP_METADATA, METADATA_JSON, RELEASE, TRACKER  # re-exported
from .dcp_records import (
    DCP_NAMES, BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, SavePlan, TensorProperties,
    TensorStorageMetadata, _StorageInfo,
)


UNITS_DIR = ".inkling-units"
SUMS_SUFFIX = ".sha256"  # beside each data file: "offset length sha256" per blob, verified on read
# mcore <= 0.18 does CheckpointingConfig(**json): exactly these keys (reference §6.2).
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
           "common_backend": "torch", "common_backend_version": 1}


def common_state(content_metadata: Mapping[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """The common (non-tensor) state: plain types only, so ``torch.load(weights_only=True)`` works."""
    state: dict[str, Any] = {"checkpoint_version": 3.0, "iteration": 0,
                             "content_metadata": dict(content_metadata or {"non_homogeneous_layers": True})}
    state.update(extra)
    return state


#: ``common.pt`` holds what inkling-ckpt knows about the conversion under this key (Megatron
#: ignores it); its ``config`` entry is the source ``config.json``, so the read-only commands
#: (inspect, verify, memory) need no ``--config`` for a checkpoint the toolkit wrote.
INKLING_KEY = "inkling"
CONFIG_KEY = "config"


def stored_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` as plain JSON types (lists, dicts, str, numbers), loadable with ``weights_only=True``."""
    return json.loads(json.dumps(dict(config)))


def read_stored_config(common: Mapping[str, Any]) -> dict[str, Any] | None:
    """The source ``config.json`` kept in ``common.pt`` by ``hf-to-megatron``, if any."""
    ours = common.get(INKLING_KEY)
    config = ours.get(CONFIG_KEY) if isinstance(ours, Mapping) else None
    return dict(config) if isinstance(config, Mapping) else None


# Keys that say how a config was saved, not what model it describes: a reference of another
# precision or transformers version describes the same weights.
_CONFIG_BOOKKEEPING = frozenset({"quantization_config", "transformers_version", "_name_or_path", "torch_dtype", "dtype",
                                 "architectures", "auto_map", "use_cache", "vision_config"})


def config_differences(kept: Mapping[str, Any], other: Mapping[str, Any]) -> list[str]:
    """Dotted names of the model fields where two config.json dicts disagree (bookkeeping keys and
    the vision config, which a torch_dist folder does not hold, left out)."""
    out: list[str] = []

    def walk(a: Any, b: Any, prefix: str) -> None:
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            for k in sorted(set(a) | set(b), key=str):
                if k in _CONFIG_BOOKKEEPING:
                    continue
                walk(a.get(k), b.get(k), f"{prefix}{k}" if prefix == "" else f"{prefix}.{k}")
        elif a != b:
            out.append(prefix.removeprefix("text_config."))

    walk(kept, other, "")
    return out


def check_reference_config(common: Mapping[str, Any], reference: Mapping[str, Any], where: str) -> None:
    """Refuse a reference whose config describes another model than the one a torch_dist folder keeps
    (what ``hf-to-megatron`` stored in ``common.pt``): its config would be published with these weights."""
    kept = read_stored_config(common)
    if kept is None:
        return
    diff = config_differences(kept, reference)
    if diff:
        more = f" (and {len(diff) - 3} more)" if len(diff) > 3 else ""
        raise ConfigError(f"{where}: the --reference config describes another model than the one kept in its "
                          f"{COMMON}: they differ in {', '.join(diff[:3])}{more}; use the release these weights came from")


def empty_extra_state() -> bytes:
    """The ``_extra_state`` payload of a TE module without FP8 state."""
    buf = io.BytesIO()
    torch.save([torch.empty(0, dtype=torch.uint8)], buf)
    return buf.getvalue()


@dataclass(frozen=True)
class ChunkItem:
    """One stored chunk of a tensor key: where it sits in the global tensor."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    unit: int

    @property
    def nbytes(self) -> int:
        return nbytes(self.sizes, self.dtype)


@dataclass(frozen=True)
class ObjectItem:
    """One ``ShardedObject`` (stored as bytes under its unique key)."""

    key: str
    unit: int
    payload: bytes


def _read_sums(folder: Path) -> dict[tuple[str, int, int], str]:
    """The per-blob sha256 sidecars our writer puts beside each data file (absent for others' saves)."""
    sums: dict[tuple[str, int, int], str] = {}
    for p in sorted(folder.glob("*" + SUMS_SUFFIX)):
        name = p.name[: -len(SUMS_SUFFIX)]
        try:
            with open_regular(p, limit=1 << 30) as f:
                lines = f.read().decode("ascii").splitlines()
            for line in lines:
                a, n, h = line.split(" ")
                if len(h) != 64:
                    raise ValueError(h)
                sums[(name, int(a), int(n))] = h
        except (OSError, ValueError, UnicodeDecodeError):
            raise CheckpointError(f"{p}: damaged checksum file") from None
    return sums


def finish_iteration_dir(folder: Path, common: Mapping[str, Any]) -> None:
    """Write ``common.pt``, drop resume sidecars, then ``metadata.json`` (the completion marker)."""
    torch.save(dict(common), folder / COMMON)
    for p in sorted((folder / UNITS_DIR).glob("*")) if (folder / UNITS_DIR).is_dir() else []:
        p.unlink()
    if (folder / UNITS_DIR).is_dir():
        (folder / UNITS_DIR).rmdir()
    tmp = folder / (METADATA_JSON + ".tmp")
    tmp.write_text(json.dumps(BACKEND) + "\n")
    os.replace(tmp, folder / METADATA_JSON)


def write_tracker(root: Path, iteration: str = RELEASE) -> None:
    (root / TRACKER).write_text(iteration)


# ---- reader -----------------------------------------------------------------------------------


class _Stand_in:
    """What a legacy ``megatron.*`` class in ``.metadata`` becomes: inert, holds its state."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)


# Exact (module, qualified name) pairs a DCP ``.metadata`` may name; nothing else resolves.
# Names are looked up in this table only, never imported or traversed (a dotted name such as
# ``os.system`` inside an allowed module would otherwise resolve under pickle protocol >= 4).
# DCP's names resolve to the toolkit's own records (:mod:`.dcp_records`), never to DCP's classes:
# importing torch.distributed.checkpoint costs seconds that a command only reading pays for nothing.
def _dcp_allowed() -> dict[tuple[str, str], Any]:
    import collections
    import copyreg
    import pathlib

    table: dict[tuple[str, str], Any] = {
        ("torch", "Size"): torch.Size, ("torch", "device"): torch.device,
        ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("builtins", "set"): set, ("builtins", "frozenset"): frozenset, ("builtins", "object"): object,
        ("copyreg", "_reconstructor"): copyreg._reconstructor,  # type: ignore[attr-defined]  # private: not in typeshed
        # torch's own FileSystemWriter records the checkpoint_id it was given, often a Path: it
        # comes back as a pure path (plain data; nothing touches the filesystem).
        ("pathlib", "PosixPath"): pathlib.PurePosixPath, ("pathlib._local", "PosixPath"): pathlib.PurePosixPath,
        ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
        ("pathlib._local", "PurePosixPath"): pathlib.PurePosixPath,
        ("pathlib", "WindowsPath"): pathlib.PureWindowsPath, ("pathlib._local", "WindowsPath"): pathlib.PureWindowsPath,
    }
    # DCP's dataclasses and enums (Megatron-Core's saves also keep their inert save plans in .metadata).
    for module, records in DCP_NAMES.items():
        for record in records:
            table[(module, record.__name__)] = record
    for d in (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16,
              torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu,
              torch.complex64):
        table[("torch", str(d).split(".")[-1])] = d
    for name in ("strided", "contiguous_format", "preserve_format", "channels_last"):
        table[("torch", name)] = getattr(torch, name)
    return table


_DCP_ALLOWED: dict[tuple[str, str], Any] | None = None
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _buildable() -> frozenset[type]:
    """Classes whose fresh instances may take pickled state (BUILD): the allowed dataclasses and
    the inert stand-in. Never a class object, an enum member or anything built elsewhere."""
    global _DCP_ALLOWED
    if _DCP_ALLOWED is None:
        _DCP_ALLOWED = _dcp_allowed()
    return frozenset({v for v in _DCP_ALLOWED.values() if isinstance(v, type) and dataclasses.is_dataclass(v)}
                     | {_Stand_in})


class _BoundedBytes(io.BytesIO):
    """The ``.metadata`` bytes, refusing any read longer than what is left: a length field
    declaring 2^60 bytes fails at once instead of allocating."""

    def read(self, n: int | None = -1) -> bytes:
        if n is not None and n > len(self.getbuffer()) - self.tell():
            raise pickle.UnpicklingError(f"a length of {n} bytes runs past the end of the file")
        return super().read(n)

    def readinto(self, b: Any) -> int:
        if len(b) > len(self.getbuffer()) - self.tell():
            raise pickle.UnpicklingError(f"a length of {len(b)} bytes runs past the end of the file")
        return super().readinto(b)


_P = pickle._Unpickler  # the pure-Python unpickler: its opcodes can be overridden
_OPS: dict[int, Callable[[Any], None]] = dict(_P.dispatch)  # its opcode table (typed loosely: it takes any subclass)


class _MetadataUnpickler(_P):
    """Unpickles DCP ``.metadata`` allowing exact (module, name) pairs: DCP's checkpoint record
    names (read into our own records, :mod:`.dcp_records`) and plain types; legacy ``megatron.*``
    classes become inert stand-ins.

    BUILD (set an object's state) applies only to instances this load itself just built, of an
    allowed dataclass (never to a class object or a shared enum member: a crafted file could
    otherwise set attributes on a class for the rest of the process), and every
    length in the file is bounded by what is left of it (:class:`_BoundedBytes`).
    """

    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = dict(_OPS)  # loosely typed: its entries take any subclass
    stack: list[Any]  # the pure-Python unpickler's value stack (not in its stub)

    def __init__(self, file: Any):
        super().__init__(file)
        self._fresh: set[int] = set()
        self._keep: list[Any] = []  # keeps what was built alive, so its id() stays its own
        self._allowed_build = _buildable()

    def _built(self) -> None:
        obj = self.stack[-1]
        self._fresh.add(id(obj))
        self._keep.append(obj)

    def _load_build(self) -> None:
        if len(self.stack) < 2:
            raise pickle.UnpicklingError("BUILD with an empty stack")
        state, inst = self.stack[-1], self.stack[-2]
        if isinstance(inst, type) or id(inst) not in self._fresh or type(inst) not in self._allowed_build:
            raise pickle.UnpicklingError(f"refusing to unpickle: BUILD on {type(inst).__name__[:80]}, not a freshly "
                                         "built checkpoint record")
        if isinstance(state, tuple) and len(state) == 2:
            parts = [x for x in state if x is not None]
        else:
            parts = [state]
        own_setstate = "__setstate__" in vars(type(inst))  # e.g. TensorProperties: its own, allowed code
        if not own_setstate and not all(isinstance(x, dict) and all(isinstance(k, str) for k in x) for x in parts):
            raise pickle.UnpicklingError(f"refusing to unpickle: state of {type(inst).__name__[:80]} is not a dict")
        _OPS[pickle.BUILD[0]](self)

    dispatch[pickle.BUILD[0]] = _load_build

    def find_class(self, module: str, name: str) -> Any:
        global _DCP_ALLOWED
        if _DCP_ALLOWED is None:
            _DCP_ALLOWED = _dcp_allowed()
        found = _DCP_ALLOWED.get((module, name))
        if found is not None:
            return found
        # Megatron's own classes are never imported: a plain class name (no dots) under
        # megatron.* becomes a stand-in that only keeps its state.
        if module.startswith("megatron.") and _IDENT.fullmatch(name) \
                and all(_IDENT.fullmatch(part) for part in module.split(".")):
            if name.endswith("Metadata"):
                return Metadata
            if name.endswith("SavePlan"):
                return SavePlan
            return _Stand_in
        raise pickle.UnpicklingError(f"refusing to unpickle {module[:80]}.{name[:80]}: not an allowed class")


def _marking(op: bytes) -> Callable[[_MetadataUnpickler], None]:
    inner = _OPS[op[0]]

    def load(self: _MetadataUnpickler) -> None:
        inner(self)
        self._built()
    return load


for _op in (pickle.REDUCE, pickle.NEWOBJ, pickle.NEWOBJ_EX, pickle.OBJ, pickle.INST):
    _MetadataUnpickler.dispatch[_op[0]] = _marking(_op)

MAX_METADATA_BYTES = 4 << 30  # .metadata of the full-size model is tens of MB
#: Stored chunks up to this size are read once into memory (checksum and load from the same bytes).
ONE_READ_BYTES = 1 << 30


def read_dcp_metadata(path: Path) -> Metadata:
    try:
        with open_regular(path, limit=MAX_METADATA_BYTES) as f:
            raw = f.read()
        md = _MetadataUnpickler(_BoundedBytes(raw)).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (not a torch_dist checkpoint)") from None
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    except Exception as e:  # untrusted bytes: any failure to unpickle is a damaged or hostile file
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: cannot read DCP metadata ({first})") from None
    if not isinstance(md, Metadata) or not isinstance(getattr(md, "state_dict_metadata", None), dict):
        raise CheckpointError(f"{path}: not a torch.distributed.checkpoint Metadata")
    _check_metadata_types(md, path)
    return md


def _ints(x: Any, n: int | None = None) -> bool:
    try:
        vals = tuple(x)
    except TypeError:
        return False
    return (n is None or len(vals) == n) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                 for v in vals)


def _check_metadata_types(md: Metadata, path: Path) -> None:
    """Every entry of an unpickled ``.metadata`` has the types the reader relies on (one-line errors)."""
    for key, v in md.state_dict_metadata.items():
        if not isinstance(key, str):
            raise CheckpointError(f"{path}: a key is {type(key).__name__}, not a string")
        if isinstance(v, TensorStorageMetadata):
            ok = (_ints(v.size) and len(tuple(v.size)) <= 8 and isinstance(getattr(v, "properties", None), TensorProperties)
                  and isinstance(v.properties.dtype, torch.dtype) and isinstance(v.chunks, list)
                  and all(isinstance(c, ChunkStorageMetadata) and _ints(c.offsets, len(v.size)) and _ints(c.sizes, len(v.size))
                          for c in v.chunks))
            if not ok:
                raise CheckpointError(f"{path}: entry of {key[:120]} is damaged (size, dtype or chunks)")
        elif not isinstance(v, BytesStorageMetadata):
            raise CheckpointError(f"{path}: entry of {key[:120]} is a {type(v).__name__}, not tensor or bytes metadata")
    sd = getattr(md, "storage_data", None)
    if not isinstance(sd, dict):
        raise CheckpointError(f"{path}: storage_data is missing")
    for idx, info in sd.items():
        if not isinstance(idx, MetadataIndex) or not isinstance(info, _StorageInfo) \
                or not isinstance(info.relative_path, str) or not _ints((info.offset, info.length)):
            raise CheckpointError(f"{path}: a storage_data entry is damaged")


_STACKED = re.compile(r"decoder\.layers\.(?![0-9]+\.)")


class _Slice(io.RawIOBase):
    """A read-only window ``[offset, offset + length)`` of an open file (torch.load reads through it)."""

    def __init__(self, f: Any, offset: int, length: int):
        self._f, self._off, self._len, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = pos if whence == 0 else self._pos + pos if whence == 1 else self._len + pos
        return self._pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), self._len - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._off + self._pos)
        got = self._f.readinto(memoryview(b)[:n])
        self._pos += got
        return got


class _Memory(_Slice):
    """A read-only file over a buffer (torch.load and zipfile read a blob already in memory through it, uncopied)."""

    def __init__(self, buf: memoryview):
        super().__init__(None, 0, len(buf))
        self._buf = buf

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self._len - self._pos))
        memoryview(b)[:n] = self._buf[self._pos:self._pos + n]
        self._pos += n
        return n


def _load_in_place(buf: torch.Tensor, shape: tuple[int, ...] | None, dtype: torch.dtype, what: str) -> Any:
    """What the ``torch.save`` blob in ``buf`` (uint8, CPU) holds; a tensor of ``shape`` and ``dtype``
    keeps its values where they are in ``buf``.

    Loading copies a tensor's bytes into fresh memory: at the size of a checkpoint that copy and
    the page faults of the new memory cost about as much as reading it. The blob's pickle is still
    read by the weights-only loader (on the meta device) and its one record found through the zip
    directory (:func:`_blob_layout`); any other blob (or a shape the metadata does not give) is
    loaded the usual way.
    """
    view = memoryview(buf.numpy())  # type: ignore[arg-type]  # numpy types ndarray as a Buffer on 3.12+ only
    lay = None if shape is None else _blob_layout(_Memory(view), Path(what), 0, len(view), shape, dtype, what)
    if lay is None or shape is None:
        return _safe_load(io.BytesIO(view.tobytes()), what)
    if any(n == 0 for n in shape):
        return torch.empty(shape, dtype=dtype)
    values = torch.frombuffer(view[lay.start:lay.start + lay.elements * lay.itemsize], dtype=dtype)
    return values.as_strided(shape, lay.strides, lay.storage_offset)


class _MegatronValue:
    """Stand-in for a Megatron class inside ``common.pt`` (run args, enums): keeps its state only."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)


# What Megatron-Core itself allows in common.pt beyond torch's weights-only set
# (megatron/core/safe_globals.py, core_v0.16.1): its run arguments and a few enums. Megatron
# classes load as inert stand-ins, so reading never needs (or runs) Megatron code; anything
# else is refused as unsafe.
_MEGATRON_SAFE_NAMES = (
    "megatron.core.enums.ModelType", "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.CudaGraphScope", "megatron.core.optimizer.optimizer_config.OptimizerConfig",
    "megatron.core.optimizer.OptimizerConfig", "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.rerun_state_machine.RerunMode", "megatron.core.rerun_state_machine.RerunState",
)


def _common_safe_globals() -> list[Any]:
    import argparse
    import pathlib
    import signal
    import types

    safe: list[Any] = [argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath, signal.Signals, io.BytesIO]
    try:
        import numpy as np

        safe += [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
        core = getattr(np, "_core", None) or np.core  # numpy 2 / 1
        recon = getattr(core.multiarray, "_reconstruct", None)
        if recon is not None:  # pickles name it after the numpy that wrote them (1.x: numpy.core)
            safe += [(recon, f"{mod}._reconstruct") for mod in ("numpy.core.multiarray", "numpy._core.multiarray")]
    except (ImportError, AttributeError):
        pass
    safe += [(_MegatronValue, name) for name in _MEGATRON_SAFE_NAMES]
    return safe


def _safe_load(data: io.IOBase | Path, what: str, *, meta: bool = False) -> Any:
    """``torch.load`` weights-only (plus Megatron's allowed run arguments); ``meta``: tensors on the
    meta device, their bytes never read (shape, strides and storage offset only)."""
    try:
        with torch.serialization.safe_globals(_common_safe_globals()):
            return torch.load(data, map_location="meta" if meta else "cpu", weights_only=True)  # type: ignore[arg-type]  # any readable, seekable file; torch annotates IO[bytes]
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{what}: needs unsafe unpickling; refusing to load it ({first[:160]})") from None
    except Exception as e:  # untrusted bytes: any failure to load is a damaged file, in one line
        raise CheckpointError(f"{what}: cannot load ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e).strip() else ''})") from None


@dataclass(frozen=True)
class StoredKey:
    """A tensor of a torch_dist checkpoint: global shape, dtype and stored chunks."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]

    @functools.cached_property
    def sizes(self) -> dict[tuple[int, ...], tuple[int, ...]]:
        """Stored chunk offsets -> their sizes (built once: a stacked key holds layers x experts chunks)."""
        return {tuple(o): tuple(z) for o, z in self.chunks}

    @functools.cached_property
    def index(self) -> "_ChunkIndex":
        """The chunks as a search tree (built once): see :func:`_overlapping`."""
        return _ChunkIndex(self.chunks, 0, len(self.shape))


_Chunk = tuple[tuple[int, ...], tuple[int, ...]]


class _ChunkIndex:
    """Chunks grouped by their offset along one dimension, each group indexed by the next dimension.

    Finding the chunks a region meets bisects each level: a read of one expert of a stacked
    [layers, experts, ...] key looks at the one chunk it needs, not at every one of the key's
    (layers x experts: thousands). A group's candidates start above ``lo - longest`` (the longest
    chunk along that dimension) and below ``hi``; the last level checks every dimension exactly.
    """

    def __init__(self, chunks: Sequence[_Chunk], dim: int, ndim: int):
        groups: dict[int, list[_Chunk]] = {}
        for c in chunks:
            groups.setdefault(c[0][dim], []).append(c)
        self.dim, self.starts = dim, sorted(groups)
        self.longest = max((c[1][dim] for c in chunks), default=0)
        self.leaf = dim + 1 == ndim
        self.children: list[Any] = [groups[k] if self.leaf else _ChunkIndex(groups[k], dim + 1, ndim)
                                    for k in self.starts]

    def meeting(self, off: Sequence[int], size: Sequence[int]) -> Iterator[_Chunk]:
        """The chunks that the region ``off`` + ``size`` overlaps, in offset order."""
        lo, hi = off[self.dim], off[self.dim] + size[self.dim]
        for child in self.children[bisect.bisect_right(self.starts, lo - self.longest):
                                   bisect.bisect_left(self.starts, hi)]:
            if not self.leaf:
                yield from child.meeting(off, size)
                continue
            for c in child:
                if all(a < b + y and b < a + x for a, x, b, y in zip(off, size, c[0], c[1], strict=True)):
                    yield c


def resolve_iteration_dir(path: Path) -> Path:
    """The iteration folder of a Megatron save folder (tracker) or the folder itself."""
    if not path.exists():
        raise CheckpointError(f"{path}: no such folder")
    tracker = path / TRACKER
    if tracker.is_file():
        try:
            with open_regular(tracker) as f:
                text = f.read(256).decode("utf-8").strip()
        except UnicodeDecodeError:
            raise CheckpointError(f"{tracker}: not text (expected 'release' or an iteration number)") from None
        except OSError as e:
            raise CheckpointError(f"{tracker}: cannot read ({e.strerror})") from None
        if text == RELEASE:
            return path / RELEASE
        if text.isascii() and text.isdigit() and len(text) <= 12:
            return path / f"iter_{int(text):07d}"
        raise CheckpointError(f"{tracker}: holds {text[:40]!r}, expected 'release' or an iteration number")
    if (path / DCP_METADATA).exists() or (path / METADATA_JSON).exists():
        return path
    if (path / RELEASE).is_dir():
        return path / RELEASE
    raise CheckpointError(f"{path}: not a Megatron torch_dist checkpoint (no {TRACKER}, {METADATA_JSON} or .metadata)")


def _check_tiling(folder: Path, st: "StoredKey") -> None:
    """The stored chunks of a tensor lie inside it, do not overlap, and cover it exactly.

    Volumes adding up is not enough: two overlapping chunks leave rows that no chunk holds,
    which would be published as uninitialised memory. Each chunk is looked up in the key's
    index (:class:`_ChunkIndex`), which finds only itself where nothing overlaps it: a stacked
    save's [48, 384, ...] expert weight (18432 chunks) is checked in a fraction of a second, where
    comparing each chunk with those sharing its layer took ~9 s.
    """
    where = f"{folder / DCP_METADATA}"
    total, got = 1, 0
    for n in st.shape:
        total *= n
    if total == 0:  # an empty tensor (a zero in its shape): DCP stores it as one chunk, the whole of it
        if [(tuple(o), tuple(z)) for o, z in st.chunks] != [((0,) * len(st.shape), tuple(st.shape))]:
            raise CheckpointError(f"{where}: the empty tensor {st.key} {list(st.shape)} is not stored as one whole chunk")
        return
    boxes = []
    for off, size in st.chunks:
        if len(off) != len(st.shape) or len(size) != len(st.shape) \
                or any(o < 0 or z <= 0 or o + z > g for o, z, g in zip(off, size, st.shape, strict=True)):
            raise CheckpointError(f"{where}: a chunk of {st.key} at {list(off)} size {list(size)} lies outside {list(st.shape)}")
        v = 1
        for z in size:
            v *= z
        got += v
        boxes.append((tuple(off), tuple(size)))
    if got != total:
        raise CheckpointError(f"{where}: the chunks of {st.key} do not cover it exactly")
    if not st.shape:
        if len(boxes) > 1:
            raise CheckpointError(f"{where}: scalar {st.key} is stored {len(boxes)} times")
        return
    boxes.sort()
    for off, size in boxes:
        # the chunk itself, and any other it overlaps (a duplicate included), by the key's index
        hits = list(st.index.meeting(off, size))
        if len(hits) > 1:
            o2 = next((o for o, _ in hits if o != off), off)
            first, second = sorted((o2, off))
            raise CheckpointError(f"{where}: chunks of {st.key} at {list(first)} and {list(second)} overlap")


def _overlapping(st: StoredKey, off: Sequence[int], size: Sequence[int]
                 ) -> Iterator[tuple[tuple[int, ...], tuple[int, ...], list[int], list[int]]]:
    """The stored chunks of ``st`` that the region ``off``+``size`` overlaps: ``(chunk offsets, chunk
    sizes, lo, hi)``, the overlap ``lo:hi`` in global coordinates."""
    for c_off, c_size in (st.index.meeting(off, size) if off else st.chunks):
        lo = [max(a, b) for a, b in zip(off, c_off, strict=True)]
        hi = [min(a + s, b + t) for a, s, b, t in zip(off, size, c_off, c_size, strict=True)]
        if all(x < y for x, y in zip(lo, hi, strict=True)):
            yield c_off, c_size, lo, hi


def _whole(c_off: Sequence[int], c_size: Sequence[int], lo: Sequence[int], hi: Sequence[int]) -> bool:
    """The region ``lo:hi`` (global coordinates) is the whole chunk at ``c_off`` of ``c_size``."""
    return list(lo) == list(c_off) and [y - o for y, o in zip(hi, c_off, strict=True)] == list(c_size)


@dataclass(frozen=True)
class _BlobLayout:
    """Where a stored chunk's elements lie in its data file: a plain tensor in an uncompressed record."""

    path: Path
    start: int  # file offset of the record's first byte
    storage_offset: int
    strides: tuple[int, ...]
    itemsize: int
    elements: int  # of the storage, from its start through the tensor's last element


_DATA_RECORD = re.compile(r"[^/]+/data/[0-9]+")
_LOCAL_HEADER = 30  # bytes of a zip local file header before its name and extra field


def _record_start(blob: "_Slice", rec: zipfile.ZipInfo) -> int | None:
    """Where an uncompressed zip record's bytes start in ``blob`` (after its local header), if sound."""
    blob.seek(rec.header_offset)
    local = blob.read(_LOCAL_HEADER)
    if len(local) != _LOCAL_HEADER or local[:4] != b"PK\x03\x04" or rec.compress_type != zipfile.ZIP_STORED:
        return None
    return rec.header_offset + _LOCAL_HEADER + int.from_bytes(local[26:28], "little") + \
        int.from_bytes(local[28:30], "little")


def _blob_layout(f: Any, path: Path, offset: int, length: int, shape: tuple[int, ...], dtype: torch.dtype,
                 what: str) -> _BlobLayout | None:
    """The layout of the ``torch.save`` blob at ``offset`` in ``f`` when its one tensor can be read
    by position (little-endian, one uncompressed record, non-negative strides inside it), else None.

    Reads the blob's pickle (the tensor on the meta device: no data) and zip directory only. Our
    writer saves without zip CRC32s, so records are read by their local headers, never checked
    against a CRC (the sha256 sidecar covers the blob).
    """
    t = _safe_load(_Slice(f, offset, length), what, meta=True)
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype \
            or any(x < 0 for x in t.stride()) or t.storage_offset() < 0:
        return None
    blob = _Slice(f, offset, length)
    try:
        infos = zipfile.ZipFile(_Slice(f, offset, length)).infolist()
        records = [i for i in infos if _DATA_RECORD.fullmatch(i.filename)]
        order = [i for i in infos if i.filename.endswith("/byteorder")]
        if len(records) != 1 or len(order) > 1:
            return None
        if order:  # absent in old saves, which are little-endian
            at = _record_start(blob, order[0])
            if at is None or order[0].file_size > 16:
                return None
            blob.seek(at)
            if blob.read(order[0].file_size) != b"little":
                return None
        rec = records[0]
        start = _record_start(blob, rec)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return None
    if start is None:
        return None
    last = t.storage_offset() + sum((n - 1) * x for n, x in zip(t.shape, t.stride(), strict=True))
    if start + rec.file_size > length or t.untyped_storage().nbytes() != rec.file_size \
            or (last + 1) * dtype.itemsize > rec.file_size:
        return None
    return _BlobLayout(path, offset + start, int(t.storage_offset()), tuple(int(x) for x in t.stride()), dtype.itemsize,
                       int(last) + 1)


class TorchDistCheckpoint:
    """A Megatron ``torch_dist`` checkpoint opened for streaming reads. Use :meth:`open`."""

    #: read takes ``device=``: a GPU gets the bytes through small pinned buffers, not a host copy.
    reads_to_device = True

    def __init__(self, folder: Path, metadata: Metadata, common: dict[str, Any]):
        self.folder = folder
        self.metadata = metadata
        self.common = common
        self.keys: dict[str, StoredKey] = {}
        self.objects: list[str] = []
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                chunks = tuple((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
                self.keys[key] = StoredKey(key, tuple(md.size), md.properties.dtype, chunks)
            elif isinstance(md, BytesStorageMetadata):
                self.objects.append(key)
        self._cache: tuple[tuple[str, tuple[int, ...]], torch.Tensor] | None = None
        self._layouts: dict[tuple[str, tuple[int, ...]], _BlobLayout | None] = {}
        self._verified: set[tuple[str, int]] = set()  # blobs checked against their sha256 (by _verify)
        self._lock = threading.Lock()
        self._views: dict[str, tuple[str, int]] = {}  # per-layer key -> (stacked key, layer)
        self._stacked: dict[str, StoredKey] = {}
        self._sums: dict[tuple[str, int, int], str] = {}

    @classmethod
    def open(cls, path: str | Path) -> "TorchDistCheckpoint":
        """Check the folder is a finished torch_dist checkpoint and read its metadata (no tensors)."""
        folder = resolve_iteration_dir(Path(path))
        mj = folder / METADATA_JSON
        if not mj.is_file():
            raise CheckpointError(f"{folder}: no {METADATA_JSON}: an unfinished or interrupted save, not a checkpoint")
        try:
            with open_regular(mj, limit=1 << 20) as f:
                backend = json.loads(f.read())
        except (OSError, ValueError, RecursionError):
            raise CheckpointError(f"{mj}: not valid JSON") from None
        if not isinstance(backend, dict) or backend.get("sharded_backend") != "torch_dist":
            raise CheckpointError(f"{mj}: sharded_backend is {backend.get('sharded_backend') if isinstance(backend, dict) else backend!r}, expected torch_dist")
        metadata = read_dcp_metadata(folder / DCP_METADATA)
        ckpt = cls(folder, metadata, {})
        if (folder / COMMON).is_file():
            common = _safe_load(check_regular(inside(folder, COMMON, str(folder))), str(folder / COMMON))
        elif "common_state/shard_0_1" in ckpt.objects:  # mcore 0.19 keeps it inside DCP
            common = ckpt.read_object("common_state/shard_0_1")
            common = common[0] if isinstance(common, list) and common else common
        else:
            common = {}
        if not isinstance(common, dict):
            raise CheckpointError(f"{folder / COMMON}: expected a dict, got {type(common).__name__}")
        ckpt.common = common
        for st in ckpt.keys.values():
            _check_tiling(folder, st)
        sizes: dict[str, int] = {}
        for rel in sorted({getattr(si, "relative_path", None) for si in metadata.storage_data.values()}, key=str):
            p = inside(folder, rel, f"{folder / DCP_METADATA}", "data file")
            if not p.is_file():
                raise CheckpointError(f"{folder}: .metadata names data file {rel}, which is missing")
            sizes[str(rel)] = p.stat().st_size
        for idx, si in metadata.storage_data.items():  # every length bounded by its file before any read
            if si.offset + si.length > sizes[str(si.relative_path)]:
                raise CheckpointError(f"{folder / DCP_METADATA}: the blob of {str(idx.fqn)[:120]} runs past the end of "
                                      f"{si.relative_path} ({si.offset} + {si.length} > {sizes[si.relative_path]} bytes)")
        ckpt._sums = _read_sums(folder)
        if INKLING_KEY in common:  # our own writer's folder: its integrity data is part of it
            for rel in sorted(sizes):
                if not any(k[0] == rel for k in ckpt._sums):
                    raise IntegrityError(f"{folder / (rel + SUMS_SUFFIX)}: missing; inkling-ckpt wrote this folder with "
                                         "a sha256 file beside each data file, so it cannot be read unverified "
                                         "(restore the file or convert again)")
        return ckpt

    def _storage(self, key: str, offsets: tuple[int, ...] | None) -> tuple[Any, Path]:
        """The storage record of the blob of ``key`` at ``offsets`` (None: an object), and its data file."""
        info = self.metadata.storage_data.get(MetadataIndex(key, torch.Size(offsets) if offsets is not None else None))
        if info is None:
            raise CheckpointError(f"{self.folder}: .metadata lists {key} at {offsets} but stores no data for it")
        return info, self.folder / info.relative_path

    def _blob(self, key: str, offsets: tuple[int, ...] | None) -> bytes:
        info, path = self._storage(key, offsets)
        try:
            with open_regular(path) as f:
                f.seek(info.offset)
                data = f.read(info.length)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
        if len(data) != info.length:
            raise CheckpointError(f"{path}: truncated (chunk of {key} runs past the end)")
        self._verify(path, info, key, hashlib.sha256(data).hexdigest())
        return data

    def _verify(self, path: Path, info: Any, key: str, digest: str | None = None) -> None:
        """Check a blob against the writer's sha256 sidecar (when the checkpoint has one); a blob that
        passed is recorded, so reading parts of it later does not stream it again."""
        if not self._sums:
            return
        want = self._sums.get((info.relative_path, info.offset, info.length))
        if want is None:
            raise IntegrityError(f"{path}{SUMS_SUFFIX}: no checksum for the blob of {key} at byte {info.offset}")
        if digest is None:
            h = hashlib.sha256()
            fd = os.open(path, os.O_RDONLY)
            try:
                pos, end = info.offset, info.offset + info.length
                while pos < end:
                    piece = os.pread(fd, min(16 << 20, end - pos), pos)
                    if not piece:
                        raise CheckpointError(f"{path}: truncated (chunk of {key} runs past the end)")
                    h.update(piece)
                    pos += len(piece)
            finally:
                os.close(fd)
            digest = h.hexdigest()
        if digest != want:
            raise IntegrityError(f"{path}: the stored chunk of {key} at byte {info.offset} fails its sha256 "
                                 f"check; the file is corrupted")
        self._verified.add((info.relative_path, info.offset))

    def read_object(self, key: str) -> Any:
        """A ``ShardedObject`` payload (a list of the saving ranks' objects), weights-only."""
        return _safe_load(io.BytesIO(self._blob(key, None)), f"{self.folder}: object {key}")

    def read_chunk(self, key: str, offsets: tuple[int, ...], *, device: torch.device | str | None = None) -> torch.Tensor:
        """One stored chunk exactly as written (weights-only load straight from the file), on ``device``
        (default the CPU; a GPU gets its values through small pinned buffers, checked as they pass)."""
        st = self._stacked.get(key) or self.keys[key]
        info, path = self._storage(key, offsets)
        what = f"{path}: chunk of {key}"
        sizes = st.sizes.get(tuple(offsets))
        gpu = off_host(device)
        if gpu is not None and sizes is not None:
            lay = self._layout(key, offsets, verify=False)
            if lay is not None:
                return self._read_chunk_to(key, info, path, lay, tuple(sizes), st.dtype, gpu)
        try:
            with open_regular(path, buffering=0) as f:
                if os.fstat(f.fileno()).st_size < info.offset + info.length:
                    raise CheckpointError(f"{path}: truncated (chunk of {key} runs past the end)")
                if info.length <= ONE_READ_BYTES:
                    # One read serves the checksum and the load (reading the blob twice cost a third of
                    # megatron-to-hf's reading); the tensor's values stay where they were read.
                    raw = read_exact(f.fileno(), info.offset, info.length,
                                     f"{path}: truncated (chunk of {key} runs past the end)")
                    self._verify(path, info, key, hashlib.sha256(memoryview(raw.numpy())).hexdigest()  # type: ignore[arg-type]  # see _load_in_place
                                 if self._sums else None)
                    t = _load_in_place(raw, sizes, st.dtype, what)
                    del raw
                else:  # a huge blob: checked by streaming it, then loaded straight from the file
                    self._verify(path, info, key)
                    t = _safe_load(_Slice(f, info.offset, info.length), what)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{what} at {offsets} is not a tensor")
        if sizes is None or tuple(t.shape) != sizes or t.dtype != st.dtype:
            raise CheckpointError(f"{what} at {offsets} is {t.dtype} {list(t.shape)}, "
                                  f".metadata says {st.dtype} {list(sizes or ())}")
        return t if device is None else t.to(device)

    def _read_chunk_to(self, key: str, info: Any, path: Path, lay: "_BlobLayout", sizes: tuple[int, ...],
                       dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A chunk whose layout is known, its values read straight onto ``device``; the whole blob is
        fed to its sha256 check on the way (its few bytes around the values read on the host)."""
        check = self._sums and (info.relative_path, info.offset) not in self._verified
        h = hashlib.sha256() if check else None
        n = lay.elements * lay.itemsize
        end = info.offset + info.length
        truncated = f"{path}: truncated (chunk of {key} runs past the end)"
        try:
            with open_regular(path, buffering=0) as f:
                if os.fstat(f.fileno()).st_size < end:
                    raise CheckpointError(truncated)
                if h is not None:  # the blob's header and pickle
                    read_exact(f.fileno(), info.offset, lay.start - info.offset, truncated, hasher=h)
                data = read_exact(f.fileno(), lay.start, n, truncated, device=device, hasher=h)
                if h is not None:  # the rest of the blob (its record's tail, the zip directory)
                    read_exact(f.fileno(), lay.start + n, end - lay.start - n, truncated, hasher=h)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
        if h is not None:
            self._verify(path, info, key, h.hexdigest())
        if any(x == 0 for x in sizes):
            return torch.empty(sizes, dtype=dtype, device=device)
        return data.view(dtype).as_strided(sizes, lay.strides, lay.storage_offset)

    def unstack_layers(self, num_layers: int) -> int:
        """Present stacked ("homogeneous") keys as per-layer keys; returns how many were stacked.

        Megatron saves ``decoder.layers.<name>`` with a leading layer axis when the training run
        treats its layers as homogeneous (reference §2.2); layer ``i`` of it is read as
        ``decoder.layers.<i>.<name>``. Per-layer keys already present are left as they are.
        """
        stacked = [st for k, st in self.keys.items()
                   if _STACKED.match(k) and st.shape and st.shape[0] == num_layers]
        for st in stacked:
            name = st.key[len("decoder.layers."):]
            del self.keys[st.key]
            zeros = (0,) * (len(st.shape) - 1)
            for i in range(num_layers):
                view = f"decoder.layers.{i}.{name}"
                if view in self.keys:
                    raise CheckpointError(f"{self.folder}: {view} is stored both per layer and stacked")
                chunks = tuple((off[1:], size[1:]) for off, size in st.index.meeting((i, *zeros), (1, *st.shape[1:])))
                self.keys[view] = StoredKey(view, st.shape[1:], st.dtype, chunks)
                self._views[view] = (st.key, i)
                self._stacked[st.key] = st
        return len(stacked)

    def read(self, key: str, offsets: Sequence[int] | None = None, sizes: Sequence[int] | None = None, *,
             device: torch.device | str | None = None) -> torch.Tensor:
        """A region (default: all) of a tensor, assembled from the stored chunks that overlap it, on
        ``device`` (default the CPU; a GPU gets the values through small pinned buffers).

        A chunk the region covers only in part is read by position: only the bytes between the
        region's first and last element (rows of a big tensor, experts of a stacked one), the
        blob checked against its sha256 once. Where a blob's record cannot be read that way,
        the chunk is loaded whole and the last one kept (reading a stacked tensor expert by
        expert from one big chunk then does not reload it every time).
        """
        if key in self._views:
            stacked, off, size = self._view_region(key, offsets, sizes)
            return self._read_stored(stacked, off, size, device)[0]
        st = self.keys.get(key)
        if st is None:
            raise CheckpointError(f"{self.folder}: no tensor {key}")
        return self._read_stored(st, offsets, sizes, device)

    def _view_region(self, key: str, offsets: Sequence[int] | None,
                     sizes: Sequence[int] | None) -> tuple[StoredKey, tuple[int, ...], tuple[int, ...]]:
        """A region of a per-layer view (``unstack_layers``) as the region of its stacked key."""
        stored, layer = self._views[key]
        shape = self.keys[key].shape
        off = tuple(offsets) if offsets is not None else (0,) * len(shape)
        size = tuple(sizes) if sizes is not None else shape
        return self._stacked[stored], (layer, *off), (1, *size)

    def extents(self, key: str, offsets: Sequence[int] | None = None,
                sizes: Sequence[int] | None = None) -> list[tuple[Path, int, int]]:
        """The stored blobs (``(file, offset, length)``) that :meth:`read` of the same region reads
        from: every chunk overlapping it, whole (a chunk's first read checks its whole blob against
        the sha256 sidecar). For the executor's read-ahead; a region outside the tensor gives none."""
        if key in self._views:
            st, off, size = self._view_region(key, offsets, sizes)
        else:
            got = self.keys.get(key)
            if got is None:
                return []
            st = got
            off = tuple(offsets) if offsets is not None else (0,) * len(st.shape)
            size = tuple(sizes) if sizes is not None else st.shape
        out = []
        for c_off, _, _, _ in _overlapping(st, off, size):
            info = self.metadata.storage_data.get(MetadataIndex(st.key, torch.Size(c_off)))
            if info is not None:
                out.append((self.folder / info.relative_path, int(info.offset), int(info.length)))
        return out

    def _read_stored(self, st: StoredKey, offsets: Sequence[int] | None, sizes: Sequence[int] | None,
                     device: torch.device | str | None = None) -> torch.Tensor:
        key = st.key
        off = tuple(offsets) if offsets is not None else (0,) * len(st.shape)
        size = tuple(sizes) if sizes is not None else st.shape
        if len(off) != len(st.shape) or len(size) != len(st.shape) \
                or any(o < 0 or o + s > g for o, s, g in zip(off, size, st.shape, strict=True)):
            raise CheckpointError(f"{key}: region {off}+{size} is outside {list(st.shape)}")
        if st.sizes.get(off) == tuple(size):
            return self.read_chunk(key, off, device=device)
        out = torch.empty(size, dtype=st.dtype, device=device)
        on_device = off_host(device) is not None
        covered = 0
        for c_off, c_size, lo, hi in _overlapping(st, off, size):
            # A whole chunk bound for a GPU goes straight there (no host copy, nothing cached).
            src = self.read_chunk(key, tuple(c_off), device=device) if on_device and _whole(c_off, c_size, lo, hi) \
                else self._chunk_region(key, tuple(c_off), tuple(c_size), lo, hi, device)
            if src is None:
                chunk = self._cached_chunk(key, c_off)
                src = chunk[tuple(slice(x - b, y - b) for x, y, b in zip(lo, hi, c_off, strict=True))]
            out[tuple(slice(x - a, y - a) for x, y, a in zip(lo, hi, off, strict=True))] = src
            n = 1
            for x, y in zip(lo, hi, strict=True):
                n *= y - x
            covered += n
        total = 1
        for s in size:
            total *= s
        if covered != total:
            raise CheckpointError(f"{self.folder}: stored chunks of {key} do not cover region {off}+{size}")
        return out

    def _cached_chunk(self, key: str, offsets: tuple[int, ...]) -> torch.Tensor:
        cached = self._cache  # one read of the slot: another thread may replace it meanwhile
        if cached is not None and cached[0] == (key, offsets):
            return cached[1]
        self._cache = None
        t = self.read_chunk(key, offsets)
        self._cache = ((key, offsets), t)
        return t

    def _chunk_region(self, key: str, c_off: tuple[int, ...], c_size: tuple[int, ...], lo: Sequence[int],
                      hi: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor | None:
        """Elements ``lo:hi`` (global coordinates) of one stored chunk, read by position; None when the
        region is the whole chunk (read it whole: one pass checks and loads it) or the blob does not allow it."""
        if _whole(c_off, c_size, lo, hi):
            return None
        rel_lo = [x - o for x, o in zip(lo, c_off, strict=True)]
        rel_hi = [y - o for y, o in zip(hi, c_off, strict=True)]
        lay = self._layout(key, c_off)
        if lay is None:
            return None
        first = lay.storage_offset + sum(a * x for a, x in zip(rel_lo, lay.strides, strict=True))
        last = lay.storage_offset + sum((b - 1) * x for b, x in zip(rel_hi, lay.strides, strict=True))
        count = (last - first + 1) * lay.itemsize
        try:
            with open_regular(lay.path, buffering=0) as f:
                buf = read_exact(f.fileno(), lay.start + first * lay.itemsize, count,
                                 f"{lay.path}: truncated (chunk of {key} runs past the end)", device=device)
        except OSError as e:
            raise CheckpointError(f"{lay.path}: cannot read ({e.strerror})") from None
        dtype = (self._stacked.get(key) or self.keys[key]).dtype
        size = [b - a for a, b in zip(rel_lo, rel_hi, strict=True)]
        return buf.view(dtype).as_strided(size, lay.strides, 0)

    def _layout(self, key: str, c_off: tuple[int, ...], *, verify: bool = True) -> _BlobLayout | None:
        """The chunk's blob layout (found once; with ``verify``, its blob checked against the sha256 sidecar once)."""
        k = (key, c_off)
        st = self._stacked.get(key) or self.keys[key]
        info, path = self._storage(key, c_off)
        if k in self._layouts and not (verify and self._sums and (info.relative_path, info.offset) not in self._verified):
            return self._layouts[k]
        sizes = st.sizes.get(c_off)
        try:
            with open_regular(path, buffering=0) as f:
                if os.fstat(f.fileno()).st_size < info.offset + info.length:
                    raise CheckpointError(f"{path}: truncated (chunk of {key} runs past the end)")
                if verify and (info.relative_path, info.offset) not in self._verified:
                    self._verify(path, info, key)  # streamed in pieces: memory stays at a piece
                lay = None if sizes is None else _blob_layout(f, path, info.offset, info.length, tuple(sizes),
                                                              st.dtype, f"{path}: chunk of {key}")
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
        with self._lock:
            self._layouts[k] = lay
        return lay

    def data_bytes(self) -> int:
        return sum(nbytes(st.shape, st.dtype) for st in self.keys.values())

    def describe(self) -> dict[str, Any]:
        files = sorted({si.relative_path for si in self.metadata.storage_data.values()})
        return {"root": str(self.folder.resolve()),
                "files": {f: (self.folder / f).stat().st_size for f in files}}


__all__ = [
    "TorchDistCheckpoint", "ChunkItem", "ObjectItem", "finish_iteration_dir", "write_tracker",
    "common_state", "empty_extra_state", "resolve_iteration_dir", "read_dcp_metadata", "BACKEND",
    "TRACKER", "RELEASE", "METADATA_JSON", "COMMON", "INKLING_KEY", "CONFIG_KEY", "stored_config", "read_stored_config",
]
