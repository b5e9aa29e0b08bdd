"""Reading safetensors files with plain positioned reads (``pread``), never a memory map."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import CheckpointError
from ..model.inventory import nbytes


def off_host(device: torch.device | str | None) -> torch.device | None:
    """``device`` when it is not the host (a GPU: reads go there through pinned buffers), else None."""
    if device is None:
        return None
    dev = torch.device(device)
    return None if dev.type == "cpu" else dev


def read_exact(fd: int, offset: int, count: int, truncated: str, *, device: torch.device | str | None = None,
               hasher: Any = None) -> torch.Tensor:
    """``count`` bytes at ``offset`` of an open file, as a uint8 tensor on ``device`` (default the CPU).

    Positioned reads until every byte has come (one read may return fewer). On the CPU into memory
    torch allocates (in huge pages when the CLI turned them on: every slice a command reads lands
    in fresh memory; recycled blocks read 1.2-2.3x faster out of the page cache, but fresh ones
    still take 18-23 GB/s on 16 threads, ten times the disk, and a pool of them left lora merge and
    quantize no faster on the node for up to 60 MiB more RSS: ``bench/read_buffers.py``,
    bench/README.md); on a GPU through this thread's two small pinned buffers
    (:data:`STAGE_BYTES` each, reused: no fresh host memory, no page faults), each piece copied up
    while the next is read, so the host holds a few MiB whatever the size. ``hasher`` (a hashlib
    object) is fed the bytes in order as they pass. A file that ends first raises
    ``CheckpointError(truncated)``; an ``OSError`` is the caller's to name.
    """
    dev = off_host(device)
    if dev is not None:
        return _read_to_device(fd, offset, count, truncated, dev, hasher)
    buf = torch.empty(count, dtype=torch.uint8)
    view = memoryview(buf.numpy())  # type: ignore[arg-type]  # numpy types ndarray as a Buffer on 3.12+ only
    _pread_into(fd, view, offset, truncated)
    if hasher is not None:
        hasher.update(view)
    return buf


def _pread_into(fd: int, view: memoryview, offset: int, truncated: str) -> None:
    got, count = 0, len(view)
    while got < count:
        k = os.preadv(fd, [view[got:]], offset + got)
        if k <= 0:
            raise CheckpointError(truncated)
        got += k


#: Bytes of one pinned staging buffer for reads that land on a GPU (two per reading thread: pinned
#: pages are resident, so 8 workers hold 32 MiB in all, against a whole slice each read to the host;
#: the executor counts them in the process's size).
STAGE_BYTES = 2 << 20


def staging_bytes(threads: int) -> int:
    """Pinned host memory ``threads`` reading threads hold for reads onto a GPU."""
    return 2 * STAGE_BYTES * max(0, threads)


_stages = threading.local()


def _stage(device: torch.device) -> list[tuple[torch.Tensor, Any]]:
    """This thread's pinned buffers and their copy events for ``device`` (made on first use)."""
    per = getattr(_stages, "by_device", None)
    if per is None:
        per = _stages.by_device = {}
    st = per.get(device)
    if st is None:
        with torch.cuda.device(device):
            st = per[device] = [(torch.empty(STAGE_BYTES, dtype=torch.uint8, pin_memory=True), torch.cuda.Event())
                                for _ in range(2)]
    return st


def _read_to_device(fd: int, offset: int, count: int, truncated: str, device: torch.device,
                    hasher: Any) -> torch.Tensor:
    out = torch.empty(count, dtype=torch.uint8, device=device)
    stage = _stage(device)
    pos = 0
    i = 0
    while pos < count:
        buf, copied = stage[i & 1]
        copied.synchronize()  # the copy out of this buffer (two pieces ago) has finished
        k = min(buf.numel(), count - pos)
        view = memoryview(buf.numpy())[:k]  # type: ignore[arg-type]
        _pread_into(fd, view, offset + pos, truncated)
        if hasher is not None:
            hasher.update(view)
        # On the caller's stream, so its kernels see the bytes; the buffer is reused once the event passes.
        out[pos:pos + k].copy_(buf[:k], non_blocking=True)
        copied.record(torch.cuda.current_stream(device))
        pos += k
        i += 1
    return out


