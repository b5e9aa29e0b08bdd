"""The streaming writer of Megatron ``torch_dist`` checkpoints.

What it writes is described in :mod:`inkling_ckpt.layouts.megatron`, which also holds the reader
and the chunk and object records. :func:`write_dcp` writes the data first: every unit's file,
its checksums and its resume record, with no ``torch.distributed.checkpoint`` (DCP) involved;
once the data is on disk, :func:`dcp.save` (:mod:`.megatron_dcp`, the one module importing DCP:
DTensor, sympy, 1.3 s on the 2-core box, 2.6–2.8 s on the H200 machine) runs its (collective,
under torchrun) planning over the written records and writes ``.metadata`` with DCP's own
classes. A rank whose data failed still takes part, and raises its error there, so every rank
stops with it (as when DCP drove the writing).
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from ..errors import CheckpointError
from .lane import Lane
from .megatron import SUMS_SUFFIX, UNITS_DIR, ChunkItem, ObjectItem
from .pread import stream_down, write_from


Produce = Callable[[ChunkItem], torch.Tensor]
Written = Callable[[int, int, bool], None]
MapItems = Callable[[Sequence[Any], Callable[[Any], Any]], Iterator[tuple[Any, Any]]]
#: Where each item was written: ``(key, chunk offsets, or None for an object)`` → ``(file, offset, length)``.
Locations = dict[tuple[str, "tuple[int, ...] | None"], tuple[str, int, int]]


def item_index(item: ChunkItem | ObjectItem) -> tuple[str, tuple[int, ...] | None]:
    """The item's DCP index as plain data: its key and chunk offsets (None for an object)."""
    return (item.key, tuple(item.offsets)) if isinstance(item, ChunkItem) else (item.key, None)


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
    # Imported here, before the data, not on a thread beside it: on the H200 machine an import thread
    # (pure Python for seconds, holding the GIL) slowed the data writing's threads by more than the
    # import itself took (hf-to-megatron 14.4 → 18.4 s on a 4-layer grid).
    import torch.distributed as dist

    from .megatron_dcp import save_metadata

    distributed = dist.is_available() and dist.is_initialized()
    error: Exception | None = None
    written: Locations = {}
    resumed = 0
    try:
        written, resumed = write_units(folder, chunks, objects, produce, on_written=on_written, map_items=map_items)
    except Exception as e:
        if not distributed:
            raise
        error = e  # raised again inside DCP's collective write step, so every rank stops with it
    save_metadata(folder, chunks, objects, written, error, save_id=save_id, key_order=key_order,
                  process_group=process_group, no_dist=not distributed)
    return resumed


def write_units(folder: Path, chunks: Sequence[ChunkItem], objects: Sequence[ObjectItem], produce: Produce, *,
                on_written: Written | None = None, map_items: MapItems | None = None) -> tuple[Locations, int]:
    """Write every unit not finished by an earlier run: one file each, in unit order; (where each
    item is, units found finished).

    Within a unit, objects first, then chunks, in the given orders; each a ``torch.save`` blob at a
    recorded offset. One stream of items runs through ``map_items`` across all units, so building
    (reading, decoding, serializing and hashing each blob, on the workers) never stalls at a unit's
    end; this thread only writes the blobs. A finished file is made durable (fsync, rename,
    checksums, resume record) on a background thread while the next one is written.
    """
    on_written = on_written or (lambda n, unit, reused: None)
    by_unit: dict[int, list[ChunkItem | ObjectItem]] = {}
    items: list[ChunkItem | ObjectItem] = [*objects, *chunks]
    for item in items:
        by_unit.setdefault(item.unit, []).append(item)
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    done: Locations = {}
    resumed = 0
    stream: list[ChunkItem | ObjectItem] = []
    for unit in sorted(by_unit):
        name = _unit_file(unit)
        old = _read_sidecar(root / UNITS_DIR / f"{unit}.json", name, by_unit[unit])
        if old is not None and (root / name).is_file() and (root / (name + SUMS_SUFFIX)).is_file():
            resumed += 1
            on_written(sum(c.nbytes for c in by_unit[unit] if isinstance(c, ChunkItem)), unit, True)
            done.update(old)
            continue
        stream += by_unit[unit]

    def build(item: ChunkItem | ObjectItem) -> _Blob:
        if isinstance(item, ObjectItem):
            blob = _Blob(None)
            blob.write(item.payload)
            return blob
        data = _chunk_tensor(item, produce(item))
        # Off in this worker too (newer torch keeps the setting per thread), and never switched back on
        # here: where torch keeps it per process, a worker restoring it mid-run let another worker's
        # save write CRCs, so a blob's bytes depended on the schedule. write_units restores it once.
        torch.serialization.set_crc32_options(False)
        if data.device.type == "cpu":
            blob = _Blob(data)
            torch.save(data, blob)  # type: ignore[arg-type]  # needs only write(); torch annotates IO[bytes]
            return blob
        # A chunk on a GPU stays there until the writer brings it down piece by piece (write_from).
        # Without CRC32s torch.save's bytes depend on the tensor only through its storage's bytes,
        # which it hands to write() and never reads: a host stand-in of the same dtype and shape,
        # never touched (so never resident), gives the blob's other bytes, and the blob keeps the
        # GPU tensor in the storage's place. Its sha256 is taken here, the bytes brought down once
        # more through this worker's pinned buffers (that copy costs far less than the hashing,
        # which so stays on the workers instead of the one writing thread).
        torch.cuda.current_stream(data.device).synchronize()  # ready for copies on another stream
        stand_in = torch.empty(item.sizes, dtype=item.dtype)
        blob = _Blob(stand_in, on_device=data)
        torch.save(stand_in, blob)  # type: ignore[arg-type]
        return blob

    with _no_crc32():  # the whole stream, restored once every worker is done
        syncer = Lane("inkling-fsync")
        f: Any = None
        current = -1
        results: list[tuple[tuple[str, tuple[int, ...] | None], int, int]] = []
        sums: list[str] = []
        try:
            for item, blob in (map_items or _read_ahead)(stream, build):
                if item.unit != current:
                    if f is not None:
                        g, f = f, None  # the syncer's from here on (it closes it)
                        syncer.submit(_finish_unit, root, g, current, results, sums)
                    current, results, sums = item.unit, [], []
                    f = open(root / _unit_file(current, ".partial"), "wb")
                start = f.tell()
                blob.write_to(f)
                length = f.tell() - start
                sums.append(f"{start} {length} {blob.hexdigest()}\n")
                index = item_index(item)
                results.append((index, start, length))
                done[index] = (_unit_file(current), start, length)
                if blob.tensor_bytes:
                    on_written(blob.tensor_bytes, current, False)
                del blob
            if f is not None:
                g, f = f, None
                syncer.submit(_finish_unit, root, g, current, results, sums)
        finally:
            if f is not None:
                f.close()
            syncer.settle(raise_errors=False)  # every file handed over is settled before returning or raising
            syncer.close()
        syncer.settle()
        return done, resumed


