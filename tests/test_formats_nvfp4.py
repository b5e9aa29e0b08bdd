"""NVFP4 codec: golden vectors, round trips, fast-vs-reference, SQNR anchor, errors.

Golden vectors are derived by hand from spec/formats.md "NVFP4" (ModelOpt 0.47 order):
    s2 = f32(amax)/2688;  sb = e4m3_rne(clamp(block_amax / f32(6*s2) (0 -> 1.0), 2^-9, 448))
    q  = rne_e2m1_sat(x / f32(f32(sb)*s2));  sign nibble = x < 0;  element 2j in the low nibble.
Most goldens pass weight_scale_2=1.0 so that sb = block_amax/6 and q = x/sb by inspection.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inkling_ckpt.errors import FormatError, NonFiniteError
from inkling_ckpt.formats import fake_quant, get_format, nvfp4_global_scale
from inkling_ckpt.formats.nvfp4 import NVFP4Format, _e2m1_signed_codes, round_e2m1_fast, round_e2m1_reference

BF = torch.bfloat16
NV = get_format("nvfp4")
REF = NVFP4Format(fast=False)


def enc(x, **kw):
    return NV.encode(torch.tensor(x, dtype=kw.pop("dtype", BF)), **kw)


def nibbles(packed: torch.Tensor) -> list[int]:
    return torch.stack((packed & 0xF, packed >> 4), -1).flatten().tolist()


def sbytes(p) -> list[int]:
    return p["weight_scale"].view(torch.uint8).flatten().tolist()


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return float(10 * torch.log10(x.pow(2).sum() / (x - y).pow(2).sum()))


# -- golden vectors ---------------------------------------------------------------------------


def test_golden_e2m1_ties_signs_and_packing():
    # s2 = 1 and block amax 6 => sb = 6/(6*1) = 1.0 (byte 0x38), so q = round_e2m1(x) directly.
    row = [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -0.0, 0.0, 0.5, 1.5, 3, -6]
    p = enc([row], weight_scale_2=1.0)
    # ties to even: .25->0, .75->1.0(2), 1.25->1.0(2), 1.75->2.0(4), 2.5->2.0(4), 3.5->4.0(6), 5->4.0(6)
    # -0.25 rounds to zero but is negative -> 0x8; exact -0.0 -> 0x0; 6 -> 7; -6 -> 0xF
    assert nibbles(p["weight"]) == [7, 0, 2, 2, 4, 4, 6, 6, 8, 0xA, 0, 0, 1, 3, 5, 0xF]
    # element 2j in the low nibble: byte 0 = 7 | 0 << 4, byte 4 = 8 | 0xA << 4
    assert p["weight"].flatten().tolist() == [0x07, 0x22, 0x44, 0x66, 0xA8, 0x00, 0x31, 0xF5]
    assert sbytes(p) == [0x38]
    assert p["weight_scale_2"].item() == 1.0 and p["input_scale"].item() == 1.0
    assert p["weight_scale_2"].shape == () and p["input_scale"].shape == ()


def test_golden_zero_block_scale_is_0x38():
    # block 0 has amax 6 (sb 1.0); block 1 is all zero: sb = 0 -> 1.0 -> 0x38, nibbles 0.
    x = [[6.0] + [0.0] * 15 + [0.0] * 16]
    p = enc(x, weight_scale_2=1.0)
    assert sbytes(p) == [0x38, 0x38]
    assert p["weight"].flatten().tolist() == [0x07] + [0] * 15


def test_golden_all_zero_tensor_policy():
    # amax 0 is taken as 1.0 (module policy): s2 = 1/2688, every block 0x38, all nibbles 0.
    p = NV.encode(torch.zeros(2, 32, dtype=BF))
    assert p["weight_scale_2"].item() == torch.tensor(1.0 / 2688.0, dtype=torch.float32).item()
    assert sbytes(p) == [0x38] * 4 and p["weight"].eq(0).all()
    assert NV.decode(p, torch.float32).eq(0).all()


def test_golden_global_scale_2688():
    # amax 2688 (exact in bf16) -> s2 = 2688/2688 = 1.0; its block: sb = 2688/6 = 448 (0x7E), q = 6 -> 7.
    x = [[2688.0] + [0.0] * 15, [3.0] + [0.0] * 15]
    p = enc(x)
    assert p["weight_scale_2"].item() == 1.0
    # second block: sb = 3/6 = 0.5 (0x30: e=6, m=0); q = 3/0.5 = 6 -> 7
    assert sbytes(p) == [0x7E, 0x30]
    assert p["weight"][:, 0].tolist() == [0x07, 0x07]


def test_golden_block_scale_rounding_and_clamps():
    # amax 7: sb = 7/6 = 1.1667 -> e4m3 neighbours 1.125 (0x39), 1.25 (0x3A) -> 1.125;
    #   7/1.125 = 6.22 saturates to 6 (7); 1/1.125 = 0.889 -> 1.0 (2).
    # amax 1e-6: sb = 1.67e-7 -> clamped up to 2^-9 (0x01); 1e-6/2^-9 = 5e-4 -> 0, negative -> 0x8.
    # amax 6000: sb = 1000 -> clamped to 448 (0x7E); 6000/448 = 13.4 saturates (7).
    x = [[7.0, 1.0] + [0.0] * 14, [1e-6, -1e-6] + [0.0] * 14, [6000.0, -6000.0] + [0.0] * 14]
    p = enc(x, weight_scale_2=1.0, dtype=torch.float32)
    assert sbytes(p) == [0x39, 0x01, 0x7E]
    assert p["weight"][:, 0].tolist() == [0x27, 0x80, 0xF7]


def test_golden_bf16_subnormals_exact():
    # s2 = 2^-140 (fp32 subnormal, given verbatim); x = 3*2^-131 (bf16 subnormal):
    #   6*s2 = 1.5*2^-138 exact; sb = 3*2^-131 / (6*2^-140) = 2^8 = 256 (0x78); eff = 2^-132 exact
    #   q(3*2^-131) = 6 (7); q(2^-133) = 0.5 (1); q(3*2^-133) = 1.5 (3); q(-2^-132) = -1 (0xA)
    s2 = torch.tensor(2.0**-140, dtype=torch.float32)
    x = [[3 * 2.0**-131, 2.0**-133, 3 * 2.0**-133, -(2.0**-132)] + [0.0] * 12]
    xt = torch.tensor(x, dtype=BF)
    assert xt.float().tolist() == torch.tensor(x).tolist()  # all exact in bf16
    p = NV.encode(xt, weight_scale_2=s2)
    assert sbytes(p) == [0x78]
    assert nibbles(p["weight"])[:4] == [7, 1, 3, 0xA]
    assert torch.equal(NV.decode(p, torch.float32), xt.float())


def test_golden_subnormal_only_tensor_policy():
    # amax 2^-130 < 2^-126 is taken as 1.0: s2 = 1/2688, sb = tiny -> 2^-9 (0x01), q = 0 (+) / 0x8 (-).
    x = torch.tensor([[2.0**-130, -(2.0**-130)] + [0.0] * 14], dtype=BF)
    p = NV.encode(x)
    assert p["weight_scale_2"].item() == pytest.approx(1 / 2688, rel=1e-7)
    assert sbytes(p) == [0x01] and nibbles(p["weight"])[:2] == [0, 8]


def test_negative_zero_vs_tiny_negative():
    x = torch.tensor([[-0.0, -1e-4, 1e-4, 6.0] + [0.0] * 12], dtype=torch.float32)
    p = NV.encode(x, weight_scale_2=1.0)
    assert nibbles(p["weight"])[:4] == [0x0, 0x8, 0x0, 0x7]


# -- global scale plumbing --------------------------------------------------------------------


def test_global_scale_function():
    assert nvfp4_global_scale(2688.0).item() == 1.0
    s = nvfp4_global_scale(torch.tensor(3.0, dtype=BF))
    assert s.dtype == torch.float32 and s.shape == ()
    assert s.item() == (torch.tensor(3.0) / 2688.0).item()
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(FormatError):
            nvfp4_global_scale(bad)


def test_given_scales_are_verbatim():
    x = torch.randn(4, 64, dtype=BF)
    s2 = torch.tensor(0.0123, dtype=torch.float32)
    p = NV.encode(x, weight_scale_2=s2, input_scale=torch.tensor([0.5]))
    assert p["weight_scale_2"].item() == s2.item() and p["input_scale"].item() == 0.5
    assert p["input_scale"].shape == ()
    q = NV.encode(x, global_amax=10.0)
    assert q["weight_scale_2"].item() == (torch.tensor(10.0) / 2688.0).item()
    with pytest.raises(FormatError):
        NV.encode(x, weight_scale_2=s2, global_amax=1.0)
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(FormatError):
            NV.encode(x, weight_scale_2=bad)


def test_encode_group_shares_global_scale():
    g = torch.randn(8, 64, dtype=BF)
    u = torch.randn(8, 64, dtype=BF) * 3
    pg, pu = NV.encode_group([g, u], names=["gate", "up"])
    amax = max(g.abs().max().float().item(), u.abs().max().float().item())
    assert pg["weight_scale_2"].item() == pu["weight_scale_2"].item() == (torch.tensor(amax) / 2688).item()
    # each member equals a single encode with the shared scale
    assert torch.equal(pg["weight"], NV.encode(g, weight_scale_2=pg["weight_scale_2"])["weight"])
    with pytest.raises(FormatError):
        NV.encode_group([g, u], names=["only-one"])


# -- round trips: encode(decode(q)) == q -------------------------------------------------------


def _random_canonical_parts(gen: torch.Generator, rows: int, nb: int, s2: float):
    """Random NVFP4 parts that re-encode to themselves.

    Canonical means: every block holds a ±6 nibble (code 7/0xF) so its amax picks its own scale
    back, block scale bytes in 0x01..0x7E (0x00 decodes to zeros and re-encodes as 0x38; 0x7F is
    NaN), and no -0 nibble (0x8 decodes to -0.0, which encodes as 0x0). s2 is a power of two so
    f32(sb)*s2 and 6*s2 are exact. An all-zero block with scale 0x38 is canonical too.
    """
    codes = torch.randint(0, 16, (rows, nb, 16), generator=gen, dtype=torch.uint8)
    codes[codes == 8] = 0
    pos = torch.randint(0, 16, (rows, nb), generator=gen)
    sign = torch.randint(0, 2, (rows, nb), generator=gen, dtype=torch.uint8) << 3
    codes.scatter_(-1, pos.unsqueeze(-1), (7 | sign).unsqueeze(-1))
    scale = torch.randint(1, 0x7F, (rows, nb), generator=gen, dtype=torch.uint8)
    zero_blocks = torch.rand((rows, nb), generator=gen) < 0.05
    codes[zero_blocks] = 0
    scale[zero_blocks] = 0x38
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).reshape(rows, nb * 8)
    return {
        "weight": packed,
        "weight_scale": scale.view(torch.float8_e4m3fn),
        "weight_scale_2": torch.tensor(s2, dtype=torch.float32),
        "input_scale": torch.tensor(1.0),
    }


@pytest.mark.parametrize("fmt", [NV, REF], ids=["fast", "reference"])
@pytest.mark.parametrize("s2", [2.0**-10, 1.0, 2.0**-20])
def test_roundtrip_canonical_codes(fmt, s2):
    gen = torch.Generator().manual_seed(1)
    parts = _random_canonical_parts(gen, 64, 32, s2)
    x = fmt.decode(parts, torch.float32)
    again = fmt.encode(x, weight_scale_2=parts["weight_scale_2"])
    assert torch.equal(again["weight"], parts["weight"])
    assert torch.equal(again["weight_scale"].view(torch.uint8), parts["weight_scale"].view(torch.uint8))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 5), nb=st.integers(1, 6), e=st.integers(-30, 20))
def test_roundtrip_property(seed, rows, nb, e):
    gen = torch.Generator().manual_seed(seed)
    parts = _random_canonical_parts(gen, rows, nb, 2.0**e)
    again = NV.encode(NV.decode(parts, torch.float32), weight_scale_2=parts["weight_scale_2"])
    assert torch.equal(again["weight"], parts["weight"])
    assert torch.equal(again["weight_scale"].view(torch.uint8), parts["weight_scale"].view(torch.uint8))


def test_decode_is_the_formula():
    gen = torch.Generator().manual_seed(2)
    parts = _random_canonical_parts(gen, 8, 4, 0.37)  # non power-of-two s2 on purpose
    codes = torch.stack((parts["weight"] & 0xF, parts["weight"] >> 4), -1).reshape(8, 64)
    e2m1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])[codes.long()]
    eff = parts["weight_scale"].float() * parts["weight_scale_2"]  # block scale first
    expected = e2m1 * eff.repeat_interleave(16, dim=1)
    got = NV.decode(parts, torch.float32)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    assert torch.equal(NV.decode(parts), expected.to(BF))
    assert torch.equal(NV.decode(parts, torch.float16), expected.to(torch.float16))


# -- fast path == reference path ----------------------------------------------------------------


def _edge_floats() -> torch.Tensor:
    """fp32 values around every E2M1 decision point and grid value, subnormals, huge values, ±inf, NaN."""
    pts = [0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 7.0, 1e30]
    t = torch.tensor(pts, dtype=torch.float32)
    near = [t, torch.nextafter(t, torch.tensor(-1.0)), torch.nextafter(t, torch.tensor(9e30))]
    extra = torch.tensor([1e-45, 1e-40, 2.0**-126, float("inf"), float("nan"), 3.4e38])
    v = torch.cat(near + [extra])
    return torch.cat([v, -v])


def test_round_e2m1_fast_equals_reference_on_dense_bit_patterns():
    # every fp32 bit pattern of [0, 8) whose low 16 bits are one of a few values, plus edges
    hi = torch.arange(0, 0x41000000 >> 16, dtype=torch.int32) << 16
    lows = torch.tensor([0, 1, 0x7FFF, 0x8000, 0xFFFF], dtype=torch.int32)
    pats = (hi.unsqueeze(1) | lows).flatten()
    y = torch.cat([pats.view(torch.float32), _edge_floats()])
    y = torch.cat([y, -y])
    assert torch.equal(round_e2m1_fast(y.clone()), round_e2m1_reference(y))


def test_signed_code_table_on_every_case():
    # Each table entry is one (bits >> 21, low 21 bits non-zero) case: these patterns reach every
    # entry (both signs, every exponent, every pair of top mantissa bits, low bits zero / not),
    # NaN excepted (the encoder replaces it first). Expected: the reference's magnitude code with
    # y's sign bit as the sign nibble bit (-0.0 included: the encoder has mapped x = -0.0 to +0.0).
    hi = torch.arange(0, 1 << 11, dtype=torch.int64) << 21
    lows = torch.tensor([0, 1, 0x1000, (1 << 21) - 1], dtype=torch.int64)
    pats = (hi.unsqueeze(1) | lows).flatten()
    y = torch.cat([pats, pats - (1 << 31)]).to(torch.int32).view(torch.float32)  # and with the sign bit set
    y = y[~y.isnan()]
    want = round_e2m1_reference(y) | (torch.signbit(y).to(torch.uint8) << 3)
    got = _e2m1_signed_codes(y.clone())
    assert got.dtype == torch.uint8 and torch.equal(got, want)
    assert set(got.tolist()) == set(range(16))


def test_underflow_keeps_the_sign_and_negative_zero_does_not():
    # a block spanning > 2^150: x / scale underflows to -0.0 for the tiny negative (code 0x8),
    # while an exact -0.0 stays 0x0, in the fast encoder as in the reference
    x = torch.tensor([[6e30, -1e-44, -0.0, 1e-44, -(2.0**-149), 0.0] + [-0.0] * 10], dtype=torch.float32)
    a, b = NV.encode(x), REF.encode(x)
    assert nibbles(a["weight"])[:6] == nibbles(b["weight"])[:6] == [0x7, 0x8, 0x0, 0x0, 0x8, 0x0]
    assert torch.equal(a["weight"], b["weight"])


def test_fast_encoder_equals_reference_on_nonfinite_blocks():
    # NaN payloads up to 0x7FFFFFFF (their table index would overflow) sit in blocks that are zeroed
    x = torch.randn(4, 64)
    x.view(torch.int32)[0, 3] = 0x7FFFFFFF
    x.view(torch.int32)[1, 20] = -1  # NaN, sign bit set, every payload bit
    x[2, 40] = float("-inf")
    a, b = NV.encode(x, allow_nonfinite=True), REF.encode(x, allow_nonfinite=True)
    for k in a:
        assert torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)), k
    nan_blocks = (a["weight_scale"].view(torch.uint8) == 0x7F).nonzero().tolist()
    assert nan_blocks == [[0, 0], [1, 1], [2, 2]]  # the blocks holding them, and only those


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=1, max_size=64))
def test_round_e2m1_fast_equals_reference_property(vals):
    y = torch.tensor(vals, dtype=torch.float32)
    assert torch.equal(round_e2m1_fast(y.clone()), round_e2m1_reference(y))


def _random_inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    for scale in (1e-3, 1.0, 1e3):
        x = torch.randn(48, 256, generator=gen) * scale
        x[3, 7] = scale * 80  # outlier
        x[5, :16] = 0.0  # zero block
        x[6, 16:32] = torch.tensor(2.0**-130)  # subnormal block
        yield x.to(BF)
        yield x.to(torch.float16) if scale <= 1.0 else x
    # exact ties at s2 = 1: blocks of grid midpoints with a 6 in each
    ties = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5] * 2).repeat(4, 4)
    yield ties.to(BF)


@pytest.mark.parametrize("seed", [0, 1])
def test_fast_encoder_equals_reference_encoder(seed):
    for x in _random_inputs(seed):
        for kw in ({}, {"weight_scale_2": 1.0}, {"weight_scale_2": 3e-5}):
            a, b = NV.encode(x, **kw), REF.encode(x, **kw)
            for k in a:
                assert torch.equal(a[k].view(torch.uint8) if a[k].dtype != torch.float32 else a[k],
                                   b[k].view(torch.uint8) if b[k].dtype != torch.float32 else b[k]), k


def test_chunking_does_not_change_bytes(monkeypatch):
    from inkling_ckpt.formats import _base

    x = torch.randn(67, 96, dtype=BF)
    whole = NV.encode(x)
    monkeypatch.setattr(_base, "CHUNK_ELEMS", 200)  # ~2 rows per chunk
    small = NV.encode(x)
    assert all(torch.equal(whole[k].view(torch.uint8), small[k].view(torch.uint8)) for k in ("weight", "weight_scale"))
    assert torch.equal(NV.decode(whole), NV.decode(small))


# -- accuracy anchor ---------------------------------------------------------------------------


def test_sqnr_anchor_gaussian():
    x = torch.randn(1024, 4096, generator=torch.Generator().manual_seed(0)).to(BF)
    y = NV.decode(NV.encode(x), torch.float32)
    assert sqnr_db(x.float(), y) == pytest.approx(20.4, abs=0.2)


# -- shapes, dtypes, devices ---------------------------------------------------------------------


def test_parts_match_encode_and_nd_inputs():
    x = torch.randn(3, 5, 48, dtype=torch.float32)
    p = NV.encode(x)
    spec = NV.parts(x.shape)
    assert list(spec) == ["weight", "weight_scale", "weight_scale_2", "input_scale"] == list(p)
    for k, (shape, dt) in spec.items():
        assert tuple(p[k].shape) == shape and p[k].dtype == dt and p[k].is_contiguous()
    assert NV.parts((7, 32)) == {
        "weight": ((7, 16), torch.uint8),
        "weight_scale": ((7, 2), torch.float8_e4m3fn),
        "weight_scale_2": ((), torch.float32),
        "input_scale": ((), torch.float32),
    }
    flat = NV.encode(x.reshape(15, 48), weight_scale_2=p["weight_scale_2"])
    assert torch.equal(flat["weight"], p["weight"].reshape(15, 24))
    assert NV.decode(p, torch.float32).shape == x.shape


def test_non_contiguous_input():
    x = torch.randn(64, 32, dtype=BF).t()  # [32, 64] non-contiguous
    assert torch.equal(NV.encode(x)["weight"], NV.encode(x.contiguous())["weight"])


def test_fp16_fp32_inputs_equal_when_values_equal():
    x = torch.randn(8, 64).to(BF)
    a = NV.encode(x)
    b = NV.encode(x.float())
    assert torch.equal(a["weight"], b["weight"]) and torch.equal(a["weight_scale_2"], b["weight_scale_2"])


# -- errors and non-finite policy ------------------------------------------------------------


def test_width_not_multiple_of_block():
    with pytest.raises(FormatError, match=r"width 40 .*block size 16"):
        NV.encode(torch.zeros(2, 40, dtype=BF))
    with pytest.raises(FormatError, match="40"):
        NV.parts((2, 40))


def test_rejects_other_dtypes():
    for dt in (torch.float64, torch.int32, torch.uint8):
        with pytest.raises(FormatError):
            NV.encode(torch.zeros(2, 16, dtype=dt))


def test_nan_is_an_error_naming_tensor_and_index():
    x = torch.randn(4, 64, dtype=BF)
    x[2, 37] = float("nan")
    x[3, 1] = float("inf")
    with pytest.raises(NonFiniteError, match=r"layers\.0\.w.*\(2, 37\)"):
        NV.encode(x, name="layers.0.w")
    with pytest.raises(NonFiniteError, match=r"\(2, 37\)"):
        NV.encode(x, name="layers.0.w", weight_scale_2=1.0)  # found block-wise too


def test_allow_nonfinite_policy():
    x = torch.randn(2, 64, dtype=BF)
    x[0, 17] = float("nan")  # block (0, 1)
    x[1, 50] = float("-inf")  # block (1, 3)
    p = NV.encode(x, allow_nonfinite=True)
    finite = torch.where(torch.isfinite(x), x, 0)
    assert p["weight_scale_2"].item() == (finite.abs().max().float() / 2688).item()
    sb = p["weight_scale"].view(torch.uint8)
    assert sb[0, 1].item() == 0x7F and sb[1, 3].item() == 0x7F
    w = p["weight"].view(2, 4, 8)
    assert w[0, 1].eq(0).all() and w[1, 3].eq(0).all()
    y = NV.decode(p, torch.float32)
    assert torch.isnan(y[0, 16:32]).all() and torch.isnan(y[1, 48:64]).all()
    mask = torch.ones_like(y, dtype=torch.bool)
    mask[0, 16:32] = False
    mask[1, 48:64] = False
    assert torch.isfinite(y[mask]).all()
    # the other blocks are exactly what a clean encode with the same s2 gives
    clean = NV.encode(finite, weight_scale_2=p["weight_scale_2"])
    assert torch.equal(clean["weight"].view(2, 4, 8)[mask.view(2, 4, 16)[..., 0]], w[mask.view(2, 4, 16)[..., 0]])


def test_decode_rejects_bad_parts():
    p = NV.encode(torch.randn(4, 32, dtype=BF))
    with pytest.raises(FormatError, match="weight_scale_2"):
        NV.decode({k: v for k, v in p.items() if k != "weight_scale_2"})
    with pytest.raises(FormatError):
        NV.decode({**p, "weight_scale": p["weight_scale"].view(torch.uint8)})
    with pytest.raises(FormatError):
        NV.decode({**p, "weight_scale": p["weight_scale"][:, :1]})
    with pytest.raises(FormatError):
        NV.decode(p, dtype=torch.int32)


def test_fake_quant_nvfp4():
    x = torch.randn(4, 64, dtype=torch.float32, requires_grad=True)
    y = fake_quant("nvfp4", x)
    assert y.dtype == torch.float32
    assert torch.equal(y.detach(), NV.decode(NV.encode(x.detach()), torch.float32))
    (y * torch.arange(256.0).view(4, 64)).sum().backward()
    assert torch.equal(x.grad, torch.arange(256.0).view(4, 64))  # straight-through
