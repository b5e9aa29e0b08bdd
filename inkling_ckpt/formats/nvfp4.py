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
* **Given scales.** ``weight_scale_2`` is used verbatim (must be finite and > 0);
  ``global_amax`` goes through :func:`nvfp4_global_scale`. ``input_scale`` is stored
  verbatim as float32, else 1.0 (a fresh quantize has no activation calibration).
"""

from __future__ import annotations

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
    check_input,
    check_out_dtype,
    check_width,
    raise_nonfinite,
    require_parts,
    row_chunks,
    scalar_f32,
)
from .encodings import E2M1, E4M3, decode_table

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
    # ModelOpt: amax.float() / (E2M1_MAX * E4M3_MAX); 6 * 448 = 2688 exactly.
    return a / (E2M1_MAX * E4M3_MAX)


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


# Bit patterns used by the fast rounding (float32 fields: sign 1, exponent 8, mantissa 23).
_MAGIC_HALF = 4194304.0  # 2^22: adding it rounds [0, 2^22) to a multiple of 0.5, ties to even
_MAGIC_HALF_BITS = 0x4A800000  # bits of 2^22; (a + 2^22).bits - this = number of halves
_KEEP1_BIAS = 0x1FFFFF  # half an ulp of a 1-mantissa-bit float, minus one, in bit 22 units
_ONE_CODE_OFFSET = 252  # (bits >> 22) of 1.0 is 254; E2M1 code of 1.0 is 2


def round_e2m1_fast(y: torch.Tensor) -> torch.Tensor:
    """Same result as :func:`round_e2m1_reference` (bit-for-bit, tested), with integer bit tricks.

    ``y`` must be float32; it is overwritten. For |y| < 1 the E2M1 grid has step 0.5 and the
    code is the number of halves, which one float add of 2^22 rounds to nearest-even. For
    |y| >= 1 an E2M1 value is a float with one mantissa bit: round the float32 bits to one
    mantissa bit (add 0x1FFFFF plus the kept bit, the usual RNE carry) and read the code
    off ``exponent*2 + mantissa_bit``.
    """
    a = y.abs_()
    a = torch.where(a < E2M1_MAX, a, E2M1_MAX)  # saturate; NaN -> 6 like the reference
    small = a < 1.0
    lo = (a + _MAGIC_HALF).view(torch.int32)
    lo -= _MAGIC_HALF_BITS
    b = a.view(torch.int32)
    hi = (b >> 22) & 1
    hi += b
    hi += _KEEP1_BIAS
    hi >>= 22
    hi -= _ONE_CODE_OFFSET
    return torch.where(small, lo, hi).to(torch.uint8)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., 2n] -> bytes [..., n] with element 2j in the low nibble."""
    if _LITTLE_ENDIAN and codes.is_contiguous():
        # Read pairs as one little-endian int16: lo | hi << 8 -> lo | hi << 4 in the low byte.
        v = codes.view(torch.int16)
        v = v | (v >> 4)
        return v.to(torch.uint8)  # keeps the low byte (values < 2^15, no wrap concerns)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., n] -> codes [..., 2n] (uint8), low nibble first."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


# -- the codec --------------------------------------------------------------------------------


class NVFP4Format(Format):
    """NVFP4 in ModelOpt naming: weight (U8 packed), weight_scale (F8_E4M3), weight_scale_2, input_scale."""

    name = "nvfp4"
    block = BLOCK
    quant_algo = "NVFP4"

    def __init__(self, *, fast: bool = True) -> None:
        # fast=False selects the plain reference rounding (tests pin the two together).
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
        if weight_scale_2 is not None:
            s2 = scalar_f32(weight_scale_2, x.device, f"nvfp4: {name}: weight_scale_2")
            sv = float(s2)
            if not (0.0 < sv < float("inf")):
                raise FormatError(f"nvfp4: {name}: weight_scale_2 must be finite and > 0, got {sv}")
        else:
            if global_amax is None:
                global_amax = _amax(x2, name, allow_nonfinite)
            s2 = nvfp4_global_scale(scalar_f32(global_amax, x.device, f"nvfp4: {name}: global_amax"))
        if input_scale is None:
            isc = torch.ones((), dtype=torch.float32, device=x.device)
        else:
            isc = scalar_f32(input_scale, x.device, f"nvfp4: {name}: input_scale")
        weight, scale = self._encode_2d(x2, s2, name, allow_nonfinite)
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
            for x, n in zip(xs, names):
                rows, width = check_input(self.name, x, n, BLOCK)
                amaxes.append(_amax(x.detach().contiguous().view(rows, width), n, allow).to(xs[0].device))
            kw = {**kw, "global_amax": torch.stack(amaxes).amax()}
        return [self.encode(x, name=n, **kw) for x, n in zip(xs, names)]

    def _encode_2d(
        self, x2: torch.Tensor, s2: torch.Tensor, name: str, allow_nonfinite: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, width = x2.shape
        nb = width // BLOCK
        weight = torch.empty((rows, width // 2), dtype=torch.uint8, device=x2.device)
        scale = torch.empty((rows, nb), dtype=torch.float8_e4m3fn, device=x2.device)
        six_s2 = s2 * E2M1_MAX  # fl32(6 * s2) first, as ModelOpt
        e4m3_table = decode_table(E4M3, x2.device)
        rnd = round_e2m1_fast if self.fast else round_e2m1_reference
        for r0, r1 in row_chunks(rows, width):
            xb = x2[r0:r1].view(r1 - r0, nb, BLOCK)
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
                sbf = e4m3_table[sb8.view(torch.uint8).long()]  # exact E4M3 values, faster than the cast
            else:
                sbf = sb8.float()
            eff = sbf * s2  # fl32(f32(sb) * s2), before the division
            y = xb / eff.unsqueeze(-1)  # float32 (type promotion), one IEEE division
            codes = rnd(y)
            codes |= (xb < 0).view(torch.uint8) << 3
            packed = _pack_nibbles(codes.view(r1 - r0, width))
            if bad is not None:
                sb8.view(torch.uint8)[bad] = NAN_SCALE_BYTE
                packed.view(r1 - r0, nb, BLOCK // 2)[bad] = 0
            weight[r0:r1] = packed
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
        out = torch.empty((rows, width), dtype=dtype, device=w.device)
        pair_table = _pair_table(w.device)
        e4m3_table = decode_table(E4M3, w.device)
        for r0, r1 in row_chunks(rows, width):
            n = r1 - r0
            vals = pair_table[w2[r0:r1].long()]  # [n, in/2, 2] float32, exact E2M1 values
            eff = e4m3_table[sc2[r0:r1].view(torch.uint8).long()] * s2  # block scale first
            torch.mul(vals.view(n, nb, BLOCK), eff.unsqueeze(-1), out=out[r0:r1].view(n, nb, BLOCK))
        return out.view(*lead, width)


def _amax(x2: torch.Tensor, name: str, allow_nonfinite: bool) -> torch.Tensor:
    """0-d float32 amax of a 2-D tensor, chunked; NonFiniteError unless allowed (then over finite values)."""
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
