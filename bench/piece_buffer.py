"""One merge piece decoded (and one LoRA product formed) into fresh memory vs into a reused buffer.

Fresh host blocks from 8 MiB up are mapped apart (``inkling_ckpt.pipeline.memory``), so a piece
decoded into fresh memory faults its pages in every time. Prints, per operation, the best time of
``--repeat`` calls and the page faults per call, both ways, and a 16 MiB copy as the baseline.
Torch's transparent huge pages are on as the CLI runs (``--no-huge-pages``: off).

    python bench/piece_buffer.py [--rows 1824] [--cols 2304] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path
from typing import Callable

if "--no-huge-pages" not in sys.argv:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the CLI sets it (cli/app.py), before torch loads
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from inkling_ckpt.formats.stacked import decode_stacked, encode_stacked  # noqa: E402
from inkling_ckpt.pipeline.memory import steady_memory  # noqa: E402


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _best(fn: Callable[[], object], repeat: int) -> tuple[float, float]:
    fn()
    best, f0 = float("inf"), _faults()
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best, (_faults() - f0) / repeat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1824, help="rows of the piece (a w13 piece of ~4M elements)")
    ap.add_argument("--cols", type=int, default=2304)
    ap.add_argument("--rank", type=int, default=32, help="LoRA rank of the product")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-huge-pages", action="store_true",
                    help="leave torch's transparent huge pages off (the CLI turns them on: THP_MEM_ALLOC_ENABLE=1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    steady_memory()  # the commands' allocator settings
    x = torch.randn(1, args.rows, args.cols)
    buf = torch.empty_like(x)
    (copy, _) = _best(lambda: buf.copy_(x), args.repeat)
    print(f"baseline: copy of {x.nbytes / 2**20:.0f} MiB into a used buffer {copy * 1e3:.1f} ms")
    for fmt in ("mxfp8", "nvfp4"):
        parts = encode_stacked(fmt, x, amax=x.abs().amax(dim=(1, 2)) if fmt == "nvfp4" else None)
        fresh, ff = _best(lambda p=parts, f=fmt: decode_stacked(f, p, torch.float32), args.repeat)
        into, fb = _best(lambda p=parts, f=fmt: decode_stacked(f, p, torch.float32, out=buf), args.repeat)
        print(f"{fmt} decode to float32: fresh {fresh * 1e3:.1f} ms ({ff:.0f} faults), "
              f"into a buffer {into * 1e3:.1f} ms ({fb:.0f} faults): {fresh / into:.1f}x")
    b, a = torch.randn(args.rows // 2, args.rank), torch.randn(args.rank, args.cols)
    out = torch.empty(args.rows // 2, args.cols)
    fresh, ff = _best(lambda: b @ a, args.repeat)
    into, fb = _best(lambda: torch.matmul(b, a, out=out), args.repeat)
    print(f"product [{args.rows // 2}, {args.rank}] @ [{args.rank}, {args.cols}]: fresh {fresh * 1e3:.1f} ms "
          f"({ff:.0f} faults), into a buffer {into * 1e3:.1f} ms ({fb:.0f} faults): {fresh / into:.1f}x")


if __name__ == "__main__":
    main()
