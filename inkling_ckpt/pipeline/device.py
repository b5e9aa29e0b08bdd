"""Where the expert codecs run: ``--device auto|cpu|cuda``.

``auto`` is CUDA when a GPU is usable, else the CPU. Under torchrun each rank takes its local
GPU (``LOCAL_RANK``). The codecs give the same bytes on every device; only the speed differs.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import torch

from ..errors import DeviceError

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(spec: str = "auto") -> torch.device:
    """The device for ``spec`` (auto, cpu, cuda, cuda:N); ``cuda`` without a usable GPU is an error."""
    name = (spec or "auto").strip().lower()
    if name == "cpu":
        return torch.device("cpu")
    if name == "auto":
        return _local_gpu() if _cuda_usable() else torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        if not _cuda_usable():
            raise DeviceError("--device cuda: no usable GPU here (torch sees no CUDA device); use --device cpu or auto")
        if name == "cuda":
            return _local_gpu()
        try:
            idx = int(name.split(":", 1)[1])
        except ValueError:
            raise DeviceError(f"--device {spec!r}: not a device; choose one of {', '.join(DEVICES)}") from None
        if not 0 <= idx < torch.cuda.device_count():
            raise DeviceError(f"--device {spec}: this machine has {torch.cuda.device_count()} GPUs")
        return torch.device("cuda", idx)
    raise DeviceError(f"--device {spec!r}: not a device; choose one of {', '.join(DEVICES)}")


def device_kind(spec: str = "auto") -> str:
    """``cpu`` or ``cuda``: what ``spec`` would run on (for estimates; checks nothing)."""
    name = (spec or "auto").strip().lower()
    if name == "auto":
        return "cuda" if _cuda_usable() else "cpu"
    return "cuda" if name.startswith("cuda") else "cpu"


def _cuda_usable() -> bool:
    try:
        return torch.cuda.is_available() and torch.cuda.device_count() > 0
    except RuntimeError:
        return False


def _local_gpu() -> torch.device:
    n = torch.cuda.device_count()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device("cuda", local % n)


@contextmanager
def oom_as_error(option: str = "--slice-mb") -> Iterator[None]:
    """Turn a GPU or host out-of-memory into one :class:`DeviceError` line naming the option that
    shrinks what is in flight (the slice on the GPU; the memory budget on the host)."""
    try:
        yield
    except torch.cuda.OutOfMemoryError:
        raise DeviceError(f"the GPU ran out of memory; pass a smaller {option} (or --workers 1), or --device cpu") from None
    except (MemoryError, RuntimeError) as e:
        # torch's CPU allocator fails with a plain RuntimeError; Python's own with MemoryError.
        if isinstance(e, RuntimeError) and _HOST_OOM not in str(e):
            raise
        raise DeviceError("the host ran out of memory; pass a smaller --memory-mb (or --workers 1, a smaller "
                          "--slice-mb)") from None


#: What torch's CPU allocator says when an allocation fails.
_HOST_OOM = "DefaultCPUAllocator: can't allocate memory"


def peak_gpu_bytes(device: torch.device) -> int:
    """Peak GPU memory allocated by this process on ``device`` (0 on the CPU)."""
    if device.type != "cuda":
        return 0
    return int(torch.cuda.max_memory_allocated(device))


__all__ = ["DEVICES", "device_kind", "resolve_device", "oom_as_error", "peak_gpu_bytes"]
