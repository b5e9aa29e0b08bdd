"""Stacked routed experts in the Inkling 2 release layout (spec/inkling2.md, formats.md).

A layer stores its experts as one tensor per projection: ``w13_weight`` [E, 2F, H] with gate
and up rows interleaved (row 2j = gate j, row 2j+1 = up j) and ``w2_weight`` [E, H, F]. Blocks
run along the last dimension, so every per-row quantity (block scales) is interleaved exactly as
the weight rows are. Part suffixes, appended to the weight's name:

========  ==========================  ==========================  =================================
format    ``""`` (the weight)          ``_scale``                  NVFP4 extras
========  ==========================  ==========================  =================================
bf16      BF16 [E, R, C]
f16, f32  F16 / F32 [E, R, C]          (a checkpoint saved from a float16 / float32 model)
mxfp8     F8_E4M3 [E, R, C]           U8 (E8M0 byte) [E, R, C/32]
nvfp4     U8 [E, R, C/2] (2 codes/B)  F8_E4M3 [E, R, C/16]        ``_amax`` F32 [E],
                                                                  ``_outer_scale_denominator`` F32 []
========  ==========================  ==========================  =================================

NVFP4 uses one global factor per expert (``amax / 2688``; gate and up share it because they are
one tensor) — numerically ModelOpt's ``weight_scale_2``, so encoding is the reference codec's,
expert by expert. Decoding follows transformers' ``Inkling2LoopDequantizeExperts`` order,
``(e2m1 * f32(block_scale)) * (amax / denominator)`` in float32, then one cast.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import FormatError, NonFiniteError
from ._base import block_amax_bits, check_out_dtype, row_chunks
from .encodings import E4M3, decode_table
from . import gpu as _gpu
from .nvfp4 import (BLOCK as NVFP4_BLOCK, E2M1_MAX, E4M3_MAX, MIN_GLOBAL_AMAX, NVFP4Format, _block_amax_all,
                    _pair_table, nvfp4_global_scale)
from .nvfp4 import _amax as _nvfp4_amax
from .mxfp8 import BLOCK as MXFP8_BLOCK, MXFP8Format

#: 6 × 448: the release's ``outer_scale_denominator`` (amax / 2688 = ModelOpt's weight_scale_2).
NVFP4_DENOMINATOR = E2M1_MAX * E4M3_MAX
WEIGHT, SCALE, AMAX, DENOM = "", "_scale", "_amax", "_outer_scale_denominator"
#: Unquantized stacked formats and the dtype each stores: one weight part, no scales. The release
#: is BF16; a checkpoint transformers saved from a float32 or float16 model holds F32 / F16 experts.
UNQUANTIZED: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
STACKED_FORMATS = ("bf16", "f16", "f32", "mxfp8", "nvfp4")
#: Elements per chunk of the NVFP4 decode on CUDA (float32 temporaries of ~256 MiB each).
_CUDA_CHUNK_ELEMS = 1 << 26


def _fmt_name(fmt: object) -> str:
    name = getattr(fmt, "name", fmt)
    if name not in STACKED_FORMATS:
        raise FormatError(f"unknown expert format {name!r}; known: {', '.join(STACKED_FORMATS)}")
    return str(name)


def stacked_parts(fmt: str, shape: Sequence[int]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """On-disk parts (suffix → (shape, dtype)) of a stacked [E, R, C] expert weight, in on-disk order."""
    name = _fmt_name(fmt)
    if len(shape) != 3 or any(int(s) <= 0 for s in shape):
        raise FormatError(f"stacked experts: expected a positive [E, rows, cols] shape, got {list(shape)}")
    e, r, c = (int(s) for s in shape)
    if name in UNQUANTIZED:
        return {WEIGHT: ((e, r, c), UNQUANTIZED[name])}
    if name == "mxfp8":
        _check_cols(name, c, MXFP8_BLOCK)
        return {WEIGHT: ((e, r, c), torch.float8_e4m3fn), SCALE: ((e, r, c // MXFP8_BLOCK), torch.uint8)}
    _check_cols(name, c, NVFP4_BLOCK)
    return {WEIGHT: ((e, r, c // 2), torch.uint8), SCALE: ((e, r, c // NVFP4_BLOCK), torch.float8_e4m3fn),
            AMAX: ((e,), torch.float32), DENOM: ((), torch.float32)}


def _check_cols(name: str, cols: int, block: int) -> None:
    if cols % block:
        raise FormatError(f"{name}: expert width {cols} is not a multiple of the block size {block}")


def format_of_parts(dtypes: Mapping[str, torch.dtype]) -> str | None:
    """The format a layer's stored parts (suffix → dtype) are in, or None if they fit none."""
    w = dtypes.get(WEIGHT)
    keys = set(dtypes)
    if keys == {WEIGHT}:
        return next((name for name, dt in UNQUANTIZED.items() if dt == w), None)
    if w == torch.float8_e4m3fn and keys == {WEIGHT, SCALE}:
        return "mxfp8"
    if w == torch.uint8 and keys == {WEIGHT, SCALE, AMAX, DENOM}:
        return "nvfp4"
    return None


