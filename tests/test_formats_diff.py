"""Differential tests against the reference implementations (test-only; skipped when absent).

Installed by the README's test command (the ``test`` extra in pyproject.toml): torchao==0.18.0
and nvidia-modelopt==0.47.0, next to the pinned torch.

What is compared, and where the references are *defined* to differ (reference/quant-formats.md):

* ModelOpt 0.47 ``NVFP4QTensor`` is the NVFP4 contract itself: every byte must match
  (weight, weight_scale, weight_scale_2), for computed and for given global scales. Excluded:
  all-zero tensors (ModelOpt yields NaN scales; our policy is documented in nvfp4.py).
* ModelOpt 0.47 ``MXFP8QTensor`` is RCEIL through float log2: byte-identical for bf16/fp16 and for
  these fp32 inputs; the one known fp32 divergence (amax/448 one ulp above 2^k) is pinned.
* torchao 0.18 ``to_mx`` RCEIL / FLOOR: identical wherever the scale byte is >= 1. At byte 0
  (amax below ~2^-118) torchao 0.18 computes the data with 2^-126 (FLOOR) or flushes (RCEIL).
* torchao 0.18 ``nvfp4_quantize(per_tensor_scale=s2)``: it clamps block scales at 2^-6 instead of
  2^-9, writes 0x08 for zero blocks, forms the block scale as (amax/6)/s2 instead of amax/(6*s2),
  and multiplies by a reciprocal. So: scale bytes are compared where our byte >= 0x08, the block is
  non-zero and both fp32 quotients are equal (and must agree in >= 99.9% of the blocks where only
  the quotients differ); elements where the scale bytes agree, the element is not -0.0 (torchao
  keeps the sign bit) and x/scale is not within 1e-6 of an E2M1 midpoint.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from conftest import oracle
from inkling_ckpt.formats import get_format

BF = torch.bfloat16
NV = get_format("nvfp4")
MX = get_format("mxfp8")
MXF = get_format("mxfp8", scale_mode="floor")
MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)


def _modelopt():
    oracle("modelopt", "nvidia-modelopt==0.47.0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.quantization.qtensor.mxfp8_tensor import MXFP8QTensor
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    return NVFP4QTensor, MXFP8QTensor


def _torchao():
    oracle("torchao", "torchao==0.18.0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import to_mx
        from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize
    return to_mx, nvfp4_quantize, ScaleCalculationMode


def random_matrices():
    """(id, tensor): several shapes, magnitudes 1e-3..1e3, outliers, dtypes."""
    gen = torch.Generator().manual_seed(1234)
    out = []
    for shape in ((64, 256), (37, 1024), (8, 4096)):
        for mag in (1e-3, 1.0, 1e3):
            x = torch.randn(shape, generator=gen) * mag
            idx = torch.randint(0, x.numel(), (5,), generator=gen)
            x.view(-1)[idx] *= 100.0  # outliers
            for dt in (BF, torch.float16, torch.float32):
                if dt == torch.float16 and mag == 1e3:
                    continue  # 1e5 outliers overflow fp16
                out.append((f"{shape[0]}x{shape[1]}-{mag:g}-{str(dt)[6:]}", x.to(dt).contiguous()))
    # heavy tails (student-t like) in bf16
    t = torch.randn(64, 512, generator=gen) / torch.rand(64, 512, generator=gen).clamp_min(1e-3)
    out.append(("heavy-tail-bf16", t.to(BF)))
    return out


def edge_matrix(dtype=BF) -> torch.Tensor:
    """Blocks of edge cases (each row a 32-wide pair of NVFP4 blocks / one MXFP8 block)."""
    rows = [
        [6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, 0.0, 0.5, 1.5, 3, -6, 4] * 2,  # E2M1 ties
        [0.0] * 32,  # zero blocks
        [2.0**-130, -(2.0**-133)] + [0.0] * 30,  # bf16 subnormals
        [1.0, 0.5, 0.25, 2.0**-10] + [0.125] * 28,  # power-of-two maxima
        [1.75, -1.75 / 3] + [0.01] * 30,  # mantissa 1.75
        [1.8125, 1.875, 1.9375] + [-0.3] * 29,  # mantissas above 1.75 (MX FLOOR saturates)
        [448.0, -448.0, 449.0, 1e4] + [1.0] * 28,  # beyond the element range
        [2.0**-120, 2.0**-121] + [0.0] * 30,  # tiny: MX scale byte 0
        [3000.0] + [1e-6] * 31,  # dynamic range inside a block
        [2688.0] + list(np.linspace(-2688, 2688, 31)),
    ]
    return torch.tensor(rows, dtype=torch.float32).to(dtype)


ALL = random_matrices() + [("edges-bf16", edge_matrix()), ("edges-fp32", edge_matrix(torch.float32))]
IDS = [a for a, _ in ALL]
XS = [b for _, b in ALL]


def u8(t):
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


# -- ModelOpt 0.47 --------------------------------------------------------------------------------


@pytest.mark.parametrize("x", XS, ids=IDS)
def test_modelopt_nvfp4_bytes(x):
    NVFP4QTensor, _ = _modelopt()
    qt, sb, s2 = NVFP4QTensor.quantize(x.clone(), 16)
    p = NV.encode(x)
    assert torch.equal(p["weight_scale_2"], s2.reshape(()).float())
    assert torch.equal(u8(p["weight_scale"]), u8(sb))
    assert torch.equal(p["weight"], qt._quantized_data)
    # decode == ModelOpt dequantize (float32), bit for bit except the sign of zero: ModelOpt's
    # E2M1 table maps nibble 0x8 to +0.0, ours to -0.0 (the code's value); both compare equal.
    ref = qt.dequantize(torch.float32, scale=sb, double_scale=s2, block_sizes={-1: 16})
    ours = NV.decode(p, torch.float32)
    assert torch.equal(ours, ref)
    nonzero = ours != 0
    assert torch.equal(ours.view(torch.int32)[nonzero], ref.view(torch.int32)[nonzero])


@pytest.mark.parametrize("s2", [1.0, 2.0**-7, 3.7e-4])
def test_modelopt_nvfp4_given_global_scale(s2):
    NVFP4QTensor, _ = _modelopt()
    s2t = torch.tensor(s2, dtype=torch.float32)
    for x in XS[::4] + [edge_matrix()]:
        qt, sb, _ = NVFP4QTensor.quantize(x.clone(), 16, weights_scaling_factor_2=s2t)
        p = NV.encode(x, weight_scale_2=s2t)
        assert torch.equal(u8(p["weight_scale"]), u8(sb))
        assert torch.equal(p["weight"], qt._quantized_data)


@pytest.mark.parametrize("x", XS, ids=IDS)
def test_modelopt_mxfp8_bytes(x):
    _, MXFP8QTensor = _modelopt()
    qt, s = MXFP8QTensor.quantize(x.clone())
    p = MX.encode(x)
    assert torch.equal(p["weight_scale"], s.reshape(p["weight_scale"].shape))
    assert torch.equal(u8(p["weight"]), u8(qt._quantized_data))
    ref = qt.dequantize(torch.float32, scale=s)
    assert torch.equal(MX.decode(p, torch.float32), ref)


def test_modelopt_mxfp8_known_fp32_divergence():
    """fp32 amax/448 one ulp above 2^-12: ModelOpt's log2 returns exactly -12 (byte 115, element
    saturates); the bit-exact RCEIL rounds up (byte 116). Documented in mxfp8.py."""
    _, MXFP8QTensor = _modelopt()
    a = float(np.nextafter(np.float32(448 * 2.0**-12), np.float32(1)))
    x = torch.tensor([[a] + [0.0] * 31], dtype=torch.float32)
    _, s = MXFP8QTensor.quantize(x.clone())
    assert int(s.flatten()[0]) == 115
    assert int(MX.encode(x)["weight_scale"].flatten()[0]) == 116


# -- torchao 0.18 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["rceil", "floor"])
@pytest.mark.parametrize("x", [x for x in XS if x.dtype != torch.float16],
                         ids=[i for i, x in zip(IDS, XS, strict=True) if x.dtype != torch.float16])
def test_torchao_to_mx(x, mode):
    to_mx, _, SCM = _torchao()
    fmt = MX if mode == "rceil" else MXF
    s, d = to_mx(x.clone(), torch.float8_e4m3fn, 32, SCM.RCEIL if mode == "rceil" else SCM.FLOOR)
    p = fmt.encode(x)
    ours_s = p["weight_scale"]
    assert torch.equal(u8(s).reshape(ours_s.shape), ours_s)  # scale bytes: always equal here
    defined = (ours_s >= 1).repeat_interleave(32, dim=-1)  # torchao 0.18 differs at byte 0 (see top)
    ours_d, ref_d = u8(p["weight"]), u8(d).reshape(p["weight"].shape)
    assert torch.equal(ours_d[defined], ref_d[defined])


@pytest.mark.parametrize("x", [x for x in XS if x.dtype != torch.float16],
                         ids=[i for i, x in zip(IDS, XS, strict=True) if x.dtype != torch.float16])
def test_torchao_nvfp4_quantize(x):
    _, nvfp4_quantize, _ = _torchao()
    p = NV.encode(x)
    s2 = p["weight_scale_2"]
    ref_s, ref_w = nvfp4_quantize(x.clone(), 16, per_tensor_scale=s2)
    rows, width = x.shape
    xb = x.float().view(rows, width // 16, 16)
    bamax = xb.abs().amax(-1)
    ours_q = bamax / (6.0 * s2)
    theirs_q = (bamax / 6.0) / s2
    ours_s, theirs_s = u8(p["weight_scale"]), u8(ref_s).reshape(rows, -1)
    scale_defined = (ours_s >= 0x08) & (bamax > 0) & (ours_q == theirs_q)
    assert torch.equal(ours_s[scale_defined], theirs_s[scale_defined])
    # where only the quotients differ (by an ulp, ~1/3 of blocks) the bytes still almost always agree
    quot = (ours_s >= 0x08) & (bamax > 0) & (ours_q != theirs_q)
    assert int((ours_s != theirs_s)[quot].sum()) <= max(1, int(quot.sum()) // 1000)
    # elements
    nib = lambda w: torch.stack((w & 0xF, w >> 4), -1).reshape(rows, width)  # noqa: E731
    ours_n, theirs_n = nib(p["weight"]), nib(ref_w.reshape(rows, -1))
    eff = p["weight_scale"].float() * s2
    y = (xb.double() / eff.double().unsqueeze(-1)).abs().reshape(rows, width)
    near_tie = ((y.unsqueeze(-1) - MIDPOINTS).abs() <= 1e-6 * MIDPOINTS).any(-1)
    neg_zero = (x.float() == 0) & torch.signbit(x.float())
    elem_defined = (ours_s == theirs_s).repeat_interleave(16, -1) & ~near_tie & ~neg_zero
    assert torch.equal(ours_n[elem_defined], theirs_n[elem_defined])
    # and for Gaussian-like data the undefined part is small (it is ~0 outside the edge rows)
    if x.shape[0] > 16:
        assert elem_defined.float().mean() > 0.95
