"""Host memory rates that bound the pipeline's per-byte work, in one process, one thread.

    python bench/memory_rates.py [--mib 64] [--repeat 10]
    THP_MEM_ALLOC_ENABLE=1 python bench/memory_rates.py     # torch's huge pages (the CLI's default)

Each row is GB/s over ``--mib`` MiB (best of the repeats' mean): allocating fresh memory and
writing it once (what every slice a command moves costs when it lands in new memory), the same
write into reused memory (the baseline: the rate without page faults), ``torch.load`` of a blob
(a copy into fresh memory), sha256 (the torch_dist sidecars), and with CUDA the device <-> host
copies into fresh, reused and pinned memory. ``THP_MEM_ALLOC_ENABLE`` is read by torch once, at its
first allocation, so set it in the environment, not inside the script.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import time
from typing import Callable

import torch


def rate(nbytes: int, fn: Callable[[], object], repeat: int) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    sync()
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync()
    return nbytes * repeat / (time.perf_counter() - t) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=10)
    a = ap.parse_args()
    torch.set_num_threads(1)
    n = a.mib << 20
    reused = torch.empty(n, dtype=torch.uint8)
    reused.fill_(3)
    raw = bytes(n)
    saved = io.BytesIO()
    torch.save(torch.zeros(n // 2, dtype=torch.bfloat16), saved)
    blob = saved.getvalue()
    rows: list[tuple[str, float]] = [
        ("allocate + first write", rate(n, lambda: torch.empty(n, dtype=torch.uint8).fill_(1), a.repeat)),
        ("write into reused memory (baseline)", rate(n, lambda: reused.fill_(1), a.repeat)),
        ("torch.load of a blob", rate(n, lambda: torch.load(io.BytesIO(blob), weights_only=True), a.repeat)),
        ("sha256", rate(n, lambda: hashlib.sha256(raw).digest(), a.repeat)),
    ]
    if torch.cuda.is_available():
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        pinned = torch.empty(n, dtype=torch.uint8).pin_memory()
        rows += [
            ("device -> host, fresh memory", rate(n, lambda: dev.to("cpu"), a.repeat)),
            ("device -> host, reused memory", rate(n, lambda: reused.copy_(dev), a.repeat)),
            ("device -> host, pinned", rate(n, lambda: pinned.copy_(dev), a.repeat)),
            ("host -> device, pageable", rate(n, lambda: reused.to("cuda"), a.repeat)),
            ("host -> device, pinned", rate(n, lambda: pinned.to("cuda", non_blocking=True), a.repeat)),
        ]
    print(f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '(unset)')}, {a.mib} MiB, one thread, torch {torch.__version__}")
    base = rows[1][1]
    for name, r in rows:
        print(f"  {name:38s} {r:7.2f} GB/s  {r / base:6.0%} of reused-memory write")


if __name__ == "__main__":
    main()
