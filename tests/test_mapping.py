"""The release ⇄ torch_dist preset tables: coverage both ways, the spec's keys, transforms both ways.

The values are checked against transformers' own Inkling 2 module (the oracle): what a Megatron
key holds must equal the parameter transformers builds from the release tensor — in particular
``linear_fc1`` equals transformers' de-interleaved ``gate_up_proj``.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import FIXTURES, TINY
from inkling_ckpt.errors import CheckpointError, ConfigError
from inkling_ckpt.layouts.hf import HFCheckpoint
from inkling_ckpt.model.config import InklingConfig
from inkling_ckpt.model.inventory import EXPERTS, TEXT
from inkling_ckpt.model.mapping import (
    DENSE_CHUNK_BYTES, MILES, PRESETS, Copy, Experts, MegatronMapping, Preset, get_preset,
)

FULL = InklingConfig.from_file(FIXTURES / "full-size" / "config.json")


@pytest.fixture(scope="module")
def bf16() -> HFCheckpoint:
    return HFCheckpoint.open(TINY["bf16"])


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("where", ["tiny", "full"])
def test_every_release_tensor_maps_to_exactly_one_key(preset, where, bf16):
    cfg = bf16.cfg if where == "tiny" else FULL
    m = MegatronMapping(cfg, preset)  # raises ConfigError if the table and the inventory disagree
    names = m.release_names()
    assert sorted(e.hf for e in m.entries()) == sorted(names)  # a bijection: one key per release tensor
    assert len(set(m.keys())) == len(m.keys()) == len(names)
    assert not any(k.startswith("model.") for k in m.keys())
    assert m.hf_coverage(names).ok and m.megatron_coverage(m.keys()).ok
    for key in m.keys():
        assert m.entry_for_hf(m.entry(key).hf).key == key


def test_full_size_keys_follow_the_spec():
    m = MegatronMapping(FULL)
    keys = set(m.keys())
    # attn_res: layer i >= 1 holds attn_queries.{i-1}; [H] on sliding layers, [3, H] on full ones.
    assert "decoder.layers.0.attn_res_query" not in keys
    assert m.entry("decoder.layers.1.attn_res_query").hf == f"{TEXT}.attn_res.attn_queries.0"
    assert m.entry("decoder.layers.5.attn_res_query").shape == (3, 4608)
    assert m.entry("decoder.layers.4.attn_res_query").shape == (4608,)
    assert m.entry("decoder.layers.47.mlp_res_query").hf == f"{TEXT}.attn_res.mlp_queries.47"
    assert m.entry("decoder.output_res_query").hf == f"{TEXT}.attn_res.output_query"
    # q/k/v/r as four sub-keys, global shapes; sliding layers use the swa_* sizes (equal here).
    assert m.entry("decoder.layers.0.self_attention.linear_qkv.weight.q").shape == (48 * 128, 4608)
    assert m.entry("decoder.layers.0.self_attention.linear_qkv.weight.k").shape == (8 * 128, 4608)
    assert m.entry("decoder.layers.0.self_attention.linear_qkv.weight.r").shape == (48 * 16, 4608)
    # Sliding vs full layers.
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in keys
    assert "decoder.layers.5.self_attention.linear_qkv.layer_norm_weight" not in keys
    assert {f"decoder.layers.5.self_attention.{p}_input_norm.weight" for p in "qkv"} <= keys
    assert m.entry("decoder.layers.0.self_attention.k_sconv.weight").shape == (1024, 1, 4)
    assert m.entry("decoder.layers.11.self_attention.v_sconv.static_weight").shape == (4, 1024)
    assert m.entry("decoder.layers.11.self_attention.k_sconv.weight_proj.weight").shape == (32, 4608)
    assert "decoder.layers.10.self_attention.k_sconv.static_weight" not in keys
    assert m.entry("decoder.layers.5.self_attention.rel_proj").shape == (16, 1024)
    # Experts: BF16, stacked, the double "experts", one chunk per expert.
    fc1 = m.entry("decoder.layers.7.mlp.experts.experts.linear_fc1.weight")
    assert fc1.shape == (384, 2 * 2304, 4608) and fc1.dtype == torch.bfloat16 and fc1.hf == f"{EXPERTS}.w13_weight".format(layer=7)
    assert len(fc1.chunks()) == 384 and fc1.chunks()[3] == ((3, 0, 0), (1, 4608, 4608))
    assert m.entry("decoder.layers.7.mlp.experts.experts.linear_fc2.weight").shape == (384, 4608, 2304)
    # Fresh dtypes where no source says otherwise; a source's own dtypes win.
    assert m.entry("decoder.layers.0.mlp.router.expert_bias").dtype == torch.float32
    f32 = MegatronMapping(FULL, dtypes={f"{TEXT}.embed.weight": torch.float32})
    assert f32.entry("embedding.word_embeddings.weight").dtype == torch.float32
    assert m.entry("embedding.word_embeddings.weight").shape == (201024, 4608)  # padded rows stored as they are
    # Big non-expert tensors are stored in row ranges of at most DENSE_CHUNK_BYTES; the rest whole.
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        chunks = m.entry(key).chunks()
        assert len(chunks) == 28 and all(size[0] * 4608 * 2 <= DENSE_CHUNK_BYTES for _, size in chunks)
        assert [off[0] for off, _ in chunks] == list(range(0, 201024, 7281)) and chunks[-1][1] == (4437, 4608)
    assert f32.entry("embedding.word_embeddings.weight").chunks()[1] == ((3640, 0), (3640, 4608))
    for e in m.entries():
        if not e.stacked and e.key not in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert e.chunks() == [((0,) * len(e.shape), e.shape)], e.key
    # Layer tensors keep one chunk each (spec/megatron.md), an F32 one over the limit too (113 MB).
    wq = f"{TEXT}.layers.0.attn.wq_du.weight"
    big_layer = MegatronMapping(FULL, dtypes={wq: torch.float32}).entry_for_hf(wq)
    assert big_layer.shape == (6144, 4608) and 6144 * 4608 * 4 > DENSE_CHUNK_BYTES
    assert big_layer.chunks() == [((0, 0), (6144, 4608))]
    # 1,514 release tensors = the text ones here plus the vision tower's.
    assert len(m.keys()) == 1092
    objs = m.extra_state()
    assert len({o.key for o in objs}) == len(objs)
    assert "decoder.layers.3.mlp.experts.experts.linear_fc2._extra_state/shard_383_384" in {o.key for o in objs}
    assert "decoder.layers.5.self_attention.q_input_norm._extra_state/shard_0_1" in {o.key for o in objs}
    assert "decoder.layers.4.self_attention.q_input_norm._extra_state/shard_0_1" not in {o.key for o in objs}


def test_bridge_preset_places_attention_at_2i_and_moe_at_2i_plus_1():
    m = MegatronMapping(FULL, "bridge")
    miles = MegatronMapping(FULL, "miles")
    assert m.entry("decoder.layers.10.attn_res_query").hf == f"{TEXT}.attn_res.attn_queries.4"
    assert m.entry("decoder.layers.10.self_attention.linear_qkv.weight.q").hf == f"{TEXT}.layers.5.attn.wq_du.weight"
    assert m.entry("decoder.layers.11.mlp_res_query").hf == f"{TEXT}.attn_res.mlp_queries.5"
    assert m.entry("decoder.layers.11.mlp.experts.experts.linear_fc1.weight").hf == f"{TEXT}.layers.5.mlp.experts.w13_weight"
    assert m.entry("decoder.layers.11.pre_mlp_layernorm.weight").layer == 5
    assert m.entry("decoder.final_norm.weight").hf == f"{TEXT}.norm.weight"
    assert sorted(e.hf for e in m.entries()) == sorted(e.hf for e in miles.entries())
    assert max(int(k.split(".")[2]) for k in m.keys() if k.startswith("decoder.layers.")) == 95
    assert all(o.unit == "layer.5" for o in m.extra_state() if o.key.startswith(("decoder.layers.10.", "decoder.layers.11.")))


def test_a_preset_is_data(bf16):
    """A new preset is a table: renamed keys and other sites, no pipeline change; broken tables are refused."""
    mini = MILES.renamed("mini", {"output_layer.weight": "lm_head.weight"}, sites={"attn": (3, 1), "mlp": (3, 2)})
    m = MegatronMapping(bf16.cfg, mini)
    assert m.entry("lm_head.weight").hf == f"{TEXT}.unembed.weight"
    assert m.entry("decoder.layers.4.self_attention.linear_proj.weight").layer == 1
    assert m.entry("decoder.layers.5.mlp.router.weight").layer == 1
    dropped = Preset("dropped", tuple(r for r in MILES.rules if r.key != "{L}.mlp.router.expert_bias"), MILES.extra_state)
    with pytest.raises(ConfigError, match=r"no rule maps release tensor model\.llm\.layers\.0\.mlp\.gate\.bias"):
        MegatronMapping(bf16.cfg, dropped)
    twice = Preset("twice", MILES.rules + (Copy("decoder.extra", f"{TEXT}.norm.weight"),), MILES.extra_state)
    with pytest.raises(ConfigError, match="maps to decoder.final_layernorm.weight and decoder.extra"):
        MegatronMapping(bf16.cfg, twice)
    clash = Preset("clash", tuple(replace(r, key="{L}.x") if r.key == "{L}.mlp_res_query" else r for r in MILES.rules)
                   + (Copy("{L}.x", f"{TEXT}.layers.{{layer}}.mlp_norm.weight", site="mlp"),), MILES.extra_state)
    with pytest.raises(ConfigError, match="produced twice"):
        MegatronMapping(bf16.cfg, clash)
    with pytest.raises(ConfigError, match="not a row of the release inventory"):
        MegatronMapping(bf16.cfg, Preset("bad", (Copy("x", "model.llm.nope.weight"),), ()))
    with pytest.raises(ConfigError, match="wrong rule type"):
        MegatronMapping(bf16.cfg, Preset("bad", (Copy("{L}.w", f"{EXPERTS}.w2_weight"),), ()))
    with pytest.raises(ConfigError, match="unknown Megatron key preset"):
        get_preset("nemo")


def test_unused_and_missing_names_are_reported_both_ways(bf16):
    m = MegatronMapping(bf16.cfg)
    names = list(bf16.tensors) + ["model.llm.layers.0.attn.extra.weight"]
    names.remove(f"{TEXT}.layers.2.mlp_sconv.weight")
    cov = m.hf_coverage(names)
    assert cov.unused == ["model.llm.layers.0.attn.extra.weight"]
    assert cov.missing == [f"{TEXT}.layers.2.mlp_sconv.weight"]
    with pytest.raises(CheckpointError, match=r"src: no Megatron rule uses model\.llm\.layers\.0\.attn\.extra\.weight"):
        m.check_hf(names, "src")
    # Quantized expert parts count for their stacked weight; vision tensors are passed through.
    mixed = HFCheckpoint.open(TINY["mixed"])
    assert MegatronMapping(mixed.cfg).hf_coverage(mixed.tensors).ok
    keys = m.keys() + ["decoder.layers.9.mlp.router.weight", "optimizer.state.exp_avg.x", "rng_state"]
    keys.remove("decoder.output_res_query")
    cov = m.megatron_coverage(keys)
    assert cov.unused == ["decoder.layers.9.mlp.router.weight"] and cov.missing == ["decoder.output_res_query"]
    with pytest.raises(CheckpointError, match="no preset miles rule uses decoder.layers.9.mlp.router.weight"):
        m.check_megatron(keys, "ckpt")


_TF_NAMES = {  # miles key (decoder layer {i}) -> transformers 5.24 module parameter; independent of our tables
    "embedding.word_embeddings.weight": "model.language_model.embed_tokens.weight",
    "embedding.embed_norm.weight": "model.language_model.embed_tokens.embed_norm.weight",
    "decoder.final_layernorm.weight": "model.language_model.norm.weight",
    "decoder.output_res_query": "model.language_model.final_input.query",
    "output_layer.weight": "lm_head.weight",
    "L.attn_res_query": "I.attention_input.query",
    "L.mlp_res_query": "I.mlp_input.query",
    "L.self_attention.linear_qkv.layer_norm_weight": "I.input_layernorm.weight",
    "L.self_attention.q_input_norm.weight": "I.q_input_layernorm.weight",
    "L.self_attention.k_input_norm.weight": "I.k_input_layernorm.weight",
    "L.self_attention.v_input_norm.weight": "I.v_input_layernorm.weight",
    "L.self_attention.linear_qkv.weight.q": "I.self_attn.q_proj.linear.weight",
    "L.self_attention.linear_qkv.weight.k": "I.self_attn.k_proj.linear.weight",
    "L.self_attention.linear_qkv.weight.v": "I.self_attn.v_proj.linear.weight",
    "L.self_attention.linear_qkv.weight.r": "I.self_attn.relative_position_bias.linear.weight",
    "L.self_attention.linear_gate.weight": "I.self_attn.o_proj.gate_proj.weight",
    "L.self_attention.sink_proj.weight": "I.self_attn.sink_proj.weight",
    "L.self_attention.linear_proj.weight": "I.self_attn.o_proj.linear.weight",
    "L.self_attention.q_scale": "I.self_attn.q_proj.norm.scale",
    "L.self_attention.rel_scale": "I.self_attn.relative_position_bias.norm.scale",
    "L.self_attention.rel_proj": "I.self_attn.relative_position_bias.proj",
    "L.self_attention.k_sconv.weight": "I.self_attn.k_proj.sconv.conv1d.weight",
    "L.self_attention.v_sconv.weight": "I.self_attn.v_proj.sconv.conv1d.weight",
    "L.self_attention.k_sconv.static_weight": "I.self_attn.k_proj.sconv.static_weight",
    "L.self_attention.v_sconv.static_weight": "I.self_attn.v_proj.sconv.static_weight",
    "L.self_attention.k_sconv.weight_proj.weight": "I.self_attn.k_proj.sconv.weight_proj.weight",
    "L.self_attention.v_sconv.weight_proj.weight": "I.self_attn.v_proj.sconv.weight_proj.weight",
    "L.self_attention.attn_sconv.weight": "I.post_attention_convolution.conv1d.weight",
    "L.pre_mlp_layernorm.weight": "I.post_attention_layernorm.weight",
    "L.mlp.router.weight": "I.mlp.gate.weight",
    "L.mlp.router.expert_bias": "I.mlp.gate.e_score_correction_bias",
    "L.mlp.mlp_sconv.weight": "I.post_mlp_convolution.conv1d.weight",
    "L.mlp.experts.experts.linear_fc1.weight": "I.mlp.experts.gate_up_proj",
    "L.mlp.experts.experts.linear_fc2.weight": "I.mlp.experts.down_proj",
}


def test_every_key_holds_what_transformers_builds(bf16):
    """Differential: each Megatron tensor (from the release bytes through our table) equals the
    parameter transformers' from_pretrained builds from the same checkpoint, bit for bit."""
    from _tiny_tf import load

    model, info = load(TINY["bf16"])
    assert not info["missing_keys"] and not info["unexpected_keys"]
    sd = model.state_dict()
    m = MegatronMapping(bf16.cfg, dtypes=bf16.dtypes())
    for e in m.entries():
        key = re.sub(r"^decoder\.layers\.\d+\.", "L.", e.key)
        tf = _TF_NAMES[key].replace("I.", f"model.language_model.layers.{e.layer}.")
        ours = m.to_megatron(e.key, bf16.get(e.hf))
        want = sd[tf]
        if e.key == "output_layer.weight":  # transformers drops the zero padding rows
            assert not ours[want.shape[0]:].any()
            ours = ours[: want.shape[0]]
        assert ours.dtype == want.dtype and torch.equal(ours.view(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), e.key
        back = m.to_hf(e.key, m.to_megatron(e.key, bf16.get(e.hf)))
        assert torch.equal(back.reshape(-1).view(torch.uint8), bf16.get(e.hf).reshape(-1).view(torch.uint8)), e.key


@settings(max_examples=30, deadline=None)
@given(e=st.integers(1, 4), f=st.integers(1, 6), c=st.integers(1, 5), seed=st.integers(0, 2**31 - 1))
def test_experts_de_interleave_is_a_bit_exact_inverse(e, f, c, seed):
    """fc1[e] = [gate rows; up rows] of w13[e] (rows gate0, up0, gate1, …), on any slice, any bits (NaN, -0.0)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-2**15, 2**15, (e, 2 * f, c), generator=g, dtype=torch.int32).to(torch.int16)
    w13 = bits.view(torch.bfloat16)
    fused = next(r for r in MILES.rules if isinstance(r, Experts) and r.row.fused)
    fc1 = fused.to_megatron(w13)
    assert torch.equal(fc1[:, :f].view(torch.int16), w13[:, 0::2].view(torch.int16))
    assert torch.equal(fc1[:, f:].view(torch.int16), w13[:, 1::2].view(torch.int16))
    assert torch.equal(fused.to_hf(fc1).view(torch.int16), bits)


def test_padded_megatron_vocabulary_is_cut_back(bf16):
    m = MegatronMapping(bf16.cfg)
    emb = bf16.get(f"{TEXT}.embed.weight")
    padded = torch.cat([emb, torch.zeros(64, emb.shape[1], dtype=emb.dtype)])
    assert torch.equal(m.to_hf("embedding.word_embeddings.weight", padded), emb)
    with pytest.raises(CheckpointError, match="the reference config says"):
        m.to_hf("embedding.word_embeddings.weight", emb[:-1])
    with pytest.raises(CheckpointError, match="does not fit"):
        m.to_megatron("decoder.layers.0.mlp.router.weight", bf16.get(f"{TEXT}.layers.0.mlp.gate.weight").bfloat16())
