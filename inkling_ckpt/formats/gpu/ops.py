"""Launch wrappers for the Triton codec kernels (this module imports Triton).

All functions take and return torch tensors on the kernel's device; ``x`` is viewed as
``[G, N]``: G groups of N contiguous elements, each group with its own NVFP4 global scale
(an expert's fused gate/up rows, or one whole tensor with G = 1). Nothing here synchronizes
with the host: non-finite input is reported through the returned ``bad`` flag tensors.
"""

from __future__ import annotations

import os

import torch
import triton

from ..encodings import E2M1, E4M3, E5M2, E8M0, decode_table
from . import _kernels as K

#: Tile sizes (blocks per program) and warps; module globals so the bench can try others.
NVFP4_ENC = {"NB": 128, "num_warps": 4}
MXFP8_ENC = {"NB": 64, "num_warps": 4}
DEC = {"NB": 256, "num_warps": 4}
AMAX = {"CHUNK": 16384, "TILE": 2048, "num_warps": 8}

_MAX_GRID_Y = 65535

#: BF16 inputs take the register-resident kernels (``*_bf16_kernel``); False forces the generic
#: ones (tests run both). Hardware FP8 casts are used except in Triton's interpreter.
BF16_FAST = True
NVFP4_BF16 = {"NB": 128, "num_warps": 4, "ITERS": 8}  # ITERS 0: the one-tile kernel
#: NVFP4 decode to BF16 by per-block byte tables (``nvfp4_decode_bf16_kernel``); False: the generic kernels.
DEC_BF16_FAST = True
NVFP4_DEC_BF16 = {"NB": 128, "num_warps": 4}
#: MXFP8 (E4M3) decode to BF16 by exponent re-biasing (``mxfp8_decode_bf16_kernel``), under the same switch.
MXFP8_DEC_BF16 = {"NB": 64, "num_warps": 4}
MXFP8_BF16 = {"NB": 128, "num_warps": 4}
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

_ELEM = {  # element: (encoding, MBITS, BIAS, SUB_SCALE = 2^(BIAS-1+MBITS), MIN_NORMAL = 2^(1-BIAS))
    "e4m3": (E4M3, 3, 7, 2.0**9, 2.0**-6),
    "e5m2": (E5M2, 2, 15, 2.0**16, 2.0**-14),
}
_ELEM_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_OUT_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _groups(x: torch.Tensor, block: int) -> tuple[int, int]:
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"expected a contiguous [G, N] tensor, got shape {list(x.shape)}")
    g, n = x.shape
    if n % block:
        raise ValueError(f"group size {n} is not a multiple of the block {block}")
    return g, n


def _in(x: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The kernel's view of an input: bf16 as int16 bits (widened exactly in the kernel)."""
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16), True
    return x, False


