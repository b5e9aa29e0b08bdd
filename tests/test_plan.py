"""TP/EP planning: the rule table covers the inventory, validation refuses bad plans with the
reason, and placements cut every tensor into pieces that cover it exactly once."""

from __future__ import annotations

import pytest

from inkling_ckpt.errors import PlanError
from inkling_ckpt.model.config import InklingConfig
from inkling_ckpt.model.inventory import ROWS, inventory
from inkling_ckpt.model.precision import PrecisionPlan
from inkling_ckpt.model.presets import preset_config
from inkling_ckpt.plan import ShardPlan, Split, validate
from inkling_ckpt.plan.rules import SPLITS, stale_rules, uncovered_rows

TINY = InklingConfig.from_dict(preset_config("tiny"))
FULL = InklingConfig.from_dict(preset_config("full"))
PLANS = {v: PrecisionPlan.parse(t, 4) for v, t in
         {"bf16": "bf16", "mixed": "0-1:nvfp4,2-3:mxfp8", "mxfp8": "mxfp8"}.items()}
L0 = "model.language_model.layers.0"


def test_rule_table_covers_every_row_and_nothing_else():
    assert uncovered_rows() == []
    assert stale_rules() == []
    assert len(SPLITS) == len(ROWS)


@pytest.mark.parametrize("tp,ep,msg", [
    (4, 3, "--ep 3 does not divide --tp 4"),
    (6, 2, "--tp 6 does not divide the 8 attention heads"),
    (2, 2, None),
    (3, 1, "--tp 3 does not divide the 8 attention heads"),
    (16, 16, "--ep 16 does not divide the 8 routed experts"),
    (0, 1, "--tp must be a positive integer"),
])
def test_validate_tiny(tp, ep, msg):
    if msg is None:
        assert validate(TINY, PLANS["bf16"], tp, ep).moe_tp == 1
    else:
        with pytest.raises(PlanError, match=msg):
            validate(TINY, PLANS["bf16"], tp, ep)


def test_nvfp4_experts_cannot_be_tp_sharded_and_the_error_says_why():
    with pytest.raises(PlanError) as e:
        validate(TINY, PLANS["mixed"], 4, 2)
    msg = str(e.value)
    assert "NVFP4 experts cannot be TP-sharded" in msg and "moe_tp 2" in msg and "layers 0-1" in msg
    assert "input_scale" in msg and "multiple of 16" in msg and "\n" not in msg
    # the full model: 2304 / 2 = 1152 inputs -> 72 scale columns
    with pytest.raises(PlanError, match="72 scale columns"):
        validate(FULL, PrecisionPlan.parse("0-39:nvfp4,40-47:mxfp8", 48), 4, 2)
    for v in ("bf16", "mxfp8"):
        assert validate(TINY, PLANS[v], 4, 2).moe_tp == 2


def test_mxfp8_experts_split_only_on_block_boundaries():
    # tiny experts are 64 wide: moe_tp 2 gives 32 (one MXFP8 block), moe_tp 4 gives 16
    with pytest.raises(PlanError, match="not a multiple of the mxfp8 block of 32"):
        validate(TINY, PLANS["mxfp8"], 8, 2)
    assert validate(TINY, PLANS["bf16"], 8, 2).moe_tp == 4


def test_vocab_must_split_evenly():
    cfg = InklingConfig.from_dict(preset_config("tiny") | {"text_config": {
        **preset_config("tiny")["text_config"], "vocab_size": 510}})
    with pytest.raises(PlanError, match="vocabulary of 510 rows"):
        validate(cfg, PLANS["bf16"], 4, 4)
    assert FULL.vocab_size % 64 == 0
    validate(FULL, PrecisionPlan.parse("0-39:nvfp4,40-47:mxfp8", 48), 8, 8)


