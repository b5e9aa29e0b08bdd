"""Stacked, interleaved experts in the release layout, checked against transformers' own dequantizer.

transformers 5.24's ``Inkling2LoopDequantizeExperts`` (core_model_loading.py) is the loader of the
Inkling 2 family's NVFP4/MXFP8 stacked experts: decoding must match it bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from _tiny_tf import transformers_or_skip
from inkling_ckpt.errors import FormatError, NonFiniteError
from inkling_ckpt.formats import get_format
from inkling_ckpt.formats.stacked import (
    AMAX, DENOM, NVFP4_DENOMINATOR, SCALE, WEIGHT, decode_stacked, deinterleave, encode_stacked, format_of_parts,
    interleave, stacked_parts,
)


def _w(e=6, r=32, c=64, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(e, r, c, generator=g) * scale
    w[1] *= 1e-3  # experts of very different ranges: per-expert global factors matter
    w[2, 3, :16] = 0  # an all-zero block
    return w.to(torch.bfloat16)


def _transformers_decode(parts, fmt, dtype=torch.bfloat16):
    transformers_or_skip()
    from transformers.core_model_loading import Inkling2LoopDequantizeExperts

    class _Model:  # the op asks the model for the target dtype
        def get_parameter(self, name):
            return torch.empty(0, dtype=dtype)

    names = ["w", "s", "a", "d"]
    inputs = {"w": parts[WEIGHT], "s": parts[SCALE]}
    if fmt == "nvfp4":
        inputs.update(a=parts[AMAX], d=parts[DENOM])
    out = Inkling2LoopDequantizeExperts().convert(inputs, names, ["t"], model=_Model(), full_layer_name="x")
    return out["t"]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_is_bit_identical_to_transformers(fmt, dtype):
    parts = encode_stacked(fmt, _w(scale=3.0), name="w13")
    ours = decode_stacked(fmt, parts, dtype)
    theirs = _transformers_decode(parts, fmt, dtype)
    assert ours.dtype == theirs.dtype == dtype
    assert torch.equal(ours.view(torch.uint8), theirs.contiguous().view(torch.uint8))


def _every_nvfp4_combination(amaxes):
    """NVFP4 parts whose expert x decodes every (scale byte, element-pair byte) combination with
    the global factor amaxes[x] / 2688: row s has scale byte s in each of its 32 blocks, and its
    256 weight bytes are 0..255."""
    e = len(amaxes)
    w = torch.arange(256, dtype=torch.uint8).expand(e, 256, 256).contiguous()
    sc = torch.arange(256, dtype=torch.uint8).view(1, 256, 1).expand(e, 256, 32).contiguous()
    return {WEIGHT: w, SCALE: sc.view(torch.float8_e4m3fn), AMAX: torch.tensor(amaxes, dtype=torch.float32),
            DENOM: torch.tensor(NVFP4_DENOMINATOR)}


# amax 2688: factor 1; 7.5: the release's typical range; 1e-38 (a float32 subnormal): products in
# the BF16/F32 subnormals or rounded to zero; 1e-6: F16 subnormals; 1e38: past the largest F16.
_AMAXES = [2688.0, 7.5, 1e-38, 1e-6, 3e-3, 1e38]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_nvfp4_cpu_tables_give_the_reference_bits_for_every_combination(dtype):
    """The CPU's per-expert tables against the reference's elementwise steps, bit for bit, NaN and
    negative scale bytes included; and both against transformers' own dequantizer."""
    from inkling_ckpt.formats.stacked import _decode_nvfp4_reference, _decode_nvfp4_tables, _factor

    parts = _every_nvfp4_combination(_AMAXES)
    factor = _factor((parts[AMAX], parts[DENOM].reshape(-1)))
    tables = _decode_nvfp4_tables(parts[WEIGHT], parts[SCALE], factor, dtype)
    reference = _decode_nvfp4_reference(parts[WEIGHT], parts[SCALE], factor, dtype)
    assert torch.equal(tables.view(torch.uint8), reference.view(torch.uint8))
    nan = torch.isnan(tables)
    assert nan.any() and (dtype != torch.float16 or torch.isinf(tables).any())  # the extremes were reached
    assert (tables == 0).any() and (tables.abs() < torch.finfo(dtype).tiny).logical_and(tables != 0).any()
    ours = decode_stacked("nvfp4", parts, dtype, allow_nonfinite=True)
    assert torch.equal(ours.view(torch.uint8), tables.view(torch.uint8))
    theirs = _transformers_decode(parts, "nvfp4", dtype).contiguous()
    # NaN where a scale byte is NaN (0x7F, 0xFF) in both, with other payloads in F16/F32 (theirs
    # casts the byte to float32); every other value the same bits
    assert torch.equal(nan, torch.isnan(theirs))
    assert torch.equal(ours[~nan].view(torch.uint8), theirs[~nan].view(torch.uint8))


