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

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import FormatError, NonFiniteError
from . import gpu as _gpu
from ._base import (FLOAT_INPUTS, block_amax_bits, check_out_buffer, check_out_dtype, nonfinite_error, raise_nonfinite, require_parts,
                    row_chunks)
from .encodings import E4M3, decode_table
from .mxfp8 import BLOCK as MXFP8_BLOCK, MXFP8Format
from .nvfp4 import (BLOCK as NVFP4_BLOCK, E2M1_MAX, E4M3_MAX, MIN_GLOBAL_AMAX, NVFP4Format, _block_amax_all,
                    _pair_table, nvfp4_global_scale)
from .nvfp4 import _amax as _nvfp4_amax

#: 6 × 448: the release's ``outer_scale_denominator`` (amax / 2688 = ModelOpt's weight_scale_2).
NVFP4_DENOMINATOR = E2M1_MAX * E4M3_MAX
WEIGHT, SCALE, AMAX, DENOM = "", "_scale", "_amax", "_outer_scale_denominator"
#: Unquantized stacked formats and the dtype each stores: one weight part, no scales. The release
#: is BF16; a checkpoint transformers saved from a float32 or float16 model holds F32 / F16 experts.
UNQUANTIZED: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
STACKED_FORMATS = ("bf16", "f16", "f32", "mxfp8", "nvfp4")
#: Elements per chunk of the NVFP4 decode on CUDA (float32 temporaries of ~256 MiB each).
_CUDA_CHUNK_ELEMS = 1 << 26
#: Blocks per step of the CPU NVFP4 table decode: 1 MiB of int32 indices, near the 256 KiB table in
#: cache (2^11 blocks ran at half the rate on the 2-core box, 2^17 a little slower than this).
_TABLE_STEP_BLOCKS = 1 << 15
#: Integers as wide as two decoded values (by the output's item size): a weight byte decodes to one.
_PAIR_BITS = {2: torch.int32, 4: torch.int64}


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
                   allow_nonfinite: bool = False, device: str | torch.device | None = None,
                   budget_bytes: int | None = None) -> dict[str, torch.Tensor]:
    """Encode a stacked [E, R, C] expert weight (w13 already interleaved) into its release parts.

    ``fmt`` is a format name or a codec from :func:`~inkling_ckpt.formats.get_format` (MXFP8
    options such as ``scale_mode`` travel with the codec). NVFP4: ``amax`` [E] gives the
    per-expert global amax (kept from a reference so unchanged weights reproduce its bytes);
    by default each expert's own max |x|. The stored ``_amax`` is the amax actually used
    (an all-zero expert is encoded and stored with amax 1.0, so decoding stays consistent).

    Where it runs: on ``w``'s device by default. A CUDA tensor goes through the batched Triton
    kernels (all experts per launch, per-expert amax on the device, one host synchronization
    per call for the non-finite checks); the CPU reference code is the specification, and
    ``formats.gpu.kernels_disabled()`` runs it on CUDA tensors too. Same bytes either way.
    ``device`` (e.g. ``"cuda"``) computes there instead, for a ``w`` held elsewhere (typically
    a host slice read from disk): experts travel in slices of at most ``budget_bytes`` of device
    memory for inputs plus outputs (default :data:`DEVICE_BUDGET_BYTES`; at least one expert
    per slice), through page-locked buffers, and the parts come back on ``w``'s device.
    ``budget_bytes`` alone slices on ``w``'s own device. Errors are the same in every mode.
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
    if w.dtype not in FLOAT_INPUTS:
        raise FormatError(f"{fname}: {name}: cannot quantize dtype {w.dtype}; expected one of "
                          f"{', '.join(str(d) for d in FLOAT_INPUTS)}")
    stacked_parts(fname, w.shape)  # positive shape, width a multiple of the block
    codec: Any = fmt if not isinstance(fmt, str) else (MXFP8Format() if fname == "mxfp8" else NVFP4Format())
    if fname == "nvfp4" and amax is not None:
        _check_amax_layout(amax, w.shape[0], name)
    else:
        amax = None  # MXFP8 has no global scale
    dev = _compute_device(device, w, name)
    if dev == w.device and budget_bytes is None:
        return _encode_whole(codec, fname, w, amax, name, allow_nonfinite)
    return _encode_sliced(codec, fname, w, amax, name, allow_nonfinite, dev, _budget(budget_bytes))


def _encode_whole(codec: Any, fname: str, w: torch.Tensor, amax: torch.Tensor | None, name: str,
                  allow_nonfinite: bool) -> dict[str, torch.Tensor]:
    if not (_gpu.wants(w) and w.numel()):
        return _encode_reference(codec, fname, w, amax, name, allow_nonfinite)
    device_amax = amax is not None and amax.device == w.device
    if amax is not None and not device_amax:
        amax = _check_amax(amax, w.shape[0], name, allow_nonfinite=False).to(w.device, non_blocking=True)
    # a kept amax on the device is checked by the encode kernel itself (flag 1)
    parts, bad = _encode_kernels(codec, fname, w, amax, check_amax=device_amax)
    if allow_nonfinite and not device_amax:
        return parts
    nonfinite, bad_amax = bad.tolist()  # the one host synchronization of the call: the flags the kernels set
    if bad_amax or (nonfinite and not allow_nonfinite):
        _raise_encode_error(fname, w, amax, name)
    return parts


def _encode_kernels(codec: Any, fname: str, w: torch.Tensor, amax: torch.Tensor | None, *,
                    check_amax: bool = False) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Parts of ``w`` (on a kernel device) through the batched kernels, one expert per group, and
    int32 [2] device flags: [0] some element is NaN/Inf (encoded as NaN blocks), [1] (with
    ``check_amax``) some given amax is not finite and > 0. No host synchronization.
    ``amax`` (on w's device) is used as given; a bad one yields garbage, which the caller refuses.
    NVFP4's global scales (the reference's zero-expert policy, amax / 2688) are computed inside
    the encode kernel, so a contiguous stack costs one fill and one or two launches."""
    ops = _gpu._load()
    e, r, c = w.shape
    slices = _contiguous_slices(w)
    fresh = fname == "nvfp4" and amax is None
    # one zeroed buffer: the flags, and (fresh NVFP4 amax) the per-expert amax bits
    work = torch.zeros(2 + (e if fresh else 0), dtype=torch.int32, device=w.device)
    bad = work[:2]
    got: list[dict[str, torch.Tensor]] = []
    for e0, e1 in slices:
        n = e1 - e0
        x = w[e0:e1].contiguous().view(n, r * c)
        if fname == "mxfp8":
            q, sc, _ = ops.mxfp8_encode(x, codec.scale_mode, codec.element, bad=bad)
            got.append({WEIGHT: q.view(n, r, c), SCALE: sc.view(n, r, c // MXFP8_BLOCK)})
            continue
        if amax is None:  # non-finite input is flagged by the encode below: the amax pass's flag is not read
            a, _ = ops.group_amax(x, bad=bad, out=work[2 + e0:2 + e1])
        else:
            a = amax[e0:e1]
        q, sc, used, denom, _ = ops.nvfp4_encode_from_amax(x, a, check_amax=check_amax, bad=bad)
        got.append({WEIGHT: q.view(n, r, c // 2), SCALE: sc.view(n, r, c // NVFP4_BLOCK), AMAX: used, DENOM: denom})
    if len(got) == 1:
        parts = got[0]
    else:  # a non-contiguous input, encoded in slices: gather them (outputs only, a fraction of the input)
        parts = {k: torch.empty((e, *t.shape[1:]), dtype=t.dtype, device=w.device)
                 for k, t in got[0].items() if k != DENOM}
        for (e0, e1), g in zip(slices, got, strict=True):
            for k in parts:
                parts[k][e0:e1] = g[k]
        if fname == "nvfp4":
            parts[DENOM] = got[0][DENOM]
    return {k: parts[k] for k in stacked_parts(fname, w.shape)}, bad  # on-disk order


def _encode_reference(codec: Any, fname: str, w: torch.Tensor, amax: torch.Tensor | None, name: str,
                      allow_nonfinite: bool) -> dict[str, torch.Tensor]:
    """The reference codec's torch code, expert by expert (any device)."""
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


def _encode_sliced(codec: Any, fname: str, w: torch.Tensor, amax: torch.Tensor | None, name: str,
                   allow_nonfinite: bool, dev: torch.device, budget: int) -> dict[str, torch.Tensor]:
    """Experts in slices computed on ``dev``, parts gathered on ``w``'s device (see encode_stacked)."""
    e, r, c = w.shape
    if amax is not None:  # checked and moved once (a blocking copy inside the loop would stall the overlap)
        amax = _check_amax(amax, e, name, allow_nonfinite=False).to(dev)
    spec = stacked_parts(fname, w.shape)
    if fname == "mxfp8":
        spec[WEIGHT] = (spec[WEIGHT][0], codec.elem_dtype)
    out = {k: torch.empty(shape, dtype=dt, device=w.device) for k, (shape, dt) in spec.items() if k != DENOM}
    per_expert = r * c * w.element_size() + sum(_nbytes(shape[1:], dt) for k, (shape, dt) in spec.items() if k != DENOM)
    flags: list[torch.Tensor] = []
    relay = _Relay(w.device, dev)
    for e0, e1 in _expert_slices(e, per_expert, budget):
        x = relay.up(w[e0:e1])
        a = None if amax is None else amax[e0:e1]
        if _gpu.wants(x):
            parts, flags2 = _encode_kernels(codec, fname, x, a)
            bad = flags2[0] > 0
        else:  # the reference code; non-finite input is refused below, for the whole tensor
            bad = ~torch.isfinite(block_amax_bits(x.reshape(1, -1))[0])
            parts = _encode_reference(codec, fname, x, a, name, True)
        flags.append(bad)
        relay.down([(parts[k], out[k][e0:e1]) for k in out])
    relay.finish()
    if not allow_nonfinite and bool(torch.stack(flags).any()):  # one synchronization, after the last slice
        _raise_first_nonfinite(fname, w, name)
    if fname == "nvfp4":
        out[DENOM] = torch.tensor(NVFP4_DENOMINATOR, dtype=torch.float32, device=w.device)
    return {k: out[k] for k in spec}


def _check_amax_layout(amax: object, experts: int, name: str) -> None:
    if not isinstance(amax, torch.Tensor) or amax.dtype != torch.float32 or tuple(amax.shape) != (experts,):
        raise FormatError(f"nvfp4: {name}: amax must be float32 [{experts}], got "
                          f"{getattr(amax, 'dtype', type(amax).__name__)} {list(getattr(amax, 'shape', []))}")


def _bad_amax(amax: torch.Tensor) -> torch.Tensor:
    return ~(torch.isfinite(amax) & (amax > 0))


def _check_amax(amax: torch.Tensor, experts: int, name: str, *, allow_nonfinite: bool) -> torch.Tensor:
    _check_amax_layout(amax, experts, name)
    if not allow_nonfinite:
        bad = _bad_amax(amax)
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            raise NonFiniteError(f"{name}_amax: expert {i} has global amax {float(amax[i])} (must be finite and > 0)")
    return amax


def _raise_encode_error(fname: str, w: torch.Tensor, amax: torch.Tensor | None, name: str) -> None:
    """The reference's error for input the kernels flagged: a bad kept amax first, then non-finite input."""
    if amax is not None:
        _check_amax(amax, w.shape[0], name, allow_nonfinite=False)
    _raise_first_nonfinite(fname, w, name)


def _raise_first_nonfinite(fname: str, w: torch.Tensor, name: str) -> None:
    """NonFiniteError as the reference raises it: NVFP4 for the first expert holding NaN/Inf (its
    amax pass), MXFP8 for the whole stack seen as [E*R, C] rows. Expert by expert (bounded memory)."""
    e, r, c = w.shape
    count, first = 0, None
    for i in range(e):
        bad = ~torch.isfinite(w[i])
        n = int(bad.sum())
        if n and fname == "nvfp4":
            raise_nonfinite(w[i].reshape(r, c), f"{name}[expert {i}]")
        if n and first is None:
            first = (i, int(torch.argmax(bad.reshape(-1).to(torch.uint8))))
        count += n
    if first is None:
        raise FormatError(f"{fname}: {name}: the kernels flagged non-finite input that is not there")
    i, flat = first
    row, col = divmod(flat, c)
    raise nonfinite_error(name, float(w[i].reshape(-1)[flat]), (i * r + row, col), count, w.numel())


# -- decode ---------------------------------------------------------------------------------------


def decode_stacked(fmt: object, parts: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16, *,
                   name: str = "experts", allow_nonfinite: bool = False, device: str | torch.device | None = None,
                   budget_bytes: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode a stacked expert weight's parts (any leading slice of experts) to ``dtype`` [E, R, C].

    ``out``: a contiguous ``dtype`` [E, R, C] tensor on the weight's device to decode into (and
    return). A caller decoding piece after piece passes one buffer: fresh host memory of a piece's
    size is mapped apart (``pipeline.memory``) and its page faults cost about as much as the decode.

    Scales that cannot come from a quantizer (NVFP4 amax / denominator ≤ 0 or non-finite,
    negative or NaN block scales, MXFP8 NaN scale bytes) raise NonFiniteError naming the tensor
    and block unless ``allow_nonfinite``: they would decode to garbage.

    Where it runs: as :func:`encode_stacked`. CUDA parts (float32/bfloat16/float16 out) go
    through the Triton kernels (NVFP4 in the release order ``(e2m1 * scale) * (amax / denom)``,
    bit-identical to the CPU reference and to transformers); the scale checks cost one host
    synchronization per call. ``device`` / ``budget_bytes``: computed there in expert slices
    of bounded device memory, the result returned on the weight's device.
    """
    fname = _fmt_name(fmt)
    check_out_dtype(dtype)
    w = parts.get(WEIGHT)
    if not isinstance(w, torch.Tensor) or w.dim() != 3:
        raise FormatError(f"{fname}: {name}: missing or non-3-D stacked weight")
    if fname in UNQUANTIZED:
        if w.dtype != UNQUANTIZED[fname]:
            raise FormatError(f"{fname}: {name}: weight is {w.dtype}, expected {UNQUANTIZED[fname]}")
        if out is None:
            return w.to(dtype)
        check_out_buffer(out, w.shape, dtype, w.device, name)
        return out.copy_(w)  # the same conversion as .to(dtype)
    sc = parts.get(SCALE)
    if not isinstance(sc, torch.Tensor):
        raise FormatError(f"{fname}: {name}: missing block scales ({name}{SCALE})")
    e, r, cw = w.shape
    scale2 = None
    if fname == "mxfp8":
        if sc.dtype != torch.uint8 and sc.dtype == getattr(torch, "float8_e8m0fnu", None):
            sc = sc.view(torch.uint8)
        require_parts("mxfp8", {"weight": w, "weight_scale": sc},
                      {"weight": torch.float8_e4m3fn, "weight_scale": torch.uint8})
        if tuple(sc.shape) != (e, r, cw // MXFP8_BLOCK) or cw % MXFP8_BLOCK:
            raise FormatError(f"mxfp8: {name}: weight {list(w.shape)} and scale {list(sc.shape)} do not match "
                              f"(expected scale [E, R, C/32])")
    else:
        scale2 = _nvfp4_globals(parts, w, sc, name)
    if out is not None:
        check_out_buffer(out, (e, r, cw * 2 if scale2 is not None else cw), dtype, w.device, name)
    dev = _compute_device(device, w, name)
    if dev != w.device or budget_bytes is not None:
        if scale2 is not None and not allow_nonfinite:
            _check_factor(_factor(scale2), name)  # [E] only, before any slice
        return _decode_sliced(fname, w, sc, scale2, dtype, name, allow_nonfinite, dev, _budget(budget_bytes), out)
    # Decoded first, checked after: on a device the kernels flag bad scale bytes as they read them
    # (and NVFP4's global factors as they compute them), so the one host synchronization waits for
    # the decode alone and reads one flag.
    if scale2 is not None:
        scale2 = (scale2[0].to(w.device), scale2[1].to(w.device))
    out, bad = _decode_values(w, sc, scale2, dtype, check=not allow_nonfinite, out=out)
    if bad is not None and bool(bad):  # the one host synchronization of the call
        if scale2 is not None:
            _check_factor(_factor(scale2), name)
        _check_scales(fname, sc, name)
    return out


def _nvfp4_globals(parts: Mapping[str, torch.Tensor], w: torch.Tensor, sc: torch.Tensor,
                   name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(amax [E], denominator [1] or [E]) float32, where the parts hold them, checked for layout."""
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
    return amax, denom.reshape(-1)


def _factor(scale2: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Per-expert global factor amax / denominator (float32 [E], one division each, on amax's device)."""
    amax, denom = scale2
    return amax / denom.to(amax.device).expand(amax.shape[0])


def _globals_slice(scale2: tuple[torch.Tensor, torch.Tensor] | None, e0: int,
                   e1: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    if scale2 is None:
        return None
    amax, denom = scale2
    return amax[e0:e1], (denom if denom.numel() == 1 else denom[e0:e1])


def _bad_factor(factor: torch.Tensor) -> torch.Tensor:
    return ~(torch.isfinite(factor) & (factor > 0))


def _check_factor(factor: torch.Tensor, name: str) -> None:
    bad = _bad_factor(factor)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise NonFiniteError(f"{name}: expert {i} has global factor amax/denominator = {float(factor[i])} "
                             "(must be finite and > 0)", "pass --allow-nonfinite to decode it anyway")


#: Smallest scale byte that no quantizer writes: MXFP8 0xFF (E8M0 NaN); NVFP4 0x7F (E4M3 NaN) and
#: every byte above (sign bit set: negative or NaN). One integer max finds either.
_BAD_SCALE_FROM = {"mxfp8": 0xFF, "nvfp4": 0x7F}


def _bad_scales_flag(fname: str, sc: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor on sc's device: some block scale is one no quantizer writes (no synchronization)."""
    if not sc.numel():
        return torch.zeros((), dtype=torch.bool, device=sc.device)
    return sc.view(torch.uint8).amax() >= _BAD_SCALE_FROM[fname]


def _check_scales(fname: str, sc: torch.Tensor, name: str) -> None:
    """NonFiniteError naming the first bad block scale, if any."""
    bad = sc.view(torch.uint8) >= _BAD_SCALE_FROM[fname]
    if not bool(bad.any()):
        return
    idx = tuple(int(i) for i in torch.nonzero(bad)[0])
    if fname == "mxfp8":
        raise NonFiniteError(f"{name}{SCALE}: NaN scale byte 0xFF at block {idx}", "pass --allow-nonfinite to decode it as NaN")
    raise NonFiniteError(f"{name}{SCALE}: negative or NaN block scale at block {idx}",
                         "pass --allow-nonfinite to decode it anyway")


def _decode_values(w: torch.Tensor, sc: torch.Tensor, scale2: tuple[torch.Tensor, torch.Tensor] | None,
                   dtype: torch.dtype, *, check: bool,
                   out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(decoded [E, R, C] on w's device, with ``check`` a one-element device tensor, non-zero where
    some scale byte is one no quantizer writes or some NVFP4 factor is not finite and > 0, else
    None) for NVFP4 with ``scale2`` = (amax [E], denominator [1] or [E]) on w's device, or MXFP8
    where ``scale2`` is None. The kernels where they apply (no host synchronization); on the CPU
    NVFP4 by per-expert tables (the reference's bits); else the reference. ``out``: where to decode
    (checked by the caller), else a fresh tensor."""
    e, r, cw = w.shape
    cols = cw if scale2 is None else cw * 2
    fname = "mxfp8" if scale2 is None else "nvfp4"
    if not (_gpu.wants_decode(w, dtype) and w.numel()):
        bad = _bad_scales_flag(fname, sc) if check else None
        if scale2 is None:
            return MXFP8Format().decode({"weight": w, "weight_scale": sc}, dtype, out=out), bad
        factor = _factor(scale2)
        if bad is not None:
            bad = bad | _bad_factor(factor).any()
        if w.device.type == "cpu" and dtype.itemsize in _PAIR_BITS:
            return _decode_nvfp4_tables(w, sc, factor, dtype, out), bad
        return _decode_nvfp4_reference(w, sc, factor, dtype, out), bad
    ops = _gpu._load()
    out = torch.empty((e, r, cols), dtype=dtype, device=w.device) if out is None else out
    flag = torch.zeros(1, dtype=torch.int32, device=w.device) if check else None
    for e0, e1 in _contiguous_slices(w, sc):
        n = e1 - e0
        wq, s = w[e0:e1].contiguous().view(n, -1), sc[e0:e1].contiguous().view(n, -1)
        o = out[e0:e1].view(n, r * cols)
        g = _globals_slice(scale2, e0, e1)
        if g is None:
            ops.mxfp8_decode(wq, s, "e4m3", dtype, out=o, bad=flag)
        else:  # the factor amax / denominator is computed (and checked) in the kernel
            ops.nvfp4_decode(wq, s, None, dtype, out=o, bad=flag, amax=g[0], denom=g[1])
    return out, flag


def _decode_nvfp4_reference(w: torch.Tensor, sc: torch.Tensor, factor: torch.Tensor, dtype: torch.dtype,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    e, r, half = w.shape
    cols = half * 2
    nb = cols // NVFP4_BLOCK
    out = torch.empty((e, r, cols), dtype=dtype, device=w.device) if out is None else out
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


def _decode_nvfp4_tables(w: torch.Tensor, sc: torch.Tensor, factor: torch.Tensor, dtype: torch.dtype,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """The reference's values on the CPU, a lookup per weight byte: each expert's table holds the
    reference's own float32 steps applied to all 65536 (scale byte, element-pair byte) combinations,
    ``(pair * f32(scale)) * factor`` then the cast, so every entry is the bits the reference gives
    that combination; each byte then becomes its two values in one int32 (int64 for float32)
    gather. 2.5x the reference's rate on one core (it makes five passes with float32
    temporaries)."""
    e, r, half = w.shape
    nb = half * 2 // NVFP4_BLOCK
    blocks = r * nb
    out = torch.empty((e, r, half * 2), dtype=dtype) if out is None else out
    if not out.numel():
        return out
    bits = _PAIR_BITS[dtype.itemsize]
    products = _scaled_pairs()
    pair_bytes = NVFP4_BLOCK // 2  # weight bytes of a block
    step = min(blocks, _TABLE_STEP_BLOCKS)
    index = np.empty((step, pair_bytes), dtype=np.int32)
    index_t = torch.from_numpy(index).view(-1)  # the same memory: numpy builds it, torch gathers with it
    shifted = np.empty(step, dtype=np.int32)
    for x in range(e):
        table = torch.mul(products, factor[x]).to(dtype).view(bits).view(-1)
        wb = w[x].reshape(blocks, pair_bytes).numpy()
        sb = sc[x].view(torch.uint8).reshape(blocks).numpy()
        ob = out[x].view(-1).view(bits)
        for b0 in range(0, blocks, step):
            n = min(step, blocks - b0)
            np.left_shift(sb[b0:b0 + n], 8, out=shifted[:n], dtype=np.int32)
            np.add(wb[b0:b0 + n], shifted[:n, None], out=index[:n])
            torch.index_select(table, 0, index_t[:n * pair_bytes], out=ob[b0 * pair_bytes:(b0 + n) * pair_bytes])
    return out


@functools.cache
def _scaled_pairs() -> torch.Tensor:
    """float32 [256 scale bytes, 256 pair bytes, 2]: E2M1 pair times the E4M3 scale (exact)."""
    cpu = torch.device("cpu")
    return _pair_table(cpu).view(1, 256, 2) * decode_table(E4M3, cpu).view(256, 1, 1)


def _decode_sliced(fname: str, w: torch.Tensor, sc: torch.Tensor, scale2: tuple[torch.Tensor, torch.Tensor] | None,
                   dtype: torch.dtype, name: str, allow_nonfinite: bool, dev: torch.device, budget: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    e, r, cw = w.shape
    cols = cw * 2 if fname == "nvfp4" else cw
    out = torch.empty((e, r, cols), dtype=dtype, device=w.device) if out is None else out
    per_expert = _nbytes(w.shape[1:], w.dtype) + _nbytes(sc.shape[1:], sc.dtype) + _nbytes((r, cols), dtype)
    flags: list[torch.Tensor] = []
    relay = _Relay(w.device, dev)
    if scale2 is not None:
        scale2 = (scale2[0].to(dev), scale2[1].to(dev))
    for e0, e1 in _expert_slices(e, per_expert, budget):
        wd, sd = relay.up(w[e0:e1]), relay.up(sc[e0:e1])
        values, bad = _decode_values(wd, sd, _globals_slice(scale2, e0, e1), dtype, check=not allow_nonfinite)
        if bad is not None:
            flags.append(bad.reshape(-1)[:1] != 0)
        relay.down([(values, out[e0:e1])])
    relay.finish()
    if flags and bool(torch.cat(flags).any()):  # one synchronization, after the last slice
        _check_scales(fname, sc, name)
    return out


# -- where the work runs ----------------------------------------------------------------------------

#: Default device memory for inputs plus outputs of the slices of :func:`encode_stacked` /
#: :func:`decode_stacked` with ``device=`` (two slices in flight, each half of it).
DEVICE_BUDGET_BYTES = 1 << 30
#: A non-contiguous input on a kernel device is made contiguous in expert slices of about this size.
_CONTIGUOUS_SLICE_BYTES = 1 << 28


def _compute_device(device: str | torch.device | None, w: torch.Tensor, name: str) -> torch.device:
    if device is None:
        return w.device
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        raise FormatError(f"{name}: unknown device {device!r}") from None
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise FormatError(f"{name}: device {device!r} asked for, but CUDA is not available")
        if d.index is None:
            d = torch.device("cuda", torch.cuda.current_device())
    return d


def _budget(budget_bytes: int | None) -> int:
    b = DEVICE_BUDGET_BYTES if budget_bytes is None else int(budget_bytes)
    if b <= 0:
        raise FormatError(f"budget_bytes must be positive, got {budget_bytes}")
    return b


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= int(s)
    return n


def _expert_slices(experts: int, per_expert: int, budget: int) -> list[tuple[int, int]]:
    """Expert ranges of at most budget / 2 bytes each (two in flight), at least one expert each."""
    k = max(1, budget // 2 // max(1, per_expert))
    return [(e0, min(experts, e0 + k)) for e0 in range(0, experts, k)]


def _contiguous_slices(*ts: torch.Tensor) -> list[tuple[int, int]]:
    """One range over all experts when every tensor is contiguous, else slices to copy contiguous."""
    e = ts[0].shape[0]
    if all(t.is_contiguous() for t in ts):
        return [(0, e)]
    per_expert = sum(_nbytes(t.shape[1:], t.dtype) for t in ts)
    return _expert_slices(e, per_expert, 2 * _CONTIGUOUS_SLICE_BYTES)


class _Relay:
    """Expert slices to the compute device and results back into the caller's tensors.

    From the host to a CUDA device, each slice goes through a page-locked buffer and a
    non-blocking copy, and results come back through page-locked buffers; a slice's results are
    copied out one slice later, so the host copies overlap the device's work on the next slice.
    torch's page-locked allocator keeps a buffer until the copies using it have completed, and
    the device's caching allocator reuses a slice's memory in stream order: about two slices are
    held at a time. Anywhere else (same device, device to host): plain copies.
    """

    def __init__(self, home: torch.device, dev: torch.device) -> None:
        self.dev = dev
        self.staged = home.type == "cpu" and dev.type == "cuda"
        self.pending: tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]] | None = None

    def up(self, t: torch.Tensor) -> torch.Tensor:
        if t.device == self.dev:
            return t
        if not self.staged:
            return t.to(self.dev)
        buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t)
        return buf.to(self.dev, non_blocking=True)

    def down(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy each (result on the device, destination) pair, now or after the next slice."""
        if not self.staged:
            for src, dst in pairs:
                dst.copy_(src)
            return
        bufs = []
        for src, dst in pairs:
            buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            buf.copy_(src, non_blocking=True)
            bufs.append((buf, dst))
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.dev))
        self.finish()
        self.pending = (done, bufs)

    def finish(self) -> None:
        """Wait for the slice in flight and copy its results out."""
        if self.pending is not None:
            done, bufs = self.pending
            self.pending = None
            done.synchronize()
            for buf, dst in bufs:
                dst.copy_(buf)


__all__ = [
    "AMAX",
    "DENOM",
    "DEVICE_BUDGET_BYTES",
    "NVFP4_DENOMINATOR",
    "SCALE",
    "STACKED_FORMATS",
    "WEIGHT",
    "decode_stacked",
    "deinterleave",
    "encode_stacked",
    "format_of_parts",
    "interleave",
    "stacked_parts",
]