def write_from(fh: Any, tensor: torch.Tensor) -> int:
    """Write ``tensor``'s bytes at ``fh``'s position; returns how many.

    A CPU tensor is written as it is. A GPU tensor comes down piece by piece (:func:`stream_down`),
    so the host never holds it (the reads' counterpart).
    """
    return stream_down(tensor, fh.write)


def stream_down(tensor: torch.Tensor, consume: Callable[[memoryview], Any]) -> int:
    """Hand ``tensor``'s bytes in order to ``consume`` (a file's ``write``, a hash's ``update``); returns how many.

    A CPU tensor in one piece. A GPU tensor through this thread's two pinned buffers
    (:func:`_stage`) on a stream of its own, each piece copied while the one before is consumed;
    a piece's memory is reused once ``consume`` returns. The tensor must be ready (its
    producer's stream synchronized); every copy has finished when this returns.
    """
    if tensor.device.type == "cpu":
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        consume(memoryview(data))  # type: ignore[arg-type]  # numpy types ndarray as a Buffer on 3.12+ only
        return int(data.nbytes)
    dev = tensor.device
    stage, stream = _stage(dev), _copy_stream(dev)
    pos, i = 0, 0
    waiting: tuple[torch.Tensor, int, Any] | None = None  # the piece copied last, not yet consumed
    with torch.cuda.stream(stream):  # a copy made contiguous here is ordered before the pieces
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        count = flat.numel()
        while pos < count or waiting is not None:
            nxt = None
            if pos < count:
                # This buffer's last piece (two ago) was consumed before the previous one was copied.
                buf, copied = stage[i & 1]
                k = min(buf.numel(), count - pos)
                buf[:k].copy_(flat[pos:pos + k], non_blocking=True)
                copied.record(stream)
                nxt, pos, i = (buf, k, copied), pos + k, i + 1
            if waiting is not None:
                buf, k, copied = waiting
                copied.synchronize()
                consume(memoryview(buf.numpy())[:k])  # type: ignore[arg-type]
            waiting = nxt
    return count


def _copy_stream(device: torch.device) -> Any:
    """This thread's stream for copies off ``device``: not the legacy default stream, which would
    wait for every worker's kernels."""
    per = getattr(_stages, "streams", None)
    if per is None:
        per = _stages.streams = {}
    st = per.get(device)
    if st is None:
        st = per[device] = torch.cuda.Stream(device)
    return st


class TensorFile:
    """A safetensors file read with plain ``pread`` at the header's offsets, never memory-mapped:
    what was read is not kept resident, so memory stays bounded by the tensors held (a mapped
    file's touched pages would count in the process's RSS and grow with the file)."""

    def __init__(self, path: Path):
        from .hf import read_header  # here: hf reads through read_exact above

        self.path = path
        self.entries = read_header(path)  # name -> (shape, dtype, absolute offset), sizes checked
        self._fd: int | None = None
        self._lock = threading.Lock()  # opened lazily, maybe by several reading threads at once

    def read(self, name: str, lo: int | None = None, hi: int | None = None, *,
             device: torch.device | str | None = None) -> torch.Tensor:
        """Tensor ``name``, or rows ``lo:hi`` of its first dimension (on ``device``, default the CPU)."""
        shape, dtype, offset = self.entries[name]
        if lo is None:
            lo, hi, lead = 0, None, shape
        else:
            if hi is None:
                hi = shape[0]
            lead = (hi - lo, *shape[1:])
        row = nbytes(shape[1:], dtype) if shape else 0
        n = nbytes(lead, dtype)
        with self._lock:
            if self._fd is None:
                try:
                    self._fd = os.open(self.path, os.O_RDONLY)
                except OSError as e:
                    raise CheckpointError(f"{self.path}: cannot read ({e.strerror})") from None
        t = read_exact(self._fd, offset + lo * row, n, f"{self.path}: truncated inside {name}", device=device)
        return t.view(dtype).reshape(lead)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