def _out(t: torch.Tensor) -> torch.Tensor:
    """The kernel's view of a decode output: bf16 as int16 bits (rounded in the kernel)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _bf16_words(x: torch.Tensor) -> bool:
    """Can the BF16 kernels read x as int32 words (bf16, even element offset)?"""
    return BF16_FAST and x.dtype == torch.bfloat16 and x.storage_offset() % 2 == 0


def _group_slices(g: int):
    for g0 in range(0, g, _MAX_GRID_Y):
        yield g0, min(g, g0 + _MAX_GRID_Y)


def group_amax(x: torch.Tensor, *, bad: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax float32 [G] over the finite elements of each group, bad int32 [G]: 1 where a group
    holds NaN/Inf). One read of x; no host synchronization. ``bad``: a zeroed int32 tensor whose
    first element is set instead, for any group (one flag for all; returned as given). ``out``:
    a zeroed int32 [G] tensor to accumulate the amax bits in (the result is its float32 view)."""
    g, n = _groups(x, 1)
    if out is None:
        bits = torch.zeros(g, dtype=torch.int32, device=x.device)
    elif out.dtype != torch.int32 or tuple(out.shape) != (g,) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous int32 [{g}], got {out.dtype} {list(out.shape)}")
    else:
        bits = out
    stride = 1 if bad is None else 0
    if bad is None:
        bad = torch.zeros(g, dtype=torch.int32, device=x.device)
    if n and _bf16_words(x):
        c = AMAX
        xw = x.view(torch.int32)
        for g0, g1 in _group_slices(g):
            grid = (triton.cdiv(n // 2, c["CHUNK"] // 2), g1 - g0)
            K.group_amax_bf16_kernel[grid](xw[g0:g1], bits[g0:g1], bad[g0 * stride:], n // 2, CHUNK=c["CHUNK"] // 2,
                                           TILE=c["TILE"] // 2, BAD_STRIDE=stride, num_warps=c["num_warps"])
    elif n:
        c = AMAX
        for g0, g1 in _group_slices(g):
            grid = (triton.cdiv(n, c["CHUNK"]), g1 - g0)
            xi, bf = _in(x[g0:g1])
            K.group_amax_kernel[grid](xi, bits[g0:g1], bad[g0 * stride:], n, CHUNK=c["CHUNK"], TILE=c["TILE"],
                                      IN_BF16=bf, BAD_STRIDE=stride, num_warps=c["num_warps"])
    return bits.view(torch.float32), bad


def nvfp4_global_scales(amax: torch.Tensor) -> torch.Tensor:
    """weight_scale_2 per group on the device: f32(amax) / 2688, an amax below 2^-126 taken as 1.0
    (the reference's zero-tensor policy, ``nvfp4.nvfp4_global_scale``)."""
    a = amax.float()
    a = torch.where(a < 2.0**-126, torch.ones_like(a), a)
    # tensor / tensor: IEEE division on CUDA too (a Python-scalar divisor becomes a reciprocal-multiply)
    return a / torch.full_like(a, 2688.0)


def nvfp4_encode(x: torch.Tensor, s2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 encode of x [G, N] with global scales s2 (float32 [G], on x's device).

    Returns (packed uint8 [G, N/2], scale float8_e4m3fn [G, N/16], bad int32 [1])."""
    g, _ = _groups(x, 16)
    s2 = s2.reshape(-1).to(device=x.device, dtype=torch.float32).contiguous()
    if s2.numel() != g:
        raise ValueError(f"{s2.numel()} global scales for {g} groups")
    bad = torch.zeros(1, dtype=torch.int32, device=x.device)
    w, sc = _nvfp4_encode(x, s2, bad, None, None, False)
    return w, sc, bad


def nvfp4_encode_from_amax(x: torch.Tensor, amax: torch.Tensor, *, check_amax: bool = False,
                           bad: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """NVFP4 encode of x [G, N] with each group's global scale computed in the kernel from its
    amax (float32 [G], on x's device) by the reference's policy (``nvfp4_global_scale``; an amax
    below 2^-126 is used as 1.0): no launches before the encode.

    Returns (packed uint8 [G, N/2], scale float8_e4m3fn [G, N/16], amax used float32 [G],
    denominator 2688.0 float32 [], bad int32 [2]): bad[0] = 1 where a block holds NaN/Inf, with
    ``check_amax`` bad[1] = 1 where a given amax is not finite and > 0. ``bad``: a zeroed int32
    tensor of at least 2 elements to use (and return) instead of a new one."""
    g, _ = _groups(x, 16)
    if amax.dtype != torch.float32 or amax.numel() != g or amax.device != x.device:
        raise ValueError(f"amax must be float32 [{g}] on {x.device}, got {amax.dtype} [{amax.numel()}] on {amax.device}")
    amax = amax.reshape(-1).contiguous()
    if bad is None:
        bad = torch.zeros(2, dtype=torch.int32, device=x.device)
    used = torch.empty(g, dtype=torch.float32, device=x.device)
    denom = torch.empty((), dtype=torch.float32, device=x.device)
    w, sc = _nvfp4_encode(x, amax, bad, used, denom, check_amax)
    return w, sc, used, denom, bad


def _nvfp4_encode(x: torch.Tensor, s2: torch.Tensor, bad: torch.Tensor, used: torch.Tensor | None,
                  denom: torch.Tensor | None, check_amax: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The launches of nvfp4_encode; with ``used`` (and ``denom``) s2 holds amax values instead."""
    g, n = x.shape
    w = torch.empty((g, n // 2), dtype=torch.uint8, device=x.device)
    sc = torch.empty((g, n // 16), dtype=torch.uint8, device=x.device)
    from_amax = used is not None
    den = denom if denom is not None else s2  # an unused pointer when not from_amax
    if n and _bf16_words(x):
        xw = x.view(torch.int32)
        w64 = w.view(torch.int64)
        nb, it = NVFP4_BF16["NB"], NVFP4_BF16.get("ITERS", 0)
        for g0, g1 in _group_slices(g):
            u = used[g0:g1] if used is not None else s2
            if it:
                grid = (triton.cdiv(n // 16, nb * it), g1 - g0)
                K.nvfp4_encode_bf16_loop_kernel[grid](xw[g0:g1], s2[g0:g1], w64[g0:g1], sc[g0:g1], bad, u, den, n // 2,
                                                      NB=nb, ITERS=it, HW=not _INTERPRETING, FROM_AMAX=from_amax,
                                                      CHECK_AMAX=check_amax, num_warps=NVFP4_BF16["num_warps"])
            else:
                grid = (triton.cdiv(n // 16, nb), g1 - g0)
                K.nvfp4_encode_bf16_kernel[grid](xw[g0:g1], s2[g0:g1], w64[g0:g1], sc[g0:g1], bad, u, den, n // 2, NB=nb,
                                                 FROM_AMAX=from_amax, CHECK_AMAX=check_amax,
                                                 num_warps=NVFP4_BF16["num_warps"])
    elif n:
        nb = NVFP4_ENC["NB"]
        for g0, g1 in _group_slices(g):
            grid = (triton.cdiv(n // 16, nb), g1 - g0)
            xi, bf = _in(x[g0:g1])
            u = used[g0:g1] if used is not None else s2
            K.nvfp4_encode_kernel[grid](xi, s2[g0:g1], w[g0:g1], sc[g0:g1], bad, u, den, n, NB=nb, IN_BF16=bf,
                                        FROM_AMAX=from_amax, CHECK_AMAX=check_amax, num_warps=NVFP4_ENC["num_warps"])
    elif used is not None and denom is not None:  # no blocks, so no program stores them: the same policy here
        used.copy_(torch.where(s2 < 2.0**-126, torch.ones_like(s2), s2))
        denom.fill_(2688.0)
        if check_amax:
            bad[1:2].copy_((~(torch.isfinite(s2) & (s2 > 0))).any().reshape(1).int())
    return w, sc.view(torch.float8_e4m3fn)


def mxfp8_encode(x: torch.Tensor, scale_mode: str = "rceil", element: str = "e4m3", *,
                 bad: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MXFP8 encode of x [G, N]. Returns (elements [G, N] as the element dtype, scale uint8 [G, N/32], bad int32 [1]:
    1 where a block holds NaN/Inf; ``bad``: a zeroed int32 tensor to use, and return, instead)."""
    g, n = _groups(x, 32)
    enc, mbits, bias, sub_scale, min_normal = _ELEM[element]
    emax = int(enc.max).bit_length() - 1  # 8 for E4M3 (448), 15 for E5M2 (57344)
    q = torch.empty((g, n), dtype=torch.uint8, device=x.device)
    sc = torch.empty((g, n // 32), dtype=torch.uint8, device=x.device)
    if bad is None:
        bad = torch.zeros(1, dtype=torch.int32, device=x.device)
    if n and _bf16_words(x):
        xw = x.view(torch.int32)
        q64 = q.view(torch.int64)
        nb = MXFP8_BF16["NB"]
        for g0, g1 in _group_slices(g):
            grid = (triton.cdiv(n // 32, nb), g1 - g0)
            K.mxfp8_encode_bf16_kernel[grid](xw[g0:g1], q64[g0:g1], sc[g0:g1], bad, n // 2, ELEM_MAX=float(enc.max),
                                             EMAX=emax, MBITS=mbits, BIAS=bias, SUB_SCALE=sub_scale,
                                             MIN_NORMAL=min_normal, RCEIL=scale_mode == "rceil", NB=nb,
                                             HW_CVT=not _INTERPRETING, E5M2=element == "e5m2",
                                             num_warps=MXFP8_BF16["num_warps"])
    elif n:
        nb = MXFP8_ENC["NB"]
        for g0, g1 in _group_slices(g):
            grid = (triton.cdiv(n // 32, nb), g1 - g0)
            xi, bf = _in(x[g0:g1])
            K.mxfp8_encode_kernel[grid](xi, q[g0:g1], sc[g0:g1], bad, n, ELEM_MAX=float(enc.max), EMAX=emax,
                                        MBITS=mbits, BIAS=bias, SUB_SCALE=sub_scale, MIN_NORMAL=min_normal,
                                        RCEIL=scale_mode == "rceil", NB=nb, IN_BF16=bf, num_warps=MXFP8_ENC["num_warps"])
    return q.view(_ELEM_DTYPE[element]), sc, bad


def _out_buffer(out: torch.Tensor | None, g: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty((g, n), dtype=dtype, device=device)
    if out.dtype != dtype or tuple(out.shape) != (g, n) or not out.is_contiguous() or out.device != device:
        raise ValueError(f"out must be a contiguous {dtype} [{g}, {n}] on {device}, got {out.dtype} {list(out.shape)}")
    return out


def nvfp4_decode(w: torch.Tensor, sc: torch.Tensor, s2: torch.Tensor | None, dtype: torch.dtype, *,
                 factor_last: bool = False, out: torch.Tensor | None = None, bad: torch.Tensor | None = None,
                 amax: torch.Tensor | None = None, denom: torch.Tensor | None = None) -> torch.Tensor:
    """Decode packed NVFP4 [G, N/2] + scales [G, N/16] with global scales s2 [G] to ``dtype`` [G, N].

    ``e2m1 * (scale * s2)``, or with ``factor_last`` ``(e2m1 * scale) * s2`` (the stacked experts'
    order, s2 = amax / denominator). ``out``: a contiguous [G, N] tensor to write into. ``bad``:
    an int32 [1] device tensor set to 1 where a scale byte is >= 0x7F (negative or NaN; no
    quantizer writes one), the decode being done regardless. ``amax`` [G] and ``denom`` (one or
    [G], float32, on w's device) instead of s2: the factor amax / denom, divided in the kernel
    (``factor_last`` order), and with ``bad`` also flagged there unless finite and > 0."""
    g, half = _groups(w, 8)
    n = half * 2
    if amax is not None and denom is not None and s2 is None:
        s2 = amax.reshape(-1)
        den = denom.reshape(-1)
        if (s2.dtype != torch.float32 or den.dtype != torch.float32 or den.numel() not in (1, g)
                or s2.device != w.device or den.device != w.device):
            raise ValueError(f"amax and denom must be float32 on {w.device}, denom one value or one per group")
        den = den.contiguous()
        factor_last, den_stride, from_amax = True, int(den.numel() != 1), True
    elif amax is None and denom is None and s2 is not None:
        s2 = s2.reshape(-1).to(device=w.device, dtype=torch.float32)
        den, den_stride, from_amax = s2, 0, False
    else:
        raise ValueError("give either s2 or both amax and denom")
    s2 = s2.contiguous()
    if s2.numel() != g:
        raise ValueError(f"{s2.numel()} global scales for {g} groups")
    out = _out_buffer(out, g, n, dtype, w.device)
    e2 = decode_table(E2M1, w.device)
    e4 = decode_table(E4M3, w.device)
    flag = e4 if bad is None else bad  # an unused pointer without bad
    if n and DEC_BF16_FAST and dtype == torch.bfloat16 and w.storage_offset() % 8 == 0 and out.storage_offset() % 2 == 0:
        ww, ow = w.view(torch.int64), out.view(torch.int32)  # one block's 8 packed bytes; 2 BF16 per word
        c = NVFP4_DEC_BF16
        nblk = n // 16
        for g0, g1 in _group_slices(g):
            grid = (triton.cdiv(nblk, c["NB"]), g1 - g0)
            K.nvfp4_decode_bf16_kernel[grid](ww[g0:g1], sc.view(torch.uint8)[g0:g1], s2[g0:g1], e2, e4, ow[g0:g1], flag,
                                             den[g0 * den_stride:], nblk, NB=c["NB"], FACTOR_LAST=bool(factor_last),
                                             BAD_FROM=0 if bad is None else 0x7F, FROM_AMAX=from_amax,
                                             DEN_STRIDE=den_stride, HW=not _INTERPRETING, EVEN=nblk % c["NB"] == 0,
                                             num_warps=c["num_warps"])
    elif n:
        nb = DEC["NB"]
        for g0, g1 in _group_slices(g):
            grid = (triton.cdiv(n // 16, nb), g1 - g0)
            K.nvfp4_decode_kernel[grid](w[g0:g1], sc.view(torch.uint8)[g0:g1], s2[g0:g1], e2, e4, _out(out[g0:g1]),
                                        flag, den[g0 * den_stride:], n, NB=nb,
                                        OUT_KIND=_OUT_KIND[dtype], FACTOR_LAST=bool(factor_last),
                                        BAD_FROM=0 if bad is None else 0x7F, FROM_AMAX=from_amax,
                                        DEN_STRIDE=den_stride, num_warps=DEC["num_warps"])
    return out


def mxfp8_decode(q: torch.Tensor, sc: torch.Tensor, element: str, dtype: torch.dtype, *,
                 out: torch.Tensor | None = None, bad: torch.Tensor | None = None) -> torch.Tensor:
    """Decode MXFP8 elements [G, N] + E8M0 scales [G, N/32] to ``dtype`` [G, N] (into ``out`` if given;
    ``bad``: int32 [1] set to 1 where a scale byte is 0xFF, E8M0 NaN)."""
    g, n = _groups(q, 32)
    out = _out_buffer(out, g, n, dtype, q.device)
    et = decode_table(_ELEM[element][0], q.device)
    st = decode_table(E8M0, q.device)
    if (n and DEC_BF16_FAST and dtype == torch.bfloat16 and element == "e4m3" and q.storage_offset() % 4 == 0
            and out.storage_offset() % 2 == 0):
        c = MXFP8_DEC_BF16
        nblk = n // 32
        qw, ow = q.view(torch.uint8).view(torch.int32), out.view(torch.int32)  # 4 elements / 2 BF16 per word
        for g0, g1 in _group_slices(g):
            grid = (triton.cdiv(nblk, c["NB"]), g1 - g0)
            K.mxfp8_decode_bf16_kernel[grid](qw[g0:g1], sc.view(torch.uint8)[g0:g1], et, st, ow[g0:g1],
                                             st if bad is None else bad, nblk, NB=c["NB"],
                                             BAD_FROM=0 if bad is None else 0xFF, HW=not _INTERPRETING,
                                             EVEN=nblk % c["NB"] == 0, num_warps=c["num_warps"])
    elif n:
        nb = DEC["NB"]
        for g0, g1 in _group_slices(g):
            grid = (triton.cdiv(n // 32, nb), g1 - g0)
            K.mxfp8_decode_kernel[grid](q.view(torch.uint8)[g0:g1], sc.view(torch.uint8)[g0:g1], et, st, _out(out[g0:g1]),
                                        st if bad is None else bad, n, NB=nb, OUT_KIND=_OUT_KIND[dtype],
                                        BAD_FROM=0 if bad is None else 0xFF, num_warps=DEC["num_warps"])
    return out