def natural_dtype(fmt: str) -> torch.dtype:
    """The dtype a stacked format decodes to with no rounding beyond the format's own: its stored
    dtype when unquantized, else BF16 (what transformers' dequantizer produces)."""
    return UNQUANTIZED.get(_fmt_name(fmt), torch.bfloat16)


def interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[E, F, C] gate and up → [E, 2F, C] w13 with rows gate0, up0, gate1, up1, …"""
    if gate.shape != up.shape or gate.dim() != 3:
        raise FormatError(f"interleave: gate {list(gate.shape)} and up {list(up.shape)} must both be [E, F, C]")
    e, f, c = gate.shape
    return torch.stack([gate, up], dim=2).reshape(e, 2 * f, c)


def deinterleave(w13: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, 2F, C] → (gate, up), each [E, F, C] (views)."""
    if w13.dim() != 3 or w13.shape[1] % 2:
        raise FormatError(f"deinterleave: expected [E, 2F, C], got {list(w13.shape)}")
    return w13[:, 0::2], w13[:, 1::2]


# -- encode ---------------------------------------------------------------------------------------


def encode_stacked(fmt: object, w: torch.Tensor, *, name: str = "experts", amax: torch.Tensor | None = None,
                   allow_nonfinite: bool = False) -> dict[str, torch.Tensor]:
    """Encode a stacked [E, R, C] expert weight (w13 already interleaved) into its release parts.

    ``fmt`` is a format name or a codec from :func:`~inkling_ckpt.formats.get_format` (MXFP8
    options such as ``scale_mode`` travel with the codec). NVFP4: ``amax`` [E] gives the
    per-expert global amax (kept from a reference so unchanged weights reproduce its bytes);
    by default each expert's own max |x|. The stored ``_amax`` is the amax actually used
    (an all-zero expert is encoded and stored with amax 1.0, so decoding stays consistent).
    """
    fname = _fmt_name(fmt)
    if not isinstance(w, torch.Tensor) or w.dim() != 3:
        raise FormatError(f"{fname}: {name}: expected a stacked [E, rows, cols] tensor")
    if fname in UNQUANTIZED:
        if w.dtype != UNQUANTIZED[fname]:
            raise FormatError(f"{fname}: {name}: tensor is {w.dtype}, not {UNQUANTIZED[fname]} (no silent casts)")
        from .bf16 import BF16Format

        if fname == "bf16":
            return {WEIGHT: BF16Format().encode(w, name=name, allow_nonfinite=allow_nonfinite)["weight"]}
        if not allow_nonfinite and w.numel() and not all(bool(torch.isfinite(v)) for v in torch.aminmax(w)):
            raise NonFiniteError(f"{fname}: {name}: NaN or Inf values; pass --allow-nonfinite to keep them")
        return {WEIGHT: w.detach().contiguous()}
    codec: Any = fmt if not isinstance(fmt, str) else (MXFP8Format() if fname == "mxfp8" else NVFP4Format())
    if fname == "mxfp8":
        p = codec.encode(w, name=name, allow_nonfinite=allow_nonfinite)
        return {WEIGHT: p["weight"], SCALE: p["weight_scale"]}
    e = w.shape[0]
    if amax is not None:
        amax = _check_amax(amax, e, name, allow_nonfinite=False).to(w.device)
    parts = stacked_parts("nvfp4", w.shape)
    weight = torch.empty(parts[WEIGHT][0], dtype=torch.uint8, device=w.device)
    scale = torch.empty(parts[SCALE][0], dtype=torch.float8_e4m3fn, device=w.device)
    used = torch.empty(e, dtype=torch.float32, device=w.device)
    fast_cpu = getattr(codec, "fast", False) and not _gpu.wants(w) and w.is_contiguous()
    for i in range(e):
        if amax is None and fast_cpu:
            # One pass for the block maxima, kept for the encode pass (what the codec itself does
            # when it computes the amax), so the expert's amax comes free and is stored exactly.
            x2 = w[i].reshape(w.shape[1], -1)
            bam = _block_amax_all(x2)
            ga = bam.amax()
            if bool(torch.isfinite(ga)) and float(ga) >= MIN_GLOBAL_AMAX:
                wi, si = codec._encode_2d(x2, nvfp4_global_scale(ga), f"{name}[expert {i}]", allow_nonfinite, bam)
                weight[i], scale[i], used[i] = wi, si, ga
                continue
        # The expert's amax (kept, or its own max |x|); below 2^-126 the codec uses 1.0, so store that.
        ga = amax[i] if amax is not None else block_amax_bits(w[i].reshape(1, -1))[0]
        if amax is None and not bool(torch.isfinite(ga)):
            # NaN/Inf in the expert: NonFiniteError naming it, or (allowed) the amax of its finite values
            ga = _nvfp4_amax(w[i].reshape(w.shape[1], -1), f"{name}[expert {i}]", allow_nonfinite)
        if bool(torch.isfinite(ga)) and float(ga) < MIN_GLOBAL_AMAX:
            ga = torch.ones((), dtype=torch.float32, device=w.device)
        p = codec.encode(w[i], name=f"{name}[expert {i}]", global_amax=ga, allow_nonfinite=allow_nonfinite)
        weight[i] = p["weight"]
        scale[i] = p["weight_scale"]
        used[i] = ga
    return {WEIGHT: weight, SCALE: scale, AMAX: used,
            DENOM: torch.tensor(NVFP4_DENOMINATOR, dtype=torch.float32, device=w.device)}