def test_nvfp4_cpu_tables_read_strided_experts():
    from inkling_ckpt.formats.stacked import _decode_nvfp4_reference, _decode_nvfp4_tables, _factor

    parts = encode_stacked("nvfp4", _w(e=8, r=48, c=256), name="w")
    w, sc = parts[WEIGHT][::2], parts[SCALE][::2]  # every other expert: not one contiguous run
    factor = _factor((parts[AMAX][::2], parts[DENOM].reshape(-1)))
    assert torch.equal(_decode_nvfp4_tables(w, sc, factor, torch.bfloat16).view(torch.int16),
                       _decode_nvfp4_reference(w, sc, factor, torch.bfloat16).view(torch.int16))


def test_nvfp4_denominator_accepted_as_vector_on_read():
    parts = encode_stacked("nvfp4", _w(), name="w")
    vec = dict(parts, **{DENOM: torch.full((6,), NVFP4_DENOMINATOR)})
    assert torch.equal(decode_stacked("nvfp4", parts), decode_stacked("nvfp4", vec))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "bf16"])
def test_parts_match_the_release_table(fmt):
    spec = stacked_parts(fmt, (6, 32, 64))
    parts = encode_stacked(fmt, _w(), name="w")
    assert list(parts) == list(spec)
    assert {k: (tuple(v.shape), v.dtype) for k, v in parts.items()} == spec
    assert format_of_parts({k: dt for k, (_, dt) in spec.items()}) == fmt
    if fmt == "nvfp4":
        assert float(parts[DENOM]) == 2688.0 and parts[DENOM].shape == ()


def test_nvfp4_stacked_equals_per_expert_modelopt_encode():
    """Per expert: the same bytes as the reference codec with weight_scale_2 = amax / 2688."""
    w = _w()
    parts = encode_stacked("nvfp4", w, name="w")
    ref = get_format("nvfp4", fast=False)
    for e in range(w.shape[0]):
        p = ref.encode(w[e])
        assert torch.equal(p["weight"], parts[WEIGHT][e])
        assert torch.equal(p["weight_scale"].view(torch.uint8), parts[SCALE][e].view(torch.uint8))
        assert float(p["weight_scale_2"]) == float(parts[AMAX][e] / parts[DENOM])


def test_gate_and_up_share_one_global_factor_per_expert():
    gate, up = _w(seed=1), _w(seed=2) * 4
    w13 = interleave(gate, up)
    parts = encode_stacked("nvfp4", w13, name="w13")
    want = torch.maximum(gate.float().abs().amax(dim=(1, 2)), up.float().abs().amax(dim=(1, 2)))
    assert torch.equal(parts[AMAX], want)
    g, u = deinterleave(w13)
    assert torch.equal(g, gate) and torch.equal(u, up)
    # block scales are interleaved exactly like the rows: encoding gate alone gives the even rows
    gate_only = encode_stacked("mxfp8", gate, name="g")
    assert torch.equal(encode_stacked("mxfp8", w13, name="w")[SCALE][:, 0::2], gate_only[SCALE])


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(["nvfp4", "mxfp8"]), st.integers(0, 2**31 - 1), st.integers(1, 4))
def test_encode_decode_encode_is_stable(fmt, seed, e):
    """decode(encode(decode(q))) == decode(q); NVFP4 keeps its very bytes (up to the sign of zero).

    MXFP8 bytes may differ where a block's largest element rounded down (it re-encodes one scale
    lower, same values): the keep-scales paths restore those bytes from the reference.
    """
    parts = encode_stacked(fmt, _w(e=e + 2, seed=seed), name="w")
    values = decode_stacked(fmt, parts, torch.float32)
    again = encode_stacked(fmt, values, name="w", amax=parts.get(AMAX))
    assert torch.equal(decode_stacked(fmt, again, torch.float32).abs(), values.abs())
    if fmt == "mxfp8":
        return
    for k in parts:
        a, b = parts[k], again[k]
        if k == WEIGHT and fmt == "nvfp4":
            # -0 codes (0x8) decode to -0.0, which encodes as +0 (0x0): compare magnitudes there
            a, b = a & 0x77, b & 0x77
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                           b.view(torch.uint8) if b.dtype != torch.float32 else b), k


def test_slices_decode_like_the_whole():
    parts = encode_stacked("nvfp4", _w(), name="w")
    whole = decode_stacked("nvfp4", parts)
    part = {k: (v if v.dim() == 0 else v[2:5]) for k, v in parts.items()}
    assert torch.equal(decode_stacked("nvfp4", part), whole[2:5])


