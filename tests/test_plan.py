"""TP/EP planning on the release layout: the rule table covers the inventory, validation refuses
bad plans with the reason, and placements cut every tensor into pieces that cover it exactly
once, on head, pair and block boundaries."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from _release_tiny import PLANS, tiny_config
from inkling_ckpt.errors import PlanError
from inkling_ckpt.model.config import InklingConfig
from inkling_ckpt.model.inventory import ROWS, inventory
from inkling_ckpt.model.precision import PrecisionPlan
from inkling_ckpt.model.presets import preset_config
from inkling_ckpt.plan import ShardPlan, Split, validate
from inkling_ckpt.plan.rules import SPLITS, stale_rules, uncovered_rows

TINY = tiny_config()  # sliding layers 0, 2: 4 heads / 4 KV heads; full layers 1, 3: 8 / 2
FULL = InklingConfig.from_dict(preset_config("full"))
TP = {v: PrecisionPlan.parse(t, 4) for v, t in PLANS.items()}
MIXED = PrecisionPlan.parse("0-39:nvfp4,40-47:mxfp8", 48)
BLOCK = {"mxfp8": 32, "nvfp4": 16}


def _by_name(cfg, plan, tp, ep):
    return {p.name: p for p in ShardPlan.build(cfg, plan, tp, ep, inventory(cfg, plan)).placements}


def test_rule_table_covers_every_row_and_nothing_else():
    assert uncovered_rows() == [] and stale_rules() == []
    assert len(SPLITS) == len(ROWS)


@pytest.mark.parametrize("tp,ep,msg", [
    (4, 3, "--ep 3 does not divide --tp 4"),
    (3, 1, "--tp 3 does not divide the 4 attention heads (layers 0,2)"),
    (8, 8, "--tp 8 does not divide the 4 attention heads (layers 0,2)"),
    (16, 16, "--ep 16 does not divide the 8 routed experts"),
    (0, 1, "--tp must be a positive integer"),
    (2, 2, None),
    (4, 4, None),
])
def test_validate_tiny(tp, ep, msg):
    if msg is None:
        assert validate(TINY, TP["bf16"], tp, ep).moe_tp == 1
    else:
        with pytest.raises(PlanError) as e:
            validate(TINY, TP["bf16"], tp, ep)
        assert msg in str(e.value) and "\n" not in str(e.value)


def test_kv_heads_must_divide_or_be_divided_by_tp():
    cfg = tiny_config(num_attention_heads=12, num_key_value_heads=3, head_dim=8, swa_num_attention_heads=12,
                      swa_num_key_value_heads=12, swa_head_dim=4, vocab_size=96 * 3,
                      moe_intermediate_size=96)
    with pytest.raises(PlanError, match="--tp 2 and the 3 KV heads"):
        validate(cfg, TP["bf16"], 2, 1)
    assert validate(cfg, TP["bf16"], 6, 2).tp == 6  # 2 KV heads per rank on sliding layers, 1 of 3 (x2) on full


def test_nvfp4_experts_cannot_be_tp_sharded_and_the_error_says_why():
    with pytest.raises(PlanError) as e:
        validate(FULL, MIXED, 4, 2)
    msg = str(e.value)
    assert msg.startswith("NVFP4 experts cannot be TP-sharded") and "moe_tp 2" in msg and "layers 0-39" in msg
    assert "activation scale must cover its full input width" in msg and "multiple of 16 scale columns" in msg
    assert "2304/16 = 144 columns at moe_tp 1, 72 at moe_tp 2" in msg and "\n" not in msg
    with pytest.raises(PlanError, match="layers 0-1 .* 4 columns at moe_tp 1, 2 at moe_tp 2"):
        validate(TINY, TP["mixed"], 4, 2)
    for v in ("bf16", "mxfp8"):  # moe_tp > 1 is allowed without NVFP4 layers
        assert validate(TINY, TP[v], 4, 2).moe_tp == 2
    assert validate(FULL, PrecisionPlan.parse("mxfp8", 48), 8, 2).moe_tp == 4  # 2304/4 = 576 = 18 blocks


def test_moe_tp_splits_land_on_block_and_pair_boundaries():
    # tiny experts are 64 wide: moe_tp 2 gives 32 (one MXFP8 block), moe_tp 4 gives 16
    with pytest.raises(PlanError, match="pieces of 16, not a multiple of the mxfp8 block of 32"):
        validate(TINY, TP["mxfp8"], 4, 1)
    assert validate(TINY, TP["bf16"], 4, 1).moe_tp == 4
    with pytest.raises(PlanError, match="does not divide the expert width moe_intermediate_size 66"):
        validate(tiny_config(moe_intermediate_size=66), TP["bf16"], 4, 1)


def test_vocab_must_split_evenly():
    with pytest.raises(PlanError, match="vocabulary of 258 rows"):
        validate(tiny_config(vocab_size=258), TP["bf16"], 4, 4)
    validate(FULL, MIXED, 48, 48)  # 201024 = 48 * 4188


def _check_cover(sp: ShardPlan) -> None:
    """Every tensor: each piece held, cuts even, on head / pair / block boundaries, holders per parallel.md."""
    cfg, par = sp.cfg, sp.parallel
    for p in sp.placements:
        spec = p.spec
        held = {h for h in p.holders if h is not None}
        assert held == set(p.pieces()), p.name
        for c in p.cuts:
            assert spec.shape[c.dim] % c.pieces == 0, p.name
        local = p.local_shape
        assert math.prod(local) * len(p.pieces()) == math.prod(spec.shape), p.name
        if p.rule.split is Split.EXPERT:
            assert p.ranks() == list(par.ranks)  # every rank holds its EP rank's experts
            if spec.part == "_outer_scale_denominator":
                assert p.cuts == () and spec.shape == ()
            elif par.ep > 1:
                assert p.cuts[0].dim == 0 and local[0] == cfg.n_routed_experts // par.ep
                assert [h[0] for h in p.holders] == [par.ep_rank(r) for r in par.ranks]
            inner = [c for c in p.cuts if c.dim != 0]
            if inner:
                assert spec.part in ("", "_scale") and par.moe_tp > 1
                if inner[0].dim == 1:  # w13: whole (gate, up) pairs
                    assert local[1] % 2 == 0
                elif spec.fmt in BLOCK and spec.part == "":  # w2 columns: whole blocks
                    elems = local[2] * (2 if spec.fmt == "nvfp4" else 1)
                    assert elems % BLOCK[spec.fmt] == 0
        elif p.rule.split in (Split.Q_HEADS, Split.KV_HEADS):
            d = cfg.layer_dims(spec.layer)
            heads = d.heads if p.rule.split is Split.Q_HEADS else d.kv_heads
            (c,) = p.cuts or (None,)
            if c is None:
                assert par.tp == 1 or (p.rule.split is Split.KV_HEADS and heads == 1)
                continue
            per_head = spec.shape[c.dim] // heads
            assert local[c.dim] % per_head == 0, p.name  # never inside a head
            if p.rule.split is Split.KV_HEADS and par.tp > heads:
                assert [h[0] for h in p.holders] == [r // (par.tp // heads) for r in par.ranks]
            else:
                assert [h[0] for h in p.holders] == list(par.ranks)
        elif p.rule.split is Split.VOCAB:
            assert par.tp == 1 or (p.cuts[0].dim == 0 and local[0] * par.tp == cfg.vocab_size)
        else:
            assert p.cuts == () and all(h == () for h in p.holders)


@pytest.mark.parametrize("variant", ["bf16", "mixed", "mxfp8"])
@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 2), (4, 4), (2, 1), (4, 2), (4, 1)])
def test_pieces_cover_each_tensor_exactly_once(variant, tp, ep):
    plan = TP[variant]
    try:
        sp = ShardPlan.build(TINY, plan, tp, ep, inventory(TINY, plan))
    except PlanError as e:
        assert (variant == "mixed" and tp != ep) or (variant == "mxfp8" and tp // ep == 4), str(e)
        return
    _check_cover(sp)


def test_attention_heads_kv_replication_and_conv_layouts():
    by = _by_name(TINY, TP["bf16"], 4, 4)
    full, swa = "model.llm.layers.1", "model.llm.layers.0"
    assert by[f"{full}.attn.wq_du.weight"].local_shape == (16, 64)  # 8 heads of 8 -> 2 per rank
    assert by[f"{swa}.attn.wq_du.weight"].local_shape == (16, 64)  # 4 heads of 16 -> 1 per rank
    k = by[f"{full}.attn.wk_dv.weight"]  # 2 KV heads, tp 4: rank r holds head r // 2
    assert k.local_shape == (8, 64) and k.holders == ((0,), (0,), (1,), (1,))
    assert by[f"{swa}.attn.wk_dv.weight"].holders == ((0,), (1,), (2,), (3,))
    sw = by[f"{full}.attn.k_sconv.static_w"]  # [K, kv*hd]: columns by KV head
    assert sw.cuts[0].dim == 1 and sw.local_shape == (4, 8) and sw.holders == k.holders
    wp = by[f"{full}.attn.v_sconv.weight_proj"]  # [kv*K, H]: head-major rows
    assert wp.local_shape == (4, 64) and wp.holders == k.holders
    assert by[f"{swa}.attn.k_sconv.weight"].local_shape == (16, 1, 4)
    assert by[f"{full}.attn.wo_ud.weight"].cuts[0].dim == 1 and by[f"{full}.attn.wo_ud.weight"].local_shape == (64, 16)
    assert by[f"{full}.attn.attn_sink_proj.weight"].local_shape == (2, 64)
    assert by[f"{full}.attn.q_l2_clip.scale"].local_shape == (2, 8)
    assert by[f"{full}.attn.rel_l2_clip.scale"].local_shape == (2, 8)
    assert by[f"{full}.attn.wr_du.weight"].local_shape == (16, 64)  # 8 heads x d_rel 8
    assert by["model.llm.unembed.weight"].local_shape == (64, 64) == by["model.llm.embed.weight"].local_shape
    for name in (f"{full}.mlp.gate.weight", f"{full}.mlp.gate.bias", f"{full}.attn.rel_logits_proj.proj",
                 f"{full}.attn_sconv.weight", "model.llm.attn_res.attn_queries.0", "model.llm.attn_res.output_query",
                 "model.visual.proj_out.weight", f"{full}.q_input_norm.weight"):
        assert by[name].rule.split is Split.REPLICATE and by[name].cuts == () and by[name].ranks() == [0, 1, 2, 3]


def test_stacked_expert_parts_follow_the_weight():
    by = _by_name(TINY, TP["mixed"], 4, 4)
    e = "model.llm.layers.0.mlp.experts"  # NVFP4
    assert by[f"{e}.w13_weight"].local_shape == (2, 128, 32)
    assert by[f"{e}.w13_weight_scale"].local_shape == (2, 128, 4)
    assert by[f"{e}.w13_weight_amax"].local_shape == (2,)
    assert by[f"{e}.w2_weight_amax"].holders == ((0,), (1,), (2,), (3,))
    den = by[f"{e}.w13_weight_outer_scale_denominator"]
    assert den.cuts == () and den.holders == ((),) * 4
    by = _by_name(TINY, TP["mxfp8"], 4, 2)  # moe_tp 2
    e = "model.llm.layers.3.mlp.experts"
    w13, s13 = by[f"{e}.w13_weight"], by[f"{e}.w13_weight_scale"]
    assert [(c.dim, c.pieces) for c in w13.cuts] == [(0, 2), (1, 2)] and w13.local_shape == (4, 64, 64)
    assert s13.local_shape == (4, 64, 2) and s13.holders == w13.holders == ((0, 0), (0, 1), (1, 0), (1, 1))
    w2, s2 = by[f"{e}.w2_weight"], by[f"{e}.w2_weight_scale"]
    assert [(c.dim, c.pieces) for c in w2.cuts] == [(0, 2), (2, 2)]
    assert w2.local_shape == (4, 64, 32) and s2.local_shape == (4, 64, 1)
    by = _by_name(TINY, TP["bf16"], 2, 1)  # ep 1: only the moe-TP cut
    assert [(c.dim, c.pieces) for c in by[f"{e}.w13_weight"].cuts] == [(1, 2)]


def test_full_model_plan_adds_up():
    specs = inventory(FULL, MIXED)
    sp = ShardPlan.build(FULL, MIXED, 4, 4, specs)
    per_rank = sp.rank_bytes()
    assert len(set(per_rank)) == 1
    experts = sum(s.nbytes for s in specs if s.category.value == "routed_experts")
    assert sp.expert_ownership()[3] == {"experts": [288, 384], "ranks": [3]}
    by = {p.name: p for p in sp.placements}
    assert by["model.llm.layers.5.attn.wk_dv.weight"].local_shape == (256, 4608)  # 8 KV heads / 4
    # a quarter of the experts each, plus the replicated NVFP4 denominators (40 layers x w13, w2 x 4 bytes)
    denominators = sum(s.nbytes for s in specs if s.part == "_outer_scale_denominator")
    assert denominators == 40 * 2 * 4
    rank0 = sum(p.local_nbytes for p in sp.for_rank(0) if p.spec.category.value == "routed_experts")
    assert rank0 * 4 == experts + 3 * denominators


@st.composite
def _model_and_plan(draw):
    tp = draw(st.sampled_from([1, 2, 2, 4, 4, 8, 3, 6, 16]))  # mostly powers of two, some that fail
    ep = draw(st.sampled_from([d for d in (1, 2, 3, 4, 6, 8, 16) if tp % d == 0 or d == 3]))
    kinds = {}
    for prefix in ("", "swa_"):  # sliding and full layers have their own head counts
        kv = draw(st.sampled_from([1, 2, 4, 8]))
        kinds[f"{prefix}num_key_value_heads"] = kv
        kinds[f"{prefix}num_attention_heads"] = max(kv, draw(st.sampled_from([tp, kv]))) * draw(st.sampled_from([1, 2, 3]))
        kinds[f"{prefix}head_dim"] = draw(st.sampled_from([8, 16]))
    experts = draw(st.sampled_from([4, 6, 8, 12, 16]))
    fmt = draw(st.sampled_from(["bf16", "mxfp8", "0-1:nvfp4,2-3:mxfp8", "nvfp4"]))
    cfg = tiny_config(**kinds, n_routed_experts=experts, num_experts_per_tok=2, vocab_size=96 * 16,
                      unpadded_vocab_size=1500, moe_intermediate_size=32 * draw(st.sampled_from([1, 2, 3, 4])))
    return cfg, PrecisionPlan.parse(fmt, 4), tp, ep


@settings(max_examples=80, deadline=None)
@given(_model_and_plan())
def test_property_valid_plans_cover_every_tensor_once_per_piece(case):
    cfg, precision, tp, ep = case
    try:
        sp = ShardPlan.build(cfg, precision, tp, ep, inventory(cfg, precision))
    except PlanError as e:
        assert "\n" not in str(e)
        return
    _check_cover(sp)


def test_precision_plan_rules_and_the_layers_no_rule_names():
    """Rules by range, one layer or all layers; a layer no rule names is unquantized (bf16), as
    --plan's help says; the plan prints back as maximal runs."""
    p = PrecisionPlan.parse(" 0-1 : NVFP4 , 3:mxfp8", 5)
    assert p.formats == ("nvfp4", "nvfp4", "bf16", "mxfp8", "bf16")
    assert str(p) == "0-1:nvfp4,2:bf16,3:mxfp8,4:bf16" and p.variant == "mixed"
    assert PrecisionPlan.parse("mxfp8", 3).formats == ("mxfp8",) * 3
    assert PrecisionPlan.parse(str(MIXED), 48) == MIXED


@pytest.mark.parametrize("text, message", [
    ("", "the precision plan is empty"),
    (" , ", "rule '' is not FIRST-LAST:FORMAT"),
    ("0-1=nvfp4", "rule '0-1=nvfp4' is not FIRST-LAST:FORMAT"),
    ("0-1:fp4", "names format 'fp4'; known formats: "),
    ("3-1:nvfp4", "rule '3-1:nvfp4': range runs backwards"),
    ("0-4:nvfp4", "rule '0-4:nvfp4' names layer 4, but the model has layers 0-3"),
    ("mxfp8,2:nvfp4", "names layer 2 twice"),
])
def test_precision_plan_refusals_name_the_rule(text, message):
    with pytest.raises(PlanError) as e:
        PrecisionPlan.parse(text, 4)
    assert message in str(e.value)