def _check_amax(amax: torch.Tensor, experts: int, name: str, *, allow_nonfinite: bool) -> torch.Tensor:
    if not isinstance(amax, torch.Tensor) or amax.dtype != torch.float32 or tuple(amax.shape) != (experts,):
        raise FormatError(f"nvfp4: {name}: amax must be float32 [{experts}], got "
                          f"{getattr(amax, 'dtype', type(amax).__name__)} {list(getattr(amax, 'shape', []))}")
    if not allow_nonfinite:
        bad = ~(torch.isfinite(amax) & (amax > 0))
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            raise NonFiniteError(f"{name}_amax: expert {i} has global amax {float(amax[i])} (must be finite and > 0)")
    return amax


# -- decode ---------------------------------------------------------------------------------------


def decode_stacked(fmt: object, parts: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16, *,
                   name: str = "experts", allow_nonfinite: bool = False) -> torch.Tensor:
    """Decode a stacked expert weight's parts (any leading slice of experts) to ``dtype`` [E, R, C].

    Scales that cannot come from a quantizer (NVFP4 amax / denominator ≤ 0 or non-finite,
    negative or NaN block scales, MXFP8 NaN scale bytes) raise NonFiniteError naming the tensor
    and block unless ``allow_nonfinite``: they would decode to garbage.
    """
    fname = _fmt_name(fmt)
    check_out_dtype(dtype)
    w = parts.get(WEIGHT)
    if not isinstance(w, torch.Tensor) or w.dim() != 3:
        raise FormatError(f"{fname}: {name}: missing or non-3-D stacked weight")
    if fname in UNQUANTIZED:
        if w.dtype != UNQUANTIZED[fname]:
            raise FormatError(f"{fname}: {name}: weight is {w.dtype}, expected {UNQUANTIZED[fname]}")
        return w.to(dtype)
    sc = parts.get(SCALE)
    if not isinstance(sc, torch.Tensor):
        raise FormatError(f"{fname}: {name}: missing block scales ({name}{SCALE})")
    if fname == "mxfp8":
        if sc.dtype != torch.uint8 and sc.dtype == getattr(torch, "float8_e8m0fnu", None):
            sc = sc.view(torch.uint8)
        if not allow_nonfinite and sc.numel() and bool((sc == 0xFF).any()):
            idx = tuple(int(i) for i in torch.nonzero(sc == 0xFF)[0])
            raise NonFiniteError(f"{name}{SCALE}: NaN scale byte 0xFF at block {idx}; pass --allow-nonfinite to decode it as NaN")
        return MXFP8Format().decode({"weight": w, "weight_scale": sc}, dtype)
    return _decode_nvfp4(parts, w, sc, dtype, name, allow_nonfinite)


