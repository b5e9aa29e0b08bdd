"""Memory per GPU under a TP/EP plan: weights by category per rank, and the KV-cache pool left.

Weights come from a tensor inventory (a checkpoint's headers, or a config plus a precision plan:
no tensor data either way) placed by :class:`~inkling_ckpt.plan.ShardPlan`. Each rank's bytes
are split by the inventory's memory categories; ``replicated`` is the part of a rank's bytes
that other ranks hold too (replicated tensors, KV heads copied when tp exceeds them).

KV cache per rank: each attention layer stores K and V for ``kv_heads_local = max(1, KV/tp)``
heads of ``head_dim``; BF16 costs 2 bytes an element, MXFP8 1 byte plus one E8M0 scale byte per
32 elements. Full-attention layers (and the MTP head's attention, which is full) keep every
token; sliding-window layers keep at most ``sliding_window`` tokens per sequence. The pool is
``mem_fraction × GPU memory − the rank's weights`` (the engines' static memory fraction covers
weights and KV; activations and CUDA graphs live in the rest). ``kv_tokens`` is how many tokens
of context fit once one sequence's sliding windows are set aside; ``sequences`` is how many
sequences of ``context`` tokens fit at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import PlanError
from ..model.config import InklingConfig
from ..model.inventory import Category, TensorSpec
from ..model.precision import PrecisionPlan
from .parallel import ShardPlan

#: GPU memory as sold, in GB (10^9 bytes). What the driver reports usable is a little different
#: (an H200 shows 143771 MiB); pass --gpu-memory to use an exact figure.
GPU_PRESETS: dict[str, int] = {
    "H200": 141, "B200": 192, "GB200": 192, "B300": 288, "GB300": 288, "MI355X": 288, "VR200": 288,
}
GB = 10**9

#: KV-cache element formats: (bytes per element numerator, elements per scale byte or None).
KV_DTYPES: dict[str, tuple[int, int | None]] = {"bf16": (2, None), "mxfp8": (1, 32)}

CATEGORIES: tuple[str, ...] = tuple(c.value for c in Category)


def gpu_memory(name: str) -> int:
    key = name.strip().upper()
    if key not in GPU_PRESETS:
        raise PlanError(f"unknown GPU preset {name!r}; known: {', '.join(GPU_PRESETS)} (or give --gpu-memory)")
    return GPU_PRESETS[key] * GB


@dataclass(frozen=True)
class KVCost:
    """KV-cache bytes per rank."""

    dtype: str
    heads_per_rank: int
    bytes_per_token_layer: int
    full_layers: int  # full-attention decoder layers plus MTP layers
    sliding_layers: int
    window: int

    @property
    def bytes_per_token(self) -> int:
        """What each token of context costs at the full-attention layers."""
        return self.full_layers * self.bytes_per_token_layer

    @property
    def sliding_bytes_per_sequence(self) -> int:
        """What one long sequence costs at the sliding-window layers (its window, whatever its length)."""
        return self.sliding_layers * self.window * self.bytes_per_token_layer

    def sequence_bytes(self, context: int) -> int:
        return (self.full_layers * context + self.sliding_layers * min(context, self.window)) * self.bytes_per_token_layer


def kv_cost(cfg: InklingConfig, tp: int, kv_dtype: str = "bf16") -> KVCost:
    if kv_dtype not in KV_DTYPES:
        raise PlanError(f"unknown KV-cache dtype {kv_dtype!r}; known: {', '.join(KV_DTYPES)}")
    per_el, per_scale = KV_DTYPES[kv_dtype]
    heads = max(1, cfg.num_key_value_heads // tp)
    elems = heads * cfg.head_dim
    if per_scale and elems % per_scale:
        raise PlanError(f"{kv_dtype} KV needs {elems} elements per token to be a multiple of {per_scale}")
    per_tensor = elems * per_el + (elems // per_scale if per_scale else 0)
    full = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_full_attention(i)) + cfg.num_nextn_predict_layers
    return KVCost(kv_dtype, heads, 2 * per_tensor, full, cfg.num_hidden_layers - (full - cfg.num_nextn_predict_layers),
                  cfg.sliding_window)


def rank_memory(plan: ShardPlan) -> list[dict[str, Any]]:
    """Per rank: bytes by category, bytes also held by other ranks, and the total."""
    tp = plan.tp
    cats = [dict.fromkeys(CATEGORIES, 0) for _ in range(tp)]
    replicated = [0] * tp
    for p in plan.placements:
        n = p.local_nbytes
        cat = p.spec.category.value
        dup = p.replicated_copies > 1
        for r, piece in enumerate(p.holders):
            if piece is not None:
                cats[r][cat] += n
                if dup:
                    replicated[r] += n
    return [{"rank": r, "ep_rank": plan.parallel.ep_rank(r), "bytes": sum(cats[r].values()),
             "by_category": cats[r], "replicated": replicated[r]} for r in range(tp)]


def memory_report(cfg: InklingConfig, precision: PrecisionPlan, specs: Sequence[TensorSpec], tp: int, ep: int, *,
                  source: str, gpus: Sequence[str] | None = None, gpu_bytes: int | None = None,
                  mem_fraction: float = 0.9, kv_dtype: str = "bf16", context: int | None = None) -> dict[str, Any]:
    """The whole report as JSON-ready data (see module docstring for the definitions)."""
    if not 0.0 < mem_fraction <= 1.0:
        raise PlanError(f"--mem-fraction must be in (0, 1], got {mem_fraction}")
    if context is not None and context < 1:
        raise PlanError(f"--context must be positive, got {context}")
    targets: list[tuple[str, int]]
    if gpu_bytes is not None:
        if gpu_bytes <= 0:
            raise PlanError("--gpu-memory must be positive")
        targets = [(gpus[0].upper() if gpus else "custom", gpu_bytes)]
    else:
        names = list(gpus) if gpus else list(GPU_PRESETS)
        targets = [(n.strip().upper(), gpu_memory(n)) for n in names]
    plan = ShardPlan.build(cfg, precision, tp, ep, specs)
    ranks = rank_memory(plan)
    by_cat = dict.fromkeys(CATEGORIES, 0)
    for s in specs:
        by_cat[s.category.value] += s.nbytes
    worst = max(r["bytes"] for r in ranks)
    kv = kv_cost(cfg, tp, kv_dtype)
    ctx = context or min(cfg.max_position_embeddings, 131072)
    gpu_rows = []
    for name, mem in targets:
        budget = int(mem * mem_fraction)
        pool = budget - worst
        tokens = max(0, (pool - kv.sliding_bytes_per_sequence) // kv.bytes_per_token) if kv.bytes_per_token else 0
        gpu_rows.append({
            "gpu": name, "memory_bytes": mem, "budget_bytes": budget, "fits": pool > 0,
            "kv_pool_bytes": max(0, pool), "kv_tokens": int(tokens) if pool > 0 else 0,
            "sequences": int(max(0, pool) // kv.sequence_bytes(ctx)),
        })
    return {
        "source": source,
        "variant": precision.variant,
        "precision_plan": str(precision),
        "plan": {"tp": tp, "ep": ep, "moe_tp": plan.parallel.moe_tp},
        "tensors": len(specs),
        "checkpoint_bytes": sum(by_cat.values()),
        "checkpoint_bytes_by_category": by_cat,
        "ranks": ranks,
        "max_rank_bytes": worst,
        "all_ranks_bytes": sum(r["bytes"] for r in ranks),
        "kv_cache": {"dtype": kv.dtype, "kv_heads_per_rank": kv.heads_per_rank,
                     "full_attention_layers": kv.full_layers, "sliding_layers": kv.sliding_layers,
                     "sliding_window": kv.window, "bytes_per_token": kv.bytes_per_token,
                     "sliding_bytes_per_sequence": kv.sliding_bytes_per_sequence, "context": ctx,
                     "bytes_per_sequence": kv.sequence_bytes(ctx)},
        "mem_fraction": mem_fraction,
        "gpus": gpu_rows,
    }


_SHORT = {"routed_experts": "experts", "attention": "attention", "embeddings_head": "embed/head",
          "router_norms": "router+norms", "mtp_head": "mtp", "vision_tower": "vision"}


def _gb(n: int) -> str:
    return f"{n / GB:.2f}" if n < 10 * GB else f"{n / GB:.1f}"


def _tokens(n: int) -> str:
    for unit, div in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _unit(largest: int) -> tuple[str, int]:
    for name, div in (("GB", GB), ("MB", 10**6), ("kB", 10**3)):
        if largest >= div:
            return name, div
    return "B", 1


def render_ranks(ranks: Sequence[dict[str, Any]], ckpt_bytes: int, ckpt_by_cat: dict[str, int] | None = None) -> str:
    """Per-rank bytes by category, with the checkpoint's own totals as the last row."""
    unit, div = _unit(ckpt_bytes)

    def f(n: int) -> str:
        return f"{n / div:.2f}" if n < 10 * div else f"{n / div:.1f}"

    cols = list(CATEGORIES)
    lines = [f"bytes per rank, in {unit} ({unit} = {div:.0e} bytes); 'replicated' = also held by other ranks",
             f"{'rank':>6} " + " ".join(f"{_SHORT[c]:>12}" for c in cols) + f" {'replicated':>11} {'total':>9}"]
    for r in ranks:
        lines.append(f"{r['rank']:>6} " + " ".join(f"{f(r['by_category'][c]):>12}" for c in cols)
                     + f" {f(r['replicated']):>11} {f(r['bytes']):>9}")
    lines.append(f"{'sum':>6} " + " ".join(f"{f(sum(r['by_category'][c] for r in ranks)):>12}" for c in cols)
                 + f" {f(sum(r['replicated'] for r in ranks)):>11} {f(sum(r['bytes'] for r in ranks)):>9}")
    cats = " ".join(f"{f(ckpt_by_cat[c]):>12}" for c in cols) if ckpt_by_cat else " ".join(f"{'':>12}" for c in cols)
    lines.append(f"{'ckpt':>6} {cats} {'':>11} {f(ckpt_bytes):>9}")
    return "\n".join(lines)


