"""The records a DCP ``.metadata`` file pickles, as the torch_dist reader holds them, without
``torch.distributed.checkpoint``.

Importing ``torch.distributed.checkpoint`` pulls in DTensor, sympy and symbolic shapes (1–3 s),
and a command that only reads a torch_dist checkpoint needs none of it. The reader's unpickler
(:mod:`inkling_ckpt.layouts.megatron`) maps each allowed DCP name to the class of the same name
here: plain records with DCP's field names, so a ``.metadata`` reads into the same shape of data
(``md.state_dict_metadata[key].chunks[i].offsets``, ``md.storage_data[MetadataIndex(key, offsets)]``).

Pickle builds them without calling ``__init__`` (``__new__``, then the pickled state into
``__dict__``), so nothing here checks its fields; the reader checks what it relies on after the
load. :class:`TensorProperties` takes DCP's tuple state through its own ``__setstate__``, which
accepts only the three memory-format codes. The enums carry DCP's values, which is what a pickle
holds of a member. Writing ``.metadata`` keeps DCP's own classes (``layouts.megatron_dcp``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ChunkStorageMetadata:
    """One stored chunk of a tensor: where it starts and its extent, per dim."""

    offsets: torch.Size
    sizes: torch.Size


class _MEM_FORMAT_ENCODING(enum.Enum):
    """How DCP pickles a ``torch.memory_format`` (which pickle cannot hold)."""

    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


def _memory_formats() -> dict[_MEM_FORMAT_ENCODING, torch.memory_format]:
    return {_MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT: torch.contiguous_format,
            _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST: torch.channels_last,
            _MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT: torch.preserve_format}


@dataclass
class TensorProperties:
    """A stored tensor's dtype (the other fields are kept by DCP but unused)."""

    dtype: torch.dtype = torch.float32
    layout: torch.layout = torch.strided
    requires_grad: bool = False
    memory_format: torch.memory_format = torch.contiguous_format
    pin_memory: bool = False

    def __getstate__(self) -> tuple[Any, ...]:
        code = next((c for c, f in _memory_formats().items() if f == self.memory_format), None)
        if code is None:
            raise ValueError(f"no pickle code for memory format {self.memory_format}")
        return (self.dtype, self.layout, self.requires_grad, code, self.pin_memory)

    def __setstate__(self, state: Any) -> None:
        """DCP's state: ``(dtype, layout, requires_grad, memory-format code, pin_memory)``."""
        if not isinstance(state, tuple) or len(state) != 5:
            raise ValueError(f"TensorProperties state is a {type(state).__name__}, not a 5-tuple")
        dtype, layout, requires_grad, code, pin_memory = state
        formats = _memory_formats()
        if not isinstance(code, _MEM_FORMAT_ENCODING) or code not in formats:
            raise ValueError("TensorProperties names no known memory format")
        self.dtype, self.layout, self.requires_grad, self.pin_memory = dtype, layout, requires_grad, pin_memory
        self.memory_format = formats[code]


@dataclass
class TensorStorageMetadata:
    """A tensor of the checkpoint: properties, global size and its stored chunks."""

    properties: TensorProperties
    size: torch.Size
    chunks: list[ChunkStorageMetadata]


@dataclass
class BytesStorageMetadata:
    """A bytes (object) entry of the checkpoint."""


@dataclass
class StorageMeta:
    checkpoint_id: Any = None  # a str or a pure path (see the reader's allow-list)
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = field(default_factory=list)


@dataclass
class Metadata:
    """What ``.metadata`` holds: every key's entry and, under ``storage_data``, where each blob lies."""

    state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata]
    planner_data: Any = None
    storage_data: Any = None  # dict[MetadataIndex, _StorageInfo] in a file the reader accepts
    storage_meta: StorageMeta | None = None
    version: str | None = None


@dataclass(frozen=True)
class MetadataIndex:
    """The key of ``storage_data``: a name and, for a tensor chunk, its offsets.

    Equal and hashed by ``fqn`` and ``offset`` only; ``index`` is a search hint that takes no
    part, so a lookup built from a key and offsets finds the stored entry whatever its hint.
    """

    fqn: str
    offset: torch.Size | None = None
    index: int | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.offset is not None and type(self.offset) is not torch.Size:
            object.__setattr__(self, "offset", torch.Size(self.offset))


@dataclass
class _StorageInfo:
    """Where a blob lies: its data file (relative to the folder), byte offset and length."""

    relative_path: str
    offset: int
    length: int
    transform_descriptors: Any = None


# The save and load plans Megatron-Core keeps in ``.metadata`` (read as inert data, never used).

class WriteItemType(enum.Enum):
    TENSOR = 1
    SHARD = 2
    BYTE_IO = 3


class LoadItemType(enum.Enum):
    TENSOR = 1
    BYTE_IO = 2


@dataclass(frozen=True)
class TensorWriteData:
    chunk: ChunkStorageMetadata
    properties: TensorProperties
    size: torch.Size


@dataclass(frozen=True)
class WriteItem:
    index: MetadataIndex
    type: WriteItemType
    bytes_io_data: Any = None
    tensor_data: TensorWriteData | None = None


@dataclass(frozen=True)
class ReadItem:
    type: LoadItemType
    dest_index: MetadataIndex
    dest_offsets: torch.Size
    storage_index: MetadataIndex
    storage_offsets: torch.Size
    lengths: torch.Size


@dataclass(frozen=True)
class SavePlan:
    items: list[WriteItem]
    storage_data: Any = None
    planner_data: Any = None
    usable: bool = True


@dataclass
class LoadPlan:
    items: list[ReadItem]
    storage_data: Any = None
    planner_data: Any = None


#: The DCP names a ``.metadata`` may use, by module, each with its record here.
DCP_NAMES: dict[str, tuple[type, ...]] = {
    "torch.distributed.checkpoint.metadata": (
        Metadata, MetadataIndex, ChunkStorageMetadata, TensorProperties, TensorStorageMetadata,
        BytesStorageMetadata, StorageMeta, _MEM_FORMAT_ENCODING),
    "torch.distributed.checkpoint.filesystem": (_StorageInfo,),
    "torch.distributed.checkpoint.planner": (
        SavePlan, WriteItem, WriteItemType, TensorWriteData, LoadPlan, ReadItem, LoadItemType),
}
