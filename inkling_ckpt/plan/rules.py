"""How each tensor of the release inventory is split over a TP/EP plan, held as data.

:data:`SPLITS` gives every :class:`~inkling_ckpt.model.inventory.Row` of the tensor table
(keyed by its name pattern) one :class:`Rule`: what the tensor is divided by and along which
stored dimension. The rules follow ``spec/parallel.md``:

* query-head tensors (``wq_du``, ``gate_attn``, ``attn_sink_proj``, ``wr_du``, the two
  ``l2_clip`` scales) are split by rows on head boundaries; ``wo_ud`` is row-parallel, so its
  *columns* are split the same way;
* KV-head tensors (``wk_dv``, ``wv_dv`` and the K/V short convolutions: ``weight`` and
  ``weight_proj`` rows, ``static_w`` columns) are split by KV heads and, when tp exceeds the
  KV heads, each rank holds KV head ``rank // (tp / kv_heads)``;
* ``embed`` and ``unembed`` are vocab-parallel (rows over tp);
* routed experts are stacked: EP rank ``e`` owns a contiguous block of dim 0, and inside its
  group of ``moe_tp`` ranks ``w13`` splits its rows (dim 1) in whole interleaved (gate, up)
  pairs and ``w2`` its columns (dim 2); :data:`EXPERT_PARTS` says how each stored part follows;
* everything else (router, norms, short convolutions of the residual stream, ``rel_logits_proj``,
  the ``attn_res`` queries, the vision tower) is replicated.

Adapting to another checkpoint means editing these tables, not the code that applies them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ..formats.stacked import AMAX, DENOM, SCALE, WEIGHT
from ..model.inventory import EXPERTS, LAYER, ROWS, TEXT, VISION_ROWS, Row, TensorSpec


class Split(str, Enum):
    """What a tensor is divided by."""

    REPLICATE = "replicate"  # every rank holds all of it
    Q_HEADS = "q_heads"  # tp pieces on query-head boundaries
    KV_HEADS = "kv_heads"  # min(tp, kv) pieces on KV-head boundaries; replicated beyond kv
    VOCAB = "vocab"  # tp pieces of the vocabulary rows
    EXPERT = "expert"  # stacked experts: dim 0 by EP rank; moe_tp pieces of `dim` within its group


@dataclass(frozen=True)
class Rule:
    """A tensor's split: by what, along which stored dimension (None: not split).

    For :attr:`Split.EXPERT`, ``dim`` is the dimension the moe_tp ranks of an EP group divide
    (the EP cut is always dim 0, the expert axis) and ``pairs`` says that rows go in
    interleaved (gate, up) pairs, so a piece must hold an even number of them.
    """

    split: Split
    dim: int | None = None
    pairs: bool = False

    def describe(self) -> str:
        what = {
            Split.REPLICATE: "replicated on every rank",
            Split.Q_HEADS: "split by query heads over tp",
            Split.KV_HEADS: "split by KV heads over tp (replicated when tp > KV heads)",
            Split.VOCAB: "vocab-parallel over tp",
            Split.EXPERT: "experts (dim 0) by EP rank",
        }[self.split]
        if self.dim is None:
            return what
        if self.split is Split.EXPERT:
            unit = "rows in whole (gate, up) pairs" if self.pairs else ("rows" if self.dim == 1 else "columns")
            return f"{what}; {unit} (dim {self.dim}) over moe_tp"
        return f"{what}, {'rows' if self.dim == 0 else 'columns'} (dim {self.dim})"

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"split": self.split.value, "dim": self.dim}
        if self.pairs:
            out["pairs"] = True
        return out


REPLICATE = Rule(Split.REPLICATE)
Q_ROWS = Rule(Split.Q_HEADS, 0)
Q_COLS = Rule(Split.Q_HEADS, 1)  # wo_ud: row-parallel, its input is the heads' output
KV_ROWS = Rule(Split.KV_HEADS, 0)
KV_COLS = Rule(Split.KV_HEADS, 1)  # static_w [K, kv*hd]
VOCAB_ROWS = Rule(Split.VOCAB, 0)
W13 = Rule(Split.EXPERT, 1, pairs=True)  # [E, 2F, H]: column-parallel inside an expert, gate/up interleaved
W2 = Rule(Split.EXPERT, 2)  # [E, H, F]: row-parallel inside an expert, split over its input width


@dataclass(frozen=True)
class PartRule:
    """How one stored part of a stacked expert weight follows the weight's split."""

    ep: bool  # sliced along dim 0 by EP rank (the part has the expert axis first)
    moe_tp: bool  # also cut like the weight over moe_tp (block scales follow their blocks)


