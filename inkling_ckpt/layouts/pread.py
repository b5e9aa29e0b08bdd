"""Reading safetensors files with plain positioned reads (``pread``), never a memory map."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..model.inventory import nbytes


def read_exact(fd: int, offset: int, count: int, truncated: str) -> torch.Tensor:
    """``count`` bytes at ``offset`` of an open file, as a uint8 tensor.

    Positioned reads until every byte has come (one read may return fewer), into memory torch
    allocates (in huge pages when the CLI turned them on: every slice a command reads lands in
    fresh memory). A file that ends first raises ``CheckpointError(truncated)``; an ``OSError``
    is the caller's to name.
    """
    buf = torch.empty(count, dtype=torch.uint8)
    view = memoryview(buf.numpy())  # type: ignore[arg-type]  # numpy types ndarray as a Buffer on 3.12+ only
    got = 0
    while got < count:
        k = os.preadv(fd, [view[got:]], offset + got)
        if k <= 0:
            raise CheckpointError(truncated)
        got += k
    return buf


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

    def read(self, name: str, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        """Tensor ``name``, or rows ``lo:hi`` of its first dimension."""
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
        t = read_exact(self._fd, offset + lo * row, n, f"{self.path}: truncated inside {name}")
        return t.view(dtype).reshape(lead)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
