"""Reading the next units' input bytes into the page cache while the workers compute.

A real conversion reads its input from disk, and a worker reads its unit's bytes only when it
starts it: while every worker computes the disk idles, and while several read they share it. The
read-ahead walks the units in plan order on one background thread and reads the byte ranges each
will read (``extents(unit)``, from headers) into one reused buffer, staying at most
:data:`READ_AHEAD_BYTES` past the units already handed to workers; the workers' own positioned
reads then find the pages in the page cache. Nothing it reads is kept by the process (the page
cache is the kernel's, not the process's resident size), and it never changes what is read or
written: it only reads earlier. A range it cannot read (a missing file, a short one) is left to
the worker, whose read raises the command's own error.
"""

from __future__ import annotations

import math
import os
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import ConfigError

#: ``(file, offset, length)``: a byte range a unit will read.
Extent = tuple[Path, int, int]

#: How far past the units handed to workers the read-ahead reads by default on a GPU: a few units of
#: every command (a GPU slice is 64 MiB), well under a second of a disk's reading. On the CPU it is off
#: by default: there the codecs, not the disk, bound the commands (H100 machine, 16 cores, 8-layer wide
#: fixture: lora merge took as long with its inputs already in the page cache, and the same with the
#: read-ahead on or off), and on two cores its copies took time from the workers (2-layer lora merge
#: 14.2-16.4 s on against 13.7-15.3 s off). On a GPU lora merge's executor took 7.4-9.3 s with it
#: against 8.3-11.3 s without (bench/README.md).
READ_AHEAD_BYTES = 256 * 2**20
#: One read of the read-ahead (its one buffer, part of the process's resident size).
PIECE_BYTES = 8 * 2**20
#: Overrides the default (MiB; 0 turns the read-ahead off, a size turns it on on the CPU too).
ENV = "INKLING_CKPT_READ_AHEAD_MB"


def read_ahead_bytes(device_type: str = "cuda") -> int:
    """How far the read-ahead runs past the started units: :data:`ENV` if set, else
    :data:`READ_AHEAD_BYTES` on a GPU and 0 (off) on the CPU."""
    v = os.environ.get(ENV, "").strip()
    if not v:
        return READ_AHEAD_BYTES if device_type != "cpu" else 0
    try:
        mib = float(v)
    except ValueError:
        mib = math.nan
    # A typo must not quietly become the default (a benchmark's "off" baseline would read ahead).
    if not math.isfinite(mib) or mib < 0:
        raise ConfigError(f"{ENV}={v!r}: expected a size in MiB (a number >= 0; 0 turns the read-ahead off)")
    return int(mib * 2**20)


class ReadAhead:
    """The background reader for one :meth:`Executor.map` call (see the module docstring).

    ``started(n)``: the first ``n`` items have been handed to workers (they read their own bytes;
    the read-ahead skips any it has not reached). ``close()`` stops it and closes its files.
    """

    def __init__(self, items: Sequence[Any], extents: Callable[[Any], Sequence[Extent]], ahead_bytes: int):
        self._items = items
        self._extents_of = extents
        # Each item's ranges and bytes, found on the reading thread as it gets there (a job of tens of
        # thousands of units names them while the first ones run, not before); an item the workers
        # took first is left out ([]). Several units may name one stored blob (a torch_dist chunk
        # they share): the first reads it.
        self._found: list[list[Extent]] = []
        # Running totals of the found items' bytes (``_total[k]``: items ``0..k-1``), so the window's
        # size is one subtraction, not a sum over its items (thousands with tiny units).
        self._total: list[int] = [0]
        self._seen: set[Extent] = set()
        self._ahead = ahead_bytes
        self._started = 0
        self._stop = False
        self._cond = threading.Condition()
        #: bytes this reader read, and the items whose ranges it went through whole before a worker
        #: began them (read, or found unreadable and left to the worker; for tests and benchmarks:
        #: how much of the input it had ready)
        self.bytes_read = 0
        self.items_ready = 0
        self._thread = threading.Thread(target=self._run, name="inkling-readahead", daemon=True)
        self._thread.start()

    def started(self, n: int) -> None:
        """Items ``0..n-1`` have been handed to workers."""
        with self._cond:
            if n > self._started:
                self._started = n
                self._cond.notify()

    def close(self) -> None:
        """Stop reading (the piece being read finishes first)."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join()

    def _find(self, i: int) -> list[Extent]:
        """Item ``i``'s ranges, those before it found first (the reading thread only)."""
        while len(self._found) <= i:
            j = len(self._found)
            mine = [e for e in self._extents_of(self._items[j]) if e not in self._seen] if j >= self._started else []
            self._seen.update(mine)
            self._found.append(mine)
            self._total.append(self._total[-1] + sum(max(0, n) for _, _, n in mine))
        return self._found[i]

    def _next(self, i: int) -> int:
        """The next item to read (waiting until it is within reach), or -1 to stop."""
        while True:
            with self._cond:
                i = max(i, self._started)
            if self._stop or i >= len(self._items):
                return -1
            self._find(i)
            with self._cond:
                while not self._stop and i >= self._started and self._total[i] - self._total[self._started] >= self._ahead:
                    self._cond.wait()
                if self._stop:
                    return -1
                if i >= self._started:
                    return i
            # the workers took it meanwhile: on to the first they have not

    def _run(self) -> None:
        buf = bytearray(PIECE_BYTES)
        view = memoryview(buf)
        fds: dict[Path, int] = {}
        try:
            i = 0
            while (i := self._next(i)) >= 0:
                whole = all(self._read(fds, i, *ext, view) for ext in self._found[i])
                if whole and self._found[i]:
                    self.items_ready += 1
                i += 1
        finally:
            for fd in fds.values():
                os.close(fd)

    def _read(self, fds: dict[Path, int], item: int, path: Path, offset: int, length: int, view: memoryview) -> bool:
        """Read ``length`` bytes at ``offset`` of ``path`` a piece at a time; False once stopped or
        once a worker has started ``item`` (it reads the rest itself: two readers would share the disk)."""
        fd = fds.get(path)
        if fd is None:
            try:
                fd = fds[path] = os.open(path, os.O_RDONLY)
            except OSError:
                return True  # the worker's own read names the problem
        end = offset + length
        while offset < end:
            if self._stop or self._started > item:
                return False
            try:
                k = os.preadv(fd, [view[: min(len(view), end - offset)]], offset)
            except OSError:
                return True
            if k <= 0:
                return True
            offset += k
            self.bytes_read += k
        return True


__all__ = ["Extent", "ReadAhead", "READ_AHEAD_BYTES", "read_ahead_bytes"]
