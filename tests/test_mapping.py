"""The HF ⇄ Megatron mapping table: coverage, shapes, transforms both ways."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inkling_ckpt.errors import CheckpointError, ConfigError
from inkling_ckpt.layouts.hf import HFCheckpoint
from inkling_ckpt.model.config import InklingConfig
from inkling_ckpt.model.mapping import RULES, InklingMapping, QKVInterleave, Rename, StackedExperts
from inkling_ckpt.model.presets import preset_config

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


@pytest.fixture(scope="module")
def bf16() -> HFCheckpoint:
    return HFCheckpoint.open(FIXTURES / "tiny-bf16")


@pytest.mark.parametrize("size", ["tiny", "small", "wide", "full"])
def test_table_covers_every_text_tensor(size: str) -> None:
    cfg = InklingConfig.from_dict(preset_config(size))
    m = InklingMapping(cfg)  # raises if the table and the inventory disagree either way
    assert m.coverage(m.expected_hf_names()).ok
    keys = m.megatron_keys()
    assert len(keys) == len(set(keys))
    assert not any(k.startswith("model.") for k in keys)


def test_full_model_shapes() -> None:
    cfg = InklingConfig.from_dict(preset_config("full"))
    m = InklingMapping(cfg)
    assert m.megatron_shape("decoder.layers.0.self_attention.linear_qkv.weight") == ((48 + 2 * 8) * 128, 4608)
    assert m.megatron_shape("decoder.layers.7.mlp.experts.experts.linear_fc1.weight") == (384, 2 * 2304, 4608)
    assert m.megatron_shape("decoder.layers.7.mlp.experts.experts.linear_fc2.weight") == (384, 4608, 2304)
    assert m.megatron_dtype("decoder.layers.7.mlp.router.expert_bias") == torch.float32
    assert m.megatron_shape("embedding.word_embeddings.weight") == (201024, 4608)
    assert len(m.chunks("decoder.layers.7.mlp.experts.experts.linear_fc1.weight")) == 384
    # K/V convolutions: full-attention layers only (every fourth), and the MTP layer.
    assert "decoder.layers.3.self_attention.k_conv.weight" in m.megatron_keys()
    assert "decoder.layers.2.self_attention.k_conv.weight" not in m.megatron_keys()
    assert "mtp.layers.0.transformer_layer.self_attention.k_conv.weight" in m.megatron_keys()
    padded = InklingMapping(cfg, pad_vocab_to_multiple=128 * 8)
    assert padded.megatron_shape("output_layer.weight") == (201728, 4608)


def test_round_trip_every_key(bf16: HFCheckpoint) -> None:
    m = InklingMapping(bf16.cfg)
    seen = set()
    for key in m.megatron_keys():
        t = m.to_megatron(key, bf16.get)
        assert tuple(t.shape) == m.megatron_shape(key) and t.dtype == m.megatron_dtype(key)
        back = m.to_hf(key, t)
        assert set(back) == set(m.hf_inputs(key))
        for name, v in back.items():
            assert torch.equal(v, bf16.get(name)), name
        seen |= set(back)
    assert seen == set(m.expected_hf_names())


def test_qkv_is_interleaved_by_query_group(bf16: HFCheckpoint) -> None:
    cfg = bf16.cfg  # 8 heads, 2 KV heads, head_dim 32: 4 q heads per group
    m = InklingMapping(cfg)
    L = "model.language_model.layers.1.self_attn"
    qkv = m.to_megatron("decoder.layers.1.self_attention.linear_qkv.weight", bf16.get)
    q, k, v = bf16.get(f"{L}.q_proj.weight"), bf16.get(f"{L}.k_proj.weight"), bf16.get(f"{L}.v_proj.weight")
    d, per = 32, 4
    group = (per + 2) * d
    for g in range(2):
        blk = qkv[g * group:(g + 1) * group]
        assert torch.equal(blk[: per * d], q[g * per * d:(g + 1) * per * d])
        assert torch.equal(blk[per * d: per * d + d], k[g * d:(g + 1) * d])
        assert torch.equal(blk[per * d + d:], v[g * d:(g + 1) * d])


def test_fc1_is_gate_then_up_per_expert(bf16: HFCheckpoint) -> None:
    m = InklingMapping(bf16.cfg)
    key = "decoder.layers.2.mlp.experts.experts.linear_fc1.weight"
    (off, size), = [c for c in m.chunks(key) if c[0][0] == 5]
    chunk = m.build_chunk(key, off, size, bf16.get)
    E = "model.language_model.layers.2.mlp.experts.5"
    assert torch.equal(chunk[0], torch.cat([bf16.get(f"{E}.gate_proj.weight"), bf16.get(f"{E}.up_proj.weight")]))
    # An EP rank's local slice maps back to global expert ids.
    out = m.experts_to_hf(key, chunk, expert_offset=5)
    assert set(out) == {f"{E}.gate_proj.weight", f"{E}.up_proj.weight"}
    with pytest.raises(CheckpointError):
        m.experts_to_hf(key, chunk, expert_offset=8)
    with pytest.raises(CheckpointError, match="experts_to_hf"):
        m.to_hf(key, chunk)


def test_vocab_padding_is_stripped(bf16: HFCheckpoint) -> None:
    m = InklingMapping(bf16.cfg, pad_vocab_to_multiple=384)
    t = m.to_megatron("output_layer.weight", bf16.get)
    assert t.shape[0] == 768 and not t[512:].any()
    back = m.to_hf("output_layer.weight", t)["lm_head.weight"]
    assert torch.equal(back, bf16.get("lm_head.weight"))
    with pytest.raises(CheckpointError, match="vocabulary rows"):
        m.to_hf("output_layer.weight", t[:500])


def test_coverage_reports_unconsumed_and_missing(bf16: HFCheckpoint) -> None:
    m = InklingMapping(bf16.cfg)
    names = m.expected_hf_names()
    cov = m.coverage(names[1:] + ["model.language_model.layers.0.mlp.shared_expert.weight"])
    assert cov.unconsumed == ["model.language_model.layers.0.mlp.shared_expert.weight"]
    assert cov.missing == [names[0]]
    with pytest.raises(CheckpointError, match="no Megatron rule consumes"):
        m.check_source(names + ["bogus.weight"], "src")


def test_rules_check_their_wildcards() -> None:
    with pytest.raises(ConfigError):
        Rename("decoder.layers.{layer}.x.weight", ("model.language_model.x.weight",))
    with pytest.raises(ConfigError):
        StackedExperts("decoder.layers.{layer}.e.weight", ("model.language_model.layers.{layer}.e.weight",))
    with pytest.raises(ConfigError):
        QKVInterleave("decoder.layers.{layer}.{mtp}.w", ("a.{layer}", "b.{layer}", "c.{layer}"))
    table = RULES[1:]  # drop the embedding rule: its HF tensor is then unconsumed
    with pytest.raises(ConfigError, match="no rule consumes"):
        InklingMapping(InklingConfig.from_dict(preset_config("tiny")), rules=table)
