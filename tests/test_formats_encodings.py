"""Every code of E2M1, E4M3, E5M2 and E8M0 decodes right, compared as float32 BITS.

Expected values are computed here, independently of inkling_ckpt.formats.encodings: from the
bit formulas written out by hand below, and (when installed) from ml_dtypes as a second,
external oracle. The float8 casts torch performs for us (fp32 -> e4m3/e5m2, RNE) are
checked against ml_dtypes too, since the encoders rely on them.
"""

from __future__ import annotations

import itertools
import math
import struct

import numpy as np
import pytest
import torch

from conftest import oracle
from inkling_ckpt.errors import FormatError
from inkling_ckpt.formats.encodings import (
    E2M1,
    E4M3,
    E5M2,
    E8M0,
    ENCODINGS,
    decode_e2m1,
    decode_e4m3,
    decode_e5m2,
    decode_e8m0,
    decode_table,
)


def f32_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def bits_of(t: torch.Tensor) -> list[int]:
    return [int(b) & 0xFFFFFFFF for b in t.contiguous().view(torch.int32).tolist()]


# -- hand formulas (deliberately not shared with the code under test) ------------------------

E2M1_BY_HAND = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def e4m3_by_hand(c: int) -> float:
    s, e, m = c >> 7, (c >> 3) & 0xF, c & 7
    if e == 0xF and m == 7:
        return math.nan
    mag = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
    return -mag if s else mag


def e5m2_by_hand(c: int) -> float:
    s, e, m = c >> 7, (c >> 2) & 0x1F, c & 3
    if e == 0x1F:
        mag = math.inf if m == 0 else math.nan
    elif e == 0:
        mag = (m / 4) * 2.0**-14
    else:
        mag = (1 + m / 4) * 2.0 ** (e - 15)
    return -mag if s else mag


def e8m0_bits_by_hand(b: int) -> int | None:
    if b == 255:
        return None  # NaN
    if b == 0:
        return 0x00400000  # 2^-127 is an fp32 subnormal: mantissa bit 22
    return b << 23  # 2^(b-127): biased exponent field b, zero mantissa


def check_bits(got: torch.Tensor, expected: list[float]) -> None:
    got_bits = bits_of(got)
    for code, (g, e) in enumerate(zip(got_bits, expected, strict=True)):
        if math.isnan(e):
            assert math.isnan(struct.unpack("<f", struct.pack("<I", g))[0]), f"code {code:#x} should be NaN"
        else:
            assert g == f32_bits(e), f"code {code:#x}: bits {g:#010x} != {f32_bits(e):#010x} ({e})"


def test_e2m1_all_16_codes_bitwise():
    codes = torch.arange(16, dtype=torch.uint8)
    check_bits(decode_e2m1(codes), E2M1_BY_HAND)
    assert bits_of(decode_e2m1(torch.tensor([8], dtype=torch.uint8))) == [0x80000000]  # -0, not +0


def test_e4m3_all_256_codes_bitwise():
    codes = torch.arange(256, dtype=torch.uint8)
    check_bits(decode_e4m3(codes), [e4m3_by_hand(c) for c in range(256)])
    check_bits(decode_e4m3(codes.view(torch.float8_e4m3fn)), [e4m3_by_hand(c) for c in range(256)])


def test_e5m2_all_256_codes_bitwise():
    codes = torch.arange(256, dtype=torch.uint8)
    check_bits(decode_e5m2(codes), [e5m2_by_hand(c) for c in range(256)])


