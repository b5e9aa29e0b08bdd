"""Reading safetensors files with plain positioned reads (``pread``), never a memory map."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from ..errors import CheckpointError
from .hf import read_header


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * dtype.itemsize


class TensorFile:
    """A safetensors file read with plain ``pread`` at the header's offsets, never memory-mapped:
    what was read is not kept resident, so memory stays bounded by the tensors held (a mapped
    file's touched pages would count in the process's RSS and grow with the file)."""

    def __init__(self, path: Path):
        self.path = path
        self.entries = read_header(path)  # name -> (shape, dtype, absolute offset), sizes checked
        self._fd: int | None = None

    def read(self, name: str, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        """Tensor ``name``, or rows ``lo:hi`` of its first dimension."""
        shape, dtype, offset = self.entries[name]
        if lo is None:
            lo, hi, lead = 0, None, shape
        else:
            if hi is None:
                hi = shape[0]
            lead = (hi - lo, *shape[1:])
        row = _nbytes(shape[1:], dtype) if shape else 0
        n = _nbytes(lead, dtype)
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY)
            except OSError as e:
                raise CheckpointError(f"{self.path}: cannot read ({e.strerror})") from None
        buf = bytearray(n)
        view, got, pos = memoryview(buf), 0, offset + lo * row
        while got < n:
            k = os.preadv(self._fd, [view[got:]], pos + got)
            if k <= 0:
                raise CheckpointError(f"{self.path}: truncated inside {name}")
            got += k
        t = torch.frombuffer(buf, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        return t.view(dtype).reshape(lead)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
