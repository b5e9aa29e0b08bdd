"""A whole layer's routed experts through the fused GPU kernels in a handful of launches.

The per-expert path (``ExpertEncoder`` through the codec) is the reference and the fallback;
this path takes the stacked Megatron tensors as they are — fc1 ``[E, 2I, H]`` viewed as groups
(expert e's gate rows, then its up rows) and fc2 ``[E, H, I]`` — and gives the same bytes
(tests/test_sync.py checks it against the per-expert path). One host synchronization per
layer (the non-finite flags); anything unusual returns None and the caller falls back to the
per-expert path, which raises the precise error.
"""

from __future__ import annotations

import torch

from ..convert.experts import expert_module
from ..formats import gpu
from ..formats._base import FLOAT_INPUTS
from ..model.inventory import EXPERT_PROJS


def batched_ok(fc1: torch.Tensor, fc2: torch.Tensor) -> bool:
    return (fc1.dtype in FLOAT_INPUTS and fc2.dtype == fc1.dtype and fc1.device == fc2.device
            and gpu.wants(fc1) and fc1.numel() > 0)


def _ref_scalar(ref, name: str) -> float:
    return float(ref.get(name).reshape(()).to(torch.float32))


def _nvfp4_scales(sync, layer: int, first: int, n: int, device) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(kept weight_scale_2 [n, 3] or None for fresh, input_scale [n, 3]) on ``device``, cached."""
    key = (layer, first, n, str(device), sync.scales)
    hit = sync._batched_cache.get(key)
    if hit is not None:
        return hit
    enc = sync.encoder
    ref = enc.reference
    ref_has = ref is not None and ref.plan.format_of(layer) == "nvfp4"
    mods = [[expert_module(layer, first + j, p) for p in EXPERT_PROJS] for j in range(n)]
    if ref_has:
        isc = torch.tensor([[_ref_scalar(ref, f"{m}.input_scale") for m in row] for row in mods], dtype=torch.float32)
    else:
        isc = torch.ones((n, 3), dtype=torch.float32)
        enc.used_default_input_scale = True
    ws2 = None
    if sync.scales == "keep":
        ws2 = torch.tensor([[_ref_scalar(ref, f"{m}.weight_scale_2") for m in row] for row in mods], dtype=torch.float32)
        if not bool(((ws2 > 0) & torch.isfinite(ws2)).all()):
            return None, isc  # let the codec name the bad scale
        ws2 = ws2.to(device)
    out = (ws2, isc.to(device))
    sync._batched_cache[key] = out
    return out


def _int_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _reuse_unchanged(sync, layer: int, fmt: str, mods, xs, encoded, scales_2):
    """``keep``: blocks whose values equal the reference's decoded block take the reference's bytes
    (what ``ExpertEncoder`` does through ``reuse_unchanged_blocks``), on the device, per layer.

    xs: [x1 (2n groups), x2 (n groups)]; encoded: [(w, sc), (w, sc)] in [G, ...] form;
    scales_2: the kept NVFP4 global scales per group (None for MXFP8).
    """
    ops = gpu._load()
    ref = sync.encoder.reference
    dev = xs[0].device
    n = len(mods)
    out = []
    for k, (x, (w, sc)) in enumerate(zip(xs, encoded)):
        projs = (0, 1) if k == 0 else (2,)
        names = [mods[j][p] for j in range(n) for p in projs]
        rw = torch.stack([ref.get(f"{m}.weight") for m in names]).to(dev).view(len(names), -1)
        rsc = torch.stack([ref.get(f"{m}.weight_scale") for m in names]).to(dev).view(len(names), -1)
        if fmt == "nvfp4":
            dec = ops.nvfp4_decode(rw, rsc, scales_2[k], x.dtype)
            block = 16
        else:
            dec = ops.mxfp8_decode(rw, rsc, "e4m3", x.dtype)
            block = 32
        g = x.shape[0]
        same = (_int_bits(dec).view(g, -1, block) == _int_bits(x).view(g, -1, block)).all(-1)
        per = w.shape[1] // same.shape[1]
        w = torch.where(same[..., None], _int_bits(rw).view(g, -1, per), _int_bits(w).view(g, -1, per)).view(w.dtype).view(g, -1)
        sc = torch.where(same, _int_bits(rsc).view(g, -1), _int_bits(sc).view(g, -1)).view(sc.dtype)
        out.append((w, sc))
    return out


def _reusing(sync, layer: int, fmt: str) -> bool:
    ref = sync.encoder.reference
    return sync.scales == "keep" and ref is not None and ref.plan.format_of(layer) == fmt


def _names(sync, layer: int, first: int, n: int, fmt: str) -> list[list[str]]:
    """Served names of each expert's parts, in checkpoint order (cached: the same every sync)."""
    key = ("names", layer, first, n, fmt)
    hit = sync._batched_cache.get(key)
    if hit is None:
        parts = ("weight", "weight_scale", "weight_scale_2", "input_scale") if fmt == "nvfp4" else ("weight", "weight_scale")
        hit = [[f"{expert_module(layer, first + j, p)}.{part}" for p in EXPERT_PROJS for part in parts] for j in range(n)]
        sync._batched_cache[key] = hit
    return hit


