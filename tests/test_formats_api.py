"""The formats package surface: registry, bf16, compressed-tensors naming, fake_quant."""

from __future__ import annotations

import pytest
import torch

from inkling_ckpt.errors import FormatError, NonFiniteError
from inkling_ckpt.formats import (
    FORMAT_NAMES,
    Format,
    fake_quant,
    from_compressed_tensors,
    get_format,
    nvfp4_global_scale,
    to_compressed_tensors,
)

BF = torch.bfloat16


def test_registry():
    assert FORMAT_NAMES == ("bf16", "nvfp4", "mxfp8")
    expect = {"bf16": (1, None), "nvfp4": (16, "NVFP4"), "mxfp8": (32, "MXFP8")}
    for name in FORMAT_NAMES:
        f = get_format(name)
        assert isinstance(f, Format) and f.name == name
        assert (f.block, f.quant_algo) == expect[name]
    assert get_format("NVFP4").name == "nvfp4"
    f = get_format("mxfp8", scale_mode="floor")
    assert (f.scale_mode, f.element) == ("floor", "e4m3")
    assert get_format(f) is f


def test_unknown_format_lists_known_names():
    with pytest.raises(FormatError, match="fp4.*bf16, nvfp4, mxfp8"):
        get_format("fp4")
    with pytest.raises(FormatError, match="options"):
        get_format("nvfp4", scale_mode="floor")


def test_bf16_format():
    f = get_format("bf16")
    x = torch.randn(3, 5).to(BF).t()
    p = f.encode(x)
    assert list(p) == ["weight"] and p["weight"].is_contiguous() and torch.equal(p["weight"], x)
    assert f.parts((5, 3)) == {"weight": ((5, 3), BF)}
    assert f.decode(p, torch.float32).dtype == torch.float32
    with pytest.raises(FormatError, match=r"float32.*bfloat16"):
        f.encode(torch.randn(2, 2))
    with pytest.raises(FormatError):
        f.encode(x, weight_scale_2=1.0)
    bad = torch.zeros(4, 4, dtype=BF)
    bad[1, 2] = float("nan")
    with pytest.raises(NonFiniteError, match=r"emb.*\(1, 2\)"):
        f.encode(bad, name="emb")
    assert torch.isnan(f.encode(bad, allow_nonfinite=True)["weight"][1, 2])
    with pytest.raises(FormatError):
        f.decode({"weight": torch.zeros(2)})


def test_compressed_tensors_naming_round_trip():
    nv = get_format("nvfp4")
    p = nv.encode(torch.randn(4, 32, dtype=BF), input_scale=0.25)
    ct = to_compressed_tensors(p)
    assert set(ct) == {"weight_packed", "weight_scale", "weight_global_scale", "input_global_scale"}
    assert ct["weight_global_scale"].shape == (1,) and ct["input_global_scale"].item() == 4.0
    assert ct["weight_global_scale"].item() == (1.0 / p["weight_scale_2"]).item()
    back = from_compressed_tensors(ct)
    assert set(back) == set(p) and back["weight_scale_2"].shape == ()
    assert torch.equal(back["weight"], p["weight"]) and torch.equal(back["weight_scale"].view(torch.uint8), p["weight_scale"].view(torch.uint8))
    # exact fp32 reciprocal (may differ from the original by an ulp: 1/(1/s) != s in general)
    assert back["weight_scale_2"].item() == (torch.tensor(1.0) / ct["weight_global_scale"].reshape(())).item()
    assert torch.allclose(nv.decode(back, torch.float32), nv.decode(p, torch.float32), rtol=1e-6)


def test_from_compressed_tensors_accepts_scalar_shapes_and_passes_others():
    gs = nvfp4_global_scale(3.0)
    ct = {"weight_packed": torch.zeros(2, 8, dtype=torch.uint8), "weight_global_scale": (1 / gs).reshape(1),
          "weight_scale": torch.zeros(2, 1, dtype=torch.float8_e4m3fn), "bias": torch.ones(2)}
    out = from_compressed_tensors(ct)
    assert out["weight_scale_2"].shape == () and "bias" in out and "input_scale" not in out
    ct["weight_global_scale"] = (1 / gs).reshape(())
    assert from_compressed_tensors(ct)["weight_scale_2"].shape == ()
    with pytest.raises(FormatError):
        from_compressed_tensors({**ct, "weight_global_scale": torch.ones(2)})
    with pytest.raises(FormatError):
        from_compressed_tensors({**ct, "weight": torch.zeros(1)})


def test_fake_quant_bf16_and_names():
    x = torch.randn(4, 64, requires_grad=True)
    y = fake_quant("bf16", x)
    assert torch.equal(y.detach(), x.detach().to(BF).float())
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    with pytest.raises(FormatError):
        fake_quant("int4", x)
    with pytest.raises(FormatError, match="the format comes first"):
        fake_quant(x, "bf16")  # the old (x, fmt) order is refused, not misread


@pytest.mark.parametrize("name", ["nvfp4", "mxfp8", "bf16"])
def test_empty_rows(name):
    f = get_format(name)
    x = torch.zeros(0, 64, dtype=BF)
    p = f.encode(x)
    for k, (shape, dt) in f.parts(x.shape).items():
        assert tuple(p[k].shape) == shape and p[k].dtype == dt
    assert f.decode(p).shape == (0, 64)
    if name != "bf16":
        assert len(f.encode_group([x, x])) == 2


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_bf16_encode_finds_a_non_finite_value_in_any_chunk(bad):
    """The BF16 finiteness check (a min/max reduction per chunk) sees NaN and ±inf past the first chunk."""
    from inkling_ckpt.errors import NonFiniteError
    from inkling_ckpt.formats.bf16 import BF16Format

    x = torch.zeros(2, (1 << 23) + 5, dtype=torch.bfloat16)  # two chunks of 2^24 elements and a bit
    x[1, -1] = bad
    with pytest.raises(NonFiniteError, match=r"index \(1, 8388612\)"):
        BF16Format().encode(x, name="w")
    assert BF16Format().encode(x, name="w", allow_nonfinite=True)["weight"] is not None
