"""Benchmark every rewriting command through the shared pipeline, beside a plain read + write.

Two modes.

``grid`` (default): on a generated ``wide`` checkpoint (real 2304 x 4608 experts; ``--layers 4``
is ~4.2 GB BF16, 8 layers ~8.4 GB), each command in ``--commands`` for each ``--devices`` x
``--ranks`` combination, each in its own process (``torchrun`` via ``python -m
torch.distributed.run`` for ranks > 1), from a settled page cache:

* ``plain``: a plain read + write of the input's shard files (before and after; the faster counts);
* ``quantize``     BF16 -> mixed (the release's NVFP4 / MXFP8 split);
* ``hf-to-megatron`` mixed -> torch_dist;   ``megatron-to-hf`` torch_dist -> mixed (``--reference``);
* ``dequantize``   mixed -> BF16;            ``hf-to-hf`` mixed -> all MXFP8;
* ``verify``       BF16 against mixed (tensor mode: reads both, writes nothing);
* ``shard``        mixed -> ``--tp 4 --ep 4`` rank folders;  ``shard-merge`` those folders -> HF;
* ``lora-merge``   mixed + a rank-32 adapter (``make-fixture --lora``, ``lora export``) -> mixed.

The first five run by default; ``--commands`` picks others (``all``: every one).

Per step: seconds, MB/s (bytes read + written per second, 1 MB = 10^6 B; "plain" counts its
read and its write alike), share of plain (and "running": the same bytes over the slowest rank's
time in its executor, leaving out process start, planning and exit), peak RSS (largest process), peak GPU memory (from
the command's closing line), and whether the output's bytes equal the first combination's
(``--no-check-bytes`` skips the hashing).

``full-layer``: one full-size layer (``make-fixture --size wide --layers 1 --experts 384``,
~24 GB BF16) through quantize -> hf-to-megatron -> megatron-to-hf -> dequantize on one device
(and hf-to-hf: the quantized layer -> all MXFP8),
time and peak memory per step, intermediates deleted as soon as the next step has read them
(peak disk ~3 x 24 GB), and the release's time extrapolated: each step is one process for the
whole release, so 48 x its executor's time plus its fixed cost (imports, CUDA, planning,
publishing, exit) once; every layer is treated as this NVFP4 one, the embeddings are not in the
fixture (48 x the wall time is printed beside it).

``--save-rates`` records each command's MB/s per device (and ranks) in
``~/.cache/inkling-ckpt/rates.json``; ``--dry-run`` of the commands turns job bytes into time with it.

Examples:

    python bench/pipeline.py --layers 2 --devices cpu --ranks 1            # a short run (~2 GB)
    python bench/pipeline.py --layers 8 --devices cpu cuda --ranks 1 2 --save-rates --json out.json
    python bench/pipeline.py --mode full-layer --devices cuda --work /scratch/bench
    python bench/pipeline.py --code /path/to/other/checkout --legacy       # the same steps with older code

Disk (grid): the input fixtures (BF16 + mixed) plus one step's output at a time.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import convert as bc  # noqa: E402  (bench/convert.py: make_wide, plain, settle, figures)

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ("quantize", "hf-to-megatron", "megatron-to-hf", "dequantize", "hf-to-hf")
#: Run by ``--commands`` naming them (or ``all``): the other commands on the shared pipeline.
MORE_COMMANDS = ("verify", "shard", "shard-merge", "lora-merge")
#: Commands without ``--device`` / ``--slice-mb`` (they copy stored bytes, decoding nothing).
NO_DEVICE = ("shard", "shard-merge")
GPU_LINE = re.compile(r"peak GPU memory ([0-9.]+) (GB|MB|kB)")


def _code_env(code: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(code) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def profiled(cmd: list[str], profile: str | None, name: str) -> list[str]:
    """``cmd`` under py-spy (sampled stacks of every thread, idle ones included, in its raw
    collapsed format) when ``--profile DIR`` asks for it; py-spy is not a dependency."""
    if not profile:
        return cmd
    Path(profile).mkdir(parents=True, exist_ok=True)
    return ["py-spy", "record", "--subprocesses", "--threads", "--idle", "--nonblocking", "-r", "47", "-f", "raw",
            "-o", str(Path(profile) / f"{name}.txt"), "--", *cmd]


def measured(cmd: list[str], code: Path, *inputs: Path) -> dict:
    """Run one step from a settled page cache, in a wrapper process: wall seconds, peak RSS of the
    largest process of the step (the wrapper's ``RUSAGE_CHILDREN``: torchrun's ranks included),
    peak GPU memory (from the command's closing line) and that line."""
    wrapper = [sys.executable, "-c",
               "import json, resource, subprocess, sys, time\n"
               "t0 = time.perf_counter()\n"
               "p = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE)\n"
               "out, err = p.communicate()\n"
               "ru = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
               "sys.stdout.write(out.decode()); sys.stderr.write(err.decode())\n"
               "print('BENCH ' + json.dumps({'rc': p.returncode, 'rss': ru.ru_maxrss * 1024, 'wall': time.perf_counter() - t0}))\n"
               "sys.exit(p.returncode)\n", *cmd]
    bc.settle(*inputs)
    if WARM:
        warm(*inputs)
    # From inside ``code``: `python -m` puts the working folder first on sys.path, ahead of PYTHONPATH,
    # so run from another checkout's root a step would import that checkout instead.
    p = _run_group(wrapper, env=_code_env(code), cwd=code)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    info = json.loads(p.stdout.rsplit("BENCH ", 1)[1])
    gpu = 0
    m = GPU_LINE.search(p.stdout)
    if m:
        gpu = int(float(m.group(1)) * {"GB": 1e9, "MB": 1e6, "kB": 1e3}[m.group(2)])
    first = next((ln for ln in p.stdout.splitlines() if ln.startswith(("wrote", "resumed"))), "")
    report: dict = {}
    text = p.stdout.rsplit("BENCH ", 1)[0]
    at = text.find("{")
    if at >= 0:  # the command's --json report (rank 0's)
        try:
            report = json.JSONDecoder().raw_decode(text[at:])[0]
        except ValueError:
            pass
    ranks = report.get("ranks", {}).get("each", []) if isinstance(report.get("ranks"), dict) else []
    if ranks:
        gpu = max(gpu, max(r.get("peak_gpu_bytes", 0) for r in ranks))
    return {"seconds": info["wall"], "peak_rss": info["rss"], "peak_gpu": gpu, "line": first, "rank_stats": ranks}


#: ``--warm``: each step's inputs are read into the page cache after settling (the bound with no disk waits).
WARM = False


def warm(*folders: Path) -> None:
    """Read every file of ``folders`` once, so a step that follows finds them in the page cache."""
    buf = bytearray(8 << 20)
    for folder in folders:
        for f in sorted(folder.rglob("*")) if folder.exists() else []:
            if f.is_file():
                with open(f, "rb", buffering=0) as fh:
                    while fh.readinto(buf):
                        pass


def _run_group(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` in a process group of its own that is
    killed whole if this run stops first (an error, Ctrl-C, or a SIGTERM from ``timeout``): the
    wrapper's step must not run on beside the next steps and spoil their timings."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kw)
    try:
        out, err = p.communicate()
    except BaseException:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        raise
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def _term_as_exit(signum, frame) -> None:
    raise SystemExit(128 + signum)


def folder_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))


def tree_digest(p: Path) -> str:
    """sha256 over every file (relative name + contents), files hashed in parallel; the done record under
    ``.cache/`` is left out (it digests the files' times, so it differs from run to run)."""
    files = sorted(f for f in p.rglob("*") if f.is_file() and ".cache" not in f.relative_to(p).parts)

    def one(f: Path) -> str:
        h = hashlib.sha256()
        with open(f, "rb", buffering=0) as fh:
            while chunk := fh.read(16 << 20):
                h.update(chunk)
        return f"{f.relative_to(p)} {h.hexdigest()}"

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        lines = list(pool.map(one, files))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def cli(ranks: int) -> list[str]:
    if ranks <= 1:
        return [sys.executable, "-m", "inkling_ckpt"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
            "-m", "inkling_ckpt"]


def flags(command: str, device: str, args: argparse.Namespace, memory_mb: int = 0) -> list[str]:
    if args.legacy:
        return ["-q"]
    out = ["-q", "--json"]
    if command not in NO_DEVICE:
        out += ["--device", device]
    if memory_mb:
        out += ["--memory-mb", str(memory_mb)]
    if args.slice_mb and command not in NO_DEVICE:
        out += ["--slice-mb", str(args.slice_mb)]
    if args.workers:
        out += ["--workers", str(args.workers)]
    return out


def mixed_plan(layers: int) -> str:
    sys.path.insert(0, str(ROOT))
    from inkling_ckpt.model.presets import preset_plan

    return preset_plan("wide", "mixed", layers)


def step_args(command: str, src: dict[str, Path], out_dir: Path, layers: int,
              shard: str) -> tuple[list[str], list[Path], Path | None]:
    """The command line (after ``inkling_ckpt``) of one step, the folders it reads, and its output
    (None: ``verify``). hf-to-megatron and shard write the inputs of megatron-to-hf and shard-merge."""
    out = out_dir / f"out-{command}"
    if command == "quantize":
        return ["quantize", str(src["bf16"]), str(out), "--plan", mixed_plan(layers), "--max-shard-size", shard], [src["bf16"]], out
    if command == "hf-to-megatron":
        return ["convert", "hf-to-megatron", str(src["mixed"]), str(src["mg"])], [src["mixed"]], src["mg"]
    if command == "megatron-to-hf":
        return (["convert", "megatron-to-hf", str(src["mg"]), str(out), "--reference", str(src["mixed"]),
                 "--max-shard-size", shard], [src["mg"], src["mixed"]], out)
    if command == "dequantize":
        return ["dequantize", str(src["mixed"]), str(out), "--max-shard-size", shard], [src["mixed"]], out
    if command == "hf-to-hf":
        return (["convert", "hf-to-hf", str(src["mixed"]), str(out), "--plan", "mxfp8", "--max-shard-size", shard],
                [src["mixed"]], out)
    if command == "verify":
        return ["verify", str(src["bf16"]), str(src["mixed"])], [src["bf16"], src["mixed"]], None
    if command == "shard":
        return (["shard", str(src["mixed"]), str(src["sharded"]), "--tp", "4", "--ep", "4", "--max-shard-size", shard],
                [src["mixed"]], src["sharded"])
    if command == "shard-merge":
        return ["shard", "--merge", str(src["sharded"]), str(out)], [src["sharded"]], out
    if command == "lora-merge":
        return ["lora", "merge", str(src["mixed"]), str(src["adapter"]), str(out)], [src["mixed"], src["adapter"]], out
    raise SystemExit(f"unknown command {command}")


def prepare_inputs(args: argparse.Namespace, src: dict[str, Path], code: Path, extra: list[str]) -> None:
    """The inputs a step needs that an earlier step of this run does not write: the torch_dist copy
    (megatron-to-hf), the rank folders (shard-merge), the adapter (lora-merge)."""
    env = _code_env(code)

    def made(cmd: list[str], what: Path) -> None:
        if not what.exists():
            subprocess.run(cli(1) + cmd + ["-q"], check=True, env=env, cwd=code)

    for needs, step in (("megatron-to-hf", "hf-to-megatron"), ("shard-merge", "shard")):
        if needs in args.commands and step not in args.commands:  # the step's own command line
            cmd, _, out = step_args(step, src, src["bf16"].parent, args.layers, args.max_shard_size)  # out: its kept folder
            made(cmd, out)
    if "lora-merge" in args.commands and not src["adapter"].exists():
        dump = src["adapter"].with_name(src["adapter"].name + "-dump")
        made(["make-fixture", str(dump), "--lora", "--lora-rank", "32", "--size", "wide", "--layers", str(args.layers),
              *extra], dump)
        made(["lora", "export", str(dump), str(src["adapter"]), "--config", str(src["mixed"])], src["adapter"])
        shutil.rmtree(dump, ignore_errors=True)


def input_bytes(folders: list[Path]) -> int:
    return sum(folder_bytes(f) for f in folders)


def plain_fig(src: Path, work: Path) -> dict:
    wall, _, rss = bc.plain_measured(src, work)
    n = bc.shard_bytes(src)
    return {"seconds": wall, "bytes": 2 * n, "mb_s": 2 * n / wall / 1e6, "peak_rss": rss}


def gpu_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    except Exception:  # noqa: BLE001 - a description only
        return "unknown"


def grid(args: argparse.Namespace) -> dict:
    work = Path(args.work).resolve()  # steps run from inside --code
    work.mkdir(parents=True, exist_ok=True)
    code = Path(args.code).resolve()
    tag = f"wide-{args.layers}L" + (f"-{args.experts}e" if args.experts else "")
    extra = ["--experts", str(args.experts)] if args.experts else []
    src = {k: work / f"{tag}-{k}" for k in ("bf16", "mixed", "mg", "sharded", "adapter")}
    outs = Path(args.out).resolve() if args.out else work
    outs.mkdir(parents=True, exist_ok=True)
    bc.make_wide(src["bf16"], "bf16", args.layers, *extra)
    bc.make_wide(src["mixed"], "mixed", args.layers, *extra)
    prepare_inputs(args, src, code, extra)
    res: dict = {"mode": "grid", "layers": args.layers, "experts": args.experts, "cores": os.cpu_count(),
                 "gpu": gpu_name(), "fixture_bytes": {k: folder_bytes(v) for k, v in src.items() if v.exists()},
                 "steps": []}
    # --plain-mb-s: a later run on the same machine and fixture compares with an earlier run's baseline
    before = ({"seconds": 0.0, "bytes": 0, "mb_s": args.plain_mb_s, "peak_rss": 0} if args.plain_mb_s
              else plain_fig(src["bf16"], work))
    print(f"plain read + write of {res['fixture_bytes']['bf16'] / 1e9:.2f} GB: {before['seconds']:.1f} s = "
          f"{before['mb_s']:.0f} MB/s (read + write)", flush=True)
    digests: dict[str, str] = {}
    combos = [(d, r, mb) for d in args.devices for r in args.ranks for mb in args.memory_mb]
    for device, ranks, memory_mb in combos:
        for command in args.commands:
            if command in NO_DEVICE and device != args.devices[0]:
                continue  # it runs on the CPU whatever --devices says: once per rank count and budget
            cmd_args, inputs, out = step_args(command, src, outs, args.layers, args.max_shard_size)
            if out is not None:
                for p in (out, out.parent / f".{out.name}.inkling-partial"):
                    shutil.rmtree(p, ignore_errors=True)
                for p in out.parent.glob(f".{out.name}.inkling-done.json"):
                    p.unlink()
            label = f"{command}-{device}-x{ranks}" + (f"-{memory_mb}mb" if memory_mb else "")
            m = measured(profiled(cli(ranks) + cmd_args + flags(command, device, args, memory_mb), args.profile, label),
                         code, *inputs)
            nread = input_bytes(inputs if command != "megatron-to-hf" else [src["mg"]])
            nwritten = folder_bytes(out) if out is not None else 0
            m.update({"command": command, "device": "cpu" if command in NO_DEVICE else device, "ranks": ranks, "memory_mb": memory_mb, "bytes_read": nread,
                      "bytes_written": nwritten, "mb_s": (nread + nwritten) / m["seconds"] / 1e6})
            m["share_of_plain"] = m["mb_s"] / before["mb_s"]
            running_figures(m, nread + nwritten, before["mb_s"])
            if args.check_bytes and out is not None:
                d = tree_digest(out / "release" if command == "hf-to-megatron" else out)
                m["same_bytes_as_first"] = digests.setdefault(command, d) == d
                m["digest"] = d  # compare across runs (another checkout, another machine)
            res["steps"].append(m)
            write_json(res, args, partial=True)
            print(f"  {command:15s} {m['device']:4s} x{ranks}" + (f" {memory_mb} MiB" if memory_mb else "")
                  + f": {m['seconds']:7.1f} s  {m['mb_s']:7.0f} MB/s  "
                  f"{m['share_of_plain']:4.0%} of plain" + running_text(m)
                  + f"  peak RSS {m['peak_rss'] / 2**20:6.0f} MiB  "
                  f"peak GPU {m['peak_gpu'] / 2**20:6.0f} MiB"
                  + ("" if "same_bytes_as_first" not in m else f"  bytes {'same' if m['same_bytes_as_first'] else 'DIFFER'}")
                  + "".join(f"  [r{r['rank']}: waited {r.get('wait_seconds', 0):.1f} s, sink {r.get('sink_seconds', 0):.1f} s"
                            f" of {r['seconds']:.1f} s"
                            + (f"; RSS at start {r['start_rss_bytes'] / 2**20:.0f} MiB, budget "
                               f"{r.get('budget_bytes', 0) / 2**20:.0f} MiB, {r['most_in_flight']} in flight"
                               + (f", held by RSS {r['rss_holds']}x" if r.get("rss_holds") else "")
                               + (f", read ahead {r['read_ahead_bytes'] / 1e6:.0f} MB, {r.get('read_ahead_units', 0)}"
                                  f" of {r['units']} units ready" if r.get("read_ahead_bytes") else "")
                               if "start_rss_bytes" in r else "") + "]" for r in m["rank_stats"]),
                  flush=True)
            if out is not None and out not in (src["mg"], src["sharded"]):
                shutil.rmtree(out, ignore_errors=True)
    after = before if args.plain_mb_s else plain_fig(src["bf16"], work)
    res["plain"] = max(before, after, key=lambda f: f["mb_s"])
    res["plain_runs_mb_s"] = [before["mb_s"], after["mb_s"]]
    for m in res["steps"]:
        m["share_of_plain"] = m["mb_s"] / res["plain"]["mb_s"]
    res["rank_speedups"] = rank_speedups(res["steps"])
    for r in res["rank_speedups"]:
        print(f"  {r['command']:15s} {r['device']:4s} x{r['ranks']}: executor {r['one_rank_seconds']:.1f} -> "
              f"{r['seconds']:.1f} s = {r['speedup']:.2f}x one rank running (wall {r['wall_speedup']:.2f}x)", flush=True)
    if not args.keep:
        for p in src.values():
            shutil.rmtree(p, ignore_errors=True)
    return res


def executor_seconds(step: dict) -> float:
    """The slowest rank's time in its executor (from its first units), 0 when the step reports none."""
    return max((r["seconds"] for r in step["rank_stats"]), default=0.0)


def running_figures(step: dict, nbytes: int, plain_mb_s: float) -> float:
    """Add the step's share of plain once running and its fixed cost; returns its executor time (0: none).

    Running: the same bytes over the slowest rank's time in its executor, without process start
    (imports), planning and exit, which a 394 GB job does not notice. Fixed: what the wall time holds
    besides the executor (imports, CUDA, planning, publishing, exit); it does not depend on the disk,
    so it compares across machines that run at other rates.
    """
    busy = executor_seconds(step)
    step["steady_share_of_plain"] = nbytes / busy / 1e6 / plain_mb_s if busy else None
    step["fixed_seconds"] = step["seconds"] - busy if busy else None
    return busy


def running_text(step: dict) -> str:
    """`` (N % running, fixed S s)`` for a step with executor figures, else nothing."""
    if not step.get("steady_share_of_plain"):
        return ""
    return f" ({step['steady_share_of_plain']:4.0%} running, fixed {step['fixed_seconds']:.1f} s)"


def rank_speedups(steps: list[dict]) -> list[dict]:
    """For each step run with several ranks, its slowest rank's executor time against the same
    command's with one rank (same device and budget): the speed-up once running, beside the wall
    time's (which carries torchrun's and every rank's start)."""
    busy = executor_seconds
    one = {(m["command"], m["device"], m.get("memory_mb", 0)): m for m in steps if m["ranks"] == 1}
    out = []
    for m in steps:
        base = one.get((m["command"], m["device"], m.get("memory_mb", 0)))
        if m["ranks"] > 1 and base is not None and busy(m) and busy(base):
            out.append({"command": m["command"], "device": m["device"], "ranks": m["ranks"],
                        "one_rank_seconds": busy(base), "seconds": busy(m), "speedup": busy(base) / busy(m),
                        "wall_speedup": base["seconds"] / m["seconds"]})
    return out


def layer_steps(work: Path, bf16: Path, shard: str) -> list[tuple[str, list[str], list[Path], Path]]:
    """The full-layer chain: (command, its command line after ``inkling_ckpt``, the folders it reads,
    its output), each step reading the one before's output."""
    q, mg, back, deq = work / "layer-q", work / "layer-mg", work / "layer-back", work / "layer-deq"
    mx = work / "layer-mx"
    return [("quantize", ["quantize", str(bf16), str(q), "--plan", "nvfp4", "--max-shard-size", shard], [bf16], q),
            ("hf-to-megatron", ["convert", "hf-to-megatron", str(q), str(mg)], [q], mg),
            ("megatron-to-hf", ["convert", "megatron-to-hf", str(mg), str(back), "--reference", str(q),
                                "--max-shard-size", shard], [mg], back),
            ("hf-to-hf", ["convert", "hf-to-hf", str(q), str(mx), "--plan", "mxfp8", "--max-shard-size", shard], [q], mx),
            ("dequantize", ["dequantize", str(back), str(deq), "--max-shard-size", shard], [back], deq)]


def full_layer(args: argparse.Namespace) -> dict:
    work = Path(args.work).resolve()  # steps run from inside --code
    work.mkdir(parents=True, exist_ok=True)
    code = Path(args.code).resolve()
    device = args.devices[0]
    experts = args.experts or 384
    bf16 = work / f"layer-{experts}e-bf16"
    bc.make_wide(bf16, "bf16", 1, "--experts", str(experts))
    res: dict = {"mode": "full-layer", "experts": experts, "device": device, "cores": os.cpu_count(),
                 "gpu": gpu_name(), "fixture_bytes": folder_bytes(bf16), "steps": []}
    res["plain"] = plain_fig(bf16, work)
    print(f"plain read + write of {res['fixture_bytes'] / 1e9:.1f} GB: {res['plain']['mb_s']:.0f} MB/s", flush=True)
    plan = layer_steps(work, bf16, args.max_shard_size)
    for i, (name, cmd_args, inputs, out) in enumerate(plan):
        m = measured(profiled(cli(1) + cmd_args + flags(name, device, args), args.profile, f"layer-{name}-{device}"),
                     code, *inputs)
        nread, nwritten = input_bytes(inputs), folder_bytes(out)
        m.update({"command": name, "bytes_read": nread, "bytes_written": nwritten,
                  "mb_s": (nread + nwritten) / m["seconds"] / 1e6})
        m["share_of_plain"] = m["mb_s"] / res["plain"]["mb_s"]
        busy = running_figures(m, nread + nwritten, res["plain"]["mb_s"])
        # The release is one process per step, not 48: its executor runs 48 layers, its fixed cost
        # (imports, CUDA, planning, publishing, exit) is paid once.
        m["release_seconds"] = 48 * busy + m["fixed_seconds"] if busy else 48 * m["seconds"]
        res["steps"].append(m)
        write_json(res, args, partial=True)
        print(f"  {name:15s} {m['seconds']:7.1f} s  {m['mb_s']:7.0f} MB/s  {m['share_of_plain']:4.0%} of plain"
              + running_text(m) + f"  peak RSS {m['peak_rss'] / 2**20:6.0f} MiB  peak GPU {m['peak_gpu'] / 2**20:6.0f} MiB", flush=True)
        # Free the disk: an input no later step reads goes now (the GPU machine has 64 GB).
        # (what a later step names on its command line counts too: megatron-to-hf's --reference)
        later = {p for _, a, ins, _ in plan[i + 1:] for p in [*ins, *map(Path, a)]}
        for p in inputs:
            if p not in later and (p != bf16 or not args.keep):
                shutil.rmtree(p, ignore_errors=True)
    for _, _, _, out in plan:  # the outputs no later step read (the last ones)
        shutil.rmtree(out, ignore_errors=True)
    total = sum(m["seconds"] for m in res["steps"])
    release = sum(m["release_seconds"] for m in res["steps"])
    res["layer_seconds"] = total
    res["release_seconds_extrapolated"] = release
    res["release_seconds_48x_wall"] = total * 48
    print(f"one layer, {len(res['steps'])} steps: {total:.0f} s; the release (48 layers) extrapolated: "
          f"{release / 60:.0f} min (48 x the executor's time + each step's fixed cost once; 48 x the wall time: "
          f"{total * 48 / 60:.0f} min)", flush=True)
    return res


def write_json(res: dict, args: argparse.Namespace, *, partial: bool) -> None:
    """``--json`` rewritten after every step (``"partial": true`` until the end): a run cut by a
    time limit still leaves the steps it finished."""
    if args.json:
        Path(args.json).write_text(json.dumps({**res, "partial": partial}, indent=2) + "\n")


def save(res: dict, args: argparse.Namespace) -> None:
    write_json(res, args, partial=False)
    if args.save_rates and res["mode"] == "grid":
        sys.path.insert(0, str(ROOT))
        from inkling_ckpt.pipeline.estimate import rate_key, save_rates

        rates: dict[str, dict[str, float]] = {}
        for m in res["steps"]:
            rates.setdefault(m["command"], {})[rate_key(m["device"], m["ranks"])] = m["mb_s"]
        path = save_rates(rates, res["plain"]["mb_s"], f"{res['cores']} cores, {res['gpu']}")
        print(f"rates saved to {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 2)[2],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=("grid", "full-layer"), default="grid",
                    help="grid: every command x device x ranks on a wide fixture; full-layer: one 384-expert layer "
                         "through the four steps, release time extrapolated")
    ap.add_argument("--work", default="bench-work", help="folder for fixtures and outputs (default ./bench-work)")
    ap.add_argument("--out", default=None,
                    help="grid: folder for the steps' outputs instead of --work (another disk, or a tmpfs such as "
                         "/dev/shm: whether sharing one disk between the inputs' reads and the outputs' writeback "
                         "is what a step waits on); torch_dist and rank folders other steps read stay in --work")
    ap.add_argument("--layers", type=int, default=4, help="grid: layers of the wide fixture (4 ~ 4.2 GB BF16, 8 ~ 8.4 GB)")
    ap.add_argument("--experts", type=int, default=0, help="experts per layer (grid: the wide default; full-layer: 384)")
    ap.add_argument("--commands", nargs="+", choices=(*COMMANDS, *MORE_COMMANDS, "all"), default=list(COMMANDS),
                    help="grid: commands to run, in this order (all: every one)")
    ap.add_argument("--devices", nargs="+", choices=("cpu", "cuda"), default=["cpu"],
                    help="--device values to run (full-layer: the first)")
    ap.add_argument("--ranks", nargs="+", type=int, default=[1], help="grid: ranks (torchrun --nproc_per_node)")
    ap.add_argument("--slice-mb", type=int, default=0, help="pass --slice-mb (0: the commands' default)")
    ap.add_argument("--workers", type=int, default=0, help="pass --workers (0: the commands' default)")
    ap.add_argument("--memory-mb", type=int, nargs="+", default=[0],
                    help="grid: --memory-mb values to run each combination with (0: the commands' default)")
    ap.add_argument("--max-shard-size", default="2GB", help="output shard size of the HF-writing steps")
    ap.add_argument("--no-check-bytes", dest="check_bytes", action="store_false",
                    help="grid: skip hashing each output to compare it with the first combination's")
    ap.add_argument("--save-rates", action="store_true",
                    help="record the measured MB/s per command and device for --dry-run estimates")
    ap.add_argument("--code", default=str(ROOT), help="checkout whose inkling_ckpt runs the steps (default: this one)")
    ap.add_argument("--legacy", action="store_true", help="the checkout predates --device/--slice-mb/--workers: pass none")
    ap.add_argument("--keep", action="store_true", help="keep the generated fixtures for the next run")
    ap.add_argument("--plain-mb-s", type=float, default=0.0,
                    help="grid: take this plain read + write rate (MB/s, an earlier run's on the same machine and "
                         "fixture) instead of measuring it before and after the steps")
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--profile", metavar="DIR",
                    help="run each step under py-spy (pip install py-spy), sampled stacks of every thread into DIR; "
                         "the sampling slows the steps a little")
    ap.add_argument("--warm", action="store_true",
                    help="read each step's inputs into the page cache before it starts (default: every step reads "
                         "them from disk, as a real run does): what the steps would take with no disk waits")
    args = ap.parse_args()
    global WARM
    WARM = args.warm
    signal.signal(signal.SIGTERM, _term_as_exit)  # unwinds through _run_group, which kills the step
    if "all" in args.commands:
        args.commands = [*COMMANDS, *MORE_COMMANDS]
    res = grid(args) if args.mode == "grid" else full_layer(args)
    save(res, args)


if __name__ == "__main__":
    main()
