"""Positioned reads out of the page cache: into fresh host blocks (what the CPU reads do) vs one
block per thread reused, with several threads at once.

    .venv/bin/python bench/read_buffers.py [--gb 2] [--threads 1 4 16] [--slice-mb 16 64]

Writes a file of ``--gb`` GB (so its pages are in the page cache), then has each thread count read
slices of it with ``os.preadv``: "fresh" into a new ``torch.empty`` per slice (mapped apart from
8 MiB up once ``steady_memory`` ran, faulted in by the read, unmapped when freed), "reused" into
one block per thread. Prints GB/s of each (two alternating runs), the ratio reused / fresh, and
the process's peak RSS. The question it answers: whether fresh read blocks (page faults, and the
memory-map lock under many threads) could be what bounds a command's reads. Compare the rates
with the disk's (``bench/pipeline.py`` prints a plain read + write of the same machine).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import threading
import time

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the CLI runs (cli/app.py)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402

from inkling_ckpt.pipeline.memory import steady_memory  # noqa: E402


def read_all(path: str, size: int, threads: int, slice_bytes: int, reuse: bool) -> float:
    """GB/s of ``threads`` threads reading every whole slice of ``path`` once."""
    offsets = iter(range(0, size - slice_bytes + 1, slice_bytes))
    count = size // slice_bytes
    lock = threading.Lock()

    def work() -> None:
        fd = os.open(path, os.O_RDONLY)
        mine = torch.empty(slice_bytes, dtype=torch.uint8) if reuse else None
        try:
            while True:
                with lock:
                    off = next(offsets, None)
                if off is None:
                    return
                buf = mine if mine is not None else torch.empty(slice_bytes, dtype=torch.uint8)
                view = memoryview(buf.numpy())
                got = 0
                while got < slice_bytes:
                    got += os.preadv(fd, [view[got:]], off + got)
                del buf, view
        finally:
            os.close(fd)

    pool = [threading.Thread(target=work) for _ in range(threads)]
    t0 = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return count * slice_bytes / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=2.0, help="size of the file read (GB)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--slice-mb", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--dir", default=None, help="folder for the file (default: the system's temporary folder)")
    args = ap.parse_args()
    steady_memory()  # the commands' allocation settings: 8 MiB blocks and up mapped apart
    size = int(args.gb * 1e9) // (64 << 20) * (64 << 20)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = os.path.join(d, "blob")
        with open(path, "wb") as f:
            piece = os.urandom(64 << 20)
            for _ in range(size // len(piece)):
                f.write(piece)
        print(f"{size / 1e9:.2f} GB in the page cache, {os.cpu_count()} cores")
        for threads in args.threads:
            for mb in args.slice_mb:
                rates: dict[bool, list[float]] = {False: [], True: []}
                for _ in range(2):
                    for reuse in (False, True):
                        rates[reuse].append(read_all(path, size, threads, mb << 20, reuse))
                fresh, reused = rates[False], rates[True]
                print(f"threads {threads:2d}, slices of {mb:3d} MiB: fresh {fresh[0]:6.2f} / {fresh[1]:6.2f} GB/s, "
                      f"reused {reused[0]:6.2f} / {reused[1]:6.2f} GB/s, reused / fresh {max(reused) / max(fresh):.2f}x")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {peak:.0f} MiB")


if __name__ == "__main__":
    main()
