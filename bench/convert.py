"""Benchmark ``convert hf-to-megatron`` (and back) on generated ``wide`` checkpoints.

For each size it writes a BF16 ``wide`` fixture (real 2304 x 4608 expert matrices; 4 layers
is about 4.2 GB, 8 layers twice that), then measures, each in its own process:

* ``plain``: a plain read + write of the fixture's shard files (64 MiB blocks, fsync per file)
  — the baseline: what the disk and page cache give without any conversion work; run before
  and after the conversions, the faster of the two counts;
* ``hf-to-megatron``: the conversion to torch_dist;
* ``megatron-to-hf``: the way back into the fixture's precision (for BF16 no encoding work
  either way; ``--variant mixed`` measures the decode and encode paths instead).

Every step starts settled (``sync``, and the step's input files dropped from the page cache),
so each reads from disk and none pays for another's writeback. It reports wall time, MB/s (output bytes / wall time; 1 MB = 10^6 B), peak RSS (the child's
``ru_maxrss``) and the acceptance checks: peak RSS of the two sizes within 10% of each other
and below 3 x the largest tensor + 512 MiB; conversion throughput >= 80% of the plain copy (issue 8).

    python bench/convert.py                     # 4 and 8 layers under ./bench-work
    python bench/convert.py --layers 1 2        # a quick run
    python bench/convert.py --json out.json

Disk: about 4 x the largest fixture at a time (fixture, copy or output); each is removed
after use unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 64 * 2**20


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def settle(*folders: Path) -> None:
    """Same start for every step: no dirty pages in flight, our files out of the page cache.

    ``sync`` flushes what earlier steps wrote (otherwise their writeback throttles the next
    step); ``POSIX_FADV_DONTNEED`` on our own files makes every step read its input from disk,
    as a real 400 GB conversion does, without touching anybody else's cache.
    """
    os.sync()
    for folder in folders:
        for f in folder.rglob("*") if folder.exists() else []:
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def run_measured_cpu(cmd: list[str], *inputs: Path) -> tuple[float, float, int]:
    """Run ``cmd`` from a settled state; (wall seconds, the child's CPU seconds (user + system),
    peak RSS bytes of that process). CPU time is stretched far less than wall time by a loaded
    shared machine."""
    settle(*inputs)
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    out, err = p.stdout.read().decode(), p.stderr.read().decode()  # type: ignore[union-attr]
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{out}\n{err}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss * 1024


def run_measured(cmd: list[str], *inputs: Path) -> tuple[float, int]:
    """Run ``cmd`` from a settled state; (wall seconds, peak RSS bytes of that process)."""
    wall, _, rss = run_measured_cpu(cmd, *inputs)
    return wall, rss


def figures(wall: float, rss: int, nbytes: int, **extra) -> dict:
    """One step's figures: seconds, bytes, MB/s (1 MB = 10^6 B), peak RSS (and ``extra``)."""
    return {"seconds": wall, "bytes": nbytes, "mb_s": nbytes / wall / 1e6, "peak_rss": rss, **extra}


def shard_bytes(folder: Path) -> int:
    """Bytes of a folder's ``*.safetensors`` files (what :func:`plain_copy` copies)."""
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def make_wide(fixture: Path, variant: str, layers: int, *extra: str) -> None:
    """Generate the ``wide`` fixture ``fixture`` with make-fixture, unless it exists."""
    if fixture.exists():
        return
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "inkling_ckpt", "make-fixture", str(fixture), "--size", "wide", "--variant",
                    variant, "--layers", str(layers), *extra, "--max-shard-size", "2GB", "-q"], check=True, env=_env())
    print(f"  generated {fixture.name} in {time.perf_counter() - t0:.0f} s", flush=True)


def plain_measured(src: Path, work: Path) -> tuple[float, float, int]:
    """The baseline, in its own process: :func:`plain_copy` of ``src`` into ``work``/plain-copy
    (removed after); (wall seconds, CPU seconds, peak RSS bytes)."""
    copy = work / "plain-copy"
    m = run_measured_cpu([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                          f"import convert as b; b.plain_copy({str(src)!r}, {str(copy)!r})"], src)
    shutil.rmtree(copy)
    return m


def plain(src: Path, work: Path) -> dict:
    """:func:`figures` of the baseline copy of ``src``'s shard files."""
    wall, _, rss = plain_measured(src, work)
    return figures(wall, rss, shard_bytes(src))


def best_plain(res: dict, before: dict, after: dict) -> None:
    """Record the baseline: the faster of a plain copy before and after the measured steps (the
    page cache and writeback of a shared machine vary; the faster one is the stricter yardstick)."""
    res["plain"] = max(before, after, key=lambda m: m["mb_s"])
    res["plain_runs_mb_s"] = [before["mb_s"], after["mb_s"]]
    res["load_avg"] = os.getloadavg()[0]