def _chunk_tensor(item: ChunkItem, t: torch.Tensor) -> torch.Tensor:
    """The produced chunk as ``torch.save`` should store it: checked against the plan, one whole
    storage, on the host or left on a GPU (for the writer to bring down)."""
    if tuple(t.shape) != item.sizes or t.dtype != item.dtype:
        raise CheckpointError(f"{item.key}: produced {t.dtype} {list(t.shape)}, planned {item.dtype} {list(item.sizes)}")
    t = t.detach()
    if t.device.type not in ("cpu", "cuda"):
        t = t.to("cpu")
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.nbytes:
        t = t.contiguous().clone()  # torch.save writes whole storages: never a view's base
    return t


def _finish_unit(root: Path, f: Any, unit: int, results: list[tuple[tuple[str, tuple[int, ...] | None], int, int]],
                 sums: list[str]) -> None:
    """A unit's file is complete: to disk, published under its name, then its checksums and resume record."""
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
        [key, list(offset) if offset is not None else None, start, length] for (key, offset), start, length in results]}))
    os.replace(tmp, sidecar)


def _read_sidecar(path: Path, name: str, items: Sequence[ChunkItem | ObjectItem]) -> Locations | None:
    """The recorded locations of a finished unit, if they cover exactly ``items``."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("file") != name:
        return None
    want = {item_index(i) for i in items}
    out: Locations = {}
    try:
        for fqn, offset, start, length in data.get("items", []):
            k = (fqn, tuple(offset) if offset is not None else None)
            if k not in want:
                return None
            want.discard(k)
            out[k] = (name, int(start), int(length))
    except (TypeError, ValueError):
        return None
    return None if want else out


def _unit_file(unit: int, suffix: str = "") -> str:
    """The data file of a conversion unit (the name depends on the unit, never on the rank)."""
    return f"__{unit}_0.distcp{suffix}"


class _Blob:
    """One item serialized in memory (by a worker), with its sha256: the writing thread only copies it out.

    ``torch.save`` writes through ``write``: small pieces (zip headers, the pickle) are copied,
    since the writer reuses their memory; the one piece that is ``values``' own storage is kept
    as a view of it (copying each tensor once more cost as much as the write itself). Every
    piece is hashed as it arrives. With ``on_device`` (a GPU tensor of ``values``' dtype and shape,
    ``values`` a stand-in whose bytes are never read), that tensor takes the storage's place: it
    is hashed from the device here and written from there by :meth:`write_to`.
    """

    def __init__(self, values: torch.Tensor | None = None, *, on_device: torch.Tensor | None = None):
        self.tensor_bytes = 0 if values is None else values.nbytes
        self.parts: list[Any] = []
        self._on_device = on_device
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
            if self._on_device is not None:
                stream_down(self._on_device, self._h.update)
                self.parts.append(self._on_device)
                return n
            data: Any = self._storage[2]
        else:
            data = bytes(view)
        self._h.update(data)
        self.parts.append(data)
        return n

    def write_to(self, f: Any) -> None:
        """Write the blob at ``f``'s position (a GPU piece through small pinned buffers)."""
        for part in self.parts:
            if isinstance(part, torch.Tensor):
                write_from(f, part)
            else:
                f.write(part)

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
    ``torch.serialization.set_crc32_options``); only a generic unzip would complain. Torch 2.13
    keeps the setting per thread, earlier releases per process (torch 2.11 on the H200 node): set
    it where ``torch.save`` runs, and switch it back only once no other thread is saving.
    """
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


__all__ = ["write_dcp", "write_units", "item_index", "Produce", "Written", "MapItems", "Locations"]
