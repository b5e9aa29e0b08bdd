"""The streaming writer of Megatron ``torch_dist`` checkpoints, through ``torch.distributed.checkpoint``.

What it writes is described in :mod:`inkling_ckpt.layouts.megatron`, which also holds the
reader and the writer's DCP-free parts (chunk and object records, ``common.pt``,
``metadata.json``, the tracker). Only this module imports DCP (DTensor, sympy: seconds), so
only writing a torch_dist checkpoint (``convert hf-to-megatron``) pays for it: :func:`dcp.save`
runs the (collective, under torchrun) planning and writes ``.metadata`` with DCP's own classes.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
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
from .lane import Lane
from .megatron import SUMS_SUFFIX, UNITS_DIR, ChunkItem, ObjectItem


Produce = Callable[[ChunkItem], torch.Tensor]
Written = Callable[[int, int, bool], None]
MapItems = Callable[[Sequence[Any], Callable[[Any], Any]], Iterator[tuple[Any, Any]]]


class _LazyPlanner(DefaultSavePlanner):
    """Plans the given chunks without holding them; ``resolve_data`` builds each on request."""

    def __init__(self, chunks: Sequence[ChunkItem], objects: Sequence[ObjectItem], produce: Produce):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._chunks = {(c.key, c.offsets): c for c in chunks}
        self._objects = {o.key: o for o in objects}
        self._produce = produce

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

    def item_of(self, wi: WriteItem) -> ChunkItem | ObjectItem:
        if wi.type == WriteItemType.BYTE_IO:
            return self._objects[wi.index.fqn]
        return self._chunks[(wi.index.fqn, tuple(wi.index.offset))]  # type: ignore[arg-type]

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        item = self.item_of(write_item)
        if isinstance(item, ObjectItem):
            return io.BytesIO(item.payload)
        t = self._produce(item)
        if tuple(t.shape) != item.sizes or t.dtype != item.dtype:
            raise CheckpointError(f"{item.key}: produced {t.dtype} {list(t.shape)}, planned {item.dtype} {list(item.sizes)}")
        t = t.detach().to("cpu")
        if not t.is_contiguous() or t.untyped_storage().nbytes() != t.nbytes:
            t = t.contiguous().clone()  # torch.save writes whole storages: never a view's base
        return t


class _UnitWriter(FileSystemWriter):
    """A DCP storage writer: one file per unit, finished atomically, skipped when already done."""

    def __init__(self, path: Path, *, on_written: Written | None = None, save_id: str = "inkling",
                 key_order: Sequence[str] = (), map_items: MapItems | None = None):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
        self._on_written: Written = on_written or (lambda n, unit, reused: None)
        self._map: MapItems = map_items or _read_ahead
        self._save_id = save_id
        self._order = {k: i for i, k in enumerate(key_order)}
        self.units_resumed = 0

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
        """Write every unit not finished by an earlier run: one file each, in unit order.

        One stream of items runs through ``map_items`` across all units, so building (reading,
        decoding, serializing and hashing each blob, on the workers) never stalls at a unit's
        end; this thread only writes the blobs. A finished file is made durable (fsync, rename,
        checksums, resume record) on a background thread while the next one is written.
        """
        by_unit: dict[int, list[WriteItem]] = {}
        for wi in plan.items:
            by_unit.setdefault(planner.item_of(wi).unit, []).append(wi)
        root = Path(self.path)
        done: dict[int, list[WriteResult]] = {}
        stream: list[tuple[int, WriteItem]] = []
        for unit in sorted(by_unit):
            name = _unit_file(unit)
            old = _read_sidecar(root / UNITS_DIR / f"{unit}.json", name, by_unit[unit])
            if old is not None and (root / name).is_file() and (root / (name + SUMS_SUFFIX)).is_file():
                self.units_resumed += 1
                chunks = [planner.item_of(wi) for wi in by_unit[unit] if wi.type != WriteItemType.BYTE_IO]
                self._on_written(sum(c.nbytes for c in chunks if isinstance(c, ChunkItem)), unit, True)
                done[unit] = old
                continue
            # Objects first, then tensors, each a torch.save blob at a recorded offset.
            items = by_unit[unit]
            stream += [(unit, wi) for wi in items if wi.type == WriteItemType.BYTE_IO]
            stream += [(unit, wi) for wi in items if wi.type != WriteItemType.BYTE_IO]

        def build(entry: tuple[int, WriteItem]) -> _Blob:
            data = planner.resolve_data(entry[1])
            blob = _Blob(None if isinstance(data, io.BytesIO) else data)
            if isinstance(data, io.BytesIO):
                blob.write(data.getbuffer())
            else:
                with _no_crc32():  # a per-thread setting: set where the blob is serialized
                    torch.save(data, blob)  # type: ignore[arg-type]  # needs only write(); torch annotates IO[bytes]
            return blob

        syncer = Lane("inkling-fsync")
        f: Any = None
        current = -1
        results: list[WriteResult] = []
        sums: list[str] = []
        try:
            for (unit, wi), blob in self._map(stream, build):
                if unit != current:
                    if f is not None:
                        g, f = f, None  # the syncer's from here on (it closes it)
                        syncer.submit(self._finish_unit, g, current, results, sums)
                    current, results, sums = unit, [], []
                    done[unit] = results
                    f = open(root / _unit_file(unit, ".partial"), "wb")
                start = f.tell()
                for part in blob.parts:
                    f.write(part)
                length = f.tell() - start
                sums.append(f"{start} {length} {blob.hexdigest()}\n")
                results.append(WriteResult(index=wi.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(_unit_file(unit), start, length)))
                if blob.tensor_bytes:
                    self._on_written(blob.tensor_bytes, unit, False)
                del blob
            if f is not None:
                g, f = f, None
                syncer.submit(self._finish_unit, g, current, results, sums)
        finally:
            if f is not None:
                f.close()
            syncer.settle(raise_errors=False)  # every file handed over is settled before returning or raising
            syncer.close()
        syncer.settle()
        out = [r for unit in sorted(done) for r in done[unit]]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(out)
        return fut

    def _finish_unit(self, f: Any, unit: int, results: list[WriteResult], sums: list[str]) -> None:
        """A unit's file is complete: to disk, published under its name, then its checksums and resume record."""
        root = Path(self.path)
        name = _unit_file(unit)
        try:
            f.flush()
            os.fsync(f.fileno())
        finally:
            f.close()
        os.replace(root / (name + ".partial"), root / name)
        tmp_sums = root / (name + SUMS_SUFFIX + ".tmp")
        tmp_sums.write_text("".join(sums))
        os.replace(tmp_sums, root / (name + SUMS_SUFFIX))
        sidecar = root / UNITS_DIR / f"{unit}.json"
        sidecar.parent.mkdir(exist_ok=True)
        tmp = sidecar.with_suffix(".tmp")
        tmp.write_text(json.dumps({"file": name, "items": [
            [r.index.fqn, list(r.index.offset) if r.index.offset is not None else None,
             r.storage_data.offset, r.storage_data.length] for r in results]}))
        os.replace(tmp, sidecar)


