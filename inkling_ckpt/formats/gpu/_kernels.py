"""Triton kernels for the NVFP4 and MXFP8 codecs (imported only when a CUDA tensor meets Triton).

Every kernel reproduces the CPU reference (``formats/nvfp4.py``, ``formats/mxfp8.py``) operation
by operation, so the bytes are identical:

* divisions are IEEE round-to-nearest (``tl.math.div_rn``), never Triton's approximate ``/``
  nor a reciprocal-multiply;
* float8 roundings are done here from the float32 bits (round-to-nearest-even, subnormals
  included) rather than by a hardware/compiler cast, so the result does not depend on the
  GPU generation or the Triton version;
* NaN/Inf never reach a ``max`` reduction: blocks are reduced over their finite elements
  and flagged, as the reference does under ``allow_nonfinite``.

Layout: a tensor is viewed as ``[G, N]`` (G groups, each N contiguous elements, N a multiple
of the block). Blocks run along the flattened row-major order, which is the same as "along the
last dimension" because the width is a multiple of the block. Grids are (chunk, group) so no
program straddles two groups and the per-group scalar is one load.
"""

from __future__ import annotations

import triton
import triton.language as tl

# ----------------------------------------------------------------------------------------
# helpers (inlined into the kernels)


@triton.jit
def _f8_rne_byte(v, MBITS: tl.constexpr, BIAS: tl.constexpr, SUB_SCALE: tl.constexpr, MIN_NORMAL: tl.constexpr):
    """Unsigned minifloat byte (MBITS mantissa bits, BIAS) of |v| rounded to nearest-even.

    |v| must already be clamped to the format's finite range. Normal results come from
    rounding the float32 mantissa to MBITS bits (carry into the exponent is the natural
    RNE carry); subnormal ones from rounding |v| * 2^(BIAS-1+MBITS) to an integer, which is
    exact scaling followed by the 2^23 magic add (ties to even). Code 2^MBITS (smallest
    normal) comes out of either branch identically.
    """
    a = tl.abs(v)
    bits = a.to(tl.int32, bitcast=True)
    SHIFT: tl.constexpr = 23 - MBITS
    r = (bits + ((1 << (SHIFT - 1)) - 1) + ((bits >> SHIFT) & 1)) >> SHIFT
    normal = r - ((127 - BIAS) << MBITS)
    up = a * SUB_SCALE  # SUB_SCALE = 2^(BIAS-1+MBITS): exact
    sub = (up + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    return tl.where(a < MIN_NORMAL, sub, normal)


@triton.jit
def _load_f32(ptr, offs, mask, IN_BF16: tl.constexpr):
    """Load as float32. bf16 comes in as int16 bits and is widened by a shift (exact for every
    value, subnormals included, whatever the compiler's own conversion does)."""
    if IN_BF16:
        raw = tl.load(ptr + offs, mask=mask, other=0)
        return (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _e4m3_value(byte):
    """float32 value of a non-negative, finite E4M3 byte (0..0x7E)."""
    e = byte >> 3
    m = byte & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # m * 2^-9, exact
    return tl.where(e == 0, sub, normal)


# ----------------------------------------------------------------------------------------
# global amax (a separate reduction, per group)


@triton.jit
def group_amax_kernel(x_ptr, amax_ptr, bad_ptr, N, CHUNK: tl.constexpr, TILE: tl.constexpr, IN_BF16: tl.constexpr):
    """amax_ptr[g] = max |x| over the finite elements of group g (int32 bits of a float32,
    combined with atomic max: non-negative floats order like their bits); bad_ptr[g] = 1 when
    the group holds a NaN or +-Inf."""
    pid = tl.program_id(0)
    g = tl.program_id(1)
    base = g.to(tl.int64) * N
    start = pid.to(tl.int64) * CHUNK
    acc = tl.zeros([TILE], dtype=tl.float32)
    bad = tl.zeros([TILE], dtype=tl.int32)
    for i in range(0, CHUNK, TILE):
        offs = start + i + tl.arange(0, TILE)
        m = offs < N
        a = tl.abs(_load_f32(x_ptr, base + offs, m, IN_BF16))
        fin = a < float("inf")  # False for NaN and Inf
        acc = tl.maximum(acc, tl.where(fin, a, 0.0))
        bad = tl.maximum(bad, (~fin & m).to(tl.int32))
    mx = tl.max(acc, axis=0)
    tl.atomic_max(amax_ptr + g, mx.to(tl.int32, bitcast=True))
    anybad = tl.max(bad, axis=0)
    tl.atomic_max(bad_ptr + g, anybad, mask=anybad > 0)


# ----------------------------------------------------------------------------------------
# NVFP4


@triton.jit
def nvfp4_encode_kernel(x_ptr, s2_ptr, w_ptr, sc_ptr, bad_ptr, N, NB: tl.constexpr, IN_BF16: tl.constexpr):
    """One pass: block amax -> E4M3 block scale -> E2M1 codes -> packed nibbles.

    x: [G, N] (bf16/fp16/fp32); s2_ptr: float32 [G] (weight_scale_2 of each group);
    w: uint8 [G, N/2]; sc: uint8 [G, N/16] (E4M3 bits); bad_ptr: int32 [1], set to 1 when a
    block holds NaN/Inf (that block gets scale 0x7F and zero nibbles).
    """
    pid = tl.program_id(0)
    g = tl.program_id(1)
    nblk = N // 16
    blk = pid.to(tl.int64) * NB + tl.arange(0, NB)  # block index inside the group
    bmask = blk < nblk
    gbase = g.to(tl.int64) * N
    offs = gbase + blk[:, None] * 16 + tl.arange(0, 16)[None, :]
    x = _load_f32(x_ptr, offs, bmask[:, None], IN_BF16)
    s2 = tl.load(s2_ptr + g)

    a = tl.abs(x)
    fin = a < float("inf")
    bamax = tl.max(tl.where(fin, a, 0.0), axis=1)
    badblk = tl.max((~fin).to(tl.int32), axis=1) > 0

    six_s2 = s2 * 6.0  # f32(6 * s2) first
    sb = tl.math.div_rn(bamax, six_s2)
    sb = tl.where(sb == 0.0, 1.0, sb)
    sb = tl.minimum(tl.maximum(sb, 0.001953125), 448.0)  # clamp(2^-9, 448)
    sbyte = _f8_rne_byte(sb, 3, 7, 512.0, 0.015625)
    eff = _e4m3_value(sbyte) * s2  # f32(f32(sb) * s2)

    y = tl.math.div_rn(x, eff[:, None])
    ay = tl.abs(y)
    ay = tl.where(ay < 6.0, ay, 6.0)  # saturate; NaN -> 6 as the reference
    code = (ay > 0.25).to(tl.int32)
    code += (ay >= 0.75).to(tl.int32)
    code += (ay > 1.25).to(tl.int32)
    code += (ay >= 1.75).to(tl.int32)
    code += (ay > 2.5).to(tl.int32)
    code += (ay >= 3.5).to(tl.int32)
    code += (ay > 5.0).to(tl.int32)
    code = code | ((x < 0.0).to(tl.int32) << 3)
    code = tl.where(badblk[:, None], 0, code)
    lo, hi = tl.split(tl.reshape(code, [NB, 8, 2]))
    packed = (lo | (hi << 4)).to(tl.uint8)

    sbyte = tl.where(badblk, 0x7F, sbyte)
    woffs = (gbase // 2) + blk[:, None] * 8 + tl.arange(0, 8)[None, :]
    tl.store(w_ptr + woffs, packed, mask=bmask[:, None])
    tl.store(sc_ptr + (gbase // 16) + blk, sbyte.to(tl.uint8), mask=bmask)
    anybad = tl.max((badblk & bmask).to(tl.int32), axis=0)
    tl.atomic_max(bad_ptr, anybad, mask=anybad > 0)


@triton.jit
def nvfp4_decode_kernel(w_ptr, sc_ptr, s2_ptr, e2m1_ptr, e4m3_ptr, out_ptr, N,
                        NB: tl.constexpr, OUT_KIND: tl.constexpr):
    """out = e2m1(nibble) * (f32(scale) * s2), float32 math, then cast (OUT_KIND 0 f32, 1 bf16, 2 f16)."""
    pid = tl.program_id(0)
    g = tl.program_id(1)
    nblk = N // 16
    blk = pid.to(tl.int64) * NB + tl.arange(0, NB)
    bmask = blk < nblk
    gbase = g.to(tl.int64) * N
    s2 = tl.load(s2_ptr + g)
    sbyte = tl.load(sc_ptr + (gbase // 16) + blk, mask=bmask, other=0).to(tl.int32)
    eff = tl.load(e4m3_ptr + sbyte) * s2
    woffs = (gbase // 2) + blk[:, None] * 8 + tl.arange(0, 8)[None, :]
    byte = tl.load(w_ptr + woffs, mask=bmask[:, None], other=0).to(tl.int32)
    lo = tl.load(e2m1_ptr + (byte & 0xF))
    hi = tl.load(e2m1_ptr + (byte >> 4))
    vals = tl.reshape(tl.join(lo, hi), [NB, 16])
    out = vals * eff[:, None]
    _store_out(out_ptr, gbase + blk[:, None] * 16 + tl.arange(0, 16)[None, :], out, bmask[:, None], OUT_KIND)


@triton.jit
def _store_out(ptr, offs, v, mask, OUT_KIND: tl.constexpr):
    """Store float32 v as OUT_KIND (0 f32, 1 bf16 through an int16 pointer, 2 f16), NaN as the CPU
    writes it (positive quiet NaN)."""
    nan = v != v
    if OUT_KIND == 0:
        v = tl.where(nan, tl.full(v.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True), v)
        tl.store(ptr + offs, v, mask=mask)
    elif OUT_KIND == 1:
        # RNE from the bits (a compiler cast may truncate, e.g. Triton's interpreter); carries
        # into the exponent give the right neighbour, up to Inf
        bits = v.to(tl.int32, bitcast=True)
        b = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        b = tl.where(nan, 0x7FC0, b).to(tl.int16)
        tl.store(ptr + offs, b, mask=mask)  # ptr is the bf16 output viewed as int16
    else:
        h = v.to(tl.float16).to(tl.int16, bitcast=True)
        h = tl.where(nan, 0x7E00, h).to(tl.int16)
        tl.store(ptr + offs, h.to(tl.float16, bitcast=True), mask=mask)


# ----------------------------------------------------------------------------------------
# MXFP8


@triton.jit
def mxfp8_encode_kernel(x_ptr, q_ptr, sc_ptr, bad_ptr, N, ELEM_MAX: tl.constexpr, EMAX: tl.constexpr,
                        MBITS: tl.constexpr, BIAS: tl.constexpr, SUB_SCALE: tl.constexpr, MIN_NORMAL: tl.constexpr,
                        RCEIL: tl.constexpr, NB: tl.constexpr, IN_BF16: tl.constexpr):
    """One pass: block amax -> E8M0 scale (RCEIL or FLOOR, from the bits) -> scaled, clamped,
    RNE-rounded FP8 elements. x: [G, N]; q: uint8 [G, N]; sc: uint8 [G, N/32]."""
    pid = tl.program_id(0)
    g = tl.program_id(1)
    nblk = N // 32
    blk = pid.to(tl.int64) * NB + tl.arange(0, NB)
    bmask = blk < nblk
    gbase = g.to(tl.int64) * N
    offs = gbase + blk[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = _load_f32(x_ptr, offs, bmask[:, None], IN_BF16)

    a = tl.abs(x)
    fin = a < float("inf")
    bamax = tl.max(tl.where(fin, a, 0.0), axis=1)
    badblk = tl.max((~fin).to(tl.int32), axis=1) > 0

    if RCEIL:
        q = tl.math.div_rn(bamax, ELEM_MAX)
        qb = q.to(tl.int32, bitcast=True)
        expo = qb >> 23
        mant = qb & 0x7FFFFF
        thr = tl.where(expo == 0, 0x400000, 0)
        biased = expo + (mant > thr).to(tl.int32)
    else:
        biased = (bamax.to(tl.int32, bitcast=True) >> 23) - EMAX
    biased = tl.minimum(tl.maximum(biased, 0), 254)
    # 2^(127 - b): biased exponent 254 - b, except b = 254 -> 2^-127 (subnormal 0x00400000)
    inv = tl.where(biased == 254, 0x400000, (254 - biased) << 23).to(tl.float32, bitcast=True)
    y = x * inv[:, None]
    y = tl.minimum(tl.maximum(y, -ELEM_MAX), ELEM_MAX)
    sign = (y.to(tl.int32, bitcast=True) >> 24) & 0x80  # sign bit (-0.0 -> 0x80, like the cast)
    code = _f8_rne_byte(y, MBITS, BIAS, SUB_SCALE, MIN_NORMAL) | sign
    code = tl.where(badblk[:, None], 0x7F, code)
    biased = tl.where(badblk, 0xFF, biased)
    tl.store(q_ptr + offs, code.to(tl.uint8), mask=bmask[:, None])
    tl.store(sc_ptr + (gbase // 32) + blk, biased.to(tl.uint8), mask=bmask)
    anybad = tl.max((badblk & bmask).to(tl.int32), axis=0)
    tl.atomic_max(bad_ptr, anybad, mask=anybad > 0)


@triton.jit
def mxfp8_decode_kernel(q_ptr, sc_ptr, elem_ptr, e8m0_ptr, out_ptr, N, NB: tl.constexpr, OUT_KIND: tl.constexpr):
    """out = fp8(q) * 2^(scale - 127) in float32 (0xFF scale -> NaN), then cast."""
    pid = tl.program_id(0)
    g = tl.program_id(1)
    nblk = N // 32
    blk = pid.to(tl.int64) * NB + tl.arange(0, NB)
    bmask = blk < nblk
    gbase = g.to(tl.int64) * N
    sbyte = tl.load(sc_ptr + (gbase // 32) + blk, mask=bmask, other=0).to(tl.int32)
    s = tl.load(e8m0_ptr + sbyte)
    offs = gbase + blk[:, None] * 32 + tl.arange(0, 32)[None, :]
    byte = tl.load(q_ptr + offs, mask=bmask[:, None], other=0).to(tl.int32)
    vals = tl.load(elem_ptr + byte)
    _store_out(out_ptr, offs, vals * s[:, None], bmask[:, None], OUT_KIND)
