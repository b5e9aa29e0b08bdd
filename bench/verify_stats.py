"""How fast verify's error statistics run, beside a copy of the same bytes.

    python bench/verify_stats.py [--elements 4194304] [--reps 5] [--workers 1 4] [--code DIR]

``tensor_stats(a, b)`` (a decoded float32 piece against another: equal bits, Σa², Σe², max |e|)
and ``exact_stats(a)`` (a bit-identical piece: Σa² only), as ``verify`` runs them on each
decode piece (``DECODE_ELEMENTS``, 4M elements), by ``--workers`` threads at once, each on its own
pair, under the glibc settings every pipeline command runs under (``pipeline/memory.py``). The
figure is million elements per second over all workers (median of ``--reps``) and its ratio to
the baseline: the same workers copying ``a`` (``clone``). On a machine with CUDA the same on
the GPU, one worker. ``--code DIR``: time another checkout's ``inkling_ckpt`` (the code before
a change) in the same run.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]


def load(code: Path) -> Any:
    """``inkling_ckpt.verify.compare`` from ``code`` (a fresh import: two checkouts in one run)."""
    for name in [m for m in sys.modules if m == "inkling_ckpt" or m.startswith("inkling_ckpt.")]:
        del sys.modules[name]
    sys.path.insert(0, str(code))
    try:
        importlib.import_module("inkling_ckpt.pipeline.memory").steady_memory()
        return importlib.import_module("inkling_ckpt.verify.compare")
    finally:
        sys.path.remove(str(code))


def rate(fn: Callable[[int], Any], workers: int, elements: int, reps: int) -> float:
    """Million elements per second of ``fn(worker)`` run by ``workers`` threads at once (median of ``reps``)."""
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(fn, range(workers)))  # warm-up: buffers, heap
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            list(pool.map(fn, range(workers)))
            times.append(time.perf_counter() - t)
    return workers * elements / statistics.median(times) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--elements", type=int, default=1 << 22, help="elements per piece (verify's DECODE_ELEMENTS)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 4], help="threads at once (each one torch thread)")
    ap.add_argument("--code", action="append", default=[], help="another checkout to time beside this one")
    args = ap.parse_args()
    torch.set_num_threads(1)  # as a pipeline worker on the 2-core box; the GPU rows use one worker
    g = torch.Generator().manual_seed(0)
    most = max(args.workers)
    a = [torch.randn(args.elements, generator=g) for _ in range(most)]
    b = [x + 1e-2 * torch.randn(args.elements, generator=g) for x in a]
    print(f"{args.elements} float32 elements a piece; Melem/s over all workers (x the copy rate)")
    for code in [ROOT, *map(Path, args.code)]:
        run(load(code.resolve()), code.name, a, b, args)


def run(cmp: Any, label: str, a: list[torch.Tensor], b: list[torch.Tensor], args: argparse.Namespace) -> None:
    """The rows of one checkout's ``compare`` module."""
    for w in args.workers:
        copy = rate(lambda i: a[i].clone(), w, args.elements, args.reps)
        full = rate(lambda i: cmp.tensor_stats(a[i], b[i]), w, args.elements, args.reps)
        same = rate(lambda i: cmp.exact_stats(a[i]), w, args.elements, args.reps)
        print(f"  {label:12s} cpu x{w}: copy {copy:7.0f}  tensor_stats {full:6.0f} ({full / copy:.2f}x)  "
              f"exact_stats {same:6.0f} ({same / copy:.2f}x)", flush=True)
    if not torch.cuda.is_available():
        return
    ga, gb = a[0].cuda(), b[0].cuda()

    def synced(fn: Callable[[], Any]) -> Callable[[int], Any]:
        return lambda i: (fn(), torch.cuda.synchronize())

    copy = rate(synced(ga.clone), 1, args.elements, args.reps)
    full = rate(synced(lambda: cmp.tensor_stats(ga, gb)), 1, args.elements, args.reps)
    same = rate(synced(lambda: cmp.exact_stats(ga)), 1, args.elements, args.reps)
    print(f"  {label:12s} cuda x1: copy {copy:7.0f}  tensor_stats {full:6.0f} ({full / copy:.3f}x)  "
          f"exact_stats {same:6.0f} ({same / copy:.3f}x)", flush=True)

if __name__ == "__main__":
    main()