def test_e8m0_all_256_codes_bitwise():
    got = bits_of(decode_e8m0(torch.arange(256, dtype=torch.uint8)))
    for b in range(256):
        exp = e8m0_bits_by_hand(b)
        if exp is None:
            assert math.isnan(struct.unpack("<f", struct.pack("<I", got[b]))[0])
        else:
            assert got[b] == exp, f"byte {b}"
    assert got[254] == 0x7F000000  # 2^127
    if hasattr(torch, "float8_e8m0fnu"):
        typed = torch.arange(256, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        assert bits_of(decode_e8m0(typed))[:255] == got[:255]


def test_table_constants():
    assert (E2M1.bias, E2M1.max, E2M1.bits) == (1, 6.0, 4)
    assert (E4M3.bias, E4M3.max, set(E4M3.nan_codes), set(E4M3.inf_codes)) == (7, 448.0, {0x7F, 0xFF}, set())
    assert (E5M2.bias, E5M2.max, set(E5M2.inf_codes)) == (15, 57344.0, {0x7C, 0xFC})
    assert set(E5M2.nan_codes) == {0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF}
    assert (E8M0.bias, E8M0.max, set(E8M0.nan_codes)) == (127, 2.0**127, {0xFF})
    assert set(ENCODINGS) == {"e2m1", "e4m3", "e5m2", "e8m0"}
    # the torch dtypes agree with the table's maxima
    assert torch.finfo(torch.float8_e4m3fn).max == E4M3.max
    assert torch.finfo(torch.float8_e5m2).max == E5M2.max


def test_decode_rejects_float_input():
    with pytest.raises(FormatError):
        decode_e2m1(torch.zeros(3))


# -- second oracle: ml_dtypes ----------------------------------------------------------------



def _ml():
    return oracle("ml_dtypes", "ml_dtypes")


@pytest.mark.parametrize(
    "enc,decoder,ml_name",
    [(E2M1, decode_e2m1, "float4_e2m1fn"), (E4M3, decode_e4m3, "float8_e4m3fn"),
     (E5M2, decode_e5m2, "float8_e5m2"), (E8M0, decode_e8m0, "float8_e8m0fnu")],
)
def test_all_codes_match_ml_dtypes(enc, decoder, ml_name):
    ml = _ml()
    mdt = getattr(ml, ml_name, None)
    if mdt is None:
        pytest.skip(f"ml_dtypes has no {ml_name}")
    n = enc.num_codes
    ref = np.arange(n, dtype=np.uint8).view(mdt).astype(np.float32)
    got = decoder(torch.arange(n, dtype=torch.uint8)).numpy()
    nan = np.isnan(ref)
    assert (np.isnan(got) == nan).all()
    assert (got[~nan].view(np.uint32) == ref[~nan].view(np.uint32)).all()


@pytest.mark.parametrize("dtype,ml_name,enc", [(torch.float8_e4m3fn, "float8_e4m3fn", E4M3),
                                                (torch.float8_e5m2, "float8_e5m2", E5M2)])
def test_torch_fp8_cast_is_rne_in_range(dtype, ml_name, enc):
    """The encoders call x.to(float8) after clamping to ±max: pin that cast to RNE (ml_dtypes)."""
    ml = _ml()
    finite = sorted({v for v in (enc.value(c) for c in range(256)) if math.isfinite(v)})
    pts = []
    for a, b in itertools.pairwise(finite):
        mid = (a + b) / 2
        pts += [a, mid, np.nextafter(np.float32(mid), np.float32(-np.inf)), np.nextafter(np.float32(mid), np.float32(np.inf))]
    pts.append(finite[-1])
    rng = np.random.default_rng(0)
    pts += list(rng.uniform(-enc.max, enc.max, 20000))
    x = np.array(pts, dtype=np.float32)
    ours = torch.from_numpy(x).to(dtype).view(torch.uint8).numpy()
    ref = x.astype(getattr(ml, ml_name)).view(np.uint8)
    assert (ours == ref).all()


@pytest.mark.parametrize("enc", [E2M1, E4M3, E5M2, E8M0], ids=lambda e: e.name)
def test_bf16_decode_tables_hold_every_value_exactly(enc):
    """The BF16 tables MXFP8's decode into BF16 uses: each entry is its code's value (NaN for NaN)."""
    t = decode_table(enc, "cpu", torch.bfloat16)
    assert t.dtype == torch.bfloat16 and t.numel() == enc.num_codes
    for c in range(enc.num_codes):
        v = enc.value(c)
        assert math.isnan(float(t[c])) if math.isnan(v) else float(t[c]) == v, (enc.name, c)


def test_a_table_that_would_round_is_refused():
    with pytest.raises(FormatError, match="not every value is exact"):
        decode_table(E8M0, "cpu", torch.float16)  # 2^-127 .. 2^127 do not fit float16
