"""How each tensor of the inventory is split over a TP/EP plan, held as data.

:data:`SPLITS` gives every :class:`~inkling_ckpt.model.inventory.Row` of the tensor table
(keyed by its name pattern) one :class:`Rule`: what the tensor is split by and along which
logical dimension. The rules follow ``spec/parallel.md`` and the engine conventions in
``reference/peers.md`` §4:

* query-head tensors (``q_proj``, ``g_proj``, ``sink_proj``, ``rel_bias``) are split by rows
  on head boundaries; ``o_proj`` is row-parallel, so its *columns* are split the same way;
* KV-head tensors (``k_proj``, ``v_proj``, ``k_conv``, ``v_conv``) are split by KV heads and,
  when tp exceeds the KV heads, each rank holds KV head ``rank // (tp / kv_heads)``;
* ``embed_tokens`` and ``lm_head`` are vocab-parallel (rows over tp);
* the MTP head's dense MLP is column-parallel for gate/up (rows), row-parallel for down
  (columns); ``eh_proj`` splits its rows;
* routed experts belong to one EP rank (contiguous blocks), and inside that rank's group of
  ``moe_tp`` ranks gate/up split by rows and down by columns; their scales follow their blocks;
* everything else (router, norms, residual queries, the vision tower) is replicated.

Adapting to another checkpoint means editing this table, not the code that applies it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ..model.inventory import EXPERT_ROWS, LAYER, MTP, ROWS, TEXT, VISION_ROWS, Row


class Split(str, Enum):
    """What a tensor is divided by."""

    REPLICATE = "replicate"  # every rank holds all of it
    Q_HEADS = "q_heads"  # tp pieces on query-head boundaries
    KV_HEADS = "kv_heads"  # min(tp, kv) pieces on KV-head boundaries; replicated beyond kv
    VOCAB = "vocab"  # tp pieces of the vocabulary rows
    TP = "tp"  # tp even pieces (dense MLP, eh_proj)
    EXPERT = "expert"  # owned by one EP rank; moe_tp pieces within its rank group


@dataclass(frozen=True)
class Rule:
    """A tensor's split: by what, along which logical dimension (None: not split)."""

    split: Split
    dim: int | None = None

    def describe(self) -> str:
        what = {
            Split.REPLICATE: "replicated on every rank",
            Split.Q_HEADS: "split by query heads over tp",
            Split.KV_HEADS: "split by KV heads over tp (replicated when tp > KV heads)",
            Split.VOCAB: "vocab-parallel over tp",
            Split.TP: "split evenly over tp",
            Split.EXPERT: "owned by one EP rank, split over moe_tp inside its group",
        }[self.split]
        if self.dim is None:
            return what
        return f"{what}, {'rows' if self.dim == 0 else 'columns'} (dim {self.dim})"

    def to_json(self) -> dict[str, object]:
        return {"split": self.split.value, "dim": self.dim}


REPLICATE = Rule(Split.REPLICATE)
Q_ROWS = Rule(Split.Q_HEADS, 0)
Q_COLS = Rule(Split.Q_HEADS, 1)  # o_proj: row-parallel, its input is the heads' output
KV_ROWS = Rule(Split.KV_HEADS, 0)
VOCAB_ROWS = Rule(Split.VOCAB, 0)
TP_ROWS = Rule(Split.TP, 0)
TP_COLS = Rule(Split.TP, 1)
EXPERT_ROWS_SPLIT = Rule(Split.EXPERT, 0)  # gate/up: column-parallel inside the expert
EXPERT_COLS_SPLIT = Rule(Split.EXPERT, 1)  # down: row-parallel, split over its input width


def _attention(prefix: str) -> dict[str, Rule]:
    a = f"{prefix}.self_attn"
    return {
        f"{prefix}.input_layernorm.weight": REPLICATE,
        f"{a}.q_proj.weight": Q_ROWS,
        f"{a}.k_proj.weight": KV_ROWS,
        f"{a}.v_proj.weight": KV_ROWS,
        f"{a}.g_proj.weight": Q_ROWS,
        f"{a}.o_proj.weight": Q_COLS,
        f"{a}.sink_proj.weight": Q_ROWS,
        f"{a}.rel_bias.weight": Q_ROWS,
        f"{a}.k_conv.weight": KV_ROWS,
        f"{a}.v_conv.weight": KV_ROWS,
    }


#: Row pattern -> rule, for every row of the tensor table.
SPLITS: dict[str, Rule] = {
    f"{TEXT}.embed_tokens.weight": VOCAB_ROWS,
    **_attention(LAYER),
    f"{LAYER}.attn_residual.query": REPLICATE,
    f"{LAYER}.attn_residual.norm.weight": REPLICATE,
    f"{LAYER}.mlp_residual.query": REPLICATE,
    f"{LAYER}.mlp_residual.norm.weight": REPLICATE,
    f"{LAYER}.post_attention_layernorm.weight": REPLICATE,
    f"{LAYER}.mlp.gate.weight": REPLICATE,
    f"{LAYER}.mlp.gate.e_score_correction_bias": REPLICATE,
    f"{TEXT}.norm.weight": REPLICATE,
    "lm_head.weight": VOCAB_ROWS,
    f"{MTP}.enorm.weight": REPLICATE,
    f"{MTP}.hnorm.weight": REPLICATE,
    f"{MTP}.eh_proj.weight": TP_ROWS,
    **_attention(MTP),
    f"{MTP}.post_attention_layernorm.weight": REPLICATE,
    f"{MTP}.mlp.gate_proj.weight": TP_ROWS,
    f"{MTP}.mlp.up_proj.weight": TP_ROWS,
    f"{MTP}.mlp.down_proj.weight": TP_COLS,
    f"{MTP}.final_layernorm.weight": REPLICATE,
    EXPERT_ROWS["gate_proj"].pattern: EXPERT_ROWS_SPLIT,
    EXPERT_ROWS["up_proj"].pattern: EXPERT_ROWS_SPLIT,
    EXPERT_ROWS["down_proj"].pattern: EXPERT_COLS_SPLIT,
    # The vision tower runs at TP1 in the engines: every rank keeps all of it.
    **{row.pattern: REPLICATE for row in VISION_ROWS},
}


def rule_of(row: Row) -> Rule:
    """The split rule of an inventory row (PlanError-free: the table covers every row, see tests)."""
    return SPLITS[row.pattern]


def uncovered_rows() -> list[str]:
    """Row patterns the table does not cover (empty when the table is complete)."""
    return [row.pattern for row in ROWS if row.pattern not in SPLITS]


def stale_rules() -> list[str]:
    """Table entries that name no row of the inventory (empty when the table is clean)."""
    known = {row.pattern for row in ROWS}
    return [p for p in SPLITS if p not in known]
