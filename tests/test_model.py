"""The model table: config parsing, precision plans, the tensor inventory and quant configs."""

from __future__ import annotations

import pytest
import torch

from inkling_ckpt.errors import ConfigError, PlanError
from inkling_ckpt.model.config import InklingConfig
from inkling_ckpt.model.inventory import Category, expert_linears, inventory, match_name, module_layer
from inkling_ckpt.model.precision import PrecisionPlan
from inkling_ckpt.model.presets import preset_config
from inkling_ckpt.model.quant_config import build_quant_configs, plan_from_quant_config

FULL = InklingConfig.from_dict(preset_config("full"))
TINY = InklingConfig.from_dict(preset_config("tiny"))
MIXED_FULL = PrecisionPlan.parse("0-39:nvfp4,40-47:mxfp8", 48)


def test_plan_parse_and_print_round_trip():
    p = PrecisionPlan.parse("0-39:nvfp4,40-47:mxfp8", 48)
    assert p.format_of(0) == "nvfp4" and p.format_of(39) == "nvfp4" and p.format_of(40) == "mxfp8"
    assert str(p) == "0-39:nvfp4,40-47:mxfp8"
    assert p.variant == "mixed"
    assert str(PrecisionPlan.parse("mxfp8", 4)) == "0-3:mxfp8"
    assert PrecisionPlan.parse("mxfp8", 4).variant == "mxfp8"
    # uncovered layers stay BF16
    assert PrecisionPlan.parse("1:nvfp4", 3).formats == ("bf16", "nvfp4", "bf16")


@pytest.mark.parametrize("text,msg", [
    ("0-4:nvfp4", "names layer 4"),
    ("0-1:fp4", "known formats"),
    ("0-1:nvfp4,1-3:mxfp8", "twice"),
    ("3-1:nvfp4", "backwards"),
    ("a-b", "FIRST-LAST:FORMAT"),
    ("", "empty"),
])
def test_plan_errors(text, msg):
    with pytest.raises(PlanError, match=msg):
        PrecisionPlan.parse(text, 4)


def test_full_size_parameter_counts_match_the_release():
    specs = inventory(FULL, PrecisionPlan.uniform("bf16", 48))
    params = {c: 0 for c in Category}
    for s in specs:
        params[s.category] += s.nbytes // s.dtype.itemsize
    experts = params[Category.EXPERTS]
    assert experts == 48 * 384 * 3 * 2304 * 4608  # 587.07B
    assert round(experts / 1e9, 2) == 587.07
    text_total = sum(v for c, v in params.items() if c is not Category.VISION)
    assert 593.5e9 < text_total < 594.5e9  # "about 594B"


@pytest.mark.parametrize("variant,gb", [("0-39:nvfp4,40-47:mxfp8", 394), ("mxfp8", 623)])
def test_full_size_checkpoint_bytes_match_the_release(variant, gb):
    plan = PrecisionPlan.parse(variant, 48)
    total = sum(s.nbytes for s in inventory(FULL, plan))
    assert abs(total / 1e9 - gb) < 2, total / 1e9


def test_inventory_expert_parts_follow_the_format():
    specs = {s.name: s for s in inventory(TINY, PrecisionPlan.parse("0-1:nvfp4,2-3:mxfp8", 4))}
    up0 = "model.language_model.layers.0.mlp.experts.3.up_proj"
    assert specs[f"{up0}.weight"].dtype == torch.uint8 and specs[f"{up0}.weight"].shape == (64, 128)
    assert specs[f"{up0}.weight_scale"].dtype == torch.float8_e4m3fn and specs[f"{up0}.weight_scale"].shape == (64, 16)
    assert specs[f"{up0}.weight_scale_2"].shape == () and specs[f"{up0}.input_scale"].shape == ()
    down2 = "model.language_model.layers.2.mlp.experts.7.down_proj"
    assert specs[f"{down2}.weight"].dtype == torch.float8_e4m3fn and specs[f"{down2}.weight"].shape == (256, 64)
    assert specs[f"{down2}.weight_scale"].dtype == torch.uint8 and specs[f"{down2}.weight_scale"].shape == (256, 2)
    assert f"{down2}.input_scale" not in specs


def test_convs_only_on_full_attention_layers():
    names = {s.name for s in inventory(TINY, PrecisionPlan.uniform("bf16", 4))}
    for i in range(4):
        has = f"model.language_model.layers.{i}.self_attn.k_conv.weight" in names
        assert has == (i % 4 == 3)
    assert "mtp.layers.0.self_attn.k_conv.weight" in names  # the MTP layer attends fully


def test_every_inventory_name_maps_back_to_its_row():
    for s in inventory(TINY, PrecisionPlan.parse("0-1:nvfp4,2-3:mxfp8", 4)):
        m = match_name(s.name)
        assert m is not None and m.row is s.row, s.name
        if s.layer is not None:
            assert m.indices["layer"] == s.layer
        assert m.part == s.part
    assert match_name("model.language_model.layers.0.mlp.experts.01.up_proj.weight") is None
    assert match_name("model.language_model.layers.0.self_attn.q_proj.bias") is None


def test_module_layer():
    assert module_layer("model.language_model.layers.41.mlp.experts.17.down_proj") == (41, 17, "down_proj")
    assert module_layer("model.language_model.layers.41.self_attn.q_proj") is None
    assert len(list(expert_linears(TINY, PrecisionPlan.uniform("bf16", 4)))) == 4 * 8 * 3


@pytest.mark.parametrize("plan", ["0-1:nvfp4,2-3:mxfp8", "mxfp8", "nvfp4", "1-2:mxfp8", "0:nvfp4,1-3:mxfp8"])
def test_quant_config_round_trip(plan):
    p = PrecisionPlan.parse(plan, 4)
    hf_quant, flat = build_quant_configs(TINY, p)
    assert plan_from_quant_config(TINY, hf_quant, None) == p
    assert plan_from_quant_config(TINY, None, flat) == p


def test_quant_config_mixed_is_modelopt_shaped():
    hf_quant, flat = build_quant_configs(TINY, PrecisionPlan.parse("0-1:nvfp4,2-3:mxfp8", 4))
    q = hf_quant["quantization"]
    assert q["quant_algo"] == "MIXED_PRECISION" and q["kv_cache_quant_algo"] is None
    assert q["quantized_layers"]["model.language_model.layers.3.mlp.experts.7.up_proj"] == {"quant_algo": "MXFP8", "group_size": 32}
    assert q["quantized_layers"]["model.language_model.layers.0.mlp.experts.0.gate_proj"] == {"quant_algo": "NVFP4", "group_size": 16}
    assert len(q["quantized_layers"]) == 4 * 8 * 3
    assert flat["quant_method"] == "modelopt" and flat["quantized_layers"] == q["quantized_layers"]
    assert build_quant_configs(TINY, PrecisionPlan.uniform("bf16", 4)) == (None, None)


def test_config_errors():
    cfg = preset_config("tiny")
    del cfg["text_config"]["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size"):
        InklingConfig.from_dict(cfg)
    cfg = preset_config("tiny")
    cfg["text_config"]["layer_types"] = cfg["text_config"]["layer_types"][:3]
    with pytest.raises(ConfigError, match="layer_types"):
        InklingConfig.from_dict(cfg)


def test_shipped_full_size_config_is_the_preset():
    import json
    from pathlib import Path

    shipped = json.loads((Path(__file__).resolve().parent.parent / "fixtures/full-size/config.json").read_text())
    assert shipped == preset_config("full")
