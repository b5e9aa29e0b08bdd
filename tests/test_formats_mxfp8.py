"""MXFP8 codec: golden vectors, an independent scale oracle, round trips, SQNR anchors, errors.

Goldens are derived by hand from spec/formats.md "MXFP8":
    RCEIL byte = 127 + ceil(log2(f32(amax/448)));  FLOOR byte = 127 + floor(log2(amax)) - 8
    clamped to [0, 254]; all-zero block -> 0; elements = RNE_e4m3(clamp(x * 2^-(byte-127), ±448)).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inkling_ckpt.errors import FormatError, NonFiniteError
from inkling_ckpt.formats import fake_quant, get_format
from inkling_ckpt.formats.mxfp8 import scale_bytes_floor, scale_bytes_rceil

BF = torch.bfloat16
MX = get_format("mxfp8")
MXF = get_format("mxfp8", scale_mode="floor")
MX5 = get_format("mxfp8", element="e5m2")


def block(*lead, dtype=BF):
    """A [1, 32] tensor starting with ``lead``, zero-padded."""
    return torch.tensor([list(lead) + [0.0] * (32 - len(lead))], dtype=dtype)


def enc_bytes(fmt, x):
    p = fmt.encode(x)
    return p["weight_scale"].flatten().tolist(), p["weight"].view(torch.uint8).flatten().tolist()


def sqnr_db(x, y):
    x, y = x.double(), y.double()
    return float(10 * torch.log10(x.pow(2).sum() / (x - y).pow(2).sum()))


# -- golden vectors ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [MX, MXF], ids=["rceil", "floor"])
def test_golden_all_zero_block(fmt):
    s, q = enc_bytes(fmt, torch.zeros(1, 64, dtype=BF))
    assert s == [0, 0] and q == [0] * 64


def test_golden_power_of_two_maxima():
    # amax 1.0: RCEIL 1/448 = 1.14*2^-9 -> ceil -> 2^-8, byte 119; element 1*2^8 = 256 = 0x78
    #           FLOOR floor(log2 1) - 8 = -8, byte 119 as well.
    # amax 448: 448/448 = 1 -> byte 127 (both); 448 -> 0x7E.  amax 2^-20: RCEIL byte 127-28 = 99 -> 0x78.
    for fmt in (MX, MXF):
        assert enc_bytes(fmt, block(1.0, 0.5, -0.25)) == ([119], [0x78, 0x70, 0xE8] + [0] * 29)
        assert enc_bytes(fmt, block(448.0))[0] == [127]
        assert enc_bytes(fmt, block(448.0))[1][0] == 0x7E
        assert enc_bytes(fmt, block(2.0**-20)) == ([99], [0x78] + [0] * 31)


def test_golden_mantissa_1_75_and_above():
    # amax 1.75: 1.75/448 = 2^-8 exactly -> RCEIL byte 119; FLOOR byte 119; element 448 (0x7E) both.
    for fmt in (MX, MXF):
        assert enc_bytes(fmt, block(1.75))[0] == [119]
        assert enc_bytes(fmt, block(1.75))[1][0] == 0x7E
    # amax 1.8125 (mantissa > 1.75): RCEIL byte 120 (scale 2^-7), element 1.8125*128 = 232, a tie
    #   between 224 (0x76, even mantissa) and 240 (0x77) -> 0x76.
    # FLOOR byte 119 (scale 2^-8): 1.8125*256 = 464 saturates to 448 (0x7E).
    assert enc_bytes(MX, block(1.8125)) == ([120], [0x76] + [0] * 31)
    assert enc_bytes(MXF, block(1.8125)) == ([119], [0x7E] + [0] * 31)
    # amax 1.875 = 0x77-pattern: RCEIL byte 120 (1.875*128 = 240 = 0x77); FLOOR 119 (480 -> 448).
    assert enc_bytes(MX, block(1.875))[1][0] == 0x77
    assert enc_bytes(MXF, block(-1.875)) == ([119], [0xFE] + [0] * 31)


def test_golden_bf16_subnormals():
    # amax 2^-133 (smallest bf16 subnormal): RCEIL amax/448 is an fp32 subnormal below 2^-127 -> byte 0;
    #   element 2^-133 * 2^127 = 2^-6 -> 0x08. FLOOR: exponent field 0 -> byte 0, same element.
    # amax 2^-127 (bf16 subnormal): byte 0, element 1.0 -> 0x38.
    for fmt in (MX, MXF):
        assert enc_bytes(fmt, block(2.0**-133)) == ([0], [0x08] + [0] * 31)
        assert enc_bytes(fmt, block(2.0**-127, -(2.0**-133))) == ([0], [0x38, 0x88] + [0] * 30)


def test_golden_rceil_subnormal_quotient_boundary():
    # amax/448 subnormal: byte 0 up to 2^-127 itself, byte 1 above.
    # amax = 1.75*2^-119: /448 = 2^-127 exactly -> byte 0; element 448 (0x7E).
    # amax = 2^-118: /448 = 1.14*2^-127 > 2^-127 -> byte 1 (2^-126); element 2^-118 * 2^126 = 256 (0x78).
    assert enc_bytes(MX, block(1.75 * 2.0**-119)) == ([0], [0x7E] + [0] * 31)
    assert enc_bytes(MX, block(2.0**-118)) == ([1], [0x78] + [0] * 31)


def test_golden_fp32_one_ulp_above_power_of_two():
    # fp32 amax = nextafter(448*2^-12): f32(amax/448) = 2^-12*(1+2^-23) -> RCEIL from bits rounds up
    # to 2^-11 (byte 116); element 224*(1+2^-23) -> 224 (0x76). (ModelOpt's float log2 gives 115
    # here - a documented fp32-only divergence, reference/quant-formats.md §1.5.)
    a = float(np.nextafter(np.float32(448 * 2.0**-12), np.float32(1)))
    assert enc_bytes(MX, block(a, dtype=torch.float32)) == ([116], [0x76] + [0] * 31)


def test_golden_negative_zero_and_e5m2_saturation():
    assert enc_bytes(MX, block(1.0, -0.0))[1][:2] == [0x78, 0x80]  # -0.0 keeps its sign in FP8
    # E5M2: amax 57344 -> RCEIL byte 127, element 0x7B (max). amax 61440 = 1.875*2^15: RCEIL byte 128,
    # element 30720 is the tie between 28672 (0x77, odd mantissa) and 32768 (0x78) -> 0x78;
    # FLOOR byte 127 (floor(log2) 15 - emax 15) and 61440 saturates to 57344 (0x7B).
    assert enc_bytes(MX5, block(57344.0, -57344.0))[1][:2] == [0x7B, 0xFB]
    assert enc_bytes(MX5, block(61440.0, dtype=torch.float32)) == ([128], [0x78] + [0] * 31)
    floor5 = get_format("mxfp8", element="e5m2", scale_mode="floor")
    assert enc_bytes(floor5, block(61440.0, dtype=torch.float32)) == ([127], [0x7B] + [0] * 31)


# -- independent scale oracle (Python floats) ---------------------------------------------------


def rceil_byte_oracle(amax: float, elem_max: float = 448.0) -> int:
    q = float(np.float32(amax) / np.float32(elem_max))  # the float32 quotient
    if q == 0:
        return 0
    m, e = math.frexp(q)  # q = m * 2^e, 0.5 <= m < 1
    k = e - 1 if m == 0.5 else e  # ceil(log2 q)
    return max(0, min(254, k + 127))


def floor_byte_oracle(amax: float, emax: int = 8) -> int:
    if amax == 0:
        return 0
    _, e = math.frexp(amax)
    return max(0, min(254, (e - 1) - emax + 127))


f32_amax = st.floats(min_value=0.0, allow_nan=False, allow_infinity=False, width=32, allow_subnormal=True)


@settings(max_examples=300, deadline=None)
@given(st.lists(f32_amax, min_size=1, max_size=32))
def test_scale_bytes_match_python_oracle(amaxes):
    t = torch.tensor(amaxes, dtype=torch.float32)
    assert scale_bytes_rceil(t, 448.0).tolist() == [rceil_byte_oracle(a) for a in amaxes]
    assert scale_bytes_rceil(t, 57344.0).tolist() == [rceil_byte_oracle(a, 57344.0) for a in amaxes]
    assert scale_bytes_floor(t, 8).tolist() == [floor_byte_oracle(a) for a in amaxes]
    assert scale_bytes_floor(t, 15).tolist() == [floor_byte_oracle(a, 15) for a in amaxes]


def test_scale_bytes_all_bf16_maxima():
    # every positive finite bf16 value as a block amax, against the oracle
    bits = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(BF).float()
    vals = bits.tolist()
    assert scale_bytes_rceil(bits, 448.0).tolist() == [rceil_byte_oracle(a) for a in vals]
    assert scale_bytes_floor(bits, 8).tolist() == [floor_byte_oracle(a) for a in vals]


# -- round trips ---------------------------------------------------------------------------------


def _canonical_parts(gen, rows, nb, *, element="e4m3", floor=False):
    """Random MXFP8 parts that re-encode to themselves.

    Canonical: each block's largest magnitude is a code whose RCEIL (FLOOR) scale is the block's own:
    E4M3 0x77..0x7E (240..448; FLOOR needs 0x78..0x7E, 256..448), E5M2 0x78..0x7B; no NaN/Inf codes;
    scale bytes 0..246 (E5M2: 0..239) so decoded values stay finite in float32. -0 (0x80) IS canonical for MXFP8:
    -0.0 * 2^-k casts back to 0x80.
    """
    if element == "e4m3":
        lo_max, hi_max = (0x78 if floor else 0x77), 0x7E
    else:
        lo_max, hi_max = 0x78, 0x7B
    mag_limit = lo_max  # other elements strictly below the smallest allowed block max (no NaN/Inf)
    codes = torch.randint(0, 256, (rows, nb, 32), generator=gen, dtype=torch.int32)
    mag = codes & 0x7F
    codes = torch.where(mag >= mag_limit, codes & 0x80 | (mag % mag_limit), codes)
    pos = torch.randint(0, 32, (rows, nb), generator=gen)
    top = torch.randint(lo_max, hi_max + 1, (rows, nb), generator=gen, dtype=torch.int32)
    top |= torch.randint(0, 2, (rows, nb), generator=gen, dtype=torch.int32) << 7
    codes.scatter_(-1, pos.unsqueeze(-1), top.unsqueeze(-1))
    top_scale = 247 if element == "e4m3" else 240  # max * 2^(s-127) must stay below 2^128
    scale = torch.randint(0, top_scale, (rows, nb), generator=gen, dtype=torch.uint8)
    dt = torch.float8_e4m3fn if element == "e4m3" else torch.float8_e5m2
    return {"weight": codes.to(torch.uint8).view(rows, nb * 32).view(dt), "weight_scale": scale}


@pytest.mark.parametrize(
    "opts", [{}, {"scale_mode": "floor"}, {"element": "e5m2"}, {"element": "e5m2", "scale_mode": "floor"}],
    ids=["rceil", "floor", "e5m2-rceil", "e5m2-floor"],
)
def test_roundtrip_canonical_codes(opts):
    fmt = get_format("mxfp8", **opts)
    gen = torch.Generator().manual_seed(3)
    parts = _canonical_parts(gen, 64, 16, element=fmt.element, floor=fmt.scale_mode == "floor")
    again = fmt.encode(fmt.decode(parts, torch.float32))
    assert torch.equal(again["weight"].view(torch.uint8), parts["weight"].view(torch.uint8))
    assert torch.equal(again["weight_scale"], parts["weight_scale"])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 4), nb=st.integers(1, 4))
def test_roundtrip_property(seed, rows, nb):
    parts = _canonical_parts(torch.Generator().manual_seed(seed), rows, nb)
    again = MX.encode(MX.decode(parts, torch.float32))
    assert torch.equal(again["weight"].view(torch.uint8), parts["weight"].view(torch.uint8))
    assert torch.equal(again["weight_scale"], parts["weight_scale"])


def test_decode_is_the_formula_and_nan_scale():
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(0, 256, (4, 64), generator=gen, dtype=torch.uint8)
    s = torch.randint(0, 256, (4, 2), generator=gen, dtype=torch.uint8)
    s[0, 0], s[1, 1], s[2, 0], s[3, 1] = 255, 0, 254, 127
    parts = {"weight": q.view(torch.float8_e4m3fn), "weight_scale": s}
    got = MX.decode(parts, torch.float32)
    ref_q = q.view(torch.float8_e4m3fn).float()
    scale = torch.where(s == 255, float("nan"), torch.exp2(s.double() - 127)).repeat_interleave(32, 1)
    expected = (ref_q.double() * scale).float()  # exact product, then one rounding (inf on overflow)
    same = (got == expected) | (torch.isnan(got) & torch.isnan(expected))
    assert same.all()
    assert torch.isnan(got[0, :32]).all()  # 0xFF scale -> NaN block
    if hasattr(torch, "float8_e8m0fnu"):
        typed = MX.decode({"weight": parts["weight"], "weight_scale": s.view(torch.float8_e8m0fnu)}, torch.float32)
        assert torch.equal(typed.nan_to_num(0.0), got.nan_to_num(0.0))


# -- accuracy anchors ----------------------------------------------------------------------------


def test_sqnr_anchors_gaussian():
    x = torch.randn(1024, 4096, generator=torch.Generator().manual_seed(0)).to(BF)
    assert sqnr_db(x.float(), MX.decode(MX.encode(x), torch.float32)) == pytest.approx(31.5, abs=0.2)
    assert sqnr_db(x.float(), MXF.decode(MXF.encode(x), torch.float32)) == pytest.approx(30.7, abs=0.2)


# -- API, errors, non-finite policy ------------------------------------------------------------------


def test_parts_and_attributes():
    assert (MX.name, MX.block, MX.quant_algo) == ("mxfp8", 32, "MXFP8")
    assert MX.parts((4, 64)) == {"weight": ((4, 64), torch.float8_e4m3fn), "weight_scale": ((4, 2), torch.uint8)}
    assert MX5.parts((4, 64))["weight"] == ((4, 64), torch.float8_e5m2)
    assert MX5.quant_algo is None  # ModelOpt has no name for E5M2 MX weights
    x = torch.randn(2, 3, 64)
    p = MX.encode(x)
    for k, (shape, dt) in MX.parts(x.shape).items():
        assert tuple(p[k].shape) == shape and p[k].dtype == dt and p[k].is_contiguous()
    assert MX.decode(p, torch.float32).shape == x.shape


def test_errors():
    with pytest.raises(FormatError, match=r"width 48 .*block size 32"):
        MX.encode(torch.zeros(2, 48, dtype=BF))
    with pytest.raises(FormatError, match="NVFP4 option"):
        MX.encode(torch.zeros(2, 32, dtype=BF), global_amax=1.0)
    with pytest.raises(FormatError, match="scale_mode"):
        get_format("mxfp8", scale_mode="even")
    with pytest.raises(FormatError, match="element"):
        get_format("mxfp8", element="e3m4")
    with pytest.raises(FormatError):
        MX.decode({"weight": torch.zeros(2, 32, dtype=torch.float8_e4m3fn), "weight_scale": torch.zeros(2, 2, dtype=torch.uint8)})
    with pytest.raises(FormatError):
        MX.decode({"weight": torch.zeros(2, 32, dtype=torch.uint8), "weight_scale": torch.zeros(2, 1, dtype=torch.uint8)})


def test_nonfinite_error_and_policy():
    x = torch.randn(3, 96, dtype=BF)
    x[1, 40] = float("nan")
    x[2, 95] = float("inf")
    with pytest.raises(NonFiniteError, match=r"w\.q.*\(1, 40\)"):
        MX.encode(x, name="w.q")
    p = MX.encode(x, allow_nonfinite=True)
    s = p["weight_scale"]
    assert s[1, 1].item() == 0xFF and s[2, 2].item() == 0xFF
    q = p["weight"].view(torch.uint8)
    assert q[1, 32:64].eq(0x7F).all() and q[2, 64:96].eq(0x7F).all()
    y = MX.decode(p, torch.float32)
    assert torch.isnan(y[1, 32:64]).all() and torch.isnan(y[2, 64:]).all()
    clean = MX.encode(torch.where(torch.isfinite(x), x, 0))
    assert torch.equal(clean["weight"].view(torch.uint8)[0], q[0]) and torch.equal(clean["weight_scale"][0], s[0])


def test_fake_quant_mxfp8_bf16():
    x = torch.randn(4, 64, dtype=BF, requires_grad=True)
    y = fake_quant(MX, x)
    assert y.dtype == BF and torch.equal(y.detach(), MX.decode(MX.encode(x.detach())))
    y.float().sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
