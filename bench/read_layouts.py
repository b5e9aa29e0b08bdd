"""Benchmark the read-only commands on every layout: ``inspect`` and ``verify`` on torch_dist and sharded.

For each size it makes a ``wide`` mixed fixture (real 2304 x 4608 expert matrices; layers 0..n/2-1
NVFP4, the rest MXFP8), converts it with ``convert hf-to-megatron`` and shards it with
``shard --tp 2 --ep 2``, then measures in its own process each:

* ``inspect`` on the HF, torch_dist and sharded folders (headers / metadata only);
* ``verify HF torch_dist`` and ``verify sharded torch_dist`` (every tensor decoded and compared);
* ``verify --forward HF HF`` (both sides streamed through transformers' model one layer at a
  time; skipped without the ``forward`` extra).

It reports wall time, MB/s (bytes of the torch_dist side compared / wall time; 1 MB = 10^6 B) and
peak RSS (the child's ``ru_maxrss``). Memory must not grow with the checkpoint: the peak RSS of
every command at two sizes stays within 10% (plus a fixed 64 MiB) of each other. ``verify
--forward`` holds one decoder layer of one side (plus one converted tensor): ``--experts 4`` keeps
that layer small beside the interpreter's own few hundred MiB.

    python bench/read_layouts.py                 # 1 and 2 layers under ./bench-work
    python bench/read_layouts.py --layers 1 2 --json out.json
    python bench/read_layouts.py --variant nvfp4   # every layer in one format
    python bench/read_layouts.py --experts 4       # smaller layers (quicker on a 2-core machine)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def has_forward() -> bool:
    """Whether transformers with the Inkling 2 model (the 'forward' extra) is importable."""
    code = "from inkling_ckpt.verify.forward import load_transformers; load_transformers()"
    return subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True).returncode == 0


def bench(work: Path, layers: int, variant: str = "mixed", experts: int | None = None,
          forward: bool = True) -> dict[str, object]:
    d = work / f"L{layers}"
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    hf, mg, sh = d / "hf", d / "mg", d / "sh"
    more = ["--experts", str(experts)] if experts else []
    subprocess.run([sys.executable, "-m", "inkling_ckpt", "make-fixture", str(hf), "--size", "wide", "--variant",
                    variant, "--layers", str(layers), "--max-shard-size", "2GB", "-q", *more], env=_env(), check=True)
    subprocess.run([sys.executable, "-m", "inkling_ckpt", "convert", "hf-to-megatron", str(hf), str(mg), "-q"],
                   env=_env(), check=True)
    subprocess.run([sys.executable, "-m", "inkling_ckpt", "shard", str(hf), str(sh), "--tp", "2", "--ep", "2", "-q"],
                   env=_env(), check=True)
    mg_bytes = sum(p.stat().st_size for p in mg.rglob("*.distcp"))
    hf_bytes = sum(p.stat().st_size for p in hf.glob("*.safetensors"))
    out: dict[str, object] = {"layers": layers, "variant": variant, "torch_dist_bytes": mg_bytes}
    runs: list[tuple[str, tuple[str, ...]]] = [
        ("inspect hf", ("inspect", str(hf))), ("inspect torch_dist", ("inspect", str(mg))),
        ("inspect sharded", ("inspect", str(sh))),
        ("verify hf torch_dist", ("verify", str(hf), str(mg), "-q")),
        ("verify sharded torch_dist", ("verify", str(sh), str(mg), "-q"))]
    if forward:
        runs.append(("verify --forward hf hf", ("verify", str(hf), str(hf), "--forward", "--random", "16", "-q")))
    for name, args in runs:
        r = measure(args)
        if name.startswith("verify --forward"):
            r["mb_per_s"] = 2 * hf_bytes / 1e6 / r["seconds"]  # both sides read
        elif name.startswith("verify"):
            r["mb_per_s"] = mg_bytes / 1e6 / r["seconds"]
        out[name] = r
        print(f"L{layers} {name:<28} {r['seconds']:7.1f} s  peak RSS {r['peak_rss_mib']:7.0f} MiB"
              + (f"  {r['mb_per_s']:.0f} MB/s" if "mb_per_s" in r else ""), flush=True)
    shutil.rmtree(d)
    return out


def measure(args: tuple[str, ...]) -> dict[str, float]:
    """Wall time and peak RSS of one CLI call, measured inside a wrapper process of its own."""
    code = ("import resource, subprocess, sys, time, json;"
            "t = time.perf_counter();"
            f"p = subprocess.run([sys.executable, '-m', 'inkling_ckpt', *{list(args)!r}], capture_output=True, text=True);"
            "w = time.perf_counter() - t;"
            "sys.stderr.write(p.stderr[-400:]) if p.returncode else None;"
            "print(json.dumps({'rc': p.returncode, 'seconds': w,"
            " 'peak_rss_mib': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))")
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr)
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    if r.pop("rc"):
        raise SystemExit(f"{' '.join(args)} failed: {proc.stderr.strip()}")
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--variant", default="mixed", help="mixed, nvfp4, mxfp8 or bf16 (same format per layer: "
                    "the fairest memory-growth check)")
    ap.add_argument("--experts", type=int, help="routed experts per layer (default: the wide fixture's)")
    ap.add_argument("--work", type=Path, default=Path("bench-work"))
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    forward = has_forward()
    if not forward:
        print("verify --forward skipped: transformers 5.24 (the 'forward' extra) is not installed", flush=True)
    results = [bench(a.work, n, a.variant, a.experts, forward) for n in a.layers]
    if len(results) >= 2:
        lo, hi = results[0], results[-1]
        for k in [k for k in lo if k.startswith(("inspect", "verify"))]:
            x, y = lo[k]["peak_rss_mib"], hi[k]["peak_rss_mib"]  # type: ignore[index]
            ok = y <= 1.1 * x + 64
            print(f"{k}: peak RSS {x:.0f} -> {y:.0f} MiB from {lo['layers']} to {hi['layers']} layers: "
                  + ("bounded" if ok else "GROWS"))
    if a.json:
        a.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
