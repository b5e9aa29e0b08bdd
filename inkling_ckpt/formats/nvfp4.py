"""NVFP4: E2M1 elements in blocks of 16 along K, E4M3 block scales, one FP32 global scale.

Encoding reproduces NVIDIA ModelOpt 0.47 ``NVFP4QTensor`` operation by operation
(spec/formats.md "NVFP4"; reference/quant-formats.md §2.4)::

    s2 = f32(amax) / (6 * 448)                    # nvfp4_global_scale; amax over the fused group
    sb = block_amax / f32(6 * s2)
    sb[sb == 0] = 1.0                             # all-zero block -> scale byte 0x38
    sb = e4m3_rne(clamp(sb, 2**-9, 448))
    q  = round_e2m1(x / f32(f32(sb) * s2))        # one IEEE division per element

``round_e2m1`` is round-to-nearest-even on {0, .5, 1, 1.5, 2, 3, 4, 6}, saturating at 6.
The sign nibble is ``x < 0``: exact -0.0 encodes 0x0, a negative value that rounds to
zero encodes 0x8. Element 2j goes in the low nibble of byte j.

Policies this module decides (not covered by ModelOpt, which yields NaN scales here):

* **Zero tensor.** A global amax below 2^-126 (all-zero, or only fp32-subnormal values)
  is replaced by 1.0, so ``weight_scale_2 = 1/2688``: every block then encodes as scale
  0x38 with zero nibbles and decodes to exact zeros, and consumers never see a zero or
  subnormal global scale (they take its reciprocal).
* **Sign of underflow.** The sign comes from ``x < 0`` as the contract says; ModelOpt
  takes it from the scaled value, so the two differ only when ``x / scale`` underflows
  to -0.0 (a block spanning more than ~2^150 in magnitude).
* **Non-finite input** is an error (NonFiniteError with the tensor name and first index)
  unless ``allow_nonfinite``. Then: the global amax, when computed here, is taken over
  the finite elements only; every block that holds a NaN or ±Inf gets scale byte 0x7F
  (E4M3 NaN) and all-zero nibbles, so the whole block decodes to NaN (Inf's sign and
  the block's finite values are not kept). Other blocks encode normally.
* **Memory.** Work goes in row chunks of ~256K elements; when the global amax is computed
  here, the block maxima (float32, 1/16 of the elements: 1/8 of a bf16 input's bytes) are
  kept between the amax pass and the encode pass.
* **Given scales.** ``weight_scale_2`` is used verbatim (must be finite and > 0);
  ``global_amax`` goes through :func:`nvfp4_global_scale`. ``input_scale`` is stored
  verbatim as float32, else 1.0 (a fresh quantize has no activation calibration).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..errors import FormatError
from ._base import (
    Format,
    Parts,
    PartSpec,
    _group_names,
    block_amax_bits,
    check_input,
    check_out_dtype,
    check_width,
    raise_nonfinite,
    require_parts,
    row_chunks,
    scalar_f32,
)
from .encodings import E2M1, E4M3, decode_e2m1, decode_table
from . import gpu as _gpu  # fused Triton kernels for CUDA tensors (Triton imported lazily)

BLOCK = 16
E2M1_MAX = E2M1.max  # 6.0
E4M3_MAX = E4M3.max  # 448.0
SCALE_MIN = 2.0**-9  # smallest E4M3 subnormal: block scales never go below it
ZERO_BLOCK_SCALE = 1.0  # ModelOpt's stand-in for a zero block scale (byte 0x38)
NAN_SCALE_BYTE = 0x7F  # E4M3 NaN: marks a non-finite block under allow_nonfinite
MIN_GLOBAL_AMAX = 2.0**-126  # below this (zero / subnormal) the global amax is taken as 1.0

_LITTLE_ENDIAN = sys.byteorder == "little"


def nvfp4_global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """``weight_scale_2`` for a (group) amax: 0-d float32 ``f32(amax) / (6 * 448)``.

    An amax below 2^-126 (all-zero tensor) is taken as 1.0 (see the module docstring).
    Raises FormatError for a negative or non-finite amax.
    """
    device = amax.device if isinstance(amax, torch.Tensor) else torch.device("cpu")
    a = scalar_f32(amax, device, "nvfp4 global amax")
    av = float(a)
    if not (av >= 0.0) or av == float("inf"):
        raise FormatError(f"nvfp4: global amax must be finite and >= 0, got {av}")
    if av < MIN_GLOBAL_AMAX:
        a = torch.ones((), dtype=torch.float32, device=device)
    # ModelOpt: amax.float() / (E2M1_MAX * E4M3_MAX); 6 * 448 = 2688 exactly. The divisor is a
    # tensor: torch divides a CUDA tensor by a Python scalar as a reciprocal-multiply (1 ulp off).
    return a / torch.tensor(E2M1_MAX * E4M3_MAX, dtype=torch.float32, device=device)


# -- element rounding -------------------------------------------------------------------------


def round_e2m1_reference(y: torch.Tensor) -> torch.Tensor:
    """Magnitude codes 0..7 (uint8) of |y| rounded to nearest-even on the E2M1 grid, saturating.

    Written as comparisons against the midpoints: a tie goes up exactly where the upper
    neighbour has an even code (0.75 -> 1.0, 1.75 -> 2.0, 3.5 -> 4.0), down elsewhere.
    NaN counts as beyond the grid (code 7), as ModelOpt's searchsorted does.
    """
    a = torch.fmin(y.abs(), torch.tensor(E2M1_MAX, dtype=y.dtype, device=y.device))
    code = (a > 0.25).to(torch.uint8)
    code += a >= 0.75
    code += a > 1.25
    code += a >= 1.75
    code += a > 2.5
    code += a >= 3.5
    code += a > 5.0
    return code


# The fast rounding, by table. Every E2M1 decision point (0.25, 0.75, ..., 5) is a float32 whose low
# 21 bits are zero, so a code depends only on ``f = bits >> 21`` (sign, exponent, two mantissa
# bits) and on whether the low 21 bits are non-zero (a tie against a decision point or just above
# it). ``c = (bits + 2^21 - 1) >> 21`` is ``f`` plus that flag, so ``f + c`` (mod 4096) indexes a
# table of every case, signed codes included: two shifts, two adds and a mask per element, and one
# gather, where the comparisons or bit arithmetic with conversions took ~20 passes. The table is
# built by the reference rounding itself, from one representative float per entry.
_CODE_SHIFT = 21
_LOW_ONES = (1 << _CODE_SHIFT) - 1
_CODE_INDEX_MASK = 4095  # f + c lies in [-2048, 2047]; the mask maps it onto the table


@functools.cache
def _signed_code_table() -> torch.Tensor:
    """uint8 [4096]: entry ``(f + c) & 4095`` (see above) -> the signed E2M1 code (sign nibble bit: y's sign bit)."""
    s = torch.arange(4096, dtype=torch.int64)
    s = torch.where(s < 2048, s, s - 4096)  # 2 * (bits >> 21) + (low bits non-zero), signed
    neg = s < 0
    hi = (s + torch.where(neg, 2048, 0)) >> 1  # the magnitude's bits >> 21
    rep = ((hi << _CODE_SHIFT) | (s & 1)).to(torch.int32).view(torch.float32)  # a magnitude in that case
    return (round_e2m1_reference(rep) | (neg.to(torch.uint8) << 3)).contiguous()


def _e2m1_signed_codes(y: torch.Tensor, f: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 signed E2M1 codes (same shape) of float32 ``y`` (overwritten), the sign nibble bit from y's sign bit.

    Magnitudes round as :func:`round_e2m1_reference`. ``y`` must hold no NaN: the index of a NaN
    with a large payload overflows (the encoder replaces NaN first; its blocks are zeroed later).
    ``f``: a reused int32 buffer of y's size (a fresh one when not given).
    """
    yi = y.view(torch.int32)
    f = torch.bitwise_right_shift(yi, _CODE_SHIFT, out=f if f is not None else torch.empty_like(yi))
    yi += _LOW_ONES  # no overflow below NaN's bit patterns
    yi >>= _CODE_SHIFT
    yi += f
    yi &= _CODE_INDEX_MASK
    # (index_select into a given buffer ran at half the speed of a fresh result on the CPU)
    return _signed_code_table().to(y.device).index_select(0, yi.reshape(-1)).view(y.shape)


def round_e2m1_fast(y: torch.Tensor) -> torch.Tensor:
    """Same result as :func:`round_e2m1_reference` (bit-for-bit, tested), by the table above.

    ``y`` must be float32 and is overwritten.
    """
    a = y.abs_()
    a.masked_fill_(a.isnan(), E2M1_MAX)  # NaN counts as beyond the grid, as the reference
    return _e2m1_signed_codes(a)


def _pack_nibbles_reference(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., 2n] -> bytes [..., n] with element 2j in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _pack_codes_u8_into(codes: torch.Tensor, out: torch.Tensor) -> None:
    """uint8 codes [n, 2m] (contiguous) -> ``out`` uint8 [n, m], element 2j in the low nibble.

    On little-endian machines a pair of codes read as one int16 is ``lo | hi << 8``;
    ``v | v >> 4`` puts ``lo | hi << 4`` in the low byte, and the copy to uint8 keeps it
    (integer conversion is modulo 256).
    """
    if _LITTLE_ENDIAN:
        v = codes.view(torch.int16)
        out.copy_(v | (v >> 4))
    else:
        out.copy_(_pack_nibbles_reference(codes))


# -- the codec --------------------------------------------------------------------------------


class NVFP4Format(Format):
    """NVFP4 in ModelOpt naming: weight (U8 packed), weight_scale (F8_E4M3), weight_scale_2, input_scale."""

    name = "nvfp4"
    block = BLOCK
    quant_algo = "NVFP4"

    def __init__(self, *, fast: bool = True) -> None:
        # fast=False selects the plain reference path (abs/amax, comparison rounding, x < 0 sign,
        # strided packing, float8 casts); tests pin the fast path to it bit for bit.
        self.fast = bool(fast)

    def parts(self, shape: Sequence[int]) -> PartSpec:
        _, width = check_width(self.name, shape, BLOCK)
        lead = tuple(int(s) for s in shape[:-1])
        return {
            "weight": ((*lead, width // 2), torch.uint8),
            "weight_scale": ((*lead, width // BLOCK), torch.float8_e4m3fn),
            "weight_scale_2": ((), torch.float32),
            "input_scale": ((), torch.float32),
        }

    # encode ----------------------------------------------------------------------------------
    def encode(
        self,
        x: torch.Tensor,
        *,
        name: str = "tensor",
        weight_scale_2: torch.Tensor | float | None = None,
        global_amax: torch.Tensor | float | None = None,
        input_scale: torch.Tensor | float | None = None,
        allow_nonfinite: bool = False,
    ) -> Parts:
        """Encode ``x`` ([..., in], in % 16 == 0) to NVFP4 parts (see the module docstring)."""
        rows, width = check_input(self.name, x, name, BLOCK)
        if weight_scale_2 is not None and global_amax is not None:
            raise FormatError(f"nvfp4: {name}: give weight_scale_2 or global_amax, not both")
        x2 = x.detach().contiguous().view(rows, width)
        bamax_all = None
        if weight_scale_2 is not None:
            s2 = scalar_f32(weight_scale_2, x.device, f"nvfp4: {name}: weight_scale_2")
            sv = float(s2)
            if not (0.0 < sv < float("inf")):
                raise FormatError(f"nvfp4: {name}: weight_scale_2 must be finite and > 0, got {sv}")
        else:
            if global_amax is None:
                if rows == 0:
                    global_amax = 0.0  # empty tensor: nothing to scale
                elif self.fast and not _gpu.wants(x2):  # (on the GPU, _amax is one reduction kernel)
                    # one pass for the block maxima, kept (1/16 of the elements) for the encode pass
                    bamax_all = _block_amax_all(x2)
                    global_amax = bamax_all.amax()
                    if not bool(torch.isfinite(global_amax)):
                        global_amax = _amax(x2, name, allow_nonfinite)
                else:
                    global_amax = _amax(x2, name, allow_nonfinite)
            s2 = nvfp4_global_scale(scalar_f32(global_amax, x.device, f"nvfp4: {name}: global_amax"))
        if input_scale is None:
            isc = torch.ones((), dtype=torch.float32, device=x.device)
        else:
            isc = scalar_f32(input_scale, x.device, f"nvfp4: {name}: input_scale")
        weight, scale = self._encode_2d(x2, s2, name, allow_nonfinite, bamax_all)
        lead = tuple(x.shape[:-1])
        return {
            "weight": weight.view(*lead, width // 2),
            "weight_scale": scale.view(*lead, width // BLOCK),
            "weight_scale_2": s2.clone(),
            "input_scale": isc.clone(),
        }

    def encode_group(
        self,
        xs: Sequence[torch.Tensor],
        *,
        names: Sequence[str] | None = None,
        **kw: Any,
    ) -> list[Parts]:
        """Encode a fused group with ONE shared weight_scale_2 from the max amax over all of ``xs``."""
        names = _group_names(xs, names)
        if not xs:
            return []
        if kw.get("weight_scale_2") is None and kw.get("global_amax") is None:
            allow = bool(kw.get("allow_nonfinite", False))
            amaxes = []
            for x, n in zip(xs, names, strict=True):
                rows, width = check_input(self.name, x, n, BLOCK)
                amaxes.append(_amax(x.detach().contiguous().view(rows, width), n, allow).to(xs[0].device))
            kw = {**kw, "global_amax": torch.stack(amaxes).amax()}
        return [self.encode(x, name=n, **kw) for x, n in zip(xs, names, strict=True)]

    def _encode_2d(
        self,
        x2: torch.Tensor,
        s2: torch.Tensor,
        name: str,
        allow_nonfinite: bool,
        bamax_all: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if _gpu.wants(x2) and x2.numel():  # CUDA tensor + Triton: one fused kernel, same bytes (formats/gpu)
            return _gpu.nvfp4_encode_2d(x2, s2, name, allow_nonfinite)
        rows, width = x2.shape
        nb = width // BLOCK
        weight = torch.empty((rows, width // 2), dtype=torch.uint8, device=x2.device)
        scale = torch.empty((rows, nb), dtype=torch.float8_e4m3fn, device=x2.device)
        six_s2 = s2 * E2M1_MAX  # fl32(6 * s2) first, as ModelOpt
        e4m3_table = decode_table(E4M3, x2.device)
        if self.fast:  # the chunks' temporaries, reused: fresh ones cost page faults each chunk
            step = next(row_chunks(rows, width), (0, 0))[1] * width  # no rows: no chunks, empty buffers
            y_buf = torch.empty(step, dtype=torch.float32, device=x2.device)
            f_buf = torch.empty(step, dtype=torch.int32, device=x2.device)
        for r0, r1 in row_chunks(rows, width):
            n = r1 - r0
            xb = x2[r0:r1].view(n, nb, BLOCK)
            if bamax_all is not None:
                bamax = bamax_all[r0:r1]
            elif self.fast:
                bamax = block_amax_bits(xb, f_buf if xb.dtype == torch.float32 else None)
            else:
                bamax = xb.abs().amax(dim=-1).float()  # exact: abs and max do not round
            bad = None
            if not bool(torch.isfinite(bamax).all()):
                if not allow_nonfinite:
                    raise_nonfinite(x2, name)  # report against the whole tensor
                bad = ~torch.isfinite(bamax)
            sb = bamax / six_s2
            sb.masked_fill_(sb == 0, ZERO_BLOCK_SCALE)
            sb8 = sb.clamp_(SCALE_MIN, E4M3_MAX).to(torch.float8_e4m3fn)
            if self.fast:
                # exact E4M3 values by table lookup (faster than the float8 -> float32 cast)
                sbf = e4m3_table.index_select(0, sb8.view(torch.uint8).view(-1).int()).view(n, nb)
            else:
                sbf = sb8.float()
            eff = sbf * s2  # fl32(f32(sb) * s2), before the division
            out = weight[r0:r1]
            if self.fast:
                # x + 0.0 turns -0.0 into +0.0 and nothing else, so after the division y's sign bit
                # is the contract's x < 0 (a negative x that underflows keeps it: code 0x8)
                m = n * width
                y = y_buf[:m].view(xb.shape).copy_(xb).add_(0.0)  # (faster than one add into a float32 out)
                y.div_(eff.unsqueeze(-1))  # the same IEEE division as the reference's
                if bad is not None:
                    y.masked_fill_(y.isnan(), 0.0)  # those blocks are zeroed below
                codes = _e2m1_signed_codes(y, f_buf[:m].view(xb.shape))
                _pack_codes_u8_into(codes.view(n, width), out)
            else:
                y = xb / eff.unsqueeze(-1)  # float32 (type promotion), one IEEE division
                codes = round_e2m1_reference(y)
                codes |= (xb < 0).to(torch.uint8) << 3
                out.copy_(_pack_nibbles_reference(codes.view(n, width)))
            if bad is not None:
                sb8.view(torch.uint8)[bad] = NAN_SCALE_BYTE
                out.view(n, nb, BLOCK // 2)[bad] = 0
            scale[r0:r1] = sb8
        return weight, scale

    # decode ----------------------------------------------------------------------------------
    def decode(self, parts: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``e2m1(nibble) * (f32(weight_scale) * weight_scale_2)`` in float32, then cast to ``dtype``."""
        check_out_dtype(dtype)
        require_parts(
            self.name,
            parts,
            {"weight": torch.uint8, "weight_scale": torch.float8_e4m3fn, "weight_scale_2": torch.float32},
        )
        w, sc = parts["weight"], parts["weight_scale"]
        s2 = parts["weight_scale_2"]
        if s2.numel() != 1:
            raise FormatError(f"nvfp4: weight_scale_2 must be a scalar, got shape {list(s2.shape)}")
        if w.dim() < 1 or sc.shape[:-1] != w.shape[:-1] or sc.shape[-1] * (BLOCK // 2) != w.shape[-1]:
            raise FormatError(
                f"nvfp4: weight {list(w.shape)} and weight_scale {list(sc.shape)} do not match "
                f"(expected weight_scale [..., in/16] for weight [..., in/2])"
            )
        lead = tuple(w.shape[:-1])
        width = w.shape[-1] * 2
        rows = 1
        for s in lead:
            rows *= s
        nb = width // BLOCK
        w2 = w.contiguous().view(rows, width // 2)
        sc2 = sc.contiguous().view(rows, nb)
        s2 = s2.reshape(()).to(w.device)
        if _gpu.wants_decode(w2, dtype):  # CUDA tensor + Triton: fused kernel, same values
            return _gpu.nvfp4_decode_2d(w2, sc2, s2, dtype).view(*lead, width)
        out = torch.empty((rows, width), dtype=dtype, device=w.device)
        pair_table = _pair_table(w.device)
        e4m3_table = decode_table(E4M3, w.device)
        for r0, r1 in row_chunks(rows, width):
            n = r1 - r0
            wc, sc_c = w2[r0:r1], sc2[r0:r1]
            if self.fast:
                # int32 index_select is much faster on CPU than advanced indexing with int64
                vals = pair_table.index_select(0, wc.reshape(-1).int())  # [n*in/2, 2] exact E2M1
                sbf = e4m3_table.index_select(0, sc_c.view(torch.uint8).reshape(-1).int()).view(n, nb)
            else:
                codes = torch.stack((wc & 0xF, wc >> 4), dim=-1)
                vals = decode_e2m1(codes)
                sbf = sc_c.float()
            eff = sbf * s2  # the block's effective scale first, as ModelOpt
            torch.mul(vals.view(n, nb, BLOCK), eff.unsqueeze(-1), out=out[r0:r1].view(n, nb, BLOCK))
        return out.view(*lead, width)


def _block_amax_all(x2: torch.Tensor) -> torch.Tensor:
    """float32 [rows, in/16] block maxima of |x|, computed chunk by chunk."""
    rows, width = x2.shape
    nb = width // BLOCK
    out = torch.empty((rows, nb), dtype=torch.float32, device=x2.device)
    for r0, r1 in row_chunks(rows, width):
        out[r0:r1] = block_amax_bits(x2[r0:r1].view(r1 - r0, nb, BLOCK))
    return out


def _amax(x2: torch.Tensor, name: str, allow_nonfinite: bool) -> torch.Tensor:
    """0-d float32 amax of a 2-D tensor, chunked; NonFiniteError unless allowed (then over finite values)."""
    if _gpu.wants(x2):  # CUDA tensor + Triton: one reduction kernel (formats/gpu)
        return _gpu.amax_2d(x2, name, allow_nonfinite)
    rows, width = x2.shape
    acc = torch.zeros((), dtype=torch.float32, device=x2.device)
    for r0, r1 in row_chunks(rows, width):
        acc = torch.maximum(acc, x2[r0:r1].abs().amax().float())
    if bool(torch.isfinite(acc)):
        return acc
    if not allow_nonfinite:
        raise_nonfinite(x2, name)
    acc = torch.zeros((), dtype=torch.float32, device=x2.device)
    for r0, r1 in row_chunks(rows, width):
        c = x2[r0:r1].abs()
        c = torch.where(torch.isfinite(c), c, 0)
        acc = torch.maximum(acc, c.amax().float())
    return acc


_PAIR_TABLES: dict[torch.device, torch.Tensor] = {}


def _pair_table(device: torch.device) -> torch.Tensor:
    """[256, 2] float32: byte -> (value of low nibble, value of high nibble)."""
    t = _PAIR_TABLES.get(device)
    if t is None:
        e2 = decode_table(E2M1, device)
        b = torch.arange(256, device=device)
        t = torch.stack((e2[b & 0xF], e2[b >> 4]), dim=-1).contiguous()
        _PAIR_TABLES[device] = t
    return t
