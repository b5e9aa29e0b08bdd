"""How the CPU codecs scale inside one process (threads) against separate processes.

    python bench/codec_threads.py [--chunks 18 20] [--ops nvfp4-encode nvfp4-decode mxfp8-encode]
                                  [--experts 2] [--reps 1] [--heap pipeline|mmap-1m]

Each of N workers encodes (or decodes) its own ``[experts, 4608, 2304]`` BF16 stack with
``encode_stacked`` / ``decode_stacked``, as the pipeline's transforms do; the figure is million
elements per second over all workers, after one warm-up round, and in brackets the peak resident
size above the inputs (outputs and temporaries of all workers together). Layouts per row: one worker with
one torch thread, 4 workers splitting the cores' torch threads (the pipeline's CPU default),
one worker per core with one thread, and one *process* per core with one thread (fork). Beside
them, the baseline: the same workers copying the same BF16 bytes (``clone``), in GB/s of input.

``--chunks``: the codecs' row chunk (``formats._base.CHUNK_ELEMS``) as powers of two. ``--heap``:
``pipeline`` applies the glibc settings every pipeline command runs under
(``pipeline/memory.py``); ``mmap-1m`` the settings before the sixth session (1 MiB mmap
threshold, 16 MiB trim), under which chunk temporaries of 4 MiB are mapped and faulted in anew.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from inkling_ckpt.formats import _base, stacked  # noqa: E402
from inkling_ckpt.pipeline import memory  # noqa: E402

ROWS, COLS = 4608, 2304


def _inputs(fmt: str, op: str, experts: int) -> object:
    w = torch.randn(experts, ROWS, COLS, dtype=torch.bfloat16)
    return w if op in ("encode", "copy") else stacked.encode_stacked(fmt, w)


def _once(fmt: str, op: str, x: object) -> None:
    if op == "encode":
        stacked.encode_stacked(fmt, x)
    elif op == "decode":
        stacked.decode_stacked(fmt, x)
    else:
        x.clone()


def threads(fmt: str, op: str, workers: int, torch_threads: int, experts: int, reps: int) -> float:
    """Million elements per second of ``workers`` threads of this process."""
    xs = [_inputs(fmt, op, experts) for _ in range(workers)]

    def job(i: int) -> None:
        torch.set_num_threads(torch_threads)
        for _ in range(reps):
            _once(fmt, op, xs[i])

    base, peak, stop = memory.resident_bytes(), [0], threading.Event()

    def sample() -> None:
        while not stop.wait(0.001):
            peak[0] = max(peak[0], memory.resident_bytes())

    sampler = threading.Thread(target=sample)
    sampler.start()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(job, range(workers)))  # warm-up
        t = time.perf_counter()
        list(pool.map(job, range(workers)))
        dt = time.perf_counter() - t
        stop.set()
        sampler.join()
    WORKING_SET[(fmt, op, workers, torch_threads)] = max(0, peak[0] - base)
    return workers * reps * experts * ROWS * COLS / dt / 1e6


#: Peak resident bytes above the inputs during each run of ``threads`` (warm-up and timed round):
#: the outputs and the codecs' temporaries of all workers together.
WORKING_SET: dict[tuple[str, str, int, int], int] = {}


def _child(fmt: str, op: str, experts: int, reps: int, chunk: int, ready: object, go: object, done: object) -> None:
    torch.set_num_threads(1)
    _base.CHUNK_ELEMS = chunk
    x = _inputs(fmt, op, experts)
    _once(fmt, op, x)
    ready.put(1)
    go.wait()
    for _ in range(reps):
        _once(fmt, op, x)
    done.put(1)


def processes(fmt: str, op: str, n: int, experts: int, reps: int) -> float:
    """Million elements per second of ``n`` forked processes, one torch thread each."""
    ctx = mp.get_context("fork")
    ready, done, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    ps = [ctx.Process(target=_child, args=(fmt, op, experts, reps, _base.CHUNK_ELEMS, ready, go, done))
          for _ in range(n)]
    for p in ps:
        p.start()
    for _ in ps:
        ready.get()
    t = time.perf_counter()
    go.set()
    for _ in ps:
        done.get()
    dt = time.perf_counter() - t
    for p in ps:
        p.join()
    return n * reps * experts * ROWS * COLS / dt / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, nargs="+", default=[18, 20], help="row chunks, as powers of two")
    ap.add_argument("--ops", nargs="+", default=["nvfp4-encode", "nvfp4-decode", "mxfp8-encode"],
                    help="FORMAT-encode / FORMAT-decode (nvfp4, mxfp8)")
    ap.add_argument("--experts", type=int, default=2, help="experts per worker's stack")
    ap.add_argument("--reps", type=int, default=1, help="calls per worker in the timed round")
    ap.add_argument("--heap", choices=["pipeline", "mmap-1m", "mmap-4m"], default="pipeline",
                    help="pipeline: the commands' settings; mmap-1m: 1 MiB mmap / 16 MiB trim thresholds (before "
                         "2^20 chunks); mmap-4m: 4 MiB / 16 MiB (for 2^19 chunks)")
    ap.add_argument("--layouts", nargs="+", default=None, metavar="WxT",
                    help="workers x torch threads to run (default: 1x1, 4 x cores/4, cores x 1)")
    ap.add_argument("--no-processes", action="store_true", help="skip the one-process-per-core column")
    args = ap.parse_args()
    if args.heap == "mmap-1m":
        memory.MMAP_THRESHOLD, memory.TRIM_THRESHOLD = 1 << 20, 16 << 20
    elif args.heap == "mmap-4m":
        memory.MMAP_THRESHOLD, memory.TRIM_THRESHOLD = 4 << 20, 16 << 20
    memory.steady_memory()
    n = os.cpu_count() or 1
    layouts = sorted({(1, 1), (min(4, n), max(1, n // 4)), (n, 1)})
    if args.layouts:
        layouts = [(int(w), int(t)) for w, _, t in (x.partition("x") for x in args.layouts)]
    print(f"{n} cores, torch {torch.__version__}, heap {args.heap} (mmap threshold "
          f"{memory.MMAP_THRESHOLD >> 20} MiB, trim {memory.TRIM_THRESHOLD >> 20} MiB); Melem/s over all workers",
          flush=True)
    copy = {f"{w}x{t}": threads("bf16", "copy", w, t, args.experts, args.reps) * 2 / 1e3 for w, t in layouts}
    print("baseline copy of the BF16 input, GB/s: " + "  ".join(f"{k}: {v:.1f}" for k, v in copy.items()), flush=True)
    for spec in args.ops:
        fmt, _, op = spec.partition("-")
        for chunk in args.chunks:
            _base.CHUNK_ELEMS = 1 << chunk
            row = [f"{w}x{t}: {threads(fmt, op, w, t, args.experts, args.reps):6.0f} "
                   f"(+{WORKING_SET[(fmt, op, w, t)] >> 20} MiB)" for w, t in layouts]
            if not args.no_processes:
                row.append(f"{n} processes: {processes(fmt, op, n, args.experts, args.reps):6.0f}")
            print(f"{spec:13s} chunk 2^{chunk}: " + "  ".join(row), flush=True)


if __name__ == "__main__":
    main()