def _decode_nvfp4(parts: Mapping[str, torch.Tensor], w: torch.Tensor, sc: torch.Tensor, dtype: torch.dtype,
                  name: str, allow_nonfinite: bool) -> torch.Tensor:
    amax, denom = parts.get(AMAX), parts.get(DENOM)
    if not isinstance(amax, torch.Tensor) or not isinstance(denom, torch.Tensor):
        raise FormatError(f"nvfp4: {name}: missing {name}{AMAX} or {name}{DENOM}")
    e, r, half = w.shape
    if w.dtype != torch.uint8 or sc.dtype != torch.float8_e4m3fn:
        raise FormatError(f"nvfp4: {name}: weight must be U8 and scale F8_E4M3, got {w.dtype} / {sc.dtype}")
    if tuple(sc.shape) != (e, r, half * 2 // NVFP4_BLOCK) or tuple(amax.shape) != (e,) or amax.dtype != torch.float32:
        raise FormatError(f"nvfp4: {name}: parts do not line up (weight {list(w.shape)}, scale {list(sc.shape)}, "
                          f"amax {list(amax.shape)})")
    if denom.dtype != torch.float32 or denom.numel() not in (1, e):
        raise FormatError(f"nvfp4: {name}{DENOM} must be a float32 scalar or [E], got {list(denom.shape)}")
    factor = amax.float() / denom.float().reshape(-1).expand(e)  # one float32 division per expert
    if not allow_nonfinite:
        bad = ~(torch.isfinite(factor) & (factor > 0))
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            raise NonFiniteError(f"{name}: expert {i} has global factor amax/denominator = {float(factor[i])} "
                                 "(must be finite and > 0); pass --allow-nonfinite to decode it anyway")
        sbits = sc.view(torch.uint8)
        badb = (sbits & 0x80).bool() | ((sbits & 0x7F) == 0x7F)
        if bool(badb.any()):
            idx = tuple(int(i) for i in torch.nonzero(badb)[0])
            raise NonFiniteError(f"{name}{SCALE}: negative or NaN block scale at block {idx}; "
                                 "pass --allow-nonfinite to decode it anyway")
    cols = half * 2
    nb = cols // NVFP4_BLOCK
    out = torch.empty((e, r, cols), dtype=dtype, device=w.device)
    pair = _pair_table(w.device)
    e4m3 = decode_table(E4M3, w.device)
    # Rows of all experts in one sequence, each with its expert's factor, so chunks span experts:
    # on CUDA a chunk per expert-slice of 2^18 elements is launch-bound (4.6 s for a full-size
    # layer on an H200, against 0.16 s in 2^26-element chunks); on CPU the small chunks stay in cache.
    w2, sc2, out2 = w.reshape(e * r, half), sc.reshape(e * r, nb), out.view(e * r, cols)
    factor_rows = factor.to(w.device).repeat_interleave(r)
    for r0, r1 in row_chunks(e * r, cols, _CUDA_CHUNK_ELEMS if w.is_cuda else None):
        n = r1 - r0
        vals = pair.index_select(0, w2[r0:r1].reshape(-1).int()).view(n, nb, NVFP4_BLOCK)
        sbf = e4m3.index_select(0, sc2[r0:r1].reshape(-1).view(torch.uint8).int()).view(n, nb, 1)
        vals *= sbf  # exact (a 2-bit mantissa times a 4-bit one)
        # the float32 product (one rounding, as transformers), cast once into the output
        torch.mul(vals, factor_rows[r0:r1].view(n, 1, 1), out=out2[r0:r1].view(n, nb, NVFP4_BLOCK))
    return out


__all__ = [
    "NVFP4_DENOMINATOR", "STACKED_FORMATS", "WEIGHT", "SCALE", "AMAX", "DENOM", "stacked_parts", "format_of_parts",
    "interleave", "deinterleave", "encode_stacked", "decode_stacked",
]