#: Stored part suffix (formats/stacked.py) -> how it follows. ``_amax`` is one value per expert
#: (whole within an EP group); the scalar ``_outer_scale_denominator`` is on every rank.
EXPERT_PARTS: dict[str, PartRule] = {
    WEIGHT: PartRule(ep=True, moe_tp=True),
    SCALE: PartRule(ep=True, moe_tp=True),
    AMAX: PartRule(ep=True, moe_tp=False),
    DENOM: PartRule(ep=False, moe_tp=False),
}

_ATT = f"{LAYER}.attn"

#: Row pattern -> rule, for every row of the tensor table.
SPLITS: dict[str, Rule] = {
    f"{TEXT}.embed.weight": VOCAB_ROWS,
    f"{TEXT}.embed_norm.weight": REPLICATE,
    f"{TEXT}.attn_res.attn_queries.{{layer}}": REPLICATE,
    f"{TEXT}.attn_res.mlp_queries.{{layer}}": REPLICATE,
    f"{_ATT}.wq_du.weight": Q_ROWS,
    f"{_ATT}.wk_dv.weight": KV_ROWS,
    f"{_ATT}.wv_dv.weight": KV_ROWS,
    f"{_ATT}.wr_du.weight": Q_ROWS,
    f"{_ATT}.wo_ud.weight": Q_COLS,
    f"{_ATT}.gate_attn.weight": Q_ROWS,
    f"{_ATT}.attn_sink_proj.weight": Q_ROWS,
    f"{_ATT}.q_l2_clip.scale": Q_ROWS,
    f"{_ATT}.rel_l2_clip.scale": Q_ROWS,
    f"{_ATT}.rel_logits_proj.proj": REPLICATE,  # [d_rel, extent]: shared by every head
    f"{_ATT}.k_sconv.weight": KV_ROWS,
    f"{_ATT}.v_sconv.weight": KV_ROWS,
    f"{_ATT}.k_sconv.static_w": KV_COLS,
    f"{_ATT}.k_sconv.weight_proj": KV_ROWS,  # [kv*K, H]: head-major (transformers views it [kv, 1, K])
    f"{_ATT}.v_sconv.static_w": KV_COLS,
    f"{_ATT}.v_sconv.weight_proj": KV_ROWS,
    f"{LAYER}.attn_norm.weight": REPLICATE,
    f"{LAYER}.q_input_norm.weight": REPLICATE,
    f"{LAYER}.k_input_norm.weight": REPLICATE,
    f"{LAYER}.v_input_norm.weight": REPLICATE,
    f"{LAYER}.attn_sconv.weight": REPLICATE,
    f"{LAYER}.mlp_sconv.weight": REPLICATE,
    f"{LAYER}.mlp_norm.weight": REPLICATE,
    f"{LAYER}.mlp.gate.weight": REPLICATE,
    f"{LAYER}.mlp.gate.bias": REPLICATE,
    f"{EXPERTS}.w13_weight": W13,
    f"{EXPERTS}.w2_weight": W2,
    f"{TEXT}.norm.weight": REPLICATE,
    f"{TEXT}.attn_res.output_query": REPLICATE,
    f"{TEXT}.unembed.weight": VOCAB_ROWS,
    # The vision tower runs at TP1 in the engines: every rank keeps all of it.
    **{row.pattern: REPLICATE for row in VISION_ROWS},
}

#: Tensors passed through by prefix (a checkpoint's vision tower: no inventory row).
PASS_THROUGH = REPLICATE


def rule_of(spec: TensorSpec | Row | None) -> Rule:
    """The split rule of a tensor (or inventory row); pass-through tensors are replicated."""
    row = spec.row if isinstance(spec, TensorSpec) else spec
    if row is None:
        return PASS_THROUGH
    return SPLITS[row.pattern]


def uncovered_rows() -> list[str]:
    """Row patterns the table does not cover (empty when the table is complete)."""
    return [row.pattern for row in ROWS if row.pattern not in SPLITS]


def stale_rules() -> list[str]:
    """Table entries that name no row of the inventory (empty when the table is clean)."""
    known = {row.pattern for row in ROWS}
    return [p for p in SPLITS if p not in known]
