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
def group_amax_kernel(x_ptr, amax_ptr, bad_ptr, N, CHUNK: tl.constexpr, TILE: tl.constexpr, IN_BF16: tl.constexpr,
                      BAD_STRIDE: tl.constexpr):
    """amax_ptr[g] = max |x| over the finite elements of group g (int32 bits of a float32,
    combined with atomic max: non-negative floats order like their bits); bad_ptr[g] = 1 when
    the group holds a NaN or +-Inf (bad_ptr[0] for every group with BAD_STRIDE 0)."""
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
    tl.atomic_max(bad_ptr + g * BAD_STRIDE, anybad, mask=anybad > 0)


# ----------------------------------------------------------------------------------------
# NVFP4


@triton.jit
def _group_s2(s2_ptr, used_ptr, den_ptr, bad_ptr, pid, g, FROM_AMAX: tl.constexpr, CHECK_AMAX: tl.constexpr):
    """The group's weight_scale_2: ``s2_ptr[g]``, or with FROM_AMAX computed from the group's
    global amax (what s2_ptr then holds) as the reference does: f32(amax) / 2688 (IEEE division),
    an amax below 2^-126 taken as 1.0. The first program of the group then stores the amax used
    (``used_ptr[g]``), the first group's the denominator (``den_ptr``); CHECK_AMAX sets
    ``bad_ptr[1]`` where the given amax is not finite and > 0. Saves the host three launches."""
    v = tl.load(s2_ptr + g)
    s2 = v
    if FROM_AMAX:
        used = tl.where(v < 1.1754943508222875e-38, 1.0, v)
        s2 = tl.math.div_rn(used, tl.full([], 2688.0, tl.float32))
        first = pid == 0
        tl.store(used_ptr + g, used, mask=first)
        tl.store(den_ptr, tl.full([], 2688.0, tl.float32), mask=first & (g == 0))
        if CHECK_AMAX:
            ok = (v > 0.0) & (v < float("inf"))  # False for NaN
            tl.atomic_max(bad_ptr + 1, tl.full([], 1, tl.int32), mask=first & ~ok)
    return s2



@triton.jit
def nvfp4_encode_kernel(x_ptr, s2_ptr, w_ptr, sc_ptr, bad_ptr, used_ptr, den_ptr, N, NB: tl.constexpr,
                        IN_BF16: tl.constexpr, FROM_AMAX: tl.constexpr, CHECK_AMAX: tl.constexpr):
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
    s2 = _group_s2(s2_ptr, used_ptr, den_ptr, bad_ptr, pid, g, FROM_AMAX, CHECK_AMAX)

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
def _group_factor(s2_ptr, den_ptr, bad_ptr, pid, g, FROM_AMAX: tl.constexpr, DEN_STRIDE: tl.constexpr,
                  BAD_FROM: tl.constexpr):
    """The decode's per-group factor: s2_ptr[g], or with FROM_AMAX amax / denominator (one IEEE
    division, as the reference), the first program of the group flagging a factor that is not
    finite and > 0 when BAD_FROM > 0."""
    f = tl.load(s2_ptr + g)
    if FROM_AMAX:
        f = tl.math.div_rn(f, tl.load(den_ptr + g * DEN_STRIDE))
        if BAD_FROM > 0:
            ok = (f > 0.0) & (f < float("inf"))  # False for NaN
            tl.atomic_max(bad_ptr, tl.full([], 1, tl.int32), mask=(pid == 0) & ~ok)
    return f