def render_memory(rep: dict[str, Any]) -> str:
    """The report as tables for people (GB = 10^9 bytes)."""
    p = rep["plan"]
    lines = [
        f"{rep['source']}: {rep['variant']} ({rep['precision_plan']}), {rep['tensors']} tensors, "
        f"{_gb(rep['checkpoint_bytes'])} GB",
        f"plan: tp {p['tp']}, ep {p['ep']}, moe_tp {p['moe_tp']}",
        "",
    ]
    lines.append(render_ranks(rep["ranks"], rep["checkpoint_bytes"], rep["checkpoint_bytes_by_category"]))
    kv = rep["kv_cache"]
    lines += [
        "",
        f"KV cache ({kv['dtype']}, {kv['kv_heads_per_rank']} KV heads/rank): {kv['bytes_per_token']} B/token over "
        f"{kv['full_attention_layers']} full-attention layers (incl. MTP); {kv['sliding_layers']} sliding layers hold "
        f"{kv['sliding_window']} tokens/sequence = {kv['sliding_bytes_per_sequence'] / 2**20:.1f} MiB",
        f"budget = {rep['mem_fraction']:g} x GPU memory; pool = budget - largest rank ({_gb(rep['max_rank_bytes'])} GB)",
        "",
        f"{'gpu':<8} {'memory':>8} {'budget':>8} {'fits':>5} {'KV pool':>9} {'KV tokens':>10} {'seqs@' + _tokens(kv['context']):>10}",
    ]
    for g in rep["gpus"]:
        lines.append(f"{g['gpu']:<8} {_gb(g['memory_bytes']):>8} {_gb(g['budget_bytes']):>8} "
                     f"{'yes' if g['fits'] else 'NO':>5} {_gb(g['kv_pool_bytes']):>9} {_tokens(g['kv_tokens']):>10} "
                     f"{g['sequences']:>10}")
    return "\n".join(lines)
