"""Fast paths == plain reference paths, bit for bit (encode and decode, NVFP4 and MXFP8).

The codecs' default (fast=True) paths use integer tricks and table lookups; fast=False runs the
plain formulation (abs/amax, comparisons, float8 casts). Inputs: random matrices of several
magnitudes and dtypes plus edge rows (ties, zeros, -0.0, subnormals, saturation), and exhaustive
checks of the two bit helpers over every 16-bit pattern.
"""

from __future__ import annotations

import pytest
import torch

from inkling_ckpt.formats._base import block_amax_bits
from inkling_ckpt.formats.mxfp8 import ELEMENTS, MXFP8Format
from inkling_ckpt.formats.nvfp4 import NVFP4Format

BF = torch.bfloat16


def inputs():
    gen = torch.Generator().manual_seed(7)
    for dt in (BF, torch.float16, torch.float32):
        for mag in (1e-3, 1.0, 1e3):
            if dt == torch.float16 and mag == 1e3:
                continue
            x = torch.randn(40, 320, generator=gen) * mag
            x.view(-1)[torch.randint(0, x.numel(), (6,), generator=gen)] *= 200.0
            x[0, :32] = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -0.0, 0.5, 1.5, 3, -6, 4] * 2)
            x[1, :32] = 0.0
            x[2, :32] = -0.0
            x[3, :4] = torch.tensor([2.0**-130, -(2.0**-133), 1e-6, -1e-6])
            x[4, :32] = torch.linspace(-1.875, 1.8125, 32)
            yield x.to(dt)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point() and a.element_size() >= 2:
        return torch.equal(a.view(torch.int32 if a.element_size() == 4 else torch.int16),
                           b.view(torch.int32 if b.element_size() == 4 else torch.int16))
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("kw", [{}, {"weight_scale_2": 1.0}, {"weight_scale_2": 2.0**-140}, {"global_amax": 1e-2}])
def test_nvfp4_fast_equals_reference(kw):
    fast, ref = NVFP4Format(fast=True), NVFP4Format(fast=False)
    for x in inputs():
        a, b = fast.encode(x, **kw), ref.encode(x, **kw)
        assert all(same(a[k], b[k]) for k in a), (x.dtype, kw)
        for dt in (torch.float32, BF):
            assert same(fast.decode(a, dt), ref.decode(a, dt))


def test_nvfp4_fast_equals_reference_allow_nonfinite():
    fast, ref = NVFP4Format(fast=True), NVFP4Format(fast=False)
    x = next(iter(inputs())).clone()
    x[5, 3], x[6, 40], x[7, 100] = float("nan"), float("inf"), -float("inf")
    a, b = fast.encode(x, allow_nonfinite=True), ref.encode(x, allow_nonfinite=True)
    assert all(same(a[k], b[k]) for k in a)


@pytest.mark.parametrize("opts", [{}, {"scale_mode": "floor"}, {"element": "e5m2"}])
def test_mxfp8_fast_equals_reference(opts):
    fast, ref = MXFP8Format(fast=True, **opts), MXFP8Format(fast=False, **opts)
    for x in inputs():
        a, b = fast.encode(x), ref.encode(x)
        assert all(same(a[k], b[k]) for k in a), (x.dtype, opts)
        for dt in (torch.float32, BF):
            d1, d2 = fast.decode(a, dt), ref.decode(a, dt)
            assert same(d1, d2)
    x = next(iter(inputs())).clone()
    x[5, 3], x[6, 40] = float("nan"), float("inf")
    a, b = fast.encode(x, allow_nonfinite=True), ref.encode(x, allow_nonfinite=True)
    assert all(same(a[k], b[k]) for k in a)
    assert torch.equal(fast.decode(a, torch.float32).isnan(), ref.decode(a, torch.float32).isnan())


@pytest.mark.parametrize("dtype", [BF, torch.float16])
def test_bit_helpers_exhaustive_16bit(dtype):
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    # block_amax_bits over blocks of one element is |x| (NaN stays NaN)
    got = block_amax_bits(x.view(-1, 1))
    ref = x.float().abs()
    assert torch.equal(got.isnan(), ref.isnan())
    ok = ~ref.isnan()
    assert torch.equal(got[ok], ref[ok])


def test_bit_helpers_fp32_edges():
    v = torch.tensor([0.0, -0.0, 1e-45, -1e-45, -1.0, 3.4e38, -3.4e38, float("inf"), -float("inf"), float("nan")])
    blocks = torch.stack([v[:9], v[:9].flip(0)])
    assert torch.equal(block_amax_bits(blocks), torch.full((2,), float("inf")))
    buf = torch.full((40,), 0x7FFFFFFF, dtype=torch.int32)  # a reused buffer, larger than the input
    assert torch.equal(block_amax_bits(blocks, buf), torch.full((2,), float("inf")))
    assert torch.equal(block_amax_bits(-v[:5].view(1, -1), buf), torch.tensor([1.0]))
    assert block_amax_bits(v.view(1, -1)).isnan().all()


@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, BF, torch.float16])
def test_mxfp8_fast_decode_gives_the_reference_bits_for_every_combination(element, dtype):
    """The CPU decode (values and scales by table, then their product): every one of the 65536
    (scale byte, element byte) combinations, NaN scale and NaN / infinite elements included, gives
    the reference's bits."""
    codes = torch.arange(256, dtype=torch.uint8)
    weight = codes.repeat(256, 1).view(ELEMENTS[element].torch_dtype)  # row s: every element byte
    scale = torch.arange(256, dtype=torch.uint8).view(256, 1).expand(256, 256 // 32).contiguous()
    parts = {"weight": weight, "weight_scale": scale}
    fast = MXFP8Format(element=element).decode(parts, dtype)
    ref = MXFP8Format(element=element, fast=False).decode(parts, dtype)
    nan = ref.isnan()  # NaN payloads differ (the float8 cast keeps more bits), NaN-ness does not
    assert torch.equal(fast.isnan(), nan)
    assert same(fast.masked_fill(nan, 0), ref.masked_fill(nan, 0))
    nan_codes = 2 if element == "e4m3" else 6  # E4M3: 0x7F, 0xFF; E5M2: 0x7D-0x7F, 0xFD-0xFF
    assert int(nan.sum()) == 256 + 255 * nan_codes  # the NaN scale's row, and each NaN code under the rest
