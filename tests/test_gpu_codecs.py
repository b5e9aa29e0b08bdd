"""GPU (Triton) codecs against the CPU reference codec: the same bytes, always.

Runs on a CUDA device; skipped where there is none. Without a GPU the same tests run through
Triton's interpreter when asked: ``TRITON_INTERPRET=1 INKLING_CKPT_GPU_CODECS=interpret``
(slow; the real-shape cases are then skipped).
"""

from __future__ import annotations

import os

import pytest
import torch

from inkling_ckpt.errors import NonFiniteError
from inkling_ckpt.formats import get_format, gpu

pytestmark = pytest.mark.gpu

INTERPRET = os.environ.get("INKLING_CKPT_GPU_CODECS", "").lower() == "interpret"
HAS_CUDA = torch.cuda.is_available()

if HAS_CUDA:
    DEV = "cuda"
elif INTERPRET:
    DEV = "cpu"
else:
    DEV = None


@pytest.fixture(autouse=True, scope="session")
def _fused_fma_in_interpreter():
    """Triton's interpreter computes fma as x*y + z (two roundings); the kernels need a fused one.
    float64 holds the exact product of two floats, so one rounding to float32 follows (a double
    rounding could only matter on a float64 tie, which the kernels' exact remainders never make)."""
    if not INTERPRET or HAS_CUDA:
        yield
        return
    import numpy as np
    from triton.runtime import interpreter as I

    orig = I.InterpreterBuilder.create_fma

    def fused(self, x, y, z):
        if x.data.dtype == np.float32:
            r = (x.data.astype(np.float64) * y.data.astype(np.float64) + z.data.astype(np.float64)).astype(np.float32)
            return I.TensorHandle(r, z.dtype.scalar)
        return orig(self, x, y, z)

    I.InterpreterBuilder.create_fma = fused
    yield
    I.InterpreterBuilder.create_fma = orig


@pytest.fixture(autouse=True)
def _need_kernels():
    if DEV is None:
        pytest.skip("needs a CUDA device (or TRITON_INTERPRET=1 INKLING_CKPT_GPU_CODECS=interpret)")
    pytest.importorskip("triton", reason="Triton is not installed (it comes with CUDA builds of torch)")
    if not gpu.kernels_available():
        pytest.skip("Triton kernels not available")


