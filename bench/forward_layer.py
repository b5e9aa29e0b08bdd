"""Benchmark ``verify --forward``'s unit of work: one full-size Inkling 2 decoder layer streamed from disk.

It writes a one-layer release-layout checkpoint with random weights (full-size layer: hidden
4608, 384 routed experts of 2304, 48 heads; the vocabulary is cut to 2048 rows since embed and
unembed are not part of the per-layer figure), experts stored in ``--format`` (bf16, mxfp8 or
nvfp4, the release layouts), then, in the same process and run:

* ``read``: the time to just read that layer's stored bytes from disk into host memory (plain
  64 MiB reads of each tensor's byte range), page cache dropped first;
* ``layer``: the streamed layer as ``verify --forward`` runs it, page cache dropped first:
  read (disk to the device), decode the experts + load the modules, the layer's forward on
  ``--batch`` x ``--seq`` tokens (default 2 x 512), and the return to meta; with the breakdown.

Each is repeated ``--repeat`` times; the best and the median are printed, with peak GPU memory
(``torch.cuda.max_memory_allocated``) and peak RSS. The layer is layer 0 of its model (so it
has no attention-input residual: a few element-wise ops on [B, T, n, H], negligible beside
the experts). ``--kind full`` times a full-attention layer instead of a sliding one.

    python bench/forward_layer.py --device cuda                        # the H200 figure (bf16)
    python bench/forward_layer.py --device cuda --format nvfp4
    python bench/forward_layer.py --device cpu --experts 8 --seq 64    # CPU smoke check

Disk: the fixture (bf16 24.5 GB, mxfp8 12.3 GB, nvfp4 6.2 GB at 384 experts) under ``--work``,
removed afterwards unless ``--keep``. Needs transformers 5.24 (the 'forward' extra).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import struct
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from inkling_ckpt.verify import forward as fwd  # noqa: E402

ST_NAMES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3"}
CHUNK = 1 << 27  # elements generated at a time while writing the fixture
BLOCK = 64 << 20  # bytes per read of the plain-read baseline


# -- the fixture ------------------------------------------------------------------------------


def layer_config(experts: int, kind: str):
    tf = fwd.load_transformers()
    cfg = tf.Config()  # the release defaults: the full-size model
    tc = cfg.text_config
    tc.num_hidden_layers = 1
    tc.layer_types = ["hybrid_sliding" if kind == "sliding" else "hybrid"]
    tc.vocab_size, tc.unpadded_vocab_size = 2048, 2000
    tc.n_routed_experts = experts
    tc.num_experts_per_tok = min(tc.num_experts_per_tok, experts)
    tc.eos_token_id = 1
    return tf, cfg


def release_inventory(tf, cfg) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """On-disk names, shapes and dtypes of the text model, as save_pretrained would write them."""
    from transformers.core_model_loading import revert_weight_conversion

    with tf.ContextManagers(tf.Model.get_init_context(torch.bfloat16, False, False, False)):
        model = tf.Model(cfg)
    sd = {k: v for k, v in model.state_dict().items() if not k.startswith("model.vision_tower.")}
    return {k: (tuple(v.shape), v.dtype) for k, v in revert_weight_conversion(model, sd).items()}


def quantized_parts(name: str, shape, fmt: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    e, rows, cols = shape
    if fmt == "mxfp8":
        return {name: (shape, torch.float8_e4m3fn), name + "_scale": ((e, rows, cols // 32), torch.uint8)}
    return {name: ((e, rows, cols // 2), torch.uint8), name + "_scale": ((e, rows, cols // 16), torch.float8_e4m3fn),
            name + "_amax": ((e,), torch.float32), name + "_outer_scale_denominator": ((), torch.float32)}


def random_values(name: str, shape, dtype, n: int, gen: torch.Generator, device) -> torch.Tensor:
    """``n`` leading-dim rows' worth of plausible random values for tensor ``name``."""
    full = (n, *shape[1:]) if shape else ()
    if name.endswith("_outer_scale_denominator"):
        return torch.tensor(2688.0)
    if name.endswith("_amax"):
        return torch.full(full, 20.0)  # factor amax/2688 ~ 0.0074: weights of a few 1e-2
    if dtype == torch.uint8 and name.endswith("_scale"):  # E8M0: 2^(b-127) around 2^-8
        return torch.randint(117, 122, full, generator=gen, device=device, dtype=torch.uint8)
    if dtype == torch.uint8:  # packed E2M1 pairs: every byte is valid
        return torch.randint(0, 256, full, generator=gen, device=device, dtype=torch.uint8)
    if dtype == torch.float8_e4m3fn and name.endswith("_scale"):  # NVFP4 block scales in [0.5, 2.5)
        return (torch.rand(full, generator=gen, device=device) * 2 + 0.5).to(dtype)
    x = torch.randn(full, generator=gen, device=device)
    if dtype == torch.float8_e4m3fn:
        return (x * 4).to(dtype)
    if name.endswith("norm.weight"):
        return (1 + 0.02 * x).to(dtype)
    return (0.02 * x).to(dtype)


