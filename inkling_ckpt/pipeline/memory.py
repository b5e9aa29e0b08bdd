"""Process-wide memory settings every pipeline command runs under (applied once per process)."""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

#: glibc's mallopt parameter for the size from which an allocation gets its own mapping.
M_MMAP_THRESHOLD = -3
#: Blocks from 8 MiB up (slices, their results) are mapped apart, so freeing one returns it to the
#: OS at once; the codecs' chunk temporaries (4 MiB, ``formats._base.CHUNK_ELEMS``) stay below it.
#: Their page faults are not what bounds a command: with the threshold at 1 GiB (big blocks reused
#: from the heap) lora merge took 60 % fewer faults on the 2-core box, and neither it nor quantize
#: ran faster there or on the 16-core node, which peaked 50-130 MiB higher (bench/README.md).
MMAP_THRESHOLD = 8 << 20
#: glibc's mallopt parameter for the free memory a heap keeps at its top before giving it back.
M_TRIM_THRESHOLD = -1
#: Kept at 32 MiB, so the chunk temporaries (a few per worker) are reused from the heap. At glibc's
#: default (128 KiB once the mmap threshold is fixed) every free of one trimmed the worker's heap and
#: the next op faulted its pages in again: 2 workers encoding and decoding [4, 4608, 4608] on the
#: 2-core box took 133-233K page faults against 2-19K, and ran NVFP4 1.1-1.9x and MXFP8 1.5x slower;
#: on the 16-core node, with chunks mapped apart (2^20 elements, 1 MiB threshold), 4 workers encoded
#: NVFP4 at 485 Melem/s against 893 from the heap.
TRIM_THRESHOLD = 32 << 20

#: glibc's mallopt parameter for the most heaps (arenas) the threads allocate from.
M_ARENA_MAX = -8
#: One heap for every thread. glibc gives each thread that allocates while another holds the heap
#: an arena of its own (up to 8 per core), and each keeps its own free blocks (up to
#: :data:`TRIM_THRESHOLD` at its top, more between blocks in use): with the workers' codec
#: temporaries in four arenas, verify in a node-sized process (start ~500 MiB, 2-core box) peaked
#: at 980-1076 MiB against 830-885 MiB from one heap, lora merge 1099 -> 1037 MiB (before it
#: merged a piece at a time). Blocks from :data:`MMAP_THRESHOLD` up bypass the heaps, so the
#: workers contend for it only for their small blocks.
ARENA_MAX = 1

_lock = threading.Lock()
_applied = False


def _glibc() -> Any:
    """The C library when it is glibc (its ``mallopt`` is what we call), else None."""
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION")
    except (AttributeError, ValueError, OSError):
        return None
    if not version or not version.startswith("glibc"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def steady_memory() -> None:
    """Make glibc return large freed blocks to the OS at once; once per process, a no-op off glibc.

    glibc raises its mmap threshold as big blocks are freed (up to 32 MiB), after which the
    tensors a command streams come from the heap and linger there once freed; a fixed 8 MiB
    threshold keeps the resident set at the few slices in flight, the same from one run to the next.
    Below it, the threads share one heap (:data:`ARENA_MAX`), which keeps up to
    :data:`TRIM_THRESHOLD` free for the next small blocks.
    """
    global _applied
    with _lock:
        if _applied:
            return
        _applied = True
        libc = _glibc()
        if libc is not None:
            libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
            libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
            libc.mallopt(M_ARENA_MAX, ARENA_MAX)


def trim_heap() -> bool:
    """Give the heap's free pages back to the OS (glibc ``malloc_trim(0)``): those between blocks
    in use too, which glibc's own trimming (the heap's top only) never returns. True when glibc
    released any; False off glibc."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))


#: ``(pid, fd)`` of this process's ``/proc/self/statm``, opened once: the executor asks before each
#: unit it starts, and an open + read + close per ask was 13 % of the main thread's samples with tiny
#: units (hf-to-megatron, 48 x 384 tiny experts, 2-core box); a positioned read of the open file is
#: ~3 us against ~24 us. The pid: a forked child must not read its parent's.
_statm: tuple[int, int] | None = None
_statm_lock = threading.Lock()
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _statm_fd() -> int:
    global _statm
    pid = os.getpid()
    with _statm_lock:
        if _statm is None or _statm[0] != pid:
            _statm = (pid, os.open("/proc/self/statm", os.O_RDONLY))
        return _statm[1]


def resident_bytes() -> int:
    """This process's resident set now (Linux ``/proc/self/statm``; elsewhere its peak so far)."""
    try:
        return int(os.pread(_statm_fd(), 256, 0).split()[1]) * _PAGE
    except (OSError, ValueError, IndexError, AttributeError):
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


__all__ = ["steady_memory", "resident_bytes", "trim_heap"]