def encode_layer(sync, layer: int, fc1: torch.Tensor, fc2: torch.Tensor, first: int):
    """``(names, per-expert tensor lists)`` for ``fc1``/``fc2`` holding experts ``first..``, or None.

    Each expert's list is in the served order (gate, up, down; each part in checkpoint order);
    the tensors are views into a few per-layer output buffers."""
    ops = gpu._load()
    fmt = sync.plan.format_of(layer)
    n, two_i, h = fc1.shape
    i = two_i // 2
    x1 = fc1.contiguous().view(2 * n, i * h)  # groups: expert j gate (2j), up (2j + 1)
    x2 = fc2.contiguous().view(n, h * i)
    allow = sync.allow_nonfinite
    names = _names(sync, layer, first, n, fmt)
    mods = None
    if fmt == "nvfp4":
        ws2, isc = _nvfp4_scales(sync, layer, first, n, fc1.device)
        if sync.scales == "keep":
            if ws2 is None:
                return None
            s1 = ws2[:, :2].reshape(-1).contiguous()
            s2 = ws2[:, 2].contiguous()
            flags = []
        else:
            a1, b1 = ops.group_amax(x1)
            a2, b2 = ops.group_amax(x2)
            s1 = ops.nvfp4_global_scales(a1.view(n, 2).amax(1)).repeat_interleave(2)  # gate/up share
            s2 = ops.nvfp4_global_scales(a2)
            flags = [b1, b2]
        w1, sc1, f1 = ops.nvfp4_encode(x1, s1)
        w2, sc2, f2 = ops.nvfp4_encode(x2, s2)
        bad = torch.stack([f.amax() for f in flags + [f1, f2]]).amax()  # checked last: views are built meanwhile
        if _reusing(sync, layer, fmt):
            mods = [[expert_module(layer, first + j, p) for p in EXPERT_PROJS] for j in range(n)]
            (w1, sc1), (w2, sc2) = _reuse_unchanged(sync, layer, fmt, mods, [x1, x2], [(w1, sc1), (w2, sc2)], [s1, s2])
        w1u = w1.view(2 * n, i, h // 2).unbind(0)
        sc1u = sc1.view(2 * n, i, h // 16).unbind(0)
        s1u = s1.unbind(0)
        w2u = w2.view(n, h, i // 2).unbind(0)
        sc2u = sc2.view(n, h, i // 16).unbind(0)
        s2u = s2.unbind(0)
        iu = isc.reshape(-1).unbind(0)
        out = [[w1u[2 * j], sc1u[2 * j], s1u[2 * j], iu[3 * j],
                w1u[2 * j + 1], sc1u[2 * j + 1], s1u[2 * j + 1], iu[3 * j + 1],
                w2u[j], sc2u[j], s2u[j], iu[3 * j + 2]] for j in range(n)]
        if not allow and bool(bad > 0):  # the one host synchronization of the layer
            return None
        return names, out
    if fmt == "mxfp8":
        q1, sc1, f1 = ops.mxfp8_encode(x1.view(1, -1))
        q2, sc2, f2 = ops.mxfp8_encode(x2.view(1, -1))
        bad = torch.maximum(f1, f2)[0]
        if _reusing(sync, layer, fmt):
            mods = [[expert_module(layer, first + j, p) for p in EXPERT_PROJS] for j in range(n)]
            (q1, sc1), (q2, sc2) = _reuse_unchanged(sync, layer, fmt, mods, [x1, x2],
                                                    [(q1.view(2 * n, -1), sc1.view(2 * n, -1)), (q2.view(n, -1), sc2.view(n, -1))], None)
        q1u = q1.view(2 * n, i, h).unbind(0)
        sc1u = sc1.view(2 * n, i, h // 32).unbind(0)
        q2u = q2.view(n, h, i).unbind(0)
        sc2u = sc2.view(n, h, i // 32).unbind(0)
        out = [[q1u[2 * j], sc1u[2 * j], q1u[2 * j + 1], sc1u[2 * j + 1], q2u[j], sc2u[j]] for j in range(n)]
        if not allow and bool(bad > 0):  # the one host synchronization of the layer
            return None
        return names, out
    return None