def write_fixture(folder: Path, cfg, inventory, fmt: str, device) -> int:
    """config.json + model.safetensors, written tensor by tensor (never the whole file in memory)."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, (shape, dtype) in sorted(inventory.items()):
        if fmt != "bf16" and name.endswith(("experts.w13_weight", "experts.w2_weight")):
            tensors.update(quantized_parts(name, shape, fmt))
        else:
            tensors[name] = (shape, dtype)
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (shape, dtype) in tensors.items():
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    gen = torch.Generator(device=device).manual_seed(0)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, (shape, dtype) in tensors.items():
            rows = shape[0] if shape else 1
            per_row = max(1, math.prod(shape[1:]) if shape else 1)
            step = max(1, CHUNK // per_row)
            for r in range(0, rows, step):
                n = min(step, rows - r)
                t = random_values(name, shape, dtype, n, gen, device).contiguous().cpu()
                f.write(t.view(torch.uint8).numpy().tobytes() if t.dim() else t.reshape(1).view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    cfg.save_pretrained(folder)
    return offset


def drop_cache(path: Path) -> None:
    """Make the next read come from disk (our file only)."""
    os.sync()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# -- the measurements -------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_read(folder: Path, unit_names: list[str], warm: bool) -> tuple[float, int]:
    """Plain reads (64 MiB ``readinto`` into one reused buffer) of the byte ranges of ``unit_names``.

    No safetensors here on purpose: ``safe_open`` on CPU hands out memory-mapped tensors whose
    pages are read only when touched, so timing ``get_tensor`` alone would time nothing.
    """
    path = folder / "model.safetensors"
    if not warm:
        drop_cache(path)
    with open(path, "rb", buffering=0) as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(hlen))
        ranges = sorted(header[n]["data_offsets"] for n in unit_names)
        buf = memoryview(bytearray(BLOCK))
        t0 = time.perf_counter()
        nbytes = 0
        for start, stop in ranges:
            f.seek(8 + hlen + start)
            left = stop - start
            while left:
                got = f.readinto(buf[:min(BLOCK, left)])
                if not got:
                    raise SystemExit(f"{path}: short read")
                left -= got
                nbytes += got
        return time.perf_counter() - t0, nbytes


def time_layer(folder: Path, device: torch.device, ids: torch.Tensor, warm: bool) -> dict[str, float]:
    sm = fwd.StreamedModel(folder, dtype=torch.bfloat16, device=device)
    embed, layer = sm.units[0], sm.units[1]
    st = sm.run_unit(embed, None, ids)
    if not warm:
        drop_cache(folder / "model.safetensors")
    sync(device)
    t0 = time.perf_counter()
    stored = sm.read(layer)
    sync(device)
    t1 = time.perf_counter()
    sm.load(layer, stored)
    del stored
    sync(device)
    t2 = time.perf_counter()
    with torch.inference_mode():
        sm.layer(layer.layer, st)
    sync(device)
    t3 = time.perf_counter()
    sm.unload(layer)
    sync(device)
    t4 = time.perf_counter()
    if not bool(torch.isfinite(st.hidden).all()):
        raise SystemExit("the layer produced non-finite values: the random fixture is off")
    sm.close()
    return {"layer_s": t4 - t0, "read_to_device_s": t1 - t0, "decode_load_s": t2 - t1, "forward_s": t3 - t2,
            "unload_s": t4 - t3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (the figure) or cpu (smoke check)")
    ap.add_argument("--format", choices=("bf16", "mxfp8", "nvfp4"), default="bf16", help="stored expert format")
    ap.add_argument("--kind", choices=("sliding", "full"), default="sliding", help="attention kind of the layer")
    ap.add_argument("--experts", type=int, default=384, help="routed experts (384 = full size)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("bench-work"), help="where the fixture is written")
    ap.add_argument("--keep", action="store_true", help="keep the fixture")
    ap.add_argument("--warm", action="store_true", help="do not drop the page cache before each read")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu --experts 8 for a smoke check)")
    tf, cfg = layer_config(args.experts, args.kind)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    folder = args.work / f"forward-layer-{args.format}-{args.kind}-{args.experts}"
    try:
        t0 = time.perf_counter()
        total = write_fixture(folder, cfg, release_inventory(tf, cfg), args.format, device)
        print(f"fixture: {folder} ({total / 1e9:.2f} GB, {time.perf_counter() - t0:.1f} s to write)", flush=True)
        sm = fwd.StreamedModel(folder, dtype=torch.bfloat16, device="cpu")
        layer = sm.units[1]
        names = [s.base + p for s in layer.sources for p in s.parts]
        layer_bytes = sm.unit_bytes(layer)
        sm.close()
        ids = torch.randint(0, 2000, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))

        reads, layers = [], []
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for r in range(args.repeat):
            dt, nbytes = time_read(folder, names, args.warm)
            assert nbytes == layer_bytes
            reads.append(dt)
            layers.append(time_layer(folder, device, ids, args.warm))
            print(f"  run {r + 1}: read {dt:.2f} s ({nbytes / dt / 1e9:.2f} GB/s); layer {layers[-1]['layer_s']:.2f} s "
                  f"= read->device {layers[-1]['read_to_device_s']:.2f} + decode/load {layers[-1]['decode_load_s']:.2f}"
                  f" + forward {layers[-1]['forward_s']:.2f} + unload {layers[-1]['unload_s']:.2f}", flush=True)
        peak_gpu = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        best = min(layers, key=lambda x: x["layer_s"])
        result = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "format": args.format, "kind": args.kind, "experts": args.experts,
            "tokens": [args.batch, args.seq], "layer_bytes": layer_bytes, "page_cache": "warm" if args.warm else "dropped",
            "read_s": {"best": min(reads), "median": statistics.median(reads)},
            "layer_s": {"best": best["layer_s"], "median": statistics.median(x["layer_s"] for x in layers)},
            "best_breakdown_s": best,
            "layer_over_read": best["layer_s"] / min(reads),
            "peak_gpu_bytes": peak_gpu, "peak_rss_bytes": peak_rss,
        }
        print(f"{args.format} {args.kind} layer, {args.experts} experts, {layer_bytes / 1e9:.2f} GB stored, "
              f"{args.batch}x{args.seq} tokens on {result['device']}:")
        print(f"  read only  {result['read_s']['best']:.2f} s best, {result['read_s']['median']:.2f} s median "
              f"({layer_bytes / min(reads) / 1e9:.2f} GB/s)")
        print(f"  streamed   {result['layer_s']['best']:.2f} s best, {result['layer_s']['median']:.2f} s median "
              f"({result['layer_over_read']:.2f}x read only)")
        if peak_gpu is not None:
            print(f"  peak GPU memory {peak_gpu / 2**30:.1f} GiB", end="; ")
        print(f"peak RSS {peak_rss / 2**30:.1f} GiB")
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
