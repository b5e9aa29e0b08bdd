"""GPU codec bench (H200): copy rate, then each Triton kernel on one EP4 rank's experts of one layer.

    python bench/gpu_codecs.py [--experts 96] [--layer-experts 384] [--sweep] [--json out.json]

Workload: one EP4 rank's routed experts of one Inkling 2 layer, 96 experts x gate/up/down,
as the trainer holds them: stacked fc1 [96, 2*2304, 4608] (gate rows, then up rows) and fc2
[96, 4608, 2304], BF16, random with magnitudes 1e-3..1e3 per row and sparse outliers.
GB/s counts bytes read + written once each (the floor), as a fraction of the measured device
copy rate (also read + written). Beside each kernel: an eager-torch reference (the same
arithmetic as whole-tensor torch ops) and that function under torch.compile, in the same run;
each reference's bytes are compared to the kernel's.

Then a whole layer (384 experts) through the weight-sync path on the GPU: wall time per layer,
GPU kernel time (torch.profiler), and the share outside kernels.

``--stacked`` (or ``--stacked-only``): the public stacked codecs (``formats.stacked``:
``encode_stacked`` / ``decode_stacked``) on the same rank's release-layout tensors, w13
[96, 4608, 4608] (gate/up interleaved) and w2 [96, 4608, 2304], BF16 on the device: NVFP4 with
kept amax (given, on the device) and fresh, MXFP8 RCEIL and FLOOR, decode to BF16; GB/s and
% of the copy rate as above (host synchronizations included: each call is timed as a whole).
Beside them, "before": the previous implementation's paths in the same run (NVFP4 encode one
codec call per expert with host syncs, the gather-based NVFP4 decode; MXFP8 through the codec on
the whole stack). Last, host tensors encoded/decoded on the device in slices (``device="cuda"``,
default 1 GiB budget): wall time from host input to host parts.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

H, I = 4608, 2304  # noqa: E741  (hidden and expert width, as the model's config names them)


def gbps(nbytes: float, ms: float) -> float:
    return nbytes / ms / 1e6


def bench(fn, reps_ms=300):
    import triton

    return triton.testing.do_bench(fn, warmup=50, rep=reps_ms, return_mode="median")


def make_experts(e: int, seed: int = 0, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)

    def one(shape):
        x = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
        x *= torch.pow(10.0, torch.rand(shape[0], shape[1], 1, generator=g, device=device) * 6 - 3)
        n = x.numel() // 5000
        idx = torch.randint(0, x.numel(), (n,), generator=g, device=device)
        x.view(-1)[idx] *= 100.0
        return x.to(torch.bfloat16)

    return one((e, 2 * I, H)), one((e, H, I))


# -- eager torch references (same arithmetic as the reference codec, whole-tensor ops) ----------

def torch_group_amax(x):  # x [G, N]
    return x.abs().amax(dim=1).float()


def torch_nvfp4(x, s2):  # x [G, N] bf16, s2 [G] f32
    g = x.shape[0]
    xb = x.view(g, -1, 16).float()
    s2b = s2.view(g, 1)
    sb = xb.abs().amax(-1) / (s2b * 6.0)
    sb = torch.where(sb == 0, 1.0, sb).clamp(2.0**-9, 448.0).to(torch.float8_e4m3fn)
    eff = sb.float() * s2b
    a = (xb / eff.unsqueeze(-1)).abs()
    a = torch.where(a < 6.0, a, 6.0)
    code = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5)
            + (a > 5.0)).to(torch.uint8)
    code = code | ((xb < 0).to(torch.uint8) << 3)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.reshape(g, -1), sb.view(torch.uint8).reshape(g, -1)


def torch_mxfp8(x):  # rceil, e4m3
    g = x.shape[0]
    xb = x.view(g, -1, 32).float()
    q = xb.abs().amax(-1) / 448.0
    bits = q.view(torch.int32)
    expo = bits >> 23
    mant = bits & 0x7FFFFF
    biased = (expo + (mant > torch.where(expo == 0, 0x400000, 0)).to(torch.int32)).clamp(0, 254)
    inv = torch.where(biased == 254, 0x400000, (254 - biased) << 23).view(torch.float32)
    y = (xb * inv.unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return y.view(torch.uint8).reshape(g, -1), biased.to(torch.uint8).reshape(g, -1)


def torch_nvfp4_decode(w, sc, s2):
    g = w.shape[0]
    lut = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6], device=w.device)
    v = torch.stack((lut[(w & 0xF).long()], lut[(w >> 4).long()]), -1).view(g, -1, 16)
    eff = sc.view(torch.float8_e4m3fn).float().view(g, -1) * s2.view(g, 1)
    return (v * eff.unsqueeze(-1)).to(torch.bfloat16).view(g, -1)


def torch_mxfp8_decode(q, sc):
    g = q.shape[0]
    v = q.view(torch.float8_e4m3fn).float().view(g, -1, 32)
    s = torch.exp2(sc.float() - 127.0).view(g, -1, 1)
    return (v * s).to(torch.bfloat16).view(g, -1)


def diff_bytes(a, b):
    return int((a.reshape(-1).view(torch.uint8) != b.reshape(-1).view(torch.uint8)).sum())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=96)
    ap.add_argument("--layer-experts", type=int, default=384)
    ap.add_argument("--sweep", action="store_true", help="try other tile sizes")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--stacked", action="store_true", help="also the public stacked codecs (formats.stacked)")
    ap.add_argument("--stacked-only", action="store_true", help="copy rate and the stacked codecs only")
    args = ap.parse_args()

    import triton

    from inkling_ckpt.formats.gpu import ops

    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    print(res, flush=True)
    rows = []

    def row(name, nbytes, ms, copy, note=""):
        r = {"name": name, "ms": ms, "GBps": gbps(nbytes, ms), "pct_copy": 100 * gbps(nbytes, ms) / copy, "note": note}
        rows.append(r)
        print(f"{name:44s} {ms:9.3f} ms {r['GBps']:8.0f} GB/s {r['pct_copy']:6.1f}% {note}", flush=True)
        return r

    # 1. copy rate
    src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    copy = gbps(2 * src.numel() * 2, ms)
    res["copy_GBps"] = copy
    print(f"device copy (2 GiB, read+write): {ms:.3f} ms  {copy:.0f} GB/s", flush=True)
    src = dst = None  # frees the 4 GiB (rebinding, not del: the closures above name them)

    if args.stacked or args.stacked_only:
        res["stacked"] = stacked_bench(args.experts, copy, row)
        torch.cuda.empty_cache()
    if args.stacked_only:
        res["rows"] = rows
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        return

    # 2. one EP4 rank's experts
    E = args.experts
    fc1, fc2 = make_experts(E)
    xs = [fc1.view(E, -1), fc2.view(E, -1)]  # gate/up share a group: the expert's fc1 rows
    n = sum(x.numel() for x in xs)
    res["elements"] = n
    print(f"workload: {E} experts, {n / 1e9:.3f} G elements, {2 * n / 1e9:.2f} GB bf16", flush=True)

    s2 = [ops.nvfp4_global_scales(ops.group_amax(x)[0]) for x in xs]

    def k_amax():
        for x in xs:
            ops.group_amax(x)

    def k_nvfp4():
        for x, s in zip(xs, s2, strict=True):
            ops.nvfp4_encode(x, s)

    def k_nvfp4_fresh():
        for x in xs:
            ops.nvfp4_encode(x, ops.nvfp4_global_scales(ops.group_amax(x)[0]))

    def k_mxfp8():
        for x in xs:
            ops.mxfp8_encode(x)

    enc4 = [ops.nvfp4_encode(x, s) for x, s in zip(xs, s2, strict=True)]
    enc8 = [ops.mxfp8_encode(x) for x in xs]

    def k_nvfp4_dec():
        for (w, sc, _), s in zip(enc4, s2, strict=True):
            ops.nvfp4_decode(w, sc, s, torch.bfloat16)

    def k_mxfp8_dec():
        for q, sc, _ in enc8:
            ops.mxfp8_decode(q, sc, "e4m3", torch.bfloat16)

    b_amax = 2 * n
    b_nv = 2 * n + n // 2 + n // 16
    b_mx = 2 * n + n + n // 32
    b_nvd = n // 2 + n // 16 + 2 * n
    b_mxd = n + n // 32 + 2 * n

    # correctness of the references against the kernels (bytes)
    checks = {}
    for (w, sc, _), x, s in zip(enc4, xs, s2, strict=True):
        rw, rsc = torch_nvfp4(x, s)
        checks.setdefault("nvfp4_eager_diff_bytes", 0)
        checks["nvfp4_eager_diff_bytes"] += diff_bytes(rw, w) + diff_bytes(rsc, sc)
    for (q, sc, _), x in zip(enc8, xs, strict=True):
        rq, rsc = torch_mxfp8(x)
        checks.setdefault("mxfp8_eager_diff_bytes", 0)
        checks["mxfp8_eager_diff_bytes"] += diff_bytes(rq, q) + diff_bytes(rsc, sc)
    print("eager-reference vs kernel:", checks, flush=True)

    results = {}
    results["amax"] = row("global amax (per expert group)", b_amax, bench(k_amax), copy)
    results["nvfp4_enc"] = row("NVFP4 encode (given global scales)", b_nv, bench(k_nvfp4), copy)
    results["nvfp4_enc_fresh"] = row("NVFP4 encode fresh (amax + encode)", b_nv, bench(k_nvfp4_fresh), copy,
                                     "bytes counted once; amax re-reads input")
    results["mxfp8_enc"] = row("MXFP8 encode (RCEIL, E4M3)", b_mx, bench(k_mxfp8), copy)
    results["nvfp4_dec"] = row("NVFP4 decode -> bf16", b_nvd, bench(k_nvfp4_dec), copy)
    results["mxfp8_dec"] = row("MXFP8 decode -> bf16", b_mxd, bench(k_mxfp8_dec), copy)

    # eager torch references
    results["nvfp4_eager"] = row("  eager torch NVFP4 encode", b_nv, bench(lambda: [torch_nvfp4(x, s) for x, s in zip(xs, s2, strict=True)]), copy)
    results["mxfp8_eager"] = row("  eager torch MXFP8 encode", b_mx, bench(lambda: [torch_mxfp8(x) for x in xs]), copy)
    results["amax_eager"] = row("  eager torch amax", b_amax, bench(lambda: [torch_group_amax(x) for x in xs]), copy)
    results["nvfp4_dec_eager"] = row("  eager torch NVFP4 decode", b_nvd, bench(lambda: [torch_nvfp4_decode(w, sc, s) for (w, sc, _), s in zip(enc4, s2, strict=True)]), copy)
    results["mxfp8_dec_eager"] = row("  eager torch MXFP8 decode", b_mxd, bench(lambda: [torch_mxfp8_decode(q, sc) for q, sc, _ in enc8]), copy)

    if not args.no_compile:
        t0 = time.time()
        c_nv = torch.compile(torch_nvfp4, dynamic=False)
        c_mx = torch.compile(torch_mxfp8, dynamic=False)
        c_am = torch.compile(torch_group_amax, dynamic=False)
        for (w, sc, _), x, s in zip(enc4, xs, s2, strict=True):
            rw, rsc = c_nv(x, s)
            checks.setdefault("nvfp4_compiled_diff_bytes", 0)
            checks["nvfp4_compiled_diff_bytes"] += diff_bytes(rw, w) + diff_bytes(rsc, sc)
        for (q, sc, _), x in zip(enc8, xs, strict=True):
            rq, rsc = c_mx(x)
            checks.setdefault("mxfp8_compiled_diff_bytes", 0)
            checks["mxfp8_compiled_diff_bytes"] += diff_bytes(rq, q) + diff_bytes(rsc, sc)
        for x in xs:
            c_am(x)
        print(f"torch.compile warm-up {time.time() - t0:.1f} s; compiled-reference vs kernel: {checks}", flush=True)
        results["nvfp4_compiled"] = row("  torch.compile NVFP4 encode", b_nv, bench(lambda: [c_nv(x, s) for x, s in zip(xs, s2, strict=True)]), copy)
        results["mxfp8_compiled"] = row("  torch.compile MXFP8 encode", b_mx, bench(lambda: [c_mx(x) for x in xs]), copy)
        results["amax_compiled"] = row("  torch.compile amax", b_amax, bench(lambda: [c_am(x) for x in xs]), copy)
    res["checks"] = checks

    if args.sweep:
        keep = dict(ops.NVFP4_BF16)
        for nb, nw, it in ((256, 8, 0), (128, 4, 0), (128, 4, 2), (128, 4, 4), (128, 4, 8), (128, 4, 16), (128, 8, 4),
                           (256, 8, 4), (256, 8, 8), (64, 2, 8), (64, 2, 16)):
            ops.NVFP4_BF16.update(NB=nb, num_warps=nw, ITERS=it)
            row(f"  sweep NVFP4 bf16 NB={nb} warps={nw} iters={it}", b_nv, bench(k_nvfp4, 150), copy)
        ops.NVFP4_BF16.update(keep)
        for nb in (128, 256):
            for nw in (4, 8):
                ops.MXFP8_BF16.update(NB=nb, num_warps=nw)
                row(f"  sweep MXFP8 bf16 NB={nb} warps={nw}", b_mx, bench(k_mxfp8, 150), copy)
        ops.MXFP8_BF16.update(NB=128, num_warps=4)
        ops.BF16_FAST = False
        row("  generic (non-bf16) NVFP4 kernel on bf16", b_nv, bench(k_nvfp4, 150), copy)
        row("  generic (non-bf16) MXFP8 kernel on bf16", b_mx, bench(k_mxfp8, 150), copy)
        ops.BF16_FAST = True
        for nb, nw in ((128, 4), (256, 4), (256, 8)):
            ops.DEC.update(NB=nb, num_warps=nw)
            row(f"  sweep decode NB={nb} warps={nw} (NVFP4)", b_nvd, bench(k_nvfp4_dec, 150), copy)
            row(f"  sweep decode NB={nb} warps={nw} (MXFP8)", b_mxd, bench(k_mxfp8_dec, 150), copy)
        ops.DEC.update(NB=128, num_warps=4)
    enc4 = enc8 = fc1 = fc2 = xs = None  # frees the workload (rebinding, not del: closures name them)
    torch.cuda.empty_cache()

    # 3. a whole layer (384 experts) on the GPU
    res["layer"] = layer_bench(args.layer_experts)

    res["rows"] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    print(f"\nsummary (GB/s; % of copy rate {copy:.0f} GB/s)")
    for r in rows:
        print(f"{r['name']:44s} {r['ms']:9.3f} ms {r['GBps']:8.0f} GB/s {r['pct_copy']:6.1f}%")


def stacked_bench(E: int, copy: float, row) -> dict:
    """The public stacked codecs on one EP4 rank's release-layout w13 and w2 (see the docstring)."""
    from inkling_ckpt.formats.stacked import decode_stacked, encode_stacked

    out: dict = {}
    fc1, fc2 = make_experts(E, seed=2)
    w13 = torch.stack([fc1[:, :I], fc1[:, I:]], dim=2).reshape(E, 2 * I, H)  # gate/up interleaved
    del fc1
    out["w13"] = _stacked_rows("w13", w13, copy, row)
    out["w2"] = _stacked_rows("w2", fc2, copy, row)
    del fc2
    torch.cuda.empty_cache()
    # host tensors through the device in slices (the pipeline's --device cuda)
    from inkling_ckpt.formats import get_format

    nv, mx = get_format("nvfp4"), get_format("mxfp8")
    w_host = w13.cpu()
    n = w_host.numel()
    enc_host = {k: v.cpu() for k, v in encode_stacked(nv, w13, name="w13").items()}
    del w13
    torch.cuda.empty_cache()
    for label, fn, nb in (
        ("NVFP4 encode fresh", lambda: encode_stacked(nv, w_host, name="w13", device="cuda"), 2 * n + n // 2 + n // 16),
        ("NVFP4 decode -> bf16", lambda: decode_stacked("nvfp4", enc_host, name="w13", device="cuda"), 2 * n + n // 2 + n // 16),
        ("MXFP8 encode", lambda: encode_stacked(mx, w_host, name="w13", device="cuda"), 3 * n + n // 32),
    ):
        fn()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = timed(fn, reps=2)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        out[f"host_{label}"] = {"ms": ms, "GBps": gbps(nb, ms), "peak_device_MiB": peak}
        print(f"host w13 via device slices: {label:24s} {ms:9.1f} ms {gbps(nb, ms):7.1f} GB/s  peak device {peak:.0f} MiB",
              flush=True)
    return out


def _stacked_rows(tname: str, w: torch.Tensor, copy: float, row) -> dict:
    from inkling_ckpt.formats import get_format, stacked
    from inkling_ckpt.formats.stacked import (
        AMAX,
        SCALE,
        WEIGHT,
        decode_stacked,
        encode_stacked,
    )

    nv, mx, mxf = get_format("nvfp4"), get_format("mxfp8"), get_format("mxfp8", scale_mode="floor")
    n = w.numel()
    b_nv, b_mx = 2 * n + n // 2 + n // 16, 2 * n + n + n // 32
    shape = "x".join(str(s) for s in w.shape)
    fresh = encode_stacked(nv, w, name=tname)
    amax = fresh[AMAX]
    factor = amax / torch.full_like(amax, 2688.0)
    enc8 = encode_stacked(mx, w, name=tname)
    r: dict = {}

    def pub(key, label, nbytes, fn):
        """A public call: wall time (do_bench, host sync included) and its GPU kernels alone (profiler)."""
        ms = bench(fn)
        k = kernel_time_ms(fn)
        note = "" if k is None else f"(GPU kernels {k:.3f} ms = {100 * gbps(nbytes, k) / copy:.1f}% of copy)"
        r[key] = row(label, nbytes, ms, copy, note)
        r[key]["kernel_ms"] = k

    pub("nvfp4_enc_kept", f"{tname} {shape} NVFP4 encode, kept amax", b_nv, lambda: encode_stacked(nv, w, name=tname, amax=amax))
    pub("nvfp4_enc_fresh", f"{tname} NVFP4 encode, fresh amax", b_nv, lambda: encode_stacked(nv, w, name=tname))
    pub("nvfp4_dec", f"{tname} NVFP4 decode -> bf16", b_nv, lambda: decode_stacked("nvfp4", fresh, torch.bfloat16, name=tname))
    pub("mxfp8_enc", f"{tname} MXFP8 encode (RCEIL)", b_mx, lambda: encode_stacked(mx, w, name=tname))
    pub("mxfp8_enc_floor", f"{tname} MXFP8 encode (FLOOR)", b_mx, lambda: encode_stacked(mxf, w, name=tname))
    pub("mxfp8_dec", f"{tname} MXFP8 decode -> bf16", b_mx, lambda: decode_stacked("mxfp8", enc8, torch.bfloat16, name=tname))
    # before: the previous implementation's code paths (kept as the reference code on the device)
    r["before_nvfp4_enc_kept"] = row(f"  before: {tname} NVFP4 encode kept (per expert)", b_nv,
                                     bench(lambda: stacked._encode_reference(nv, "nvfp4", w, amax, tname, False), 500), copy)
    r["before_nvfp4_enc_fresh"] = row(f"  before: {tname} NVFP4 encode fresh (per expert)", b_nv,
                                      bench(lambda: stacked._encode_reference(nv, "nvfp4", w, None, tname, False), 500), copy)
    r["before_nvfp4_dec"] = row(f"  before: {tname} NVFP4 decode (gather, checks not counted)", b_nv,
                                bench(lambda: stacked._decode_nvfp4_reference(fresh[WEIGHT], fresh[SCALE], factor,
                                                                              torch.bfloat16), 500), copy)
    r["before_mxfp8_enc"] = row(f"  before: {tname} MXFP8 encode (codec on the whole stack)", b_mx,
                                bench(lambda: stacked._encode_reference(mx, "mxfp8", w, None, tname, False)), copy)
    # bytes: the new paths against the previous ones (the CPU reference itself is pinned by the tests)
    old = stacked._encode_reference(nv, "nvfp4", w, None, tname, False)
    same = {
        "nvfp4_fresh": all(torch.equal(fresh[k].reshape(-1).view(torch.uint8), old[k].reshape(-1).view(torch.uint8))
                           for k in fresh),
        "nvfp4_dec": torch.equal(decode_stacked("nvfp4", fresh).view(torch.int16),
                                 stacked._decode_nvfp4_reference(fresh[WEIGHT], fresh[SCALE], factor,
                                                                 torch.bfloat16).view(torch.int16)),
    }
    r["same_bytes_as_before"] = same
    print(f"{tname}: same bytes as the previous paths: {same}", flush=True)
    return r


def kernel_time_ms(fn) -> float | None:
    """Sum of GPU kernel durations (ms) of one call of fn, from torch.profiler; None if unavailable."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        tot = 0.0
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                tot += e.time_range.elapsed_us()
        return tot / 1e3
    except Exception as ex:  # pragma: no cover - profiler API differences
        print("profiler unavailable:", ex)
        return None


def timed(fn, reps=3) -> float:
    best = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best.append((time.perf_counter() - t) * 1e3)
    return sorted(best)[len(best) // 2]


def layer_bench(E: int) -> dict:
    """One layer's E experts: wall time per layer and the share of it outside GPU kernels."""
    out: dict = {"experts": E}
    fc1, fc2 = make_experts(E, seed=1)
    n = fc1.numel() + fc2.numel()
    out["bytes_nvfp4"] = 2 * n + n // 2 + n // 16
    out["bytes_mxfp8"] = 2 * n + n + n // 32
    variants = {}

    from inkling_ckpt.formats.gpu import ops

    def ops_nvfp4():
        res = []
        for x in (fc1.view(E, -1), fc2.view(E, -1)):
            amax, bad = ops.group_amax(x)
            res.append(ops.nvfp4_encode(x, ops.nvfp4_global_scales(amax)))
        return res

    def ops_mxfp8():
        return [ops.mxfp8_encode(x.view(E, -1)) for x in (fc1, fc2)]

    variants["ops_nvfp4_fresh"] = ops_nvfp4
    variants["ops_mxfp8"] = ops_mxfp8

    try:  # the weight-sync API: Megatron names in, release tensors out (one load group per layer), 512 MiB buckets
        from inkling_ckpt.convert.experts import ExpertEncoder
        from inkling_ckpt.model.config import InklingConfig
        from inkling_ckpt.model.inventory import expert_stacks
        from inkling_ckpt.model.precision import PrecisionPlan
        from inkling_ckpt.model.presets import preset_config
        from inkling_ckpt.sync import WeightSync

        cfg = InklingConfig.from_dict(preset_config("full", layers=2, experts=E))
        plan = PrecisionPlan.parse("0:nvfp4,1:mxfp8", 2)
        sync = WeightSync(cfg, plan, scales="fresh", select="experts")

        def via_sync(layer):
            pre = f"decoder.layers.{layer}.mlp.experts.experts."
            pairs = [(pre + "linear_fc1.weight", fc1), (pre + "linear_fc2.weight", fc2)]

            def run():
                n = 0
                for b in sync.buckets(pairs):
                    n += len(b)
                return n
            return run

        def per_expert_reference(layer):
            """The reference path (ExpertEncoder, expert by expert through the codec) on the same tensors."""
            enc = ExpertEncoder(plan)
            w13, w2 = expert_stacks(cfg, plan, layer)
            x13 = torch.stack([fc1[:, :I], fc1[:, I:]], dim=2).reshape(E, 2 * I, H)

            def run():
                enc.encode(w13, 0, x13)
                enc.encode(w2, 0, fc2)
            return run

        variants["WeightSync_layer_nvfp4_fresh"] = via_sync(0)
        variants["WeightSync_layer_mxfp8"] = via_sync(1)
        variants["ExpertEncoder_reference_nvfp4"] = per_expert_reference(0)
        variants["ExpertEncoder_reference_mxfp8"] = per_expert_reference(1)
    except Exception:
        import traceback
        traceback.print_exc()

    for name, fn in variants.items():
        try:
            fn()  # warm-up (compiles)
            wall = timed(fn)
            kern = kernel_time_ms(fn)
            fmt = "mxfp8" if "mxfp8" in name else "nvfp4"
            nb = out[f"bytes_{fmt}"]
            v = {"wall_ms": wall, "kernel_ms": kern, "GBps_wall": gbps(nb, wall)}
            if kern:
                v["outside_kernels_pct"] = 100 * max(0.0, wall - kern) / wall
            variants_out = out.setdefault("variants", {})
            variants_out[name] = v
            print(f"layer {E} experts {name:36s} wall {wall:8.2f} ms  kernels {kern if kern is None else round(kern, 2)} ms  "
                  f"outside {v.get('outside_kernels_pct', float('nan')):5.1f}%  {v['GBps_wall']:6.0f} GB/s", flush=True)
        except Exception as ex:
            import traceback
            traceback.print_exc()
            out.setdefault("errors", {})[name] = repr(ex)
        torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    main()
