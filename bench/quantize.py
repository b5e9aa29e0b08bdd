"""Benchmark ``quantize`` and ``dequantize`` (HF → HF) on generated ``wide`` release checkpoints.

The stacked release layout stores a layer's experts as one tensor (a full-size layer's w13 is
16 GB in BF16), so memory must be bounded by an expert slice, not by a layer. For each size
(``--sizes LAYERSxEXPERTS``, default 2x16 and 2x32: the second doubles every stacked tensor)
it writes a BF16 ``wide`` fixture (real 4608 × 4608 w13 and 4608 × 2304 w2 per expert), then
measures, each in its own process from a settled start (``bench/convert.py``'s ``settle``):

* ``plain``: a plain read + write of the fixture's shard files — the baseline;
* ``quantize``: BF16 → mixed NVFP4/MXFP8 (``--plan`` of the preset), encode-bound;
* ``dequantize``: that mixed output back to BF16, decode-bound.

Figures: wall time, input MB/s (source bytes / wall; 1 MB = 10^6 B), ratio to plain, peak RSS.
Checks: peak RSS of the sizes within 10% of each other although the largest tensor doubles.

    python bench/quantize.py                      # 2x16 and 2x32 under ./bench-work
    python bench/quantize.py --sizes 1x8 1x16     # a quick run
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import convert as base  # noqa: E402  (settle, run_measured, plain_copy: one baseline for every bench)

ROOT = base.ROOT


def bench_size(work: Path, layers: int, experts: int) -> dict:
    cli = [sys.executable, "-m", "inkling_ckpt"]
    fixture = work / f"wide-bf16-{layers}x{experts}"
    base.make_wide(fixture, "bf16", layers, "--experts", str(experts))
    src_bytes = base.shard_bytes(fixture)
    res: dict = {"layers": layers, "experts": experts, "fixture_bytes": src_bytes,
                 "largest_tensor": base.largest_tensor(fixture)}

    before = base.plain(fixture, work)
    plan = f"0-{max(0, layers // 2 - 1)}:nvfp4" + (f",{layers // 2}-{layers - 1}:mxfp8" if layers > 1 else "")
    q = work / "q"
    wall, rss = base.run_measured(cli + ["quantize", str(fixture), str(q), "--plan", plan, "--max-shard-size", "2GB", "-q"],
                                  fixture)
    res["quantize"] = base.figures(wall, rss, src_bytes, plan=plan)
    d = work / "d"
    wall, rss = base.run_measured(cli + ["dequantize", str(q), str(d), "--max-shard-size", "2GB", "-q"], q)
    res["dequantize"] = base.figures(wall, rss, src_bytes)
    shutil.rmtree(q)
    shutil.rmtree(d)
    base.best_plain(res, before, base.plain(fixture, work))
    shutil.rmtree(fixture)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=ROOT / "bench-work")
    ap.add_argument("--sizes", nargs="+", default=["2x16", "2x32"], help="LAYERSxEXPERTS per run")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    results = []
    for size in args.sizes:
        layers, experts = (int(x) for x in size.lower().split("x"))
        print(f"wide bf16, {layers} layers x {experts} experts:", flush=True)
        r = bench_size(args.work, layers, experts)
        results.append(r)
        print(f"  largest tensor {r['largest_tensor'] / 2**20:.0f} MiB; load average {r['load_avg']:.1f}")
        for what in ("plain", "quantize", "dequantize"):
            print(base.step_line(what, r[what], r["plain"], 11), flush=True)
    if len(results) > 1:
        print("checks:")
        for what in ("quantize", "dequantize"):
            shown, spread = base.rss_spread([r[what]["peak_rss"] for r in results])
            largest = ", ".join(f"{r['largest_tensor'] / 2**20:.0f}" for r in results)
            print(f"  {what}: peak RSS {shown} MiB while the largest tensor goes "
                  f"{largest} MiB; spread {spread:.1%} "
                  f"(<= 10%: {'yes' if spread <= 0.10 else 'NO'})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