def test_all_zero_expert_stores_a_usable_amax():
    w = _w()
    w[0] = 0
    parts = encode_stacked("nvfp4", w, name="w")
    assert float(parts[AMAX][0]) == 1.0
    assert torch.count_nonzero(decode_stacked("nvfp4", parts)[0]) == 0


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_nvfp4_global_factor_is_refused_unless_allowed(bad):
    parts = encode_stacked("nvfp4", _w(), name="layers.0.w13_weight")
    parts[AMAX] = parts[AMAX].clone()
    parts[AMAX][3] = bad
    with pytest.raises(NonFiniteError, match="expert 3"):
        decode_stacked("nvfp4", parts, name="layers.0.w13_weight")
    decode_stacked("nvfp4", parts, allow_nonfinite=True)


@pytest.mark.parametrize("byte", [0xFF, 0x7F, 0xB8])
def test_bad_block_scales_are_refused_naming_the_block(byte):
    fmt = "mxfp8" if byte == 0xFF else "nvfp4"
    parts = encode_stacked(fmt, _w(), name="w")
    sc = parts[SCALE].clone()
    sc.view(torch.uint8)[1, 2, 1] = byte
    parts[SCALE] = sc
    with pytest.raises(NonFiniteError, match=r"\(1, 2, 1\)"):
        decode_stacked(fmt, parts, name="w")


def test_no_silent_casts_and_bad_shapes():
    with pytest.raises(FormatError, match="not torch.bfloat16"):
        encode_stacked("bf16", _w().float(), name="w")
    with pytest.raises(FormatError, match="block size 16"):
        stacked_parts("nvfp4", (2, 4, 24))
    with pytest.raises(FormatError, match="float32"):
        encode_stacked("nvfp4", _w(), name="w", amax=torch.ones(6, dtype=torch.float64))