def plain_copy(src: str, dst: str) -> None:
    """The baseline: copy every file of ``src`` into ``dst`` with plain reads and writes."""
    os.makedirs(dst, exist_ok=True)
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    for name in sorted(os.listdir(src)):
        if not name.endswith(".safetensors"):
            continue
        with open(os.path.join(src, name), "rb", buffering=0) as fi, open(os.path.join(dst, name), "wb", buffering=0) as fo:
            while True:
                n = fi.readinto(buf)
                if not n:
                    break
                fo.write(view[:n])
            os.fsync(fo.fileno())


def folder_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def largest_tensor(fixture: Path) -> int:
    sys.path.insert(0, str(ROOT))
    from inkling_ckpt.layouts.hf import HFCheckpoint

    return max(t.nbytes for t in HFCheckpoint.open(fixture).tensors.values())


def step_line(what: str, m: dict, plain: dict, width: int) -> str:
    """One printed row of a step's :func:`figures`, beside the baseline ``plain``."""
    return (f"  {what:{width}s} {m['bytes'] / 1e9:6.2f} GB in {m['seconds']:6.1f} s = {m['mb_s']:7.1f} MB/s "
            f"({m['mb_s'] / plain['mb_s']:4.0%} of plain)  peak RSS {m['peak_rss'] / 2**20:7.1f} MiB")


def rss_spread(peaks: list[int]) -> tuple[str, float]:
    """Peak RSS figures in MiB (as printed) and their spread (max / min - 1)."""
    return ", ".join(f"{p / 2**20:.0f}" for p in peaks), max(peaks) / min(peaks) - 1


def bench_size(work: Path, layers: int, keep: bool, variant: str = "bf16") -> dict:
    cli = [sys.executable, "-m", "inkling_ckpt"]
    fixture = work / f"wide-{variant}-{layers}L"
    make_wide(fixture, variant, layers)
    src_bytes = shard_bytes(fixture)
    res: dict = {"layers": layers, "variant": variant, "fixture_bytes": src_bytes, "largest_tensor": largest_tensor(fixture)}
    before = plain(fixture, work)

    mg = work / "mg"
    wall, rss = run_measured(cli + ["convert", "hf-to-megatron", str(fixture), str(mg), "-q"], fixture)
    out_bytes = folder_bytes(mg / "release")
    res["hf-to-megatron"] = figures(wall, rss, out_bytes)

    back = work / "back"
    # Back into the fixture's own precision (BF16: no encoding; mixed: NVFP4/MXFP8 encode, scales kept).
    wall, rss = run_measured(cli + ["convert", "megatron-to-hf", str(mg), str(back), "--reference", str(fixture),
                                    "--max-shard-size", "2GB", "-q"], fixture, mg)
    res["megatron-to-hf"] = figures(wall, rss, shard_bytes(back))
    same = subprocess.run(["cmp", "-s", *sorted(str(p) for p in fixture.glob("*.safetensors"))[:1],
                           *sorted(str(p) for p in back.glob("*.safetensors"))[:1]]).returncode == 0
    res["round_trip_first_shard_identical"] = same
    shutil.rmtree(mg)
    shutil.rmtree(back)
    best_plain(res, before, plain(fixture, work))
    if not keep:
        shutil.rmtree(fixture)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=ROOT / "bench-work", help="scratch folder (needs ~4x the largest fixture)")
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8], help="fixture sizes in layers (4 = ~4.2 GB)")
    ap.add_argument("--keep", action="store_true", help="keep the generated fixtures")
    ap.add_argument("--variant", default="bf16", choices=["bf16", "mixed", "mxfp8"],
                    help="fixture precision: bf16 (I/O bound) or a quantized one (decode/encode bound)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    results = []
    for layers in args.layers:
        print(f"wide {args.variant}, {layers} layers:", flush=True)
        r = bench_size(args.work, layers, args.keep, args.variant)
        results.append(r)
        print(f"  plain runs {', '.join(f'{x:.0f}' for x in r['plain_runs_mb_s'])} MB/s; load average {r['load_avg']:.1f}")
        for what in ("plain", "hf-to-megatron", "megatron-to-hf"):
            print(step_line(what, r[what], r["plain"], 15), flush=True)
    print("checks:")
    limit = 3 * max(r["largest_tensor"] for r in results) + 512 * 2**20
    for what in ("hf-to-megatron", "megatron-to-hf"):
        peaks = [r[what]["peak_rss"] for r in results]
        shown, spread = rss_spread(peaks)
        print(f"  {what}: peak RSS {shown} MiB; spread {spread:.1%} (<= 10%: "
              f"{'yes' if spread <= 0.10 else 'NO'}); below 3 x largest tensor + 512 MiB = {limit / 2**20:.0f} MiB: "
              f"{'yes' if max(peaks) < limit else 'NO'}")
        ratios = [r[what]["mb_s"] / r["plain"]["mb_s"] for r in results]
        print(f"  {what}: throughput {', '.join(f'{x:.0%}' for x in ratios)} of plain read+write (>= 80%: "
              f"{'yes' if min(ratios) >= 0.8 else 'NO'})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