FORMATS = [
    ("nvfp4", {}),
    ("mxfp8", {}),
    ("mxfp8", {"scale_mode": "floor"}),
    ("mxfp8", {"element": "e5m2"}),
    ("mxfp8", {"element": "e5m2", "scale_mode": "floor"}),
]
FMT_IDS = ["nvfp4", "mxfp8-rceil", "mxfp8-floor", "mxfp8-e5m2", "mxfp8-e5m2-floor"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a tensor, for bitwise comparison (NaN payloads included)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _same_values(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Decoded tensors: identical bits, except that any NaN matches any NaN at the same place.

    (The CPU reference's NaN bits in bf16 depend on torch's CPU conversion, 0xFFFF from its
    vectorized path on x86 where the scalar path writes 0x7FC0; the kernel writes 0x7FC0.)"""
    g, w = got.detach().cpu(), want.detach().cpu()
    if g.dtype != w.dtype or g.shape != w.shape:
        return False
    gn, wn = torch.isnan(g.float()), torch.isnan(w.float())
    if not torch.equal(gn, wn):
        return False
    keep = ~wn.reshape(-1)
    return torch.equal(_bits(g.reshape(-1)[keep]), _bits(w.reshape(-1)[keep]))


def _ref_encode(fmt, x, **kw):
    with gpu.kernels_disabled():
        return fmt.encode(x.cpu(), **kw)


def _assert_same_parts(got, want, what=""):
    assert sorted(got) == sorted(want), what
    for k in want:
        g, w = got[k], want[k]
        assert g.dtype == w.dtype and tuple(g.shape) == tuple(w.shape), f"{what} {k}: {g.dtype}{list(g.shape)} vs {w.dtype}{list(w.shape)}"
        gb, wb = _bits(g), _bits(w)
        if not torch.equal(gb, wb):
            bad = (gb != wb).nonzero()
            raise AssertionError(f"{what} {k}: {bad.numel()} of {wb.numel()} bytes differ, first at byte {int(bad[0])}: "
                                 f"{int(gb[bad[0]])} vs {int(wb[bad[0]])}")


def _check(name, opts, x, **kw):
    fmt = get_format(name, **opts)
    xd = x.to(DEV)
    got = fmt.encode(xd, **kw)
    for t in got.values():
        assert t.device.type == xd.device.type
    want = _ref_encode(fmt, x, **kw)
    _assert_same_parts(got, want, f"{name}{opts} {list(x.shape)} {x.dtype}")
    # decode of the same parts: same values, bit for bit
    for dt in (torch.bfloat16, torch.float32):
        dg = fmt.decode(got, dt)
        with gpu.kernels_disabled():
            dw = fmt.decode({k: v.cpu() for k, v in want.items()}, dt)
        assert _same_values(dg, dw), f"decode {name}{opts} -> {dt}"
    return got


def _wide_range(rows, cols, dtype=torch.bfloat16, seed=0, outliers=True):
    """Gaussian rows scaled 1e-3..1e3 (per row and per 64-column stripe), with sparse outliers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    x *= torch.pow(10.0, torch.empty(rows, 1).uniform_(-3, 3, generator=g))
    x *= torch.pow(10.0, torch.empty(1, cols // 64 + 1).uniform_(-0.5, 0.5, generator=g)).repeat_interleave(64, 1)[:, :cols]
    if outliers:
        n = max(1, rows * cols // 5000)
        idx = torch.randint(0, rows * cols, (n,), generator=g)
        x.view(-1)[idx] *= torch.empty(n).uniform_(20, 200, generator=g)
    return x.to(dtype)


@pytest.fixture(params=["bf16-kernels", "generic-kernels"])
def kernels(request, monkeypatch):
    """Run a test with the BF16 register-resident kernels and with the generic ones."""
    from inkling_ckpt.formats.gpu import ops

    monkeypatch.setattr(ops, "BF16_FAST", request.param == "bf16-kernels")
    return request.param


# -- random inputs -------------------------------------------------------------------------


@pytest.mark.parametrize("name,opts", FORMATS, ids=FMT_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_random_small(name, opts, dtype, kernels):
    for seed in range(3):
        x = _wide_range(48, 512, dtype=dtype if dtype != torch.float16 else torch.float32, seed=seed)
        if dtype == torch.float16:
            x = x.clamp(-60000, 60000).half()
        _check(name, opts, x)


@pytest.mark.skipif(not HAS_CUDA, reason="real shapes need a GPU (too slow in the interpreter)")
@pytest.mark.parametrize("name,opts", FORMATS[:3], ids=FMT_IDS[:3])
@pytest.mark.parametrize("shape", [(2304, 4608), (4608, 2304)])
def test_random_real_shapes(name, opts, shape, kernels):
    for seed in range(2):
        _check(name, opts, _wide_range(*shape, seed=seed))


@pytest.mark.skipif(not HAS_CUDA, reason="real shapes need a GPU")
def test_nvfp4_given_scales_real_shape(kernels):
    x = _wide_range(2304, 4608, seed=7)
    _check("nvfp4", {}, x, weight_scale_2=torch.tensor(0.01), input_scale=0.5)
    _check("nvfp4", {}, x, global_amax=3.0)  # many blocks clamp at 448 and saturate


def test_shapes():
    for shape in [(16,), (1, 32), (3, 5, 64), (7, 96)]:
        x = torch.randn(shape) * 3
        _check("nvfp4", {}, x.to(torch.bfloat16)) if shape[-1] % 16 == 0 else None
        if shape[-1] % 32 == 0:
            _check("mxfp8", {}, x.to(torch.bfloat16))


# -- NVFP4 edge cases (spec/formats.md) -------------------------------------------------------


def test_nvfp4_ties_and_signs(kernels):
    # weight_scale_2 = 1 and a block amax of 6 give block scale 1.0, so elements are encoded as is
    row = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -5.0, -0.0, 0.0, -0.1, 0.1])
    x = torch.stack([row, row.flip(0)])
    got = _check("nvfp4", {}, x, weight_scale_2=1.0)
    codes = torch.stack([got["weight"].cpu() & 0xF, got["weight"].cpu() >> 4], -1).reshape(2, 16)[0]
    assert codes.tolist() == [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 14, 0, 0, 8, 0]


def test_nvfp4_saturation_and_scale_clamps(kernels):
    x = torch.zeros(4, 32)
    x[0, :16] = torch.linspace(-1, 1, 16) * 6 * 1.0625  # block scale 1.0625 rounds (ties-even) to 1.0: saturates
    x[1, :16] = 1e-8  # block scale below 2^-9: clamped
    x[2, :16] = 5e5  # block scale above 448 with a given small global scale: clamped
    x[3, 16:] = torch.arange(16) * 0.37
    _check("nvfp4", {}, x, weight_scale_2=1.0)
    _check("nvfp4", {}, x)  # fresh global scale


def test_nvfp4_zero_block_and_zero_tensor(kernels):
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    got = _check("nvfp4", {}, x)
    assert (_bits(got["weight_scale"]) == 0x38).all()
    x[0, 20] = 1.5
    _check("nvfp4", {}, x)


def test_nvfp4_subnormal_and_extreme_range(kernels):
    x = torch.zeros(3, 32, dtype=torch.float32)
    x[0, :16] = torch.tensor(1e-40)  # fp32 subnormal input; global amax < 2^-126 -> taken as 1.0
    x[1, :16] = torch.linspace(-1e-38, 1e-38, 16)
    x[2, :16] = torch.tensor([1e30] + [1e-30] * 7 + [-1e-30] * 8)  # underflow inside a block
    x[2, 16:] = -3e-39
    _check("nvfp4", {}, x)
    _check("nvfp4", {}, x[:2])
    _check("nvfp4", {}, x, weight_scale_2=2.0**-140)  # subnormal given global scale


def test_nvfp4_group_shares_scale():
    fmt = get_format("nvfp4")
    a, b = _wide_range(32, 64, seed=1), _wide_range(32, 64, seed=2) * 10
    got = fmt.encode_group([a.to(DEV), b.to(DEV)])
    with gpu.kernels_disabled():
        want = fmt.encode_group([a, b])
    for g, w in zip(got, want, strict=True):
        _assert_same_parts(g, w)


# -- MXFP8 edge cases -------------------------------------------------------------------------


@pytest.mark.parametrize("name,opts", FORMATS[1:], ids=FMT_IDS[1:])
def test_mxfp8_edges(name, opts, kernels):
    x = torch.zeros(8, 64, dtype=torch.float32)
    x[0, :32] = 448.0 * 2.0 ** torch.arange(-16, 16).float()  # powers of two times 448: no round up
    x[1, :32] = torch.nextafter(torch.tensor(448.0 * 4), torch.tensor(1e9))  # one ulp above
    x[1, 32:] = 448.0 * 1.875  # FLOOR saturation (mantissa above 1.75)
    x[2, :32] = 1e-40  # subnormal amax -> byte 0
    x[2, 32:] = 3e38  # huge amax -> exponent clamped to 127
    x[3, :32] = -0.0
    x[3, 32:] = torch.linspace(-1, 1, 32) * 1e-3
    x[4, :32] = torch.tensor([2.0**-k for k in range(32)])  # element subnormals
    x[5] = torch.randn(64) * 1e4
    x[6, :] = torch.linspace(-7, 7, 64)
    _check(name, opts, x)
    _check(name, opts, x.to(torch.bfloat16))


# -- non-finite ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name,opts", FORMATS, ids=FMT_IDS)
def test_nonfinite(name, opts, kernels):
    x = _wide_range(4, 128, seed=3)
    x[1, 5] = float("nan")
    x[2, 100] = float("inf")
    x[3, 0] = float("-inf")
    fmt = get_format(name, **opts)
    with pytest.raises(NonFiniteError):
        fmt.encode(x.to(DEV), name="w")
    _check(name, opts, x, allow_nonfinite=True)
    if name == "nvfp4":
        with pytest.raises(NonFiniteError):
            fmt.encode(x.to(DEV), name="w", weight_scale_2=1.0)
        _check(name, opts, x, allow_nonfinite=True, weight_scale_2=0.5)


# -- decode of arbitrary stored bytes ---------------------------------------------------------


@pytest.mark.parametrize("name,opts", FORMATS, ids=FMT_IDS)
def test_decode_any_bytes(name, opts):
    fmt = get_format(name, **opts)
    g = torch.Generator().manual_seed(5)
    spec = fmt.parts((64, 256))
    parts = {}
    for k, (shape, dt) in spec.items():
        if dt == torch.float32:
            parts[k] = torch.tensor(0.003, dtype=torch.float32)
        else:
            parts[k] = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(dt)
    for dt in (torch.bfloat16, torch.float32, torch.float16):
        got = fmt.decode({k: v.to(DEV) for k, v in parts.items()}, dt)
        with gpu.kernels_disabled():
            want = fmt.decode(parts, dt)
        assert _same_values(got, want), f"{name}{opts} decode -> {dt}"


def test_nvfp4_decode_bf16_block_tables():
    """The BF16 NVFP4 decode builds per-block value tables where every product stays normal and
    falls back to per-element math elsewhere: all codes, valid scales, global factors from
    subnormal-making to near-overflow (constant-scale groups put whole programs right at the
    limits), both multiplication orders, against the reference."""
    from inkling_ckpt.formats import stacked
    from inkling_ckpt.formats.gpu import ops

    g = torch.Generator().manual_seed(11)
    groups, n = 10, 16 * 128 * 3  # three programs of 128 blocks per group
    w = torch.randint(0, 256, (groups, n // 2), generator=g, dtype=torch.uint8)
    sc = torch.randint(1, 0x7F, (groups, n // 16), generator=g, dtype=torch.uint8)
    s2 = torch.tensor([1e-3, 3.7e-7, 2.0**-120, 2.0**-131, 2.0**118, 1.3 * 2.0**-123, 1.9 * 2.0**125,
                       1.3 * 2.0**-124, 1.9 * 2.0**126, 2.0**-10], dtype=torch.float32)
    sc[5:9] = 0x38  # scale 1.0: A = s2 exactly at the table path's exponent limits (in, out, in, out)
    sc[9] = 0x7E  # 448
    f8 = sc.view(torch.float8_e4m3fn)
    fmt = get_format("nvfp4")
    for factor_last in (False, True):
        got = ops.nvfp4_decode(w.to(DEV), f8.to(DEV), s2.to(DEV), torch.bfloat16, factor_last=factor_last).cpu()
        with gpu.kernels_disabled():
            if factor_last:
                want = stacked._decode_nvfp4_reference(w.view(groups, 1, -1), f8.view(groups, 1, -1), s2, torch.bfloat16)
            else:
                want = torch.stack([fmt.decode({"weight": w[i].view(1, -1), "weight_scale": f8[i].view(1, -1),
                                                "weight_scale_2": s2[i]}, torch.bfloat16) for i in range(groups)])
        assert _same_values(got, want.view(groups, n)), f"factor_last={factor_last}"


def test_mxfp8_decode_bf16_rebiased():
    """The BF16 MXFP8 (E4M3) decode re-biases exponents where every product is a normal BF16 value
    (scale bytes 15..246) and falls back to per-element math elsewhere: every element byte,
    constant-scale groups at and beyond the limits, a group with a NaN element, against the reference."""
    from inkling_ckpt.formats.gpu import ops

    g = torch.Generator().manual_seed(12)
    scales = [127, 15, 14, 246, 247, 10, 0, 200, 127]
    groups, n = len(scales), 32 * 256 * 2
    q = torch.randint(0, 256, (groups, n), generator=g, dtype=torch.uint8)
    q[(q & 0x7F) == 0x7F] = 0x3C  # no NaN elements (but in the last group)
    q[:, :256] = torch.arange(256, dtype=torch.uint8)  # every byte once per group...
    q[:-1, 0x7F] = 0x00
    q[:-1, 0xFF] = 0x80
    sc = torch.tensor(scales, dtype=torch.uint8)[:, None].expand(groups, n // 32).contiguous()
    sc[0, 5] = 126  # a varying scale inside one group
    fmt = get_format("mxfp8")
    got = ops.mxfp8_decode(q.view(torch.float8_e4m3fn).to(DEV), sc.to(DEV), "e4m3", torch.bfloat16).cpu()
    with gpu.kernels_disabled():
        want = fmt.decode({"weight": q.view(torch.float8_e4m3fn), "weight_scale": sc}, torch.bfloat16)
    assert _same_values(got, want)


# -- grouped ops (what the weight sync uses) --------------------------------------------------


def test_grouped_ops_match_per_tensor():
    from inkling_ckpt.formats.gpu import ops

    fmt = get_format("nvfp4")
    xs = torch.stack([_wide_range(32, 128, seed=s) for s in range(5)])
    xs[3] = 0
    xd = xs.to(DEV)
    amax, bad = ops.group_amax(xd.view(5, -1))
    assert not bad.any()
    s2 = ops.nvfp4_global_scales(amax)
    w, sc, bad = ops.nvfp4_encode(xd.view(5, -1), s2)
    for i in range(5):
        want = _ref_encode(fmt, xs[i])
        assert torch.equal(_bits(s2[i]), _bits(want["weight_scale_2"]))
        assert torch.equal(_bits(w[i]), _bits(want["weight"]))
        assert torch.equal(_bits(sc[i]), _bits(want["weight_scale"]))


def test_dispatch_reaches_the_kernels(monkeypatch):
    """The codec must hand device tensors to the kernels (else the comparisons above prove nothing)."""
    from inkling_ckpt.formats.gpu import ops

    calls = []
    for fn in ("group_amax", "nvfp4_encode", "mxfp8_encode", "nvfp4_decode", "mxfp8_decode"):
        orig = getattr(ops, fn)

        def wrap(*a, _orig=orig, _fn=fn, **k):
            calls.append(_fn)
            return _orig(*a, **k)

        monkeypatch.setattr(ops, fn, wrap)
    x = _wide_range(8, 64).to(DEV)
    for name in ("nvfp4", "mxfp8"):
        fmt = get_format(name)
        fmt.decode(fmt.encode(x))
    get_format("nvfp4").encode_group([x, x])
    assert sorted(set(calls)) == ["group_amax", "mxfp8_decode", "mxfp8_encode", "nvfp4_decode", "nvfp4_encode"], calls
    calls.clear()
    with gpu.kernels_disabled():
        get_format("nvfp4").encode(x)
    assert calls == []


def test_nvfp4_exact_ties_at_random_scales(kernels):
    """Elements exactly on E2M1 rounding ties and grid points, at many block scales (power-of-two
    global scale, so every x / eff is exact): the case a re-encode of decoded weights hits."""
    from inkling_ckpt.formats.encodings import E4M3, decode_table

    g = torch.Generator().manual_seed(11)
    table = decode_table(E4M3)
    sbf = table[torch.randint(1, 127, (64, 8), generator=g)]  # positive finite block scales
    s2 = 2.0**-10
    eff = sbf * s2
    vals = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.5, 0.0, 0.125])
    q = vals[torch.randint(0, len(vals), (64, 8, 16), generator=g)]
    q *= torch.where(torch.rand(64, 8, 16, generator=g) < 0.5, -1.0, 1.0)
    q[..., 0] = 6.0  # fixes each block's scale at exactly sbf
    x = (q * eff[..., None]).reshape(64, 128)
    assert torch.equal(x.bfloat16().float(), x)  # all exact in bf16
    _check("nvfp4", {}, x.bfloat16(), weight_scale_2=s2)
    _check("nvfp4", {}, x.bfloat16())


def test_odd_offset_views(kernels):
    """A bf16 view starting at an odd element cannot be read as int32 words: generic kernels."""
    base = _wide_range(9, 64, seed=4).reshape(-1)
    x = base[64 - 16:64 - 16 + 8 * 64 + 16][16 - 15:][:8 * 64].view(8, 64)  # odd storage offset
    assert x.storage_offset() % 2 == 1
    for name in ("nvfp4", "mxfp8"):
        fmt = get_format(name)
        xd = base.to(DEV)[x.storage_offset():x.storage_offset() + 8 * 64].view(8, 64)
        assert xd.storage_offset() % 2 == 1
        got = fmt.encode(xd)
        _assert_same_parts(got, _ref_encode(fmt, x), name)


def test_nvfp4_decision_boundaries(kernels):
    """Elements on and beside every E2M1 decision boundary x = m * eff (m = 0.25 ... 5, the bf16
    values within a few ulps of it), at many block scales and non-power-of-two global scales:
    where the BF16 kernel's per-block thresholds must agree with RN(x / eff) bit for bit."""
    from inkling_ckpt.formats.encodings import E4M3, decode_table

    g = torch.Generator().manual_seed(5)
    table = decode_table(E4M3)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    for s2 in (0.0123456789, 3.3e-5, 7.77, 1.0 / 2688.0, 2.0**-50 * 1.37):
        s2 = float(torch.tensor(s2, dtype=torch.float32))
        nblk = 512
        sbf = table[torch.randint(1, 127, (nblk,), generator=g)]
        eff = sbf * s2  # float32, as the codec computes it
        k = torch.randint(0, 7, (nblk, 15), generator=g)
        centre = (mids[k] * eff[:, None]).to(torch.bfloat16).view(torch.int16)
        near = (centre + torch.randint(-3, 4, (nblk, 15), generator=g, dtype=torch.int16)).view(torch.bfloat16).float()
        near *= torch.where(torch.rand(nblk, 15, generator=g) < 0.5, -1.0, 1.0)
        top = (6.0 * eff).to(torch.bfloat16).float()  # block amax: the block scale rounds to sbf
        x = torch.cat([top[:, None], near], 1).reshape(64, -1)
        _check("nvfp4", {}, x.bfloat16(), weight_scale_2=s2)
    _check("nvfp4", {}, x.bfloat16())


# -- stacked experts (formats.stacked): batched kernels and device slices ------------------------

STACKED = [("nvfp4", {}), ("mxfp8", {}), ("mxfp8", {"scale_mode": "floor"})]
STACKED_IDS = ["nvfp4", "mxfp8-rceil", "mxfp8-floor"]


def _experts(e=5, r=16, c=128, dtype=torch.bfloat16, seed=0):
    """Experts of very different ranges, an all-zero one and one of fp32-subnormal size (amax -> 1.0)."""
    w = torch.stack([_wide_range(r, c, seed=seed + i, dtype=torch.float32) for i in range(e)])
    w[1] *= 1e-4
    w[2] = 0
    if dtype == torch.float32:
        w[3] = torch.randn(r, c) * 1e-40  # subnormal amax: stored as 1.0
    return w.to(dtype)


def _ref_stacked(fmt, w, **kw):
    from inkling_ckpt.formats.stacked import encode_stacked

    with gpu.kernels_disabled():
        return encode_stacked(fmt, w.cpu(), **kw)


def _ref_stacked_decode(fmt, parts, dtype, **kw):
    from inkling_ckpt.formats.stacked import decode_stacked

    with gpu.kernels_disabled():
        return decode_stacked(fmt, {k: v.cpu() for k, v in parts.items()}, dtype, **kw)


def _stacked_error(fn, *a, **kw) -> str:
    with pytest.raises(NonFiniteError) as ei:
        fn(*a, **kw)
    return str(ei.value)


@pytest.mark.parametrize("name,opts", STACKED, ids=STACKED_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_stacked_kernels_match_the_reference(name, opts, dtype, kernels):
    from inkling_ckpt.formats.stacked import AMAX, decode_stacked, encode_stacked

    fmt = get_format(name, **opts)
    w = _experts(dtype=dtype)
    want = _ref_stacked(fmt, w, name="w13")
    got = encode_stacked(fmt, w.to(DEV), name="w13")
    assert all(t.device.type == torch.device(DEV).type for t in got.values())
    _assert_same_parts(got, want, f"stacked {name}{opts} {dtype}")
    if name == "nvfp4":  # kept amax (a re-encode), and one that differs from the weights' own
        kept = want[AMAX] * torch.linspace(0.5, 2.0, w.shape[0])
        for a in (want[AMAX], kept):
            _assert_same_parts(encode_stacked(fmt, w.to(DEV), name="w13", amax=a.to(DEV)),
                               _ref_stacked(fmt, w, name="w13", amax=a), "kept amax")
            _assert_same_parts(encode_stacked(fmt, w.to(DEV), name="w13", amax=a),  # a host amax
                               _ref_stacked(fmt, w, name="w13", amax=a), "kept host amax")
    for out in (torch.bfloat16, torch.float32, torch.float16):
        dg = decode_stacked(name, got, out)
        assert _same_values(dg, _ref_stacked_decode(name, want, out)), f"decode {name} -> {out}"
    if name == "nvfp4":  # one denominator per expert (allowed by the layout), not all the same
        from inkling_ckpt.formats.stacked import DENOM

        per = dict(want, **{DENOM: torch.linspace(2000.0, 3000.0, w.shape[0])})
        dg = decode_stacked(name, {k: v.to(DEV) for k, v in per.items()}, torch.bfloat16)
        assert _same_values(dg, _ref_stacked_decode(name, per, torch.bfloat16)), "per-expert denominators"


@pytest.mark.parametrize("name,opts", STACKED, ids=STACKED_IDS)
def test_stacked_non_contiguous_and_sliced(name, opts, monkeypatch):
    """A strided stack (made contiguous in expert slices) and the device-slice path (host input,
    parts back on the host, tiny budget: one expert per slice) give the reference's bytes."""
    from inkling_ckpt.formats import stacked
    from inkling_ckpt.formats.stacked import decode_stacked, encode_stacked

    fmt = get_format(name, **opts)
    base = _experts(e=6, c=160, seed=4)
    w = base[:, :, 16:144]  # not contiguous
    want = _ref_stacked(fmt, w, name="w")
    monkeypatch.setattr(stacked, "_CONTIGUOUS_SLICE_BYTES", 1)  # one expert per slice
    got = encode_stacked(fmt, base.to(DEV)[:, :, 16:144], name="w")
    _assert_same_parts(got, want, "non-contiguous")
    sliced = encode_stacked(fmt, w, name="w", device=DEV, budget_bytes=1)
    assert all(t.device.type == "cpu" for t in sliced.values())
    _assert_same_parts(sliced, want, "device slices")
    _assert_same_parts(encode_stacked(fmt, w, name="w", device=DEV, budget_bytes=3 * 16 * 128 * 6), want, "3 per slice")
    ref = _ref_stacked_decode(name, want, torch.bfloat16)
    dec = decode_stacked(name, want, torch.bfloat16, device=DEV, budget_bytes=1)
    assert dec.device.type == "cpu" and _same_values(dec, ref)
    # strided weight and scales on the device (each a view into a wider tensor)
    wide = {k: v.to(DEV) for k, v in want.items()}
    strided = {k: (torch.cat([v, v], -1)[..., :v.shape[-1]] if v.dim() == 3 else v) for k, v in wide.items()}
    assert not strided["_scale"].is_contiguous()
    assert _same_values(decode_stacked(name, strided, torch.bfloat16), ref)


@pytest.mark.parametrize("name,opts", STACKED, ids=STACKED_IDS)
def test_stacked_nonfinite_refused_as_the_reference(name, opts, kernels):
    """NaN/Inf: the same NonFiniteError text as the CPU reference (first bad expert, index, count),
    whole, kept amax and device slices; allowed, the same bytes (NaN blocks)."""
    from inkling_ckpt.formats.stacked import encode_stacked

    fmt = get_format(name, **opts)
    w = _experts(e=4, seed=2)
    w[2, 3, 7] = float("nan")
    w[3, 0, 1] = float("inf")
    w[3, 5, 9] = float("-inf")
    want = _stacked_error(_ref_stacked, fmt, w, name="w13")
    assert _stacked_error(encode_stacked, fmt, w.to(DEV), name="w13") == want
    assert _stacked_error(encode_stacked, fmt, w, name="w13", device=DEV, budget_bytes=1) == want
    _assert_same_parts(encode_stacked(fmt, w.to(DEV), name="w13", allow_nonfinite=True),
                       _ref_stacked(fmt, w, name="w13", allow_nonfinite=True), "allowed")
    if name == "nvfp4":
        a = torch.full((4,), 3.0)
        want = _stacked_error(_ref_stacked, fmt, w, name="w13", amax=a)
        assert _stacked_error(encode_stacked, fmt, w.to(DEV), name="w13", amax=a.to(DEV)) == want
        _assert_same_parts(encode_stacked(fmt, w.to(DEV), name="w13", amax=a.to(DEV), allow_nonfinite=True),
                           _ref_stacked(fmt, w, name="w13", amax=a, allow_nonfinite=True), "allowed, kept")
        for bad in (0.0, -1.0, float("nan"), float("inf")):
            a = torch.full((4,), 3.0)
            a[1] = bad
            want = _stacked_error(_ref_stacked, fmt, w, name="w13", amax=a, allow_nonfinite=True)
            assert "expert 1" in want
            for amax in (a, a.to(DEV)):
                assert _stacked_error(encode_stacked, fmt, w.to(DEV), name="w13", amax=amax, allow_nonfinite=True) == want


@pytest.mark.parametrize("name", ["nvfp4", "mxfp8"])
def test_stacked_decode_bad_scales_as_the_reference(name):
    from inkling_ckpt.formats.stacked import AMAX, SCALE, decode_stacked

    parts = _ref_stacked(name, _experts(e=4), name="w")
    cases = [(SCALE, (1, 2, 3), 0xFF if name == "mxfp8" else 0x7F)]
    if name == "nvfp4":
        cases += [(SCALE, (2, 0, 1), 0xB8), (AMAX, (3,), float("nan")), (AMAX, (0,), 0.0), (AMAX, (2,), -2.0)]
    for part, idx, v in cases:
        bad = {k: t.clone() for k, t in parts.items()}
        if part == SCALE:
            bad[part].view(torch.uint8)[idx] = v
            bad[part].view(torch.uint8)[3, 0, 0] = v  # a later one: the first is named
        else:
            bad[part][idx] = v
        want = _stacked_error(_ref_stacked_decode, name, bad, torch.bfloat16, name="w")
        dev = {k: t.to(DEV) for k, t in bad.items()}
        assert _stacked_error(decode_stacked, name, dev, torch.bfloat16, name="w") == want
        assert _stacked_error(decode_stacked, name, bad, torch.bfloat16, name="w", device=DEV, budget_bytes=1) == want
        got = decode_stacked(name, dev, torch.bfloat16, name="w", allow_nonfinite=True)
        assert _same_values(got, _ref_stacked_decode(name, bad, torch.bfloat16, allow_nonfinite=True))


def test_stacked_dispatch_is_batched(monkeypatch):
    """CUDA stacks reach the kernels in one launch per op for all experts (no per-expert codec calls)."""
    from inkling_ckpt.formats.gpu import ops
    from inkling_ckpt.formats.stacked import decode_stacked, encode_stacked

    calls = []
    for fn in ("group_amax", "nvfp4_encode", "nvfp4_encode_from_amax", "mxfp8_encode", "nvfp4_decode", "mxfp8_decode"):
        orig = getattr(ops, fn)

        def wrap(*a, _orig=orig, _fn=fn, **k):
            calls.append(_fn)
            return _orig(*a, **k)

        monkeypatch.setattr(ops, fn, wrap)
    w = _experts(e=7).to(DEV)
    for name in ("nvfp4", "mxfp8"):
        decode_stacked(name, encode_stacked(name, w))
    assert calls == ["group_amax", "nvfp4_encode_from_amax", "nvfp4_decode", "mxfp8_encode", "mxfp8_decode"], calls
