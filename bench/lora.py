"""Benchmark ``lora export`` and ``lora merge`` at rank 32 beside a plain read + write of the same bytes.

Inputs are generated here in the real release layout (spec/inkling2.md) with real Inkling 2
Small widths (H 4608, F 2304, 48 heads x 128, d_rel 16; vocabulary cut to 16384 rows so the
unembed does not dominate):

* ``export``: a safetensors dump of the trainer's LoRA factors (Megatron-Bridge names, BF16,
  rank 32) for ``--export-layers`` layers of all 384 experts: the release's per-layer adapter
  size (~175 MB a layer). Output: the engine adapter folder.
* ``merge``: a base checkpoint of ``--merge-layers`` layers with ``--experts`` real-size experts
  each, BF16 and mixed (NVFP4 layer 0, MXFP8 the rest), and a random rank-32 adapter; merged at
  two sizes (1 layer and all) so peak RSS can be compared across checkpoint sizes.

Each step runs in its own process from a settled start (``sync``, inputs dropped from the page
cache; ``bench/convert.py``'s helpers). ``plain``: the same input files read and written in
64 MiB blocks with fsync, run before and after; the faster counts. MB/s = output bytes / wall
time, process start included (1 MB = 10^6 B).

    python bench/lora.py                        # under ./bench-work
    python bench/lora.py --merge-layers 2 --experts 8 --json out.json
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
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

import convert as cb  # noqa: E402  (settle, run_measured, plain_copy)

# torch is imported only by the generator subprocesses: the measuring parent stays small, so a
# measured child's peak RSS (ru_maxrss counts the pages it shares with the parent after fork)
# is its own.

H, F, NH, KV, HD, DREL, V, VU, R = 4608, 2304, 48, 8, 128, 16, 16384, 16000, 32


def config(layers: int, experts: int) -> dict:
    text = {"model_type": "inkling2_text", "hidden_size": H, "num_hidden_layers": layers, "vocab_size": V,
            "unpadded_vocab_size": VU, "num_attention_heads": NH, "num_key_value_heads": KV, "head_dim": HD,
            "swa_num_attention_heads": NH, "swa_num_key_value_heads": KV, "swa_head_dim": HD, "d_rel": DREL,
            "n_routed_experts": experts, "moe_intermediate_size": F, "num_experts_per_tok": 8}
    return {"model_type": "inkling2", "architectures": ["Inkling2ForConditionalGeneration"], "text_config": text}


class _Writer:
    """Stream a planned safetensors file: header first, each tensor (or a row range) at its offset."""

    def __init__(self, path: Path, entries: list):
        from inkling_ckpt.lora.io import _st_header

        self.header, self.offsets, total = _st_header(entries, {"format": "pt"})
        self.fh = open(path, "wb")
        self.fh.write(self.header)
        self.fh.truncate(len(self.header) + total)

    def write(self, name: str, t, at: int = 0) -> None:
        import torch

        self.fh.seek(len(self.header) + self.offsets[name] + at)
        self.fh.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))

    def close(self) -> None:
        self.fh.close()


def make_base(dst: Path, layers: int, experts: int, fmts: list[str]) -> None:
    """A release-layout checkpoint (one shard), generated expert by expert (bounded memory)."""
    import torch

    from inkling_ckpt.formats import get_format

    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(config(layers, experts), indent=1))
    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    dense = {"model.llm.embed.weight": (V, H), "model.llm.norm.weight": (H,), "model.llm.unembed.weight": (V, H)}
    entries = [(n, s, bf) for n, s in dense.items()]
    for i in range(layers):
        L = f"model.llm.layers.{i}."
        for n, s in (("attn.wq_du.weight", (NH * HD, H)), ("attn.wk_dv.weight", (KV * HD, H)), ("attn.wv_dv.weight", (KV * HD, H)),
                     ("attn.wr_du.weight", (NH * DREL, H)), ("attn.wo_ud.weight", (H, NH * HD)), ("attn.gate_attn.weight", (NH * HD, H)),
                     ("attn.attn_sink_proj.weight", (NH, H))):
            entries.append((L + n, s, bf))
        entries.append((L + "mlp.gate.weight", (experts, H), torch.float32))
        for proj, rows, cols in (("w13_weight", 2 * F, H), ("w2_weight", H, F)):
            n = L + "mlp.experts." + proj
            if fmts[i] == "bf16":
                entries.append((n, (experts, rows, cols), bf))
            elif fmts[i] == "mxfp8":
                entries += [(n, (experts, rows, cols), torch.float8_e4m3fn), (n + "_scale", (experts, rows, cols // 32), torch.uint8)]
            else:
                entries += [(n, (experts, rows, cols // 2), torch.uint8), (n + "_scale", (experts, rows, cols // 16), torch.float8_e4m3fn),
                            (n + "_amax", (experts,), torch.float32), (n + "_outer_scale_denominator", (), torch.float32)]
    w = _Writer(dst / "model.safetensors", entries)
    shapes = {n: s for n, s, _ in entries}
    for n, s, d in entries:
        if ".mlp.experts." in n:
            continue
        w.write(n, (torch.randn(*s, generator=g) * 0.02).to(d))
    for i in range(layers):
        for proj in ("w13_weight", "w2_weight"):
            n = f"model.llm.layers.{i}.mlp.experts.{proj}"
            E, rows = shapes[n][0], shapes[n][1]
            cols = H if proj == "w13_weight" else F
            amax = torch.empty(E)
            per = {s: None for s in ("", "_scale")}
            for e in range(E):
                x = (torch.randn(rows, cols, generator=g) * 0.02).to(bf)
                if fmts[i] == "bf16":
                    w.write(n, x, e * x.numel() * 2)
                    continue
                if fmts[i] == "mxfp8":
                    p = get_format("mxfp8").encode(x)
                else:
                    amax[e] = x.float().abs().amax()
                    p = get_format("nvfp4").encode(x, weight_scale_2=amax[e] / torch.tensor(2688.0))
                for s, part in (("", p["weight"]), ("_scale", p["weight_scale"])):
                    per[s] = part.numel() * part.element_size()
                    w.write(n + s, part, e * per[s])
            if fmts[i] == "nvfp4":
                w.write(n + "_amax", amax)
                w.write(n + "_outer_scale_denominator", torch.tensor(2688.0))
    w.close()


def make_dump(path: Path, layers: int, experts: int) -> None:
    """Trainer LoRA factors at rank 32 (Megatron-Bridge names), streamed into one safetensors file."""
    import torch

    from inkling_ckpt.lora.io import _st_header

    path.parent.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(1)
    entries = []
    for i in range(layers):
        L = f"decoder.layers.{i}."
        for k, rows in (("q", NH * HD), ("k", KV * HD), ("v", KV * HD), ("r", NH * DREL)):
            entries += [(L + f"self_attention.linear_qkv.adapter.adapter_{k}.linear_in.weight", (R, H)),
                        (L + f"self_attention.linear_qkv.adapter.adapter_{k}.linear_out.weight", (rows, R))]
        entries += [(L + "self_attention.linear_proj.adapter.linear_in.weight", (R, NH * HD)),
                    (L + "self_attention.linear_proj.adapter.linear_out.weight", (H, R)),
                    (L + "self_attention.linear_gate.adapter.linear_in.weight", (R, H)),
                    (L + "self_attention.linear_gate.adapter.linear_out.weight", (NH * HD, R)),
                    (L + "mlp.experts.linear_fc1.adapter.linear_in.weight", (R, H)),
                    (L + "mlp.experts.linear_fc1.adapter.linear_out.weight", (experts, 2 * F, R)),
                    (L + "mlp.experts.linear_fc2.adapter.linear_in.weight", (experts, R, F)),
                    (L + "mlp.experts.linear_fc2.adapter.linear_out.weight", (H, R))]
    entries += [("output_layer.adapter.linear_in.weight", (R, H)), ("output_layer.adapter.linear_out.weight", (V, R))]
    header, offsets, total = _st_header([(n, s, torch.bfloat16) for n, s in entries], {"format": "pt", "lora_alpha": "32"})
    with open(path, "wb") as fh:
        fh.write(header)
        for _, s in entries:
            fh.write(memoryview((torch.randn(*s, generator=g) * 0.01).to(torch.bfloat16).reshape(-1).view(torch.uint8).numpy()))


def folder_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))


def _figures(wall: float, cpu: float, rss: int, b: int) -> dict:
    return {"seconds": wall, "cpu_seconds": cpu, "bytes": b, "mb_s": b / wall / 1e6, "mb_per_cpu_s": b / cpu / 1e6,
            "peak_rss": rss}


def measure(cmd: list[str], out: Path, *inputs: Path) -> dict:
    wall, cpu, rss = cb.run_measured_cpu(cmd, *inputs)
    b = folder_bytes(out)
    shutil.rmtree(out)
    return _figures(wall, cpu, rss, b)


def plain(src: Path, work: Path) -> dict:
    wall, cpu, rss = cb.plain_measured(src, work)
    return _figures(wall, cpu, rss, cb.shard_bytes(src))


def line(what: str, m: dict, base: dict | None = None) -> str:
    ratio = f" ({m['mb_s'] / base['mb_s']:4.0%} of plain)" if base else ""
    return (f"  {what:24s} {m['bytes'] / 1e9:6.3f} GB in {m['seconds']:6.1f} s = {m['mb_s']:7.1f} MB/s{ratio}  "
            f"CPU {m['cpu_seconds']:6.1f} s ({m['mb_per_cpu_s']:6.0f} MB per CPU-s)  peak RSS {m['peak_rss'] / 2**20:7.1f} MiB")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("gen-base", "gen-dump"):  # generator subprocess
        what, dst, layers, experts = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
        if what == "gen-base":
            make_base(dst, layers, experts, sys.argv[5].split(","))
        else:
            make_dump(dst, layers, experts)
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=ROOT / "bench-work")
    ap.add_argument("--export-layers", type=int, default=4, help="layers of the 384-expert trainer dump")
    ap.add_argument("--merge-layers", type=int, default=2, help="layers of the merge base (also run at 1 layer)")
    ap.add_argument("--experts", type=int, default=8, help="real-size experts per layer of the merge base")
    ap.add_argument("--variants", nargs="+", default=["bf16", "mixed"], choices=["bf16", "mixed"])
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per step (OMP_NUM_THREADS; 1 is steadiest on a shared 2-core box)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    work = args.work / "lora"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cli = [sys.executable, "-m", "inkling_ckpt", "lora"]
    res: dict = {"load_avg_start": os.getloadavg()[0], "cpus": os.cpu_count(), "threads": args.threads}

    def gen(*a) -> None:
        subprocess.run([sys.executable, __file__, *map(str, a)], check=True, env=cb._env())

    # export ---------------------------------------------------------------------------------
    t0 = time.perf_counter()
    dump_dir = work / "dump"
    gen("gen-dump", dump_dir / "adapter.safetensors", args.export_layers, 384)
    (work / "cfg-export.json").write_text(json.dumps(config(args.export_layers, 384)))
    print(f"export: generated a {folder_bytes(dump_dir) / 1e9:.2f} GB trainer dump ({args.export_layers} layers x 384 "
          f"experts, rank {R}) in {time.perf_counter() - t0:.0f} s", flush=True)
    p1 = plain(dump_dir, work)
    ex = measure(cli + ["export", str(dump_dir / "adapter.safetensors"), str(work / "ad-out"), "--config",
                        str(work / "cfg-export.json"), "-q"], work / "ad-out", dump_dir)
    p2 = plain(dump_dir, work)
    pe = max(p1, p2, key=lambda m: m["mb_s"])
    res["export"] = {"plain": pe, "plain_runs_mb_s": [p1["mb_s"], p2["mb_s"]], "export": ex}
    print(line("plain read+write", pe) + f"  (runs {p1['mb_s']:.0f}, {p2['mb_s']:.0f} MB/s)")
    print(line("lora export", ex, pe), flush=True)
    shutil.rmtree(dump_dir)

    # merge ----------------------------------------------------------------------------------
    for variant in args.variants:
        for layers in sorted({1, args.merge_layers}):
            fmts = ["bf16"] * layers if variant == "bf16" else ["nvfp4"] + ["mxfp8"] * (layers - 1)
            base = work / f"base-{variant}-{layers}L"
            t0 = time.perf_counter()
            gen("gen-base", base, layers, args.experts, ",".join(fmts))
            dump = work / "mdump" / "a.safetensors"
            gen("gen-dump", dump, layers, args.experts)
            subprocess.run(cli + ["export", str(dump), str(work / "ad"), "--config", str(base), "-q"], check=True, env=cb._env())
            shutil.rmtree(dump.parent)
            print(f"merge {variant} ({'/'.join(fmts)}), {layers} layer(s) x {args.experts} experts: base "
                  f"{folder_bytes(base) / 1e9:.2f} GB generated in {time.perf_counter() - t0:.0f} s", flush=True)
            q1 = plain(base, work)
            mg = measure(cli + ["merge", str(base), str(work / "ad"), str(work / "merged"), "-q"], work / "merged", base, work / "ad")
            q2 = plain(base, work)
            pm = max(q1, q2, key=lambda m: m["mb_s"])
            res[f"merge-{variant}-{layers}L"] = {"formats": fmts, "plain": pm, "plain_runs_mb_s": [q1["mb_s"], q2["mb_s"]],
                                                 "merge": mg}
            print(line("plain read+write", pm) + f"  (runs {q1['mb_s']:.0f}, {q2['mb_s']:.0f} MB/s)")
            print(line("lora merge", mg, pm), flush=True)
            shutil.rmtree(base)
            shutil.rmtree(work / "ad")
    res["load_avg_end"] = os.getloadavg()[0]
    print(f"load average {res['load_avg_start']:.1f} at start, {res['load_avg_end']:.1f} at end")
    for variant in args.variants:
        peaks = [res[k]["merge"]["peak_rss"] for k in res if k.startswith(f"merge-{variant}-")]
        shown, spread = cb.rss_spread(peaks)
        print(f"merge {variant}: peak RSS {shown} MiB at 1 and {args.merge_layers} layers (spread {spread:.1%})")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
