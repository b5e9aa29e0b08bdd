"""quantize / dequantize / inspect / make-fixture on the release layout, with transformers as the oracle."""

from __future__ import annotations

import json

import pytest
import torch

from _tiny_tf import load, logits, save_tiny, transformers_or_skip
from conftest import TINY, TINY_PLAN, oracle, same_files
from inkling_ckpt.convert.experts import decode_slice
from inkling_ckpt.layouts.hf import HFCheckpoint
from inkling_ckpt.model.inventory import expert_stacks


@pytest.mark.parametrize("variant,plan", [("mixed", TINY_PLAN), ("mxfp8", "mxfp8")])
def test_quantize_bf16_fixture_reproduces_bundled_variant_byte_for_byte(cli, tmp_path, variant, plan):
    code, out, err = cli("quantize", TINY["bf16"], tmp_path / "q", "--plan", plan, "--max-shard-size", "2MB", "-q")
    assert code == 0, err
    assert same_files(TINY[variant], tmp_path / "q") == []


@pytest.mark.parametrize("variant", ["bf16", "mixed", "mxfp8"])
def test_make_fixture_is_deterministic_and_matches_bundled(cli, tmp_path, variant):
    code, _, err = cli("make-fixture", tmp_path / "f", "--variant", variant, "-q")
    assert code == 0, err
    assert same_files(TINY[variant], tmp_path / "f") == []


@pytest.mark.parametrize("variant,expected_plan", [("bf16", "0-3:bf16"), ("mixed", TINY_PLAN), ("mxfp8", "0-3:mxfp8")])
def test_inspect_lists_exactly_the_stored_tensors(cli, variant, expected_plan):
    code, out, err = cli("inspect", TINY[variant], "--json")
    assert code == 0, err
    info = json.loads(out)
    ckpt = HFCheckpoint.open(TINY[variant])
    assert info["precision_plan"] == expected_plan and info["variant"] == variant
    assert info["tensors"] == len(ckpt.tensors) == len(ckpt.expected())
    assert info["bytes"] == sum(t.nbytes for t in ckpt.tensors.values())
    code, text, _ = cli("inspect", TINY[variant])
    assert code == 0 and f"variant {variant}" in text


def test_mixed_layout_has_no_quantization_config_and_mxfp8_has_fine_grained_fp8():
    mixed = json.loads((TINY["mixed"] / "config.json").read_text())
    mx = json.loads((TINY["mxfp8"] / "config.json").read_text())
    assert "quantization_config" not in mixed
    qc = mx["quantization_config"]
    assert (qc["quant_method"], qc["weight_block_size"], qc["scale_fmt"]) == ("fp8", [1, 32], "ue8m0")
    assert "model.llm.layers.*.attn" in qc["modules_to_not_convert"]
    for folder in TINY.values():
        assert not (folder / "hf_quant_config.json").exists()
    # every other key of the source config is kept verbatim
    bf16 = json.loads((TINY["bf16"] / "config.json").read_text())
    assert {k: v for k, v in mx.items() if k != "quantization_config"} == bf16 == mixed


def test_non_expert_tensors_untouched_and_experts_decode_close():
    bf16, mixed = HFCheckpoint.open(TINY["bf16"]), HFCheckpoint.open(TINY["mixed"])
    for name, st in mixed.tensors.items():
        if "mlp.experts" not in name:
            assert st.dtype == bf16.tensors[name].dtype
            assert torch.equal(bf16.get(name).view(torch.uint8), mixed.get(name).view(torch.uint8)), name
    floor = {"nvfp4": 18.0, "mxfp8": 29.0}
    for stack in expert_stacks(mixed.cfg, mixed.plan):
        ref = next(s for s in expert_stacks(bf16.cfg, bf16.plan, stack.layer) if s.key == stack.key)
        a = decode_slice(bf16, ref, 0, stack.shape[0]).float()
        b = decode_slice(mixed, stack, 0, stack.shape[0]).float()
        sqnr = 10 * torch.log10((a * a).sum() / ((a - b) ** 2).sum())
        assert sqnr > floor[stack.fmt], (stack.name, float(sqnr))


