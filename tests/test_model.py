"""The model as data, checked against transformers 5.24's own Inkling 2 (the oracle)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from _tiny_tf import TEXT, save_tiny, tiny_config, transformers_or_skip
from conftest import FIXTURES
from inkling_ckpt.errors import CheckpointError, ConfigError
from inkling_ckpt.layouts.hf import DTYPE_TO_ST, HFCheckpoint
from inkling_ckpt.model.config import InklingConfig
from inkling_ckpt.model.inventory import detect_plan, inventory, match_name, parameter_count
from inkling_ckpt.model.precision import PrecisionPlan
from inkling_ckpt.model.presets import PRESETS, preset_config

FULL_CONFIG = FIXTURES / "full-size" / "config.json"


# ---- config --------------------------------------------------------------------------------------

def test_full_size_config_is_transformers_default():
    tf = transformers_or_skip()
    ours = json.loads(FULL_CONFIG.read_text())
    theirs = tf.Inkling2Config().to_dict()
    for key in ("text_config", "vision_config"):
        mine = {k: v for k, v in ours[key].items()}
        for k, v in theirs[key].items():
            if k in mine:
                assert mine[k] == v, (key, k)
    # and transformers reads our file to the same values
    assert tf.Inkling2Config.from_dict(ours).to_dict()["text_config"] == theirs["text_config"]


def test_aliases_are_read_and_unknown_keys_ignored():
    text = dict(preset_config("tiny")["text_config"])
    for alias, name in {"sliding_window": "sliding_window_size", "intermediate_size": "moe_intermediate_size",
                        "num_local_experts": "n_routed_experts", "sconv_kernel_size": "conv_kernel_size"}.items():
        text[alias] = text.pop(name)
    text["some_future_field"] = {"nested": [1, 2]}
    cfg = InklingConfig.from_dict({"text_config": text})
    ref = InklingConfig.from_dict(preset_config("tiny"))
    assert (cfg.sliding_window_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.conv_kernel_size) == (
        ref.sliding_window_size, ref.moe_intermediate_size, ref.n_routed_experts, ref.conv_kernel_size)


def test_aliases_agree_with_transformers():
    tf = transformers_or_skip()
    text = {**TEXT, "intermediate_size": 96, "sliding_window": 40}
    text.pop("moe_intermediate_size")
    text.pop("sliding_window_size")
    theirs = tf.Inkling2TextConfig(**text)
    ours = InklingConfig.from_dict({"text_config": text})
    assert (ours.moe_intermediate_size, ours.sliding_window_size) == (theirs.moe_intermediate_size, theirs.sliding_window_size)


@pytest.mark.parametrize("field", ["hidden_size", "unpadded_vocab_size", "swa_head_dim", "rel_extent", "d_rel"])
def test_missing_shape_field_is_one_line_error(field):
    text = dict(preset_config("tiny")["text_config"])
    text.pop(field)
    with pytest.raises(ConfigError, match=f"missing required field '{field}'"):
        InklingConfig.from_dict({"text_config": text})


@pytest.mark.parametrize("bad", [{"num_hidden_layers": "4"}, {"hidden_size": 2.5}, {"n_routed_experts": True},
                                 {"layer_types": "hybrid"}, {"layer_types": ["hybrid"] * 3},
                                 {"n_routed_experts": 10**12}, {"num_hidden_layers": 10**9},
                                 {"unpadded_vocab_size": 10**6}])
def test_wrong_types_and_absurd_sizes_are_refused(bad):
    text = {**preset_config("tiny")["text_config"], **bad}
    with pytest.raises(ConfigError):
        InklingConfig.from_dict({"text_config": text})


def test_layer_types_default_like_transformers():
    tf = transformers_or_skip()
    text = dict(preset_config("small")["text_config"])
    text.pop("layer_types")
    text["num_hidden_layers"] = 13
    ours = InklingConfig.from_dict({"text_config": text})
    assert list(ours.layer_types) == tf.Inkling2TextConfig(num_hidden_layers=13).layer_types
    # any value other than "hybrid_sliding" is a full layer, as in transformers
    text["layer_types"] = ["hybrid_sliding"] * 12 + ["whatever"]
    assert InklingConfig.from_dict({"text_config": text}).full_layers() == [12]


# ---- inventory against save_pretrained -------------------------------------------------------------

def _saved_tensors(path):
    from safetensors import safe_open

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                s = h.get_slice(k)
                out[k] = (tuple(s.get_shape()), s.get_dtype())
    return out


@pytest.mark.parametrize("bf16", [True, False])
def test_inventory_equals_what_save_pretrained_writes(tmp_path, bf16):
    """bf16=False: transformers' default save of a float32 model, experts F32 (read as the f32 format)."""
    saved = _saved_tensors(save_tiny(tmp_path / "m", bf16=bf16))
    ckpt = HFCheckpoint.open(tmp_path / "m")  # validates names, shapes, dtypes against the table
    assert ckpt.plan.variant == ("bf16" if bf16 else "f32")
    specs = ckpt.expected()
    assert {s.name: (s.shape, DTYPE_TO_ST[s.dtype]) for s in specs} == saved
    # the table's own dtypes (used for fresh checkpoints) are the bf16 release pattern
    fresh = {s.name: DTYPE_TO_ST[s.dtype] for s in inventory(ckpt.cfg, ckpt.plan) if not s.name.startswith("model.visual")}
    if bf16:
        assert fresh == {n: dt for n, (_, dt) in saved.items() if not n.startswith("model.visual")}