def test_encode_nonfinite_expert_is_named_or_allowed():
    """NaN in one expert: NonFiniteError naming the expert and index; allowed, the amax of its finite values."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 8, 32, generator=g).bfloat16()
    x[1, 5, 7] = float("nan")
    with pytest.raises(NonFiniteError, match=r"w13\[expert 1\].*\(5, 7\)"):
        encode_stacked("nvfp4", x, name="w13")
    parts = encode_stacked("nvfp4", x, name="w13", allow_nonfinite=True)
    finite = torch.where(torch.isfinite(x[1].float()), x[1].float().abs(), 0).amax()
    assert float(parts["_amax"][1]) == float(finite)
    assert torch.equal(parts["_amax"][[0, 2]], x[[0, 2]].float().abs().amax(dim=(1, 2)))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_budgeted_slices_give_the_same_parts_and_errors(fmt):
    """budget_bytes works in expert slices (here on the CPU, one or two experts at a time): the
    same parts, the same decode, the same errors as the whole stack."""
    w = _w(e=5)
    whole = encode_stacked(fmt, w, name="w")
    for budget in (1, 2 * 32 * 64 * 5):
        sliced = encode_stacked(fmt, w, name="w", budget_bytes=budget, device="cpu")
        assert list(sliced) == list(whole)
        for k in whole:
            assert torch.equal(sliced[k].reshape(-1).view(torch.uint8), whole[k].reshape(-1).view(torch.uint8)), k
        assert torch.equal(decode_stacked(fmt, whole, budget_bytes=budget).view(torch.int16),
                           decode_stacked(fmt, whole).view(torch.int16))
    bad = w.clone()
    bad[3, 1, 2] = float("inf")
    bad[4, 0, 0] = float("nan")
    with pytest.raises(NonFiniteError) as want:
        encode_stacked(fmt, bad, name="w")
    with pytest.raises(NonFiniteError) as got:
        encode_stacked(fmt, bad, name="w", budget_bytes=1)
    assert str(got.value) == str(want.value)
    assert ("w[expert 3]" in str(want.value)) == (fmt == "nvfp4")
    sc = whole[SCALE].clone()
    sc.view(torch.uint8)[2, 0, 1] = 0xFF
    with pytest.raises(NonFiniteError, match=r"\(2, 0, 1\)"):
        decode_stacked(fmt, dict(whole, **{SCALE: sc}), name="w", budget_bytes=1)


def test_device_and_dtype_arguments_are_checked():
    with pytest.raises(FormatError, match="cannot quantize dtype torch.float64"):
        encode_stacked("nvfp4", _w().double(), name="w")
    with pytest.raises(FormatError, match="cannot quantize dtype torch.int32"):
        encode_stacked("mxfp8", torch.ones(2, 4, 32, dtype=torch.int32), name="w")
    with pytest.raises(FormatError, match="budget_bytes"):
        encode_stacked("nvfp4", _w(), name="w", budget_bytes=0)
    with pytest.raises(FormatError, match="unknown device"):
        encode_stacked("nvfp4", _w(), name="w", device="nowhere")
    if not torch.cuda.is_available():
        with pytest.raises(FormatError, match="CUDA is not available"):
            decode_stacked("nvfp4", encode_stacked("nvfp4", _w(), name="w"), device="cuda")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_unchanged_blocks_are_found_band_by_band_as_in_one_go(fmt, monkeypatch):
    """The keep-bytes rule compares the decoded reference with the new values a band of rows at a
    time on the CPU (bounded memory): the same blocks are taken from the reference as when the
    whole slice is compared at once, whatever the band."""
    from inkling_ckpt.convert import experts

    ref = encode_stacked(fmt, _w(e=3, seed=5), name="w")
    x = decode_stacked(fmt, ref, torch.bfloat16).clone()
    x[0, 1, :16] += 1.0  # some blocks changed, the rest equal to the reference's values
    x[2, 5:9, 32:48] *= 3
    new = encode_stacked(fmt, x, name="w", amax=ref.get(AMAX))
    monkeypatch.setattr(experts, "CHECK_BYTES", 1 << 40)
    whole = experts.reuse_unchanged_blocks(fmt, x, new, ref)
    for rows_at_once in (1, 3, 7):
        monkeypatch.setattr(experts, "CHECK_BYTES", rows_at_once * 3 * x.shape[-1] * 2)
        banded = experts.reuse_unchanged_blocks(fmt, x, new, ref)
        for k in whole:
            assert torch.equal(banded[k].reshape(-1).view(torch.uint8), whole[k].reshape(-1).view(torch.uint8)), \
                (k, rows_at_once)
    kept = whole[SCALE].view(torch.uint8) == ref[SCALE].view(torch.uint8)
    assert bool(kept.any()) and not bool(kept.all())
    # Nothing changed (a round trip): the reference's bytes, in tensors of their own.
    values = decode_stacked(fmt, ref, torch.bfloat16)
    again = experts.reuse_unchanged_blocks(fmt, values, encode_stacked(fmt, values, name="w", amax=ref.get(AMAX)), ref)
    for k in (WEIGHT, SCALE):
        assert torch.equal(again[k].view(torch.uint8), ref[k].view(torch.uint8)), k
        assert again[k].data_ptr() != ref[k].data_ptr()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8", "bf16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_into_a_given_buffer_gives_the_fresh_decode(fmt, dtype, device):
    """``out=`` (a unit decodes its pieces into one buffer): every element written, the same bits
    as a fresh decode, whole or in budgeted slices, and the buffer's memory returned."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    w = _w(e=5)
    parts = {WEIGHT: w} if fmt == "bf16" else encode_stacked(fmt, w, name="w")
    parts = {k: v.to(device) for k, v in parts.items()}
    want = decode_stacked(fmt, parts, dtype)
    for budget in (None, 2 * 32 * 64 * 5):
        buf = torch.full(want.shape, float("nan"), dtype=dtype, device=device)  # leftovers must not show
        got = decode_stacked(fmt, parts, dtype, out=buf, budget_bytes=budget)
        assert got.data_ptr() == buf.data_ptr()
        assert torch.equal(got.view(torch.int16 if dtype.itemsize == 2 else torch.int32),
                           want.view(torch.int16 if dtype.itemsize == 2 else torch.int32))


def test_a_decode_buffer_of_another_shape_dtype_or_layout_is_refused():
    parts = encode_stacked("mxfp8", _w(e=3), name="w")
    for bad, what in ((torch.empty(3, 32, 63), r"float32 \[3, 32, 63\]"), (torch.empty(3, 32, 64, dtype=torch.bfloat16), "bfloat16"),
                      (torch.empty(3, 64, 32).transpose(1, 2), "not contiguous"), ("buffer", "str")):
        with pytest.raises(FormatError, match=f"w: out must be a contiguous torch.float32 \\[3, 32, 64\\] on cpu, got .*{what}"):
            decode_stacked("mxfp8", parts, torch.float32, name="w", out=bad)
    with pytest.raises(FormatError, match="out must be"):
        decode_stacked("bf16", {WEIGHT: _w(e=3)}, torch.float32, name="w", out=torch.empty(3, 32, 64).transpose(1, 2))
    flat = {"weight": parts[WEIGHT][0], "weight_scale": parts[SCALE][0]}  # the per-tensor codec checks its own
    with pytest.raises(FormatError, match=r"mxfp8: out must be a contiguous torch.float32 \[32, 64\] on cpu, got .*\[64, 32\]"):
        get_format("mxfp8").decode(flat, torch.float32, out=torch.empty(64, 32))
