"""MXFP8 (OCP Microscaling v1.0): FP8 elements in blocks of 32 along K, one E8M0 scale per block.

Encoding (spec/formats.md "MXFP8"; reference/quant-formats.md §1.2-1.7), per block of 32:

* **RCEIL** (default; TransformerEngine, ModelOpt export, FlashInfer, cuDNN): the scale is
  ``2^e`` with ``e = ceil(log2(f32(amax / max_elem)))``, read from the float32 bits of the
  quotient: the biased exponent field, plus one when the mantissa is non-zero. For a
  subnormal quotient the result is 2^-127 (byte 0) up to 2^-127 itself and 2^-126 above.
* **FLOOR** (OCP spec text): ``e = floor(log2(amax)) - emax_elem`` (emax 8 for E4M3, 15 for
  E5M2) from amax's own exponent field; blocks whose amax mantissa exceeds 1.75 saturate.

``e`` is clamped to [-127, 127] and stored biased by 127 as a uint8; an all-zero block
gets byte 0. Elements are ``x * 2^-e`` (exact), clamped to ±448 (±57344 for E5M2) and cast
round-to-nearest-even. Decode: ``fp8(q) * 2^(b - 127)`` in float32, 0xFF scale -> NaN block.

The exponent never goes through ``.to(float8_e8m0fnu)`` (that cast rounds to nearest) and
the element cast never relies on torch saturating (older torch gives NaN): we clamp.

Non-finite input is an error (NonFiniteError: tensor name, first index) unless
``allow_nonfinite``; then every block holding a NaN or ±Inf gets scale byte 0xFF and all
its element bytes are 0x7F (E4M3 NaN; 0x7F is also a NaN in E5M2), so it decodes to NaN.
Other blocks encode normally.

Differences from references are only in corner cases: ModelOpt's float ``log2`` misses the
round-up when an fp32 amax/448 lies one ulp above a power of two (never for bf16/fp16
inputs, §1.5); the references' NaN/Inf blocks differ among themselves (§1.6).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from ..errors import FormatError
from ._base import (
    Format,
    Parts,
    PartSpec,
    block_amax_bits,
    check_input,
    check_out_buffer,
    check_out_dtype,
    check_width,
    raise_nonfinite,
    reject_nvfp4_options,
    require_parts,
    row_chunks,
)
from .encodings import E4M3, E5M2, E8M0, Encoding, decode_e8m0, decode_table
from . import gpu as _gpu  # fused Triton kernels for CUDA tensors (Triton imported lazily)

BLOCK = 32
SCALE_MODES = ("rceil", "floor")
ELEMENTS: dict[str, Encoding] = {"e4m3": E4M3, "e5m2": E5M2}
NAN_SCALE_BYTE = 0xFF
NAN_ELEM_BYTE = 0x7F  # NaN in both E4M3 and E5M2
_MAX_BIASED = 2 * E8M0.bias  # 254: largest finite E8M0 byte (2^127)

_E8M0_ENC_TABLES: dict[torch.device, torch.Tensor] = {}


def _inverse_scale_table(device: torch.device) -> torch.Tensor:
    """float32 [256]: entry b = 2^(127 - b) for b in 0..254 (exact; 2^-127 is subnormal); NaN at 255."""
    t = _E8M0_ENC_TABLES.get(device)
    if t is None:
        t = torch.tensor(
            [2.0 ** (E8M0.bias - b) for b in range(255)] + [float("nan")], dtype=torch.float32
        ).to(device)
        _E8M0_ENC_TABLES[device] = t
    return t


def _emax(enc: Encoding) -> int:
    """Exponent of the largest power of two of the element type (8 for E4M3, 15 for E5M2)."""
    return math.frexp(enc.max)[1] - 1


def scale_bytes_rceil(amax: torch.Tensor, elem_max: float) -> torch.Tensor:
    """uint8 E8M0 bytes: ceil(log2(f32(amax / elem_max))) + 127 from the float32 bits, clamped to [0, 254].

    ``amax`` is float32, finite and >= 0 (callers handle non-finite blocks).
    """
    # The quotient the references form (ModelOpt, torchao 0.18), as one IEEE division: the divisor
    # is a tensor because torch turns division by a Python scalar on CUDA into a multiply by its
    # rounded reciprocal, which moves exact quotients such as 1.75*2^k / 448 off a power of two.
    q = amax.float() / torch.tensor(elem_max, dtype=torch.float32, device=amax.device)
    bits = q.view(torch.int32)
    expo = bits >> 23  # biased exponent field (sign is 0)
    mant = bits & 0x7FFFFF
    # Round up when the mantissa is non-zero. Subnormal quotients (expo 0) are m * 2^-149:
    # ceil(log2) is <= -127 (byte 0) while m <= 2^22, and -126 (byte 1) above.
    threshold = torch.where(expo == 0, 0x400000, 0)
    biased = expo + (mant > threshold).to(torch.int32)
    return biased.clamp_(0, _MAX_BIASED).to(torch.uint8)


def scale_bytes_floor(amax: torch.Tensor, emax_elem: int) -> torch.Tensor:
    """uint8 E8M0 bytes: floor(log2(amax)) - emax_elem + 127 from the float32 bits, clamped to [0, 254].

    A subnormal or zero amax has floor(log2) <= -127, which clamps to byte 0 anyway.
    """
    expo = amax.float().view(torch.int32) >> 23
    return (expo - emax_elem).clamp_(0, _MAX_BIASED).to(torch.uint8)


class MXFP8Format(Format):
    """MXFP8: weight (F8_E4M3 / F8_E5M2, [..., in]) and weight_scale (U8 E8M0, [..., in/32])."""

    name = "mxfp8"
    block = BLOCK

    def __init__(self, *, scale_mode: str = "rceil", element: str = "e4m3", fast: bool = True) -> None:
        scale_mode = str(scale_mode).lower()
        element = str(element).lower()
        if scale_mode not in SCALE_MODES:
            raise FormatError(f"mxfp8: unknown scale_mode {scale_mode!r}; known: {', '.join(SCALE_MODES)}")
        if element not in ELEMENTS:
            raise FormatError(f"mxfp8: unknown element {element!r}; known: {', '.join(ELEMENTS)}")
        self.scale_mode = scale_mode
        self.element = element
        # fast=False: plain reference path (abs/amax, float8 casts); tests pin the two together.
        self.fast = bool(fast)
        self.elem: Encoding = ELEMENTS[element]
        self.elem_dtype: torch.dtype = self.elem.torch_dtype  # type: ignore[assignment]
        # ModelOpt has no quant_algo for E5M2 elements: writers must not label them "MXFP8".
        self.quant_algo = "MXFP8" if element == "e4m3" else None

    def __repr__(self) -> str:
        return f"<Format mxfp8 element={self.element} scale_mode={self.scale_mode}>"

    def parts(self, shape: Sequence[int]) -> PartSpec:
        _, width = check_width(self.name, shape, BLOCK)
        lead = tuple(int(s) for s in shape[:-1])
        return {
            "weight": ((*lead, width), self.elem_dtype),
            "weight_scale": ((*lead, width // BLOCK), torch.uint8),
        }

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
        """Encode ``x`` ([..., in], in % 32 == 0) to MXFP8 parts (see the module docstring)."""
        reject_nvfp4_options("mxfp8", name, "MXFP8 has no global scale", weight_scale_2=weight_scale_2, global_amax=global_amax,
                             input_scale=input_scale)
        rows, width = check_input(self.name, x, name, BLOCK)
        x2 = x.detach().contiguous().view(rows, width)
        nb = width // BLOCK
        if _gpu.wants(x2):  # CUDA tensor + Triton: one fused kernel, same bytes (formats/gpu)
            weight, scale = _gpu.mxfp8_encode_2d(x2, self.scale_mode, self.element, name, allow_nonfinite)
            lead = tuple(x.shape[:-1])
            return {"weight": weight.view(*lead, width), "weight_scale": scale.view(*lead, nb)}
        weight = torch.empty((rows, width), dtype=self.elem_dtype, device=x.device)
        scale = torch.empty((rows, nb), dtype=torch.uint8, device=x.device)
        elem_max = self.elem.max
        emax = _emax(self.elem)
        inv_table = _inverse_scale_table(x.device)
        for r0, r1 in row_chunks(rows, width):
            n = r1 - r0
            xb = x2[r0:r1].view(n, nb, BLOCK)
            if self.fast:
                bamax = block_amax_bits(xb)
            else:
                bamax = xb.abs().amax(dim=-1).float()  # exact
            bad = None
            if not bool(torch.isfinite(bamax).all()):
                if not allow_nonfinite:
                    raise_nonfinite(x2, name)
                bad = ~torch.isfinite(bamax)
                bamax = bamax.masked_fill(bad, 0.0)
            if self.scale_mode == "rceil":
                sbytes = scale_bytes_rceil(bamax, elem_max)
            else:
                sbytes = scale_bytes_floor(bamax, emax)
            out = weight[r0:r1].view(n, nb, BLOCK)
            if self.fast:
                inv = inv_table.index_select(0, sbytes.view(-1).int()).view(n, nb, 1)  # 2^-e, exact
                y = xb * inv  # float32, exact (a power-of-two scaling)
                y.clamp_(-elem_max, elem_max)
                out.copy_(y)  # round-to-nearest-even cast straight into the output
            else:
                inv = inv_table[sbytes.long()]
                y = xb * inv.unsqueeze(-1)
                y.clamp_(-elem_max, elem_max)
                out.copy_(y.to(self.elem_dtype))
            if bad is not None:
                sbytes[bad] = NAN_SCALE_BYTE
                out.view(torch.uint8)[bad] = NAN_ELEM_BYTE
            scale[r0:r1] = sbytes
        lead = tuple(x.shape[:-1])
        return {"weight": weight.view(*lead, width), "weight_scale": scale.view(*lead, nb)}

    def decode(self, parts: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """``fp8(q) * 2^(scale - 127)`` in float32 (0xFF scale -> NaN block), then cast to ``dtype``.

        ``out``: a contiguous ``dtype`` tensor of the weight's shape and device to decode into (a
        reused buffer spares the page faults of fresh memory)."""
        check_out_dtype(dtype)
        parts = dict(parts)
        sc = parts.get("weight_scale")
        if isinstance(sc, torch.Tensor) and sc.dtype == getattr(torch, "float8_e8m0fnu", None):
            parts["weight_scale"] = sc.view(torch.uint8)  # same bits, typed E8M0 on disk
        require_parts(self.name, parts, {"weight": self.elem_dtype, "weight_scale": torch.uint8})
        w, sc = parts["weight"], parts["weight_scale"]
        if w.dim() < 1 or sc.shape[:-1] != w.shape[:-1] or sc.shape[-1] * BLOCK != w.shape[-1]:
            raise FormatError(
                f"mxfp8: weight {list(w.shape)} and weight_scale {list(sc.shape)} do not match "
                f"(expected weight_scale [..., in/32])"
            )
        lead = tuple(w.shape[:-1])
        width = w.shape[-1]
        rows = 1
        for d in lead:
            rows *= d
        nb = width // BLOCK
        w2 = w.contiguous().view(rows, width)
        sc2 = sc.contiguous().view(rows, nb)
        if out is not None:
            check_out_buffer(out, w.shape, dtype, w.device, "mxfp8")
        if _gpu.wants_decode(w2, dtype):  # CUDA tensor + Triton: fused kernel, same values
            got = _gpu.mxfp8_decode_2d(w2, sc2, self.element, dtype).view(*lead, width)
            return got if out is None else out.copy_(got)
        out = torch.empty((rows, width), dtype=dtype, device=w.device) if out is None else out.view(rows, width)
        # Into BF16, the tables and their product are BF16: every element and scale value is exact
        # there, so the product is the same exact float32 product rounded once, as the float32 path's
        # cast rounds it (tests: every scale x element byte), with half the temporaries' bytes. 2-core
        # box, [2304, 4608], 40 calls alternating with the float32 tables in one process, median:
        # 191 -> 359 and 497 -> 558 Melem/s on one thread, 359 -> 524 on two (a noisy box;
        # bench/codecs.py times this decode on its own).
        tdtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        elem_table = decode_table(self.elem, w.device, tdtype)
        scale_table = decode_table(E8M0, w.device, tdtype)
        for r0, r1 in row_chunks(rows, width):
            n = r1 - r0
            wc, sc_c = w2[r0:r1].view(torch.uint8), sc2[r0:r1]
            if self.fast:
                # exact values by int32 index_select: faster than the float8 cast or int64 indexing
                vals = elem_table.index_select(0, wc.reshape(-1).int())
                s = scale_table.index_select(0, sc_c.reshape(-1).int()).view(n, nb)
            else:
                vals = w2[r0:r1].float()
                s = decode_e8m0(sc_c)
            torch.mul(vals.view(n, nb, BLOCK), s.unsqueeze(-1), out=out[r0:r1].view(n, nb, BLOCK))
        return out.view(*lead, width)