def _unit_file(unit: int, suffix: str = "") -> str:
    """The data file of a conversion unit (the name depends on the unit, never on the rank)."""
    return f"__{unit}_0.distcp{suffix}"


class _Blob:
    """One item serialized in memory (by a worker), with its sha256: the writing thread only copies it out.

    ``torch.save`` writes through ``write``: small pieces (zip headers, the pickle) are copied,
    since the writer reuses their memory; the one piece that is ``values``' own storage is kept
    as a view of it (copying each tensor once more cost as much as the write itself). Every
    piece is hashed as it arrives.
    """

    def __init__(self, values: torch.Tensor | None = None):
        self.tensor_bytes = 0 if values is None else values.nbytes
        self.parts: list[Any] = []
        self._h = hashlib.sha256()
        self._storage: tuple[int, int, memoryview] | None = None
        if values is not None and values.device.type == "cpu" and values.untyped_storage().nbytes():
            st = values.untyped_storage()
            raw = torch.empty(0, dtype=torch.uint8).set_(st)  # the whole storage, as torch.save writes it
            self._storage = (st.data_ptr(), st.nbytes(), memoryview(raw.numpy()))  # type: ignore[arg-type]  # numpy types ndarray as a Buffer on 3.12+ only

    def write(self, b: Any) -> int:
        view = memoryview(b)
        n = view.nbytes
        if self._storage is not None and n == self._storage[1] and _address(view) == self._storage[0]:
            data: Any = self._storage[2]
        else:
            data = bytes(view)
        self._h.update(data)
        self.parts.append(data)
        return n

    def flush(self) -> None:
        pass

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def _address(view: memoryview) -> int:
    """Where a (possibly read-only) buffer's bytes start in memory."""
    return int(np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0]) if view.nbytes else 0


