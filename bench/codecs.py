"""Codec throughput and peak memory: inkling_ckpt.formats vs torchao 0.18 (when installed).

    .venv/bin/python bench/codecs.py [--rows 2304] [--cols 4608] [--repeat 10] [--threads N]

For a [rows, cols] bf16 N(0,1) matrix, prints encode and decode throughput (million elements
per second, best of --repeat runs after one warm-up) and the peak extra resident memory of one
call, for NVFP4 and MXFP8 (RCEIL), ours beside torchao's reference functions measured in the
same run, and the ratio. Each measurement runs in its own subprocess so that the peak-RSS
high-water mark belongs to that one codec call.

torchao counterparts: NVFP4 encode = per-tensor amax + ``nvfp4_quantize(per_tensor_scale=...)``,
decode = ``NVFP4Tensor.dequantize``; MXFP8 encode = ``to_mx(..., RCEIL)``, decode = ``to_dtype``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import warnings

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

CASES = [("nvfp4", "encode"), ("nvfp4", "decode"), ("mxfp8", "encode"), ("mxfp8", "decode")]


def _status_kib(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return float(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (Linux: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_of(fn) -> float:
    """MiB of resident memory one call adds at its peak, above what was resident before it."""
    if _reset_peak():
        before = _status_kib("VmRSS")
        fn()
        peak = _status_kib("VmHWM")
        if before is not None and peak is not None:
            return max(0.0, peak - before) / 1024.0
    # fallback: the process high-water mark can only under-report (it includes earlier peaks)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fn()
    return max(0.0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024.0


def _ours(fmt_name: str, op: str, x):
    import torch

    from inkling_ckpt.formats import get_format

    fmt = get_format(fmt_name)
    if op == "encode":
        return lambda: fmt.encode(x)
    parts = fmt.encode(x)
    return lambda: fmt.decode(parts, torch.bfloat16)


def _torchao(fmt_name: str, op: str, x):
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx
        from torchao.prototype.mx_formats.nvfp4_tensor import (
            NVFP4Tensor,
            nvfp4_quantize,
            per_tensor_amax_to_scale,
        )
    if fmt_name == "nvfp4":
        if op == "encode":
            return lambda: nvfp4_quantize(x, 16, per_tensor_scale=per_tensor_amax_to_scale(x.abs().amax().float()))
        t = NVFP4Tensor.to_nvfp4(x, per_tensor_scale=per_tensor_amax_to_scale(x.abs().amax().float()))
        return lambda: t.dequantize(torch.bfloat16)
    if op == "encode":
        return lambda: to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
    scale, data = to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
    return lambda: to_dtype(data, scale, torch.float8_e4m3fn, 32, torch.bfloat16)


def child(impl: str, fmt_name: str, op: str, rows: int, cols: int, repeat: int) -> dict:
    """Run one measurement in this process and return its figures."""
    import torch

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=gen).to(torch.bfloat16)
    fn = (_ours if impl == "ours" else _torchao)(fmt_name, op, x)
    fn()  # warm-up (lazy tables, allocator)
    peak = _peak_of(fn)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return {"melem_s": x.numel() / best / 1e6, "peak_mib": peak, "threads": torch.get_num_threads()}


def _run_child(impl, fmt_name, op, args) -> dict | None:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", impl, fmt_name, op,
           "--rows", str(args.rows), "--cols", str(args.cols), "--repeat", str(args.repeat),
           "--threads", str(args.threads)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.stderr.write(f"[{impl} {fmt_name} {op}] failed:\n{r.stderr[-2000:]}\n")
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def _have_torchao() -> bool:
    try:
        import importlib.util

        return importlib.util.find_spec("torchao") is not None
    except Exception:  # noqa: BLE001 - any import machinery problem means "not available"
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2304)
    ap.add_argument("--cols", type=int, default=4608)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--child", nargs=3, metavar=("IMPL", "FORMAT", "OP"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        print(json.dumps(child(*args.child, args.rows, args.cols, args.repeat)))
        return 0

    ref = _have_torchao()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"[{args.rows}, {args.cols}] bf16 N(0,1); best of {args.repeat}; load average {load:.2f}; "
          f"peak = extra resident memory of one call; reference: {'torchao 0.18' if ref else 'torchao not installed'}")
    head = f"{'format':<14}{'op':<8}{'ours Melem/s':>14}{'peak MiB':>10}"
    if ref:
        head += f"{'torchao Melem/s':>17}{'peak MiB':>10}{'ratio':>8}"
    print(head)
    threads = None
    for fmt_name, op in CASES:
        o = _run_child("ours", fmt_name, op, args)
        label = "mxfp8 (rceil)" if fmt_name == "mxfp8" else fmt_name
        if o is None:
            print(f"{label:<14}{op:<8}{'failed':>14}")
            continue
        threads = o["threads"]
        line = f"{label:<14}{op:<8}{o['melem_s']:>14.1f}{o['peak_mib']:>10.1f}"
        if ref:
            t = _run_child("torchao", fmt_name, op, args)
            if t is None:
                line += f"{'failed':>17}"
            else:
                line += f"{t['melem_s']:>17.1f}{t['peak_mib']:>10.1f}{o['melem_s'] / t['melem_s']:>7.1f}x"
        print(line, flush=True)
    print(f"torch threads: {threads}; input {args.rows * args.cols * 2 / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