@pytest.mark.parametrize("variant", ["bf16", "mixed", "mxfp8"])
@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 2), (4, 4), (8, 8), (4, 2), (8, 4)])
def test_pieces_cover_each_tensor_exactly_once(variant, tp, ep):
    plan = PLANS[variant]
    try:
        sp = ShardPlan.build(TINY, plan, tp, ep, inventory(TINY, plan))
    except PlanError:
        assert variant == "mixed" and tp != ep
        return
    for p in sp.placements:
        held = {piece for piece in p.holders if piece is not None}
        assert held == set(range(p.pieces)), p.name
        if p.dim is not None:
            assert p.spec.shape[p.dim] == p.pieces * p.local_shape[p.dim]
            ranges = [p.piece_range(i) for i in range(p.pieces)]
            assert ranges[0][0] == 0 and ranges[-1][1] == p.spec.shape[p.dim]
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        if p.rule.split is Split.EXPERT:  # only the owner's group holds an expert
            owner = p.spec.expert // (TINY.n_routed_experts // ep)
            assert p.ranks() == list(range(owner * (tp // ep), (owner + 1) * (tp // ep)))
        elif p.rule.split is not Split.REPLICATE:
            assert p.ranks() == list(range(tp))


def test_attention_heads_and_kv_replication():
    sp = ShardPlan.build(TINY, PLANS["bf16"], 8, 8, inventory(TINY, PLANS["bf16"]))
    by = {p.name: p for p in sp.placements}
    q = by[f"{L0}.self_attn.q_proj.weight"]
    assert q.local_shape == (32, 256) and q.pieces == 8  # one 32-row head per rank
    k = by[f"{L0}.self_attn.k_proj.weight"]
    assert k.pieces == 2 and k.holders == (0, 0, 0, 0, 1, 1, 1, 1)  # KV head rank // (8/2)
    assert by[f"{L0}.self_attn.o_proj.weight"].dim == 1
    assert by[f"{L0}.self_attn.sink_proj.weight"].local_shape == (1, 256)
    assert by["lm_head.weight"].local_shape == (64, 256)
    assert by[f"{L0}.mlp.gate.weight"].pieces == 1 and by[f"{L0}.mlp.gate.weight"].ranks() == list(range(8))
    assert by["mtp.layers.0.mlp.down_proj.weight"].dim == 1
    assert by["model.visual.blocks.0.attn.qkv.weight"].rule.split is Split.REPLICATE


def test_expert_moe_tp_split_follows_blocks():
    sp = ShardPlan.build(TINY, PLANS["mxfp8"], 4, 2, inventory(TINY, PLANS["mxfp8"]))
    by = {p.name: p for p in sp.placements}
    e5 = "model.language_model.layers.2.mlp.experts.5"
    down_w, down_s = by[f"{e5}.down_proj.weight"], by[f"{e5}.down_proj.weight_scale"]
    assert down_w.local_shape == (256, 32) and down_s.local_shape == (256, 1)
    assert down_w.holders == (None, None, 0, 1)  # expert 5 belongs to EP rank 1 = ranks 2, 3
    assert by[f"{e5}.up_proj.weight"].local_shape == (32, 256)
    assert sp.expert_ownership() == {0: {"experts": [0, 4], "ranks": [0, 1]},
                                     1: {"experts": [4, 8], "ranks": [2, 3]}}


def test_full_model_plan_is_fast_enough_and_adds_up():
    plan = PrecisionPlan.parse("0-39:nvfp4,40-47:mxfp8", 48)
    specs = inventory(FULL, plan)
    sp = ShardPlan.build(FULL, plan, 4, 4, specs)
    total = sum(s.nbytes for s in specs)
    per_rank = sp.rank_bytes()
    # every rank holds a quarter of the experts plus its share of the rest, replicas counted per rank
    assert sum(per_rank) >= total
    assert max(per_rank) - min(per_rank) < 0.01 * max(per_rank)


from hypothesis import given, settings, strategies as st  # noqa: E402


@st.composite
def _model_and_plan(draw):
    kv = draw(st.sampled_from([1, 2, 4, 8]))
    nh = kv * draw(st.sampled_from([1, 2, 3, 6]))
    experts = draw(st.sampled_from([4, 6, 8, 12, 16]))
    tp = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 16]))
    ep = draw(st.sampled_from([d for d in (1, 2, 3, 4, 8, 16) if d <= tp]))
    fmt = draw(st.sampled_from(["bf16", "mxfp8", "0-1:nvfp4,2-3:mxfp8"]))
    text = {**preset_config("tiny")["text_config"], "num_attention_heads": nh, "num_key_value_heads": kv,
            "n_routed_experts": experts, "num_experts_per_tok": 2, "moe_intermediate_size": 64 * draw(st.sampled_from([1, 3]))}
    return InklingConfig.from_dict({**preset_config("tiny"), "text_config": text}), PrecisionPlan.parse(fmt, 4), tp, ep


@settings(max_examples=60, deadline=None)
@given(_model_and_plan())
def test_property_valid_plans_cover_every_tensor_once_per_piece(case):
    cfg, precision, tp, ep = case
    try:
        sp = ShardPlan.build(cfg, precision, tp, ep, inventory(cfg, precision))
    except PlanError as e:
        assert "\n" not in str(e)
        return
    for p in sp.placements:
        assert {h for h in p.holders if h is not None} == set(range(p.pieces)), p.name
        if p.dim is not None:
            assert p.spec.shape[p.dim] % p.pieces == 0
        if p.spec.fmt not in (None, "bf16") and p.dim == len(p.spec.shape) - 1 and p.spec.part == "weight":
            # a cut along an expert's input width lands on a block boundary
            block = 16 if p.spec.fmt == "nvfp4" else 32
            elems = p.local_shape[-1] * (2 if p.spec.fmt == "nvfp4" else 1)
            assert elems % block == 0