def test_dequantize_gives_bf16_layout_that_transformers_loads(cli, tmp_path):
    code, _, err = cli("dequantize", TINY["mixed"], tmp_path / "d", "-q")
    assert code == 0, err
    ckpt = HFCheckpoint.open(tmp_path / "d")
    assert ckpt.plan.variant == "bf16"
    assert "quantization_config" not in json.loads((tmp_path / "d" / "config.json").read_text())
    model, info = load(tmp_path / "d")
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert torch.isfinite(logits(model)).all()


def test_transformers_checkpoint_quantize_dequantize_round_trip(cli, tmp_path):
    """save_pretrained → quantize → dequantize → from_pretrained: no missing/unexpected keys; the
    non-expert weights are bit-identical and the experts equal our decode of the quantized file."""
    src = save_tiny(tmp_path / "src")
    assert cli("quantize", src, tmp_path / "q", "--plan", "0-1:nvfp4,2-3:mxfp8", "-q")[0] == 0
    assert cli("dequantize", tmp_path / "q", tmp_path / "d", "-q")[0] == 0
    orig, _ = load(src)
    deq, info = load(tmp_path / "d")
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    q = HFCheckpoint.open(tmp_path / "q")
    sd_o, sd_d = orig.state_dict(), deq.state_dict()
    for name, t in sd_o.items():
        if ".mlp.experts." not in name:
            assert torch.equal(t, sd_d[name]), name
    for stack in expert_stacks(q.cfg, q.plan):
        ours = decode_slice(q, stack, 0, stack.shape[0])
        key = f"model.language_model.layers.{stack.layer}.mlp.experts." + ("gate_up_proj" if stack.key == "w13" else "down_proj")
        theirs = sd_d[key]
        if stack.key == "w13":  # transformers holds gate/up concatenated, not interleaved
            theirs = torch.stack([theirs[:, : theirs.shape[1] // 2], theirs[:, theirs.shape[1] // 2:]], 2).reshape(ours.shape)
        assert torch.equal(ours, theirs), stack.name


def test_quantize_of_a_bf16_release_checkpoint_keeps_bf16_logits_for_bf16_layers(cli, tmp_path):
    """A plan that leaves every layer BF16 is a byte-for-byte copy: identical logits in transformers."""
    src = save_tiny(tmp_path / "src")
    assert cli("quantize", src, tmp_path / "q", "--plan", "bf16", "-q")[0] == 0
    a, _ = load(src)
    b, _ = load(tmp_path / "q")
    assert torch.equal(logits(a), logits(b))


def test_mxfp8_scales_line_up_with_interleaved_rows_in_transformers(tmp_path, cli):
    """transformers' FineGrainedFP8 path renames w13_weight_scale → gate_up_proj_scale_inv with the same
    interleave as the weight: decoding its gate half equals our decode's even rows."""
    transformers_or_skip()
    from transformers.core_model_loading import Interleave

    ckpt = HFCheckpoint.open(TINY["mxfp8"])
    stack = next(expert_stacks(ckpt.cfg, ckpt.plan, 0))
    w, sc = ckpt.get(stack.name), ckpt.get(stack.name + "_scale")
    op = Interleave(dim=1)
    tw = op.convert({"w": w.view(torch.uint8)}, ["w"], ["t"])["t"].view(torch.float8_e4m3fn)
    ts = op.convert({"s": sc}, ["s"], ["t"])["t"]
    values = tw.float() * torch.exp2(ts.float() - 127).repeat_interleave(32, dim=-1)
    ours = decode_slice(ckpt, stack, 0, stack.shape[0]).float()
    f = ours.shape[1] // 2
    assert torch.equal(values[:, :f], ours[:, 0::2]) and torch.equal(values[:, f:], ours[:, 1::2])


@pytest.mark.gpu
def test_mxfp8_fixture_loads_quantized_through_fine_grained_fp8(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: transformers' FineGrainedFP8 path dequantizes on CPU")
    oracle("accelerate", "accelerate (transformers needs it to load FP8 models)")
    model, info = load(TINY["mxfp8"])
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


def test_quantize_refuses_bad_plans_in_one_line(cli, tmp_path):
    code, _, err = cli("quantize", TINY["bf16"], tmp_path / "q", "--plan", "0-9:nvfp4")
    assert code != 0 and err.count("\n") == 1 and "layer 9" in err
    assert not (tmp_path / "q").exists()
