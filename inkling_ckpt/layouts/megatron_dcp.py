"""The ``torch.distributed.checkpoint`` (DCP) side of writing a torch_dist checkpoint: its planning
and ``.metadata``, over data :mod:`.megatron_writer` has already written.

Only this module imports DCP (DTensor, sympy: seconds): reading a torch_dist checkpoint never
does. :func:`dcp.save` runs the (collective, under torchrun)
planning and writes ``.metadata`` with DCP's own classes, in a canonical order.
"""

from __future__ import annotations

import sys
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType, TensorWriteData
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..errors import CheckpointError
from ..pipeline.world import together
from .megatron import ChunkItem, ObjectItem
from .megatron_writer import Locations


class _LazyPlanner(DefaultSavePlanner):
    """Plans the given chunks and objects (their data is on disk already: nothing is resolved)."""

    def __init__(self, chunks: Sequence[ChunkItem], objects: Sequence[ObjectItem]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._chunks = {(c.key, c.offsets): c for c in chunks}
        self._objects = {o.key: o for o in objects}

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        for c in self._chunks.values():
            items.append(WriteItem(
                index=MetadataIndex(c.key, torch.Size(c.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes)),
                    properties=TensorProperties(dtype=c.dtype),
                    size=torch.Size(c.global_shape),
                ),
            ))
        for o in self._objects.values():
            items.append(WriteItem(index=MetadataIndex(o.key), type=WriteItemType.BYTE_IO))
        self.plan = SavePlan(items)
        return self.plan


class _UnitWriter(FileSystemWriter):
    """A DCP storage writer over data already written (one file per unit): ``.metadata`` only."""

    def __init__(self, path: Path, written: Locations, error: Exception | None, *, save_id: str = "inkling",
                 key_order: Sequence[str] = ()):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
        self._written = written
        self._error = error
        self._save_id = save_id
        self._order = {k: i for i, k in enumerate(key_order)}

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write ``.metadata`` in a canonical form: the same bytes whatever the number of ranks."""
        def order(k: str) -> tuple[int, str]:
            return (self._order.get(k, len(self._order)), k)

        sdm: dict[str, Any] = {}
        hint: dict[tuple[str, tuple[int, ...]], int] = {}
        for key in sorted(metadata.state_dict_metadata, key=order):
            md = metadata.state_dict_metadata[key]
            if isinstance(md, TensorStorageMetadata):
                chunks = sorted(((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks))
                for i, (off, _) in enumerate(chunks):
                    hint[(key, off)] = i
                sdm[sys.intern(key)] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=md.properties.dtype), size=torch.Size(tuple(md.size)),
                    chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(z)) for o, z in chunks])
            else:
                sdm[sys.intern(key)] = BytesStorageMetadata()
        flat = sorted((wr for rs in results for wr in rs),
                      key=lambda wr: (order(wr.index.fqn), tuple(wr.index.offset or ())))
        canon = [WriteResult(
            # Interned strings: pickle memoises by identity, so equal strings must be one object
            # for the bytes not to depend on which rank produced them.
            index=MetadataIndex(sys.intern(wr.index.fqn), torch.Size(tuple(wr.index.offset)) if wr.index.offset is not None else None,
                                hint.get((wr.index.fqn, tuple(wr.index.offset or ())))),
            size_in_bytes=wr.size_in_bytes,
            storage_data=_StorageInfo(sys.intern(wr.storage_data.relative_path), wr.storage_data.offset, wr.storage_data.length),
        ) for wr in flat]
        super().finish(Metadata(state_dict_metadata=sdm), [canon])

    def storage_meta(self) -> StorageMeta | None:
        # Deterministic: no temporary paths or random ids in .metadata.
        return StorageMeta(checkpoint_id=None, save_id=self._save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        Path(self.path).mkdir(parents=True, exist_ok=True)
        return plan

    def write_data(self, plan: SavePlan, planner: _LazyPlanner) -> Future[list[WriteResult]]:  # type: ignore[override]
        """The items' results from where :func:`~.megatron_writer.write_units` put them (the data is
        written already); this rank's data error, if it had one, is raised here, inside DCP's
        collective step, so that every rank stops with it."""
        if self._error is not None:
            raise self._error
        out = []
        for wi in plan.items:
            k = (wi.index.fqn, tuple(wi.index.offset) if wi.index.offset is not None else None)
            if k not in self._written:
                raise CheckpointError(f"{wi.index.fqn}: planned for .metadata but never written")
            name, start, length = self._written[k]
            out.append(WriteResult(index=wi.index, size_in_bytes=length, storage_data=_StorageInfo(name, start, length)))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(out)
        return fut


def save_metadata(folder: Path, chunks: Sequence[ChunkItem], objects: Sequence[ObjectItem], written: Locations,
                  error: Exception | None, *, save_id: str, key_order: Sequence[str], process_group: Any,
                  no_dist: bool) -> None:
    """Collectively write ``.metadata`` (rank 0) for this rank's items, written at ``written``;
    ``error``: this rank's data failed (every rank raises the first rank's error)."""
    writer = _UnitWriter(folder, written, error, save_id=save_id, key_order=key_order)
    planner = _LazyPlanner(chunks, objects)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            with nullcontext() if no_dist else together(dist.get_rank(process_group)):
                # DCP runs the ranks' own steps inside its error handling (their failures come back as
                # a CheckpointException); what escapes as it is comes from its collectives: a lost rank.
                dcp.save({}, storage_writer=writer, planner=planner, no_dist=no_dist, process_group=process_group)
    except dcp.api.CheckpointException as e:  # a rank failed: surface the first cause as one line
        raise _first_cause(e) from None


def _first_cause(e: BaseException) -> BaseException:
    """The first failing rank's own exception (DCP wraps every rank's failure in one).

    Bad input (InklingError), I/O errors and interrupts come back as they were, so the
    staging folder is removed or kept exactly as if DCP were not in between.
    """
    failures = getattr(e, "failures", {}) or {}
    for _, exc in sorted(failures.items()):
        inner = exc[0] if isinstance(exc, tuple) else exc
        if isinstance(inner, BaseException):
            return inner
    return RuntimeError(f"writing torch_dist failed: {e}")


__all__ = ["save_metadata"]