def test_every_name_maps_back_to_its_row_and_layer(tmp_path):
    ckpt = HFCheckpoint.open(save_tiny(tmp_path / "m"))
    for spec in ckpt.expected():
        if spec.row is None:
            continue
        hit = match_name(spec.name)
        assert hit is not None and hit.row is spec.row and hit.layer == spec.layer, spec.name
    # the attn_res index shift: attn_queries.{i-1} belongs to layer i, and layer 0 has none
    assert match_name("model.llm.attn_res.attn_queries.0").layer == 1
    assert "model.llm.attn_res.attn_queries.3" not in {s.name for s in ckpt.expected()}
    assert match_name("model.llm.layers.0.mlp.experts.w13_weight_amax").part == "_amax"
    assert match_name("model.llm.layers.0.mlp.shared_expert.weight") is None


def test_full_size_inventory_counts_and_parameters():
    """1,514 tensors (BF16 experts), 594,046,172,160 parameters, as transformers builds the model."""
    cfg = InklingConfig.from_file(FULL_CONFIG)
    bf16 = inventory(cfg, PrecisionPlan.uniform("bf16", 48))
    assert len(bf16) == 1514
    assert parameter_count(bf16, cfg) == 594_046_172_160
    assert sum(math.prod(s.shape) for s in bf16) == 594_050_641_920  # + 966 zero unembed rows × H + router biases
    assert len(inventory(cfg, PrecisionPlan.uniform("mxfp8", 48))) == 1610
    mixed = inventory(cfg, PrecisionPlan.parse("0-39:nvfp4,40-47:mxfp8", 48))
    assert parameter_count(mixed, cfg) == 594_046_172_160
    experts = sum(math.prod(s.shape) for s in bf16 if s.part == "")
    assert experts == 587_068_342_272


def test_full_size_parameters_match_transformers_meta_model():
    tf = transformers_or_skip()
    with torch.device("meta"):
        model = tf.Inkling2ForConditionalGeneration(tf.Inkling2Config.from_pretrained(FULL_CONFIG.parent))
    cfg = InklingConfig.from_file(FULL_CONFIG)
    assert sum(p.numel() for p in model.parameters()) == parameter_count(inventory(cfg, PrecisionPlan.uniform("bf16", 48)), cfg)


def _fake_shards(root, specs, per_file: int = 200):
    """Safetensors files holding only headers: sparse files of the promised size (no data written)."""
    from inkling_ckpt.layouts.hf import _st_header

    weight_map = {}
    for k in range(0, len(specs), per_file):
        chunk = specs[k:k + per_file]
        name = f"model-{k // per_file + 1:05d}.safetensors"
        header, offsets = _st_header([(s.name, s.shape, s.dtype) for s in chunk])
        with open(root / name, "wb") as f:
            f.write(header)
            f.truncate(len(header) + max(b for _, b in offsets.values()))
        weight_map.update({s.name: name for s in chunk})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("plan,count", [("bf16", 1514), ("mxfp8", 1610), ("0-39:nvfp4,40-47:mxfp8", 1770)])
def test_inspect_full_size_from_headers_only(tmp_path, cli, plan, count):
    root = tmp_path / "full"
    root.mkdir()
    (root / "config.json").write_text(FULL_CONFIG.read_text())
    cfg = InklingConfig.from_file(FULL_CONFIG)
    _fake_shards(root, inventory(cfg, PrecisionPlan.parse(plan, 48)))
    code, out, err = cli("inspect", root, "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["tensors"] == count and info["parameters"] == 594_046_172_160
    assert info["precision_plan"] == str(PrecisionPlan.parse(plan, 48))


def test_detect_plan_names_the_broken_layer():
    cfg = InklingConfig.from_dict(preset_config("tiny"))
    plan = PrecisionPlan.parse("0-1:nvfp4,2-3:mxfp8", 4)
    dtypes = {s.name: s.dtype for s in inventory(cfg, plan)}
    assert str(detect_plan(cfg, dtypes, "x")) == str(plan)
    del dtypes["model.llm.layers.1.mlp.experts.w2_weight_amax"]
    with pytest.raises(CheckpointError, match="layer 1 experts are in no known format"):
        detect_plan(cfg, dtypes, "x")
    dtypes = {s.name: s.dtype for s in inventory(cfg, plan)}
    dtypes["model.llm.layers.3.mlp.experts.w2_weight"] = torch.bfloat16
    del dtypes["model.llm.layers.3.mlp.experts.w2_weight_scale"]
    with pytest.raises(CheckpointError, match="layer 3 stores w13 as mxfp8 but w2 as bf16"):
        detect_plan(cfg, dtypes, "x")


@pytest.mark.parametrize("size", sorted(PRESETS))
def test_presets_build_in_transformers(size):
    tf = transformers_or_skip()
    config = preset_config(size)
    cfg = InklingConfig.from_dict(config)
    tcfg = tf.Inkling2Config.from_dict(config)
    with torch.device("meta"):
        model = tf.Inkling2ForConditionalGeneration(tcfg)
    assert sum(p.numel() for p in model.parameters()) == parameter_count(
        inventory(cfg, PrecisionPlan.uniform("bf16", cfg.num_hidden_layers)), cfg)


def test_tiny_fixture_config_round_trips_through_transformers():
    tf = transformers_or_skip()
    for v in ("bf16", "mixed", "mxfp8"):
        path = FIXTURES / f"tiny-{v}"
        ours = json.loads((path / "config.json").read_text())
        theirs = tf.Inkling2Config.from_pretrained(path).to_dict()
        for k, val in ours["text_config"].items():
            assert theirs["text_config"][k] == val, (v, k)
    assert tiny_config() is not None