def _read_ahead(items: Sequence[Any], build: Callable[[Any], Any]) -> Iterator[tuple[Any, Any]]:
    """``(item, build(item))`` in order, building the next item in a thread while the caller writes this one.

    Reading the source (disk) and writing the output (page cache, writeback) then overlap; at
    most two chunks are in memory.
    """
    if not items:
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="inkling-read-ahead") as pool:
        pending = pool.submit(build, items[0])
        for i, wi in enumerate(items):
            data = pending.result()
            if i + 1 < len(items):
                pending = pool.submit(build, items[i + 1])
            yield wi, data
            del data


@contextmanager
def _no_crc32() -> Iterator[None]:
    """``torch.save`` without zip CRC32s: computing them costs more than writing the bytes.

    Every ``torch.load`` can read the result: PyTorch builds its zip reader with
    ``MINIZ_DISABLE_ZIP_READER_CRC32_CHECKS`` (and documents that loading works,
    ``torch.serialization.set_crc32_options``); only a generic unzip would complain. The setting
    is per thread (torch keeps it thread-local): it applies where ``torch.save`` runs.
    """
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def _read_sidecar(path: Path, name: str, items: list[WriteItem]) -> list[WriteResult] | None:
    """The recorded results of a finished unit, if they cover exactly ``items``."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("file") != name:
        return None
    want = {(wi.index.fqn, tuple(wi.index.offset) if wi.index.offset is not None else None): wi for wi in items}
    out = []
    for fqn, offset, start, length in data.get("items", []):
        k = (fqn, tuple(offset) if offset is not None else None)
        wi = want.pop(k, None)
        if wi is None:
            return None
        out.append(WriteResult(index=wi.index, size_in_bytes=length, storage_data=_StorageInfo(name, start, length)))
    return None if want else out


def write_dcp(folder: Path, chunks: Sequence[ChunkItem], objects: Sequence[ObjectItem], produce: Produce, *,
              on_written: Written | None = None, process_group: Any = None,
              save_id: str = "inkling", key_order: Sequence[str] = (), map_items: MapItems | None = None) -> int:
    """Write this rank's chunks and objects; collectively write ``.metadata`` (rank 0).

    Call on every rank with that rank's items (disjoint across ranks). Returns how many units
    were found finished from an earlier, interrupted run. ``key_order`` (every rank's keys) makes
    ``.metadata`` list keys in that order, so its bytes do not depend on the number of ranks.
    ``on_written(nbytes, unit, reused)`` follows each chunk written (a reused unit: once, all its
    bytes). ``map_items(items, fn)`` yields ``(item, fn(item))`` in order, building items ahead
    (the pipeline executor's ``map``: worker threads, the device); default: one read-ahead thread.
    """
    writer = _UnitWriter(folder, on_written=on_written, save_id=save_id, key_order=key_order, map_items=map_items)
    planner = _LazyPlanner(chunks, objects, produce)
    no_dist = not (dist.is_available() and dist.is_initialized())
    try:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save({}, storage_writer=writer, planner=planner, no_dist=no_dist, process_group=process_group)
    except dcp.api.CheckpointException as e:  # a rank failed: surface the first cause as one line
        raise _first_cause(e) from None
    return writer.units_resumed


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


__all__ = ["write_dcp", "Produce", "Written", "MapItems"]
