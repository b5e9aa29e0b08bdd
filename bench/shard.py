"""Benchmark ``shard`` and ``shard --merge`` on generated ``wide`` checkpoints.

For each size it writes a ``wide`` fixture (real 2304 x 4608 expert matrices, 16 experts per
layer: one layer's stacked ``w13`` is 680 MB in BF16, 340 MB in MXFP8), then measures, each in
its own process and from a settled page cache (``bench/convert.py``'s helpers):

* ``plain``: a plain read + write of the fixture's shard files — the baseline;
* ``shard``: ``shard --tp 4 --ep 4`` (every expert byte goes to one rank, the rest is split or
  replicated);
* ``merge``: ``shard --merge`` back, checked byte for byte against the fixture.

Reported: wall time, MB/s (bytes read / wall time), peak RSS, and the checks: peak RSS of the
sizes within 10% of each other and below one layer's stacked ``w13`` + 512 MiB (tensors move
in blocks of rows, never a whole layer), throughput against the plain copy.

    python bench/shard.py                       # 1 and 2 layers, MXFP8, under ./bench-work
    python bench/shard.py --layers 2 4 --variant bf16
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import convert as b  # noqa: E402  (settle, run_measured, plain_copy)

ROOT = b.ROOT


def bench_size(work: Path, layers: int, variant: str, tp: int, ep: int, keep: bool) -> dict:
    cli = [sys.executable, "-m", "inkling_ckpt"]
    fixture = work / f"wide-{variant}-{layers}L"
    b.make_wide(fixture, variant, layers)
    src_bytes = b.shard_bytes(fixture)
    sys.path.insert(0, str(ROOT))
    from inkling_ckpt.layouts.hf import HFCheckpoint

    ck = HFCheckpoint.open(fixture)
    layer_w13 = max(t.nbytes for n, t in ck.tensors.items() if n.endswith("w13_weight"))
    res: dict = {"layers": layers, "variant": variant, "tp": tp, "ep": ep, "fixture_bytes": src_bytes,
                 "layer_w13_bytes": layer_w13}

    before = b.plain(fixture, work)
    sh, back = work / "sh", work / "back"
    wall, rss = b.run_measured(cli + ["shard", str(fixture), str(sh), "--tp", str(tp), "--ep", str(ep), "-q"], fixture)
    res["shard"] = b.figures(wall, rss, src_bytes)
    wall, rss = b.run_measured(cli + ["shard", "--merge", str(sh), str(back), "-q"], sh)
    res["merge"] = b.figures(wall, rss, src_bytes)
    res["identical"] = all(subprocess.run(["cmp", "-s", str(f), str(back / f.name)]).returncode == 0
                           for f in fixture.iterdir() if f.is_file() and not f.name.startswith("."))
    shutil.rmtree(sh)
    shutil.rmtree(back)
    b.best_plain(res, before, b.plain(fixture, work))
    if not keep:
        shutil.rmtree(fixture)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=ROOT / "bench-work", help="scratch folder (~3x the largest fixture)")
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 2], help="fixture sizes in layers")
    ap.add_argument("--variant", default="mxfp8", choices=["bf16", "mixed", "mxfp8"])
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--ep", type=int, default=4)
    ap.add_argument("--keep", action="store_true", help="keep the generated fixtures")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    results = []
    for layers in args.layers:
        print(f"wide {args.variant}, {layers} layers, tp {args.tp} ep {args.ep}:", flush=True)
        r = bench_size(args.work, layers, args.variant, args.tp, args.ep, args.keep)
        results.append(r)
        print(f"  plain runs {', '.join(f'{x:.0f}' for x in r['plain_runs_mb_s'])} MB/s; load average "
              f"{r['load_avg']:.1f}; merge byte-identical: {r['identical']}")
        for what in ("plain", "shard", "merge"):
            print(b.step_line(what, r[what], r["plain"], 6), flush=True)
    print("checks:")
    limit = max(r["layer_w13_bytes"] for r in results) + 512 * 2**20
    for what in ("shard", "merge"):
        shown, spread = b.rss_spread([r[what]["peak_rss"] for r in results])
        print(f"  {what}: peak RSS {shown} MiB; spread {spread:.1%} (<= 10%: "
              f"{'yes' if spread <= 0.10 else 'NO'}); below one layer's w13 + 512 MiB = {limit / 2**20:.0f} MiB: "
              f"{'yes' if max(r[what]['peak_rss'] for r in results) < limit else 'NO'}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