@triton.jit
def nvfp4_decode_kernel(w_ptr, sc_ptr, s2_ptr, e2m1_ptr, e4m3_ptr, out_ptr, bad_ptr, den_ptr, N,
                        NB: tl.constexpr, OUT_KIND: tl.constexpr, FACTOR_LAST: tl.constexpr, BAD_FROM: tl.constexpr,
                        FROM_AMAX: tl.constexpr, DEN_STRIDE: tl.constexpr):
    """out = e2m1(nibble) * (f32(scale) * s2), float32 math, then cast (OUT_KIND 0 f32, 1 bf16, 2 f16).

    FACTOR_LAST: out = (e2m1(nibble) * f32(scale)) * s2 instead, the order of the stacked release
    experts (transformers' Inkling2LoopDequantizeExperts; s2 = amax / denominator): the first
    product is exact, the second one rounding, so the two orders differ in the last bit at times.
    BAD_FROM > 0: bad_ptr (int32 [1]) is set to 1 when a block's scale byte is >= BAD_FROM (the
    caller's validity check, done on the bytes the decode reads anyway). FROM_AMAX: s2_ptr holds
    each group's amax and den_ptr the denominator(s) (DEN_STRIDE 0: one for all groups): the
    factor is their IEEE quotient, flagged in bad_ptr (BAD_FROM > 0) unless finite and > 0."""
    pid = tl.program_id(0)
    g = tl.program_id(1)
    nblk = N // 16
    blk = pid.to(tl.int64) * NB + tl.arange(0, NB)
    bmask = blk < nblk
    gbase = g.to(tl.int64) * N
    s2 = _group_factor(s2_ptr, den_ptr, bad_ptr, pid, g, FROM_AMAX, DEN_STRIDE, BAD_FROM)
    sbyte = tl.load(sc_ptr + (gbase // 16) + blk, mask=bmask, other=0).to(tl.int32)
    if BAD_FROM > 0:
        tl.atomic_max(bad_ptr + tl.zeros([NB], tl.int32), tl.full([NB], 1, tl.int32), mask=bmask & (sbyte >= BAD_FROM))
    sval = tl.load(e4m3_ptr + sbyte)
    woffs = (gbase // 2) + blk[:, None] * 8 + tl.arange(0, 8)[None, :]
    byte = tl.load(w_ptr + woffs, mask=bmask[:, None], other=0).to(tl.int32)
    lo = tl.load(e2m1_ptr + (byte & 0xF))
    hi = tl.load(e2m1_ptr + (byte >> 4))
    vals = tl.reshape(tl.join(lo, hi), [NB, 16])
    if FACTOR_LAST:
        out = (vals * sval[:, None]) * s2
    else:
        eff = sval * s2
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
def mxfp8_decode_kernel(q_ptr, sc_ptr, elem_ptr, e8m0_ptr, out_ptr, bad_ptr, N, NB: tl.constexpr, OUT_KIND: tl.constexpr,
                        BAD_FROM: tl.constexpr):
    """out = fp8(q) * 2^(scale - 127) in float32 (0xFF scale -> NaN), then cast. BAD_FROM: as in
    nvfp4_decode_kernel."""
    pid = tl.program_id(0)
    g = tl.program_id(1)
    nblk = N // 32
    blk = pid.to(tl.int64) * NB + tl.arange(0, NB)
    bmask = blk < nblk
    gbase = g.to(tl.int64) * N
    sbyte = tl.load(sc_ptr + (gbase // 32) + blk, mask=bmask, other=0).to(tl.int32)
    if BAD_FROM > 0:
        tl.atomic_max(bad_ptr + tl.zeros([NB], tl.int32), tl.full([NB], 1, tl.int32), mask=bmask & (sbyte >= BAD_FROM))
    s = tl.load(e8m0_ptr + sbyte)
    offs = gbase + blk[:, None] * 32 + tl.arange(0, 32)[None, :]
    byte = tl.load(q_ptr + offs, mask=bmask[:, None], other=0).to(tl.int32)
    vals = tl.load(elem_ptr + byte)
    _store_out(out_ptr, offs, vals * s[:, None], bmask[:, None], OUT_KIND)


# ----------------------------------------------------------------------------------------
# BF16 fast paths. A block is read as [NB, 4] int32 words (each word = two bf16 elements,
# the even one in the low half), in pieces of four words: every thread then holds whole
# blocks, so the block reductions and the nibble/byte packing stay in registers (no shuffles,
# no shared memory). Same arithmetic as the generic kernels above, with two cheaper steps:
#
# * the per-element IEEE division x / eff is done as Markstein's correction of x * RN(1/eff)
#   (two FMA refinements; RN(1/eff) by div_rn once per block): correctly rounded whenever no
#   intermediate leaves the normal range, which a per-block power-of-two rescaling of x and
#   eff guarantees wherever the quotient is near a rounding threshold;
# * E2M1 rounding from the float bits (magic-number add below 1, one-mantissa-bit RNE above).
#
# The NVFP4 loop kernel (the one ops uses) goes further for the usual global scales: no
# per-element division at all. round_e2m1(RN(x / eff)) only depends on where |x| falls among
# seven per-block bf16 thresholds, computed exactly once per block (_nv_thresh_blocks); the
# elements are then compared two at a time in 16-bit lanes (_nv_word_nibbles). About 18
# instructions per element instead of about 25: the division path spent as long computing as
# moving the bytes.


@triton.jit
def _e2m1_code(q):
    """E2M1 magnitude code (int32 0..7) of |q| rounded to nearest-even, saturating (NaN -> 7)."""
    a = tl.abs(q)
    a = tl.where(a < 6.0, a, 6.0)
    lo = (a + 4194304.0).to(tl.int32, bitcast=True) - 0x4A800000  # halves below 1, ties to even
    b = a.to(tl.int32, bitcast=True)
    # one mantissa bit, RNE: (bits + 0x1FFFFF + lsb) >> 22, minus 252 folded in (252 << 22)
    hi = (b + ((b >> 22) & 1) + (0x1FFFFF - 0x3F000000)) >> 22
    return tl.where(a < 1.0, lo, hi)


@triton.jit
def _div_markstein(x, b, y):
    """RN(x / b) given y = RN(1 / b), for b and the quotient's neighbourhood in the normal range."""
    q = x * y
    r = tl.fma(-b, q, x)
    q = tl.fma(r, y, q)  # faithful
    r = tl.fma(-b, q, x)  # exact remainder
    return tl.fma(r, y, q)  # correctly rounded (Markstein)


@triton.jit
def _nv_word_byte(w, scale, eff, y):
    """One int32 word (two bf16) -> one NVFP4 byte (low nibble = even element).

    ``scale`` = 2^k, ``eff`` and ``y`` are the block's (scaled) divisor and RN(1/eff): x*2^k /
    (eff*2^k) is the same real quotient, and keeps Markstein's intermediates normal."""
    e0 = (w << 16).to(tl.float32, bitcast=True)
    e1 = (w & -65536).to(tl.float32, bitcast=True)
    q0 = _div_markstein(e0 * scale, eff, y)
    q1 = _div_markstein(e1 * scale, eff, y)
    c0 = _e2m1_code(q0) | tl.where(e0 < 0.0, 8, 0)
    c1 = _e2m1_code(q1) | tl.where(e1 < 0.0, 8, 0)
    return c0 | (c1 << 4)


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _absbits_max(w):
    """Per row: max over the row's words of |element| float bits (both halves), int32."""
    lo = (w << 16) & 0x7FFFFFFF
    hi = w & 0x7FFF0000
    return tl.max(tl.maximum(lo, hi), axis=1)


@triton.jit
def nvfp4_encode_bf16_kernel(x_ptr, s2_ptr, w_ptr, sc_ptr, bad_ptr, used_ptr, den_ptr, NW, NB: tl.constexpr,
                             FROM_AMAX: tl.constexpr, CHECK_AMAX: tl.constexpr):
    """NVFP4 encode of bf16 data seen as int32 words. x: [G, NW] int32 (NW = N/2); w: [G, NW/8]
    int64 (8 packed bytes per block); sc: uint8 [G, NW/8]; s2: float32 [G]; bad: int32 [1]."""
    pid = tl.program_id(0)
    g = tl.program_id(1)
    nblk = NW // 8
    blk = pid.to(tl.int64) * NB + tl.arange(0, NB)
    bmask = blk < nblk
    row = g.to(tl.int64) * nblk + blk  # global block index: offsets below are provably multiples of 8 words
    base = row[:, None] * 8 + tl.arange(0, 4)[None, :]
    wa = tl.load(x_ptr + base, mask=bmask[:, None], other=0)
    wb = tl.load(x_ptr + base + 4, mask=bmask[:, None], other=0)
    s2 = _group_s2(s2_ptr, used_ptr, den_ptr, bad_ptr, pid, g, FROM_AMAX, CHECK_AMAX)

    mbits = tl.maximum(_absbits_max(wa), _absbits_max(wb))
    badblk = mbits >= 0x7F800000  # NaN or Inf in the block
    bamax = mbits.to(tl.float32, bitcast=True)
    six_s2 = s2 * 6.0
    sb = tl.math.div_rn(bamax, six_s2)
    sb = tl.where(sb == 0.0, 1.0, sb)
    sb = tl.minimum(tl.maximum(sb, 0.001953125), 448.0)
    sbyte = _f8_rne_byte(sb, 3, 7, 512.0, 0.015625)
    eff = _e4m3_value(sbyte) * s2
    # Scale the block's divisor (and every x) by 2^k, k from eff's exponent clamped to
    # [-126, 126], so that eff*2^k is normal and near 1: exact for x (a power of two; results
    # that overflow or underflow are far from any rounding threshold and keep their code).
    ebits = (eff.to(tl.int32, bitcast=True) >> 23) & 0xFF
    scale = (tl.minimum(tl.maximum(254 - ebits, 1), 253) << 23).to(tl.float32, bitcast=True)
    effs = eff * scale
    y = tl.math.div_rn(tl.full([NB], 1.0, tl.float32), effs)
    shift = tl.arange(0, 4)[None, :] * 8
    ba = _nv_word_byte(wa, scale[:, None], effs[:, None], y[:, None])
    bb = _nv_word_byte(wb, scale[:, None], effs[:, None], y[:, None])
    lo = tl.reduce((ba & 0xFF) << shift, 1, _or).to(tl.int64) & 0xFFFFFFFF
    hi = tl.reduce((bb & 0xFF) << shift, 1, _or).to(tl.int64) << 32
    packed = tl.where(badblk, 0, lo | hi)
    sbyte = tl.where(badblk, 0x7F, sbyte)
    tl.store(w_ptr + row, packed, mask=bmask)
    tl.store(sc_ptr + row, sbyte.to(tl.uint8), mask=bmask)
    # per-block atomics, issued only for bad blocks (no program-wide reduction, no barrier)
    tl.atomic_max(bad_ptr + tl.zeros([NB], tl.int32), tl.full([NB], 1, tl.int32), mask=badblk & bmask)


@triton.jit
def _mx_word(w, inv, MBITS: tl.constexpr, BIAS: tl.constexpr, SUB_SCALE: tl.constexpr, MIN_NORMAL: tl.constexpr,
             ELEM_MAX: tl.constexpr, HW_CVT: tl.constexpr, E5M2: tl.constexpr):
    """One int32 word (two bf16) -> two FP8 bytes (even element in the low byte), int32."""
    e0 = (w << 16).to(tl.float32, bitcast=True) * inv
    e1 = (w & -65536).to(tl.float32, bitcast=True) * inv
    if HW_CVT:
        # One PTX cvt.rn.satfinite.{e4m3,e5m2}x2.f32 per pair: RNE, and beyond the largest finite
        # value it gives that value, which is what the reference's clamp-then-cast does. The
        # first source lands in the high byte. (Written as inline PTX: the pair layout is then
        # ours, not the compiler's.)
        if E5M2:
            return tl.inline_asm_elementwise(
                "{ .reg .b16 t; cvt.rn.satfinite.e5m2x2.f32 t, $2, $1; cvt.u32.u16 $0, t; }",
                "=r,f,f", [e0, e1], dtype=tl.int32, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise(
                "{ .reg .b16 t; cvt.rn.satfinite.e4m3x2.f32 t, $2, $1; cvt.u32.u16 $0, t; }",
                "=r,f,f", [e0, e1], dtype=tl.int32, is_pure=True, pack=1)
    else:
        e0 = tl.minimum(tl.maximum(e0, -ELEM_MAX), ELEM_MAX)
        e1 = tl.minimum(tl.maximum(e1, -ELEM_MAX), ELEM_MAX)
        c0 = _f8_rne_byte(e0, MBITS, BIAS, SUB_SCALE, MIN_NORMAL) | ((e0.to(tl.int32, bitcast=True) >> 24) & 0x80)
        c1 = _f8_rne_byte(e1, MBITS, BIAS, SUB_SCALE, MIN_NORMAL) | ((e1.to(tl.int32, bitcast=True) >> 24) & 0x80)
        return c0 | (c1 << 8)


@triton.jit
def _mx_piece(q_ptr, qoffs, w, inv, bad, bmask, MBITS: tl.constexpr, BIAS: tl.constexpr, SUB_SCALE: tl.constexpr,
              MIN_NORMAL: tl.constexpr, ELEM_MAX: tl.constexpr, HW_CVT: tl.constexpr, E5M2: tl.constexpr):
    """Encode and store one piece (4 words = 8 elements) of each block as one int64."""
    c = _mx_word(w, inv[:, None], MBITS, BIAS, SUB_SCALE, MIN_NORMAL, ELEM_MAX, HW_CVT, E5M2) & 0xFFFF
    col = tl.arange(0, 4)[None, :]
    # two int32 halves (words 0-1, words 2-3), then one int64, as in the NVFP4 kernel
    lo = tl.reduce(tl.where(col < 2, c << (16 * col), 0), 1, _or)
    hi = tl.reduce(tl.where(col >= 2, c << (16 * (col - 2)), 0), 1, _or)
    v = (lo.to(tl.int64) & 0xFFFFFFFF) | (hi.to(tl.int64) << 32)
    v = tl.where(bad, 0x7F7F7F7F7F7F7F7F, v)
    tl.store(q_ptr + qoffs, v, mask=bmask)


@triton.jit
def mxfp8_encode_bf16_kernel(x_ptr, q_ptr, sc_ptr, bad_ptr, NW, ELEM_MAX: tl.constexpr, EMAX: tl.constexpr,
                             MBITS: tl.constexpr, BIAS: tl.constexpr, SUB_SCALE: tl.constexpr,
                             MIN_NORMAL: tl.constexpr, RCEIL: tl.constexpr, NB: tl.constexpr,
                             HW_CVT: tl.constexpr, E5M2: tl.constexpr):
    """MXFP8 encode of bf16 data seen as int32 words: x [G, NW]; q: int64 [G, NW/4] (4 per block);
    sc: uint8 [G, NW/16]."""
    pid = tl.program_id(0)
    g = tl.program_id(1)
    nblk = NW // 16
    blk = pid.to(tl.int64) * NB + tl.arange(0, NB)
    bmask = blk < nblk
    row = g.to(tl.int64) * nblk + blk
    base = row[:, None] * 16 + tl.arange(0, 4)[None, :]
    m2 = bmask[:, None]
    w0 = tl.load(x_ptr + base, mask=m2, other=0)
    w1 = tl.load(x_ptr + base + 4, mask=m2, other=0)
    w2 = tl.load(x_ptr + base + 8, mask=m2, other=0)
    w3 = tl.load(x_ptr + base + 12, mask=m2, other=0)
    mbits = tl.maximum(tl.maximum(_absbits_max(w0), _absbits_max(w1)), tl.maximum(_absbits_max(w2), _absbits_max(w3)))
    bad = mbits >= 0x7F800000
    bamax = mbits.to(tl.float32, bitcast=True)
    if RCEIL:
        q = tl.math.div_rn(bamax, ELEM_MAX)
        qb = q.to(tl.int32, bitcast=True)
        expo = qb >> 23
        mant = qb & 0x7FFFFF
        thr = tl.where(expo == 0, 0x400000, 0)
        biased = expo + (mant > thr).to(tl.int32)
    else:
        biased = (mbits >> 23) - EMAX
    biased = tl.minimum(tl.maximum(biased, 0), 254)
    inv = tl.where(biased == 254, 0x400000, (254 - biased) << 23).to(tl.float32, bitcast=True)
    qbase = row * 4
    _mx_piece(q_ptr, qbase, w0, inv, bad, bmask, MBITS, BIAS, SUB_SCALE, MIN_NORMAL, ELEM_MAX, HW_CVT, E5M2)
    _mx_piece(q_ptr, qbase + 1, w1, inv, bad, bmask, MBITS, BIAS, SUB_SCALE, MIN_NORMAL, ELEM_MAX, HW_CVT, E5M2)
    _mx_piece(q_ptr, qbase + 2, w2, inv, bad, bmask, MBITS, BIAS, SUB_SCALE, MIN_NORMAL, ELEM_MAX, HW_CVT, E5M2)
    _mx_piece(q_ptr, qbase + 3, w3, inv, bad, bmask, MBITS, BIAS, SUB_SCALE, MIN_NORMAL, ELEM_MAX, HW_CVT, E5M2)
    biased = tl.where(bad, 0xFF, biased)
    tl.store(sc_ptr + row, biased.to(tl.uint8), mask=bmask)
    tl.atomic_max(bad_ptr + tl.zeros([NB], tl.int32), tl.full([NB], 1, tl.int32), mask=bad & bmask)


@triton.jit
def group_amax_bf16_kernel(x_ptr, amax_ptr, bad_ptr, NW, CHUNK: tl.constexpr, TILE: tl.constexpr,
                           BAD_STRIDE: tl.constexpr):
    """group_amax_kernel for bf16 data seen as int32 words (two elements each): integer max of
    the |element| bits, finite elements only, and a non-finite flag; x: [G, NW]."""
    pid = tl.program_id(0)
    g = tl.program_id(1)
    base = g.to(tl.int64) * NW
    start = pid.to(tl.int64) * CHUNK
    acc = tl.zeros([TILE], dtype=tl.int32)
    raw = tl.zeros([TILE], dtype=tl.int32)
    for i in range(0, CHUNK, TILE):
        offs = start + i + tl.arange(0, TILE)
        w = tl.load(x_ptr + base + offs, mask=offs < NW, other=0)
        lo = (w << 16) & 0x7FFFFFFF
        hi = w & 0x7FFF0000
        raw = tl.maximum(raw, tl.maximum(lo, hi))
        acc = tl.maximum(acc, tl.maximum(tl.where(lo < 0x7F800000, lo, 0), tl.where(hi < 0x7F800000, hi, 0)))
    tl.atomic_max(amax_ptr + g, tl.max(acc, axis=0))
    anybad = (tl.max(raw, axis=0) >= 0x7F800000).to(tl.int32)
    tl.atomic_max(bad_ptr + g * BAD_STRIDE, anybad, mask=anybad > 0)


@triton.jit
def _bf16_above(z):
    """bf16 bits (int32) of the smallest bf16 value above z, a positive float64 in bf16's normal
    range that is no bf16 value itself: its top 8 significant bits, plus one."""
    return ((z.to(tl.int64, bitcast=True) >> 45) + (1 - (896 << 7))).to(tl.int32)  # exponent bias 1023 -> 127


@triton.jit
def _lanes_set(s, HW: tl.constexpr):
    """0xFFFF in each 16-bit lane of s whose top bit (15 or 31) is set, else 0."""
    if HW:  # one PRMT: each byte takes the sign of byte 1 (lane 0) or byte 3 (lane 1)
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, 0, 0xBB99;", "=r,r", [s], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        return ((s >> 15) & 0x10001) * 0xFFFF


@triton.jit
def _nv_word_nibbles(w, a, c1, c2, c3, c4, c5, c6, c7, HW: tl.constexpr):
    """E2M1 nibbles of the two bf16 of each word w (a = w & 0x7FFF7FFF: their |x| bits), in bits
    12-15 (even element) and 28-31 (odd one), uint32.

    ck = 0x8000 - T_k in both 16-bit lanes, T_k the bf16 bits of the smallest |x| whose code is
    >= k: |x| bits + ck sets the lane's top bit exactly when |x| >= T_k (|x| bits < 2^15 and
    ck <= 2^15, so lanes never spill into each other). The code comes from a binary search,
    both lanes at once: T_4, then T_2 or T_6, then T_1, T_3, T_5 or T_7."""
    m4 = _lanes_set(a + c4, HW)
    m2 = _lanes_set(a + ((m4 & c6) | (~m4 & c2)), HW)
    lo = (m4 & c5) | (~m4 & c1)
    hi = (m4 & c7) | (~m4 & c3)
    s1 = (a + ((m2 & hi) | (~m2 & lo))) >> 3  # bit 12 / 28: |x| >= T_(code | 1)
    m42 = (m4 & 0x40004000) | (m2 & ~0x40004000)  # bit 14 / 30 from m4, 13 / 29 from m2
    code = (m42 & 0x60006000) | (s1 & ~0x60006000)
    sg = w & (a + 0x7FFF7FFF) & -2147450880  # bit 15 / 31 (mask 0x80008000): negative and not -0.0
    return ((code & 0x70007000) | sg).to(tl.uint32, bitcast=True)


@triton.jit
def _nv_half_block(w, a, c1, c2, c3, c4, c5, c6, c7, HW: tl.constexpr):
    """Packed nibbles (uint32 [NB], byte j from word j) of 4 words [NB, 4]."""
    nb: tl.constexpr = w.shape[0]
    v = _nv_word_nibbles(w, a, c1, c2, c3, c4, c5, c6, c7, HW)
    ve, vo = tl.split(tl.reshape(v, [nb, 2, 2]))  # words 0, 2 / 1, 3
    u = (ve >> 12) | (vo >> 4)  # word 2j's nibbles at bits 0-3 / 16-19, word 2j+1's at 8-11 / 24-27
    p = (u | (u >> 12)) & 0xFFFF  # bytes 2j, 2j+1
    p0, p1 = tl.split(p)
    return p0 | (p1 << 16)


@triton.jit
def _nv_thresh_blocks(wa, wb, aa, ab, eff, HW: tl.constexpr):
    """Packed int64 [NB] of NB blocks (words wa, wb; |x| bits aa, ab) with block divisors eff, from
    per-block thresholds instead of a division per element."""
    # The reference's code of x is round_e2m1(min(RN(|x| / eff), 6)), a non-decreasing function of
    # |x| (saturation and Inf quotients included), so code >= k exactly from some bf16 T_k on:
    # code >= k  <=>  RN(|x| / eff) >= m_k (> m_k where the tie rounds down: 0.25, 1.25, 2.5, 5)
    #            <=>  |x| > K_k * eff, K_k the real point where float32 RN switches (m_k -+ half an
    # ulp). K_k * eff is exact in float64 (24 x 25 significant bits) and never a bf16 value (an
    # odd 25-bit numerator), so T_k is the next bf16 above it. 2.5 = 2 * 1.25, 5 = 4 * 1.25 and
    # 3.5 = 2 * 1.75 give +1 / +2 on the exponent. x = +-0 codes 0 (T_1 > 0) and -0.0 gets no sign.
    e64 = eff.to(tl.float64)
    t1 = _bf16_above(e64 * 0.2500000149011612)   # 0.25 + 2^-26 (0.25 rounds to 0)
    t2 = _bf16_above(e64 * 0.7499999701976776)   # 0.75 - 2^-25 (0.75 rounds to 1)
    t3 = _bf16_above(e64 * 1.2500000596046448)   # 1.25 + 2^-24
    t4 = _bf16_above(e64 * 1.7499999403953552)   # 1.75 - 2^-24
    c1 = ((0x8000 - t1) * 0x10001)[:, None]
    c2 = ((0x8000 - t2) * 0x10001)[:, None]
    c3 = ((0x8000 - t3) * 0x10001)[:, None]
    c4 = ((0x8000 - t4) * 0x10001)[:, None]
    c5 = c3 - 128 * 0x10001
    c6 = c4 - 128 * 0x10001
    c7 = c3 - 256 * 0x10001
    lo = _nv_half_block(wa, aa, c1, c2, c3, c4, c5, c6, c7, HW)
    hi = _nv_half_block(wb, ab, c1, c2, c3, c4, c5, c6, c7, HW)
    return lo.to(tl.int64) | (hi.to(tl.int64) << 32)


@triton.jit
def _nv_tile(wa, wb, s2, six_s2, y6, SANE: tl.constexpr, NB: tl.constexpr, HW: tl.constexpr):
    """(packed int64 [NB], scale byte [NB], bad [NB]) of NB blocks held as two [NB, 4] word pieces."""
    aa = wa & 0x7FFF7FFF  # |x| bits of both halves
    ab = wb & 0x7FFF7FFF
    # block max: the odd elements' is the high half of the largest word, the even ones' from words << 16
    mbits = tl.maximum(tl.max(tl.maximum(aa, ab), axis=1) & -65536, tl.max(tl.maximum(aa << 16, ab << 16), axis=1))
    badblk = mbits >= 0x7F800000
    bamax = mbits.to(tl.float32, bitcast=True)
    if SANE:
        q0 = bamax * y6
        sb = tl.minimum(tl.maximum(_div_markstein(bamax, six_s2, y6), 0.001953125), 448.0)
        sb = tl.where(q0 > 1.0e6, 448.0, sb)  # overflowing quotients: clamped anyway
        sb = tl.where(bamax == 0.0, 1.0, sb)
        sbyte = _f8_rne_byte(sb, 3, 7, 512.0, 0.015625)
        eff = _e4m3_value(sbyte) * s2
        packed = _nv_thresh_blocks(wa, wb, aa, ab, eff, HW)
    else:
        sb = tl.math.div_rn(bamax, tl.full([NB], 1.0, tl.float32) * six_s2)
        sb = tl.where(sb == 0.0, 1.0, sb)
        sb = tl.minimum(tl.maximum(sb, 0.001953125), 448.0)
        sbyte = _f8_rne_byte(sb, 3, 7, 512.0, 0.015625)
        eff = _e4m3_value(sbyte) * s2
        ebits = (eff.to(tl.int32, bitcast=True) >> 23) & 0xFF
        scale = (tl.minimum(tl.maximum(254 - ebits, 1), 253) << 23).to(tl.float32, bitcast=True)
        effs = eff * scale
        y = tl.math.div_rn(tl.full([NB], 1.0, tl.float32), effs)
        ba = _nv_word_byte(wa, scale[:, None], effs[:, None], y[:, None])
        bb = _nv_word_byte(wb, scale[:, None], effs[:, None], y[:, None])
        shift = tl.arange(0, 4)[None, :] * 8
        lo = tl.reduce(ba << shift, 1, _or).to(tl.int64) & 0xFFFFFFFF
        hi = tl.reduce(bb << shift, 1, _or).to(tl.int64) << 32
        packed = lo | hi
    packed = tl.where(badblk, 0, packed)
    sbyte = tl.where(badblk, 0x7F, sbyte)
    return packed, sbyte, badblk


@triton.jit
def _nv_loop(x_ptr, w_ptr, sc_ptr, bad_ptr, pid, g, nblk, s2, six_s2, y6, SANE: tl.constexpr, NB: tl.constexpr,
             ITERS: tl.constexpr, HW: tl.constexpr):
    """ITERS consecutive tiles, the next tile's words loaded before the current one is computed."""
    blk = pid.to(tl.int64) * ITERS * NB + tl.arange(0, NB)
    row = g.to(tl.int64) * nblk + blk
    m = blk < nblk
    base = row[:, None] * 8 + tl.arange(0, 4)[None, :]
    wa = tl.load(x_ptr + base, mask=m[:, None], other=0)
    wb = tl.load(x_ptr + base + 4, mask=m[:, None], other=0)
    for it in range(ITERS):
        nblk_next = blk + NB
        mn = (nblk_next < nblk) & (it + 1 < ITERS)
        nbase = base + NB * 8
        wa_n = tl.load(x_ptr + nbase, mask=mn[:, None], other=0)  # prefetch
        wb_n = tl.load(x_ptr + nbase + 4, mask=mn[:, None], other=0)
        packed, sbyte, badblk = _nv_tile(wa, wb, s2, six_s2, y6, SANE, NB, HW)
        tl.store(w_ptr + row, packed, mask=m)
        tl.store(sc_ptr + row, sbyte.to(tl.uint8), mask=m)
        tl.atomic_max(bad_ptr + tl.zeros([NB], tl.int32), tl.full([NB], 1, tl.int32), mask=badblk & m)
        wa = wa_n
        wb = wb_n
        blk = nblk_next
        row = row + NB
        base = nbase
        m = blk < nblk


@triton.jit
def nvfp4_encode_bf16_loop_kernel(x_ptr, s2_ptr, w_ptr, sc_ptr, bad_ptr, used_ptr, den_ptr, NW, NB: tl.constexpr,
                                  ITERS: tl.constexpr, HW: tl.constexpr, FROM_AMAX: tl.constexpr,
                                  CHECK_AMAX: tl.constexpr):
    """nvfp4_encode_bf16_kernel over ITERS tiles per program (loads of the next tile in flight
    while one is computed), with a cheaper path for the usual global scales.

    For weight_scale_2 in [2^-60, 2^13] (any real weight: amax / 2688) every quotient that decides
    a byte stays in the normal range, so the block scale is also a Markstein quotient (RN(1/(6*s2))
    once per program), and every block divisor eff lies in [2^-69, 2^22], where the E2M1 decision
    thresholds are normal bf16 values: the elements are coded by comparisons (_nv_thresh_blocks).
    The bound 2^13 also keeps a non-zero block maximum from underflowing to a zero block scale.
    Other global scales take the rescaled division path. HW: PRMT by inline PTX (False in
    Triton's interpreter, which runs no PTX; the same masks then come from shifts).
    """
    pid = tl.program_id(0)
    g = tl.program_id(1)
    nblk = NW // 8
    s2 = _group_s2(s2_ptr, used_ptr, den_ptr, bad_ptr, pid, g, FROM_AMAX, CHECK_AMAX)
    six_s2 = s2 * 6.0
    y6 = tl.math.div_rn(tl.full([NB], 1.0, tl.float32), tl.full([NB], 1.0, tl.float32) * six_s2)
    if (s2 >= 8.673617379884035e-19) & (s2 <= 8192.0):
        _nv_loop(x_ptr, w_ptr, sc_ptr, bad_ptr, pid, g, nblk, s2, six_s2, y6, True, NB, ITERS, HW)
    else:
        _nv_loop(x_ptr, w_ptr, sc_ptr, bad_ptr, pid, g, nblk, s2, six_s2, y6, False, NB, ITERS, HW)


# ----------------------------------------------------------------------------------------
# NVFP4 decode to BF16 without per-element arithmetic. In a block every output is one of 16
# values: (e2m1 * scale) * s2 rounded to float32, then to BF16 (or e2m1 * (scale * s2) in the
# other order). With A = the value for e2m1 = 1 and B = the one for 1.5, both rounded as the
# reference rounds them, the value for 0.5, 2, 4 is A times that power of two and for 3, 6 B
# times 2 or 4: exact scalings, so they round the same, whenever A and B (as BF16) have
# exponents in [4, 252] (nothing nears the subnormal range or overflows). Such a block's eight BF16 magnitudes
# then form a byte table (low bytes, high bytes: two 8-byte tables), looked up four elements
# at a time by PRMT, the sign bit ORed in. A program whose blocks are not all like that (zero,
# negative or NaN scales, extreme global factors) takes the float path, element by element.


@triton.jit
def _prmt(a, b, c, HW: tl.constexpr):
    """PTX prmt.b32 (default mode): byte i of the result is byte (c >> 4i) & 7 of the pair
    (b:a), or with bit 3 of that nibble set, its top bit replicated. Shifts when not HW."""
    if HW:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        r = tl.zeros(a.shape, tl.int32)
        for i in tl.static_range(4):
            sel = (c >> (4 * i)) & 0xF
            idx = sel & 7
            src = tl.where(idx < 4, a, b)
            byte = (src >> (8 * (idx & 3))) & 0xFF
            byte = tl.where(sel >= 8, tl.where(byte >= 128, 0xFF, 0), byte)
            r = r | (byte << (8 * i))
        return r


@triton.jit
def _bf16_bits(v):
    """BF16 bits (int32, 0..0xFFFF) of float32 v, round to nearest even (finite v; Inf stays Inf)."""
    bits = v.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


@triton.jit
def _nv_dec_word(x, tl0, tl1, th0, th1, HW: tl.constexpr):
    """Four output words (two BF16 each) of one input word x (eight nibbles) from the block's
    byte tables (magnitude k: low byte k of tl1:tl0, high byte k of th1:th0)."""
    k = x & 0x77777777
    k2 = (k >> 16) & 0xFFFF
    l03 = _prmt(tl0, tl1, k, HW)
    h03 = _prmt(th0, th1, k, HW)
    l47 = _prmt(tl0, tl1, k2, HW)
    h47 = _prmt(th0, th1, k2, HW)
    xs = x << 4  # element 2j's sign (bit 3 of byte j) at bit 7 of byte j; element 2j+1's is already there
    o0 = _prmt(l03, h03, tl.full(x.shape, 0x5140, tl.int32), HW)
    o1 = _prmt(l03, h03, tl.full(x.shape, 0x7362, tl.int32), HW)
    o2 = _prmt(l47, h47, tl.full(x.shape, 0x5140, tl.int32), HW)
    o3 = _prmt(l47, h47, tl.full(x.shape, 0x7362, tl.int32), HW)
    # sign words: byte 1 replicates the top bit of xs's byte j, byte 3 that of x's byte j
    m = -2147450880  # 0x80008000
    o0 = o0 | (_prmt(xs, x, tl.full(x.shape, 0xC080, tl.int32), HW) & m)
    o1 = o1 | (_prmt(xs, x, tl.full(x.shape, 0xD090, tl.int32), HW) & m)
    o2 = o2 | (_prmt(xs, x, tl.full(x.shape, 0xE0A0, tl.int32), HW) & m)
    o3 = o3 | (_prmt(xs, x, tl.full(x.shape, 0xF0B0, tl.int32), HW) & m)
    return o0, o1, o2, o3


@triton.jit
def _join8(o0, o1, o2, o3, o4, o5, o6, o7):
    """[NB, 8] from eight [NB] vectors, in that order."""
    nb: tl.constexpr = o0.shape[0]
    x = tl.reshape(tl.join(tl.join(o0, o4), tl.join(o2, o6)), [nb, 4])  # o0, o2, o4, o6
    y = tl.reshape(tl.join(tl.join(o1, o5), tl.join(o3, o7)), [nb, 4])  # o1, o3, o5, o7
    return tl.reshape(tl.join(x, y), [nb, 8])


@triton.jit
def nvfp4_decode_bf16_kernel(w_ptr, sc_ptr, s2_ptr, e2m1_ptr, e4m3_ptr, out_ptr, bad_ptr, den_ptr, NBLK,
                             NB: tl.constexpr, FACTOR_LAST: tl.constexpr, BAD_FROM: tl.constexpr,
                             FROM_AMAX: tl.constexpr, DEN_STRIDE: tl.constexpr, HW: tl.constexpr, EVEN: tl.constexpr):
    """nvfp4_decode_kernel to BF16 with the packed weight as int64 (w: [G, NBLK], one per block of
    16) and the output as int32 words (out: [G, 8 * NBLK], two BF16 each); same results, bit for
    bit (see the section comment above). EVEN: NBLK is a multiple of NB (no masks)."""
    pid = tl.program_id(0)
    g = tl.program_id(1)
    blk = pid.to(tl.int64) * NB + tl.arange(0, NB)
    bmask = blk < NBLK
    row = g.to(tl.int64) * NBLK + blk
    s2 = _group_factor(s2_ptr, den_ptr, bad_ptr, pid, g, FROM_AMAX, DEN_STRIDE, BAD_FROM)
    if EVEN:
        sbyte = tl.load(sc_ptr + row).to(tl.int32)
        x64 = tl.load(w_ptr + row)
    else:
        sbyte = tl.load(sc_ptr + row, mask=bmask, other=0).to(tl.int32)
        x64 = tl.load(w_ptr + row, mask=bmask, other=0)
    if BAD_FROM > 0:
        tl.atomic_max(bad_ptr + tl.zeros([NB], tl.int32), tl.full([NB], 1, tl.int32), mask=bmask & (sbyte >= BAD_FROM))
    wa = x64.to(tl.int32)  # low word: elements 0-7
    wb = (x64 >> 32).to(tl.int32)
    sval = _e4m3_value(sbyte & 0x7F)
    a32 = sval * s2
    if FACTOR_LAST:
        b32 = (sval * 1.5) * s2
    else:
        b32 = a32 * 1.5
    a16 = _bf16_bits(a32)
    b16 = _bf16_bits(b32)
    ea = a16 >> 7
    eb = b16 >> 7
    sane = (sbyte < 0x7F) & (ea >= 4) & (ea <= 252) & (eb >= 4) & (eb <= 252)
    offs = row[:, None] * 8 + tl.arange(0, 8)[None, :]
    if tl.min((sane | ~bmask).to(tl.int32), axis=0) > 0:
        la = a16 & 0xFF
        lb = b16 & 0xFF
        ha = a16 >> 8
        hb = b16 >> 8
        # magnitudes 0, 0.5, 1, 1.5 | 2, 3, 4, 6 -> 0, A/2, A, B | 2A, 2B, 4A, 4B (BF16 bits)
        tl0 = ((la ^ 0x80) << 8) | (la << 16) | (lb << 24)
        tl1 = (la ^ 0x80) | ((lb ^ 0x80) << 8) | (la << 16) | (lb << 24)
        th0 = (((a16 - 128) >> 8) << 8) | (ha << 16) | (hb << 24)
        th1 = ((a16 + 128) >> 8) | (((b16 + 128) >> 8) << 8) | ((ha + 1) << 16) | ((hb + 1) << 24)
        o0, o1, o2, o3 = _nv_dec_word(wa, tl0, tl1, th0, th1, HW)
        o4, o5, o6, o7 = _nv_dec_word(wb, tl0, tl1, th0, th1, HW)
        out = _join8(o0, o1, o2, o3, o4, o5, o6, o7)
        if EVEN:
            tl.store(out_ptr + offs, out)
        else:
            tl.store(out_ptr + offs, out, mask=bmask[:, None])
    else:
        sv = tl.load(e4m3_ptr + sbyte)  # any byte (NaN, negative), as the generic kernel
        words = tl.join(wa, wb)  # [NB, 2]
        nib = (words[:, :, None] >> (4 * tl.arange(0, 8))[None, None, :]) & 0xF
        vals = tl.reshape(tl.load(e2m1_ptr + nib), [NB, 16])
        if FACTOR_LAST:
            v = (vals * sv[:, None]) * s2
        else:
            eff = sv * s2
            v = vals * eff[:, None]
        b = tl.where(v != v, 0x7FC0, _bf16_bits(v))
        lo, hi = tl.split(tl.reshape(b, [NB, 8, 2]))
        tl.store(out_ptr + offs, lo | (hi << 16), mask=bmask[:, None])


# ----------------------------------------------------------------------------------------
# MXFP8 (E4M3) decode to BF16 without a table per element. For a scale byte s in [15, 246],
# e4m3 * 2^(s - 127) is a normal BF16 value for every finite E4M3 element (|e4m3| in [2^-9, 448]),
# so the reference's float32 product and BF16 cast are exact: the result is the element's
# half-precision bits (the hardware's exact E4M3 -> F16 conversion, two at a time) with the
# exponent re-biased by s - 15 and the mantissa cut to 7 bits (E4M3 has 3), zeros kept, signs
# kept. Two elements per 32-bit operation. A program with a scale outside that range or a NaN
# element takes the float path.


@triton.jit
def _e4m3x2_f16(p, HW: tl.constexpr):
    """F16 bits of the two E4M3 bytes in the low 16 bits of p (the first in the low half), for
    non-NaN bytes; exact (every E4M3 value is an F16 value)."""
    if HW:
        return tl.inline_asm_elementwise("{ .reg .b16 t; cvt.u16.u32 t, $1; cvt.rn.f16x2.e4m3x2 $0, t; }", "=r,r", [p],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        b0 = p & 0xFF
        b1 = (p >> 8) & 0xFF
        return _e4m3_f16_bits(b0) | (_e4m3_f16_bits(b1) << 16)


@triton.jit
def _e4m3_f16_bits(b):
    """F16 bits of one non-NaN E4M3 byte (the shift path of _e4m3x2_f16)."""
    e = (b >> 3) & 0xF
    m = b & 7
    normal = ((e + 8) << 10) | (m << 7)
    # subnormal m * 2^-9: through float32 (exact), then F16 bits of that normal value
    f = (m.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)
    sub = tl.where(m == 0, 0, (((f >> 23) - 112) << 10) | ((f >> 13) & 0x3FF))
    return tl.where(e == 0, sub, normal) | ((b & 0x80) << 8)


@triton.jit
def _mx_bf16_pair(p, k, HW: tl.constexpr):
    """Word of two BF16 (first element low) of the E4M3 pair in p's low 16 bits, scaled by
    2^(s - 127), k = (s - 15) << 7 (s in [15, 246]): exponent re-biased in both lanes at once."""
    h = _e4m3x2_f16(p, HW)
    v = (h >> 3) & 0x0FFF0FFF  # exponent and top 7 mantissa bits per lane, signs dropped
    nz = ((v + 0x7FFF7FFF) >> 15) & 0x00010001  # lanes holding a non-zero value
    return (v + nz * k) | (h & -2147450880)  # + k per non-zero lane (no carry: lanes stay < 2^15); signs


@triton.jit
def mxfp8_decode_bf16_kernel(q_ptr, sc_ptr, elem_ptr, e8m0_ptr, out_ptr, bad_ptr, NBLK, NB: tl.constexpr,
                             BAD_FROM: tl.constexpr, HW: tl.constexpr, EVEN: tl.constexpr):
    """mxfp8_decode_kernel for E4M3 elements to BF16, the elements as int32 words (q: [G, 8 * NBLK],
    four per word) and the output as int32 words (out: [G, 16 * NBLK], two BF16 each); same
    results, bit for bit (see the section comment above). EVEN: NBLK is a multiple of NB."""
    pid = tl.program_id(0)
    g = tl.program_id(1)
    blk = pid.to(tl.int64) * NB + tl.arange(0, NB)
    bmask = blk < NBLK
    row = g.to(tl.int64) * NBLK + blk
    qoffs = row[:, None] * 8 + tl.arange(0, 8)[None, :]
    if EVEN:
        sbyte = tl.load(sc_ptr + row).to(tl.int32)
        x = tl.load(q_ptr + qoffs)
    else:
        sbyte = tl.load(sc_ptr + row, mask=bmask, other=0).to(tl.int32)
        x = tl.load(q_ptr + qoffs, mask=bmask[:, None], other=0)
    if BAD_FROM > 0:
        tl.atomic_max(bad_ptr + tl.zeros([NB], tl.int32), tl.full([NB], 1, tl.int32), mask=bmask & (sbyte >= BAD_FROM))
    nan = tl.max((((x & 0x7F7F7F7F) + 0x01010101) & -2139062144) != 0, axis=1)  # some byte is 0x7F / 0xFF
    sane = (sbyte >= 15) & (sbyte <= 246) & ~nan
    ooffs = row[:, None] * 16 + tl.arange(0, 16)[None, :]
    if tl.min((sane | ~bmask).to(tl.int32), axis=0) > 0:
        k = ((sbyte - 15) << 7)[:, None]
        lo = _mx_bf16_pair(x, k, HW)  # elements 0, 1 of each word
        hi = _mx_bf16_pair(x >> 16, k, HW)  # elements 2, 3
        out = tl.reshape(tl.join(lo, hi), [NB, 16])
        if EVEN:
            tl.store(out_ptr + ooffs, out)
        else:
            tl.store(out_ptr + ooffs, out, mask=bmask[:, None])
    else:
        s = tl.load(e8m0_ptr + sbyte)
        byte = (x[:, :, None] >> (8 * tl.arange(0, 4))[None, None, :]) & 0xFF  # [NB, 8, 4]
        v = tl.reshape(tl.load(elem_ptr + byte), [NB, 32]) * s[:, None]
        b = tl.where(v != v, 0x7FC0, _bf16_bits(v))
        lo2, hi2 = tl.split(tl.reshape(b, [NB, 16, 2]))
        tl.store(out_ptr + ooffs, lo2 | (hi2 << 16), mask=bmask[:, None])
