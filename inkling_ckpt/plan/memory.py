"""Memory per GPU under a TP/EP plan: weights by category per rank, and the KV-cache pool left.

Weights come from a tensor inventory (a checkpoint's headers, or a config plus a precision plan
and a dtype assumption: no tensor data either way) placed by :class:`~inkling_ckpt.plan.ShardPlan`.
Each rank's bytes are split by the inventory's memory categories; ``replicated`` is the part of
a rank's bytes that other ranks hold too (replicated tensors, KV heads copied when tp exceeds
them, an EP rank's expert scalars shared by its moe-TP group).

KV cache per rank, per attention layer: K and V for ``max(1, kv_heads / tp)`` heads of
``head_dim`` (sliding layers use the ``swa_*`` head counts); BF16 costs 2 bytes an element,
MXFP8 1 byte plus one E8M0 scale byte per 32 elements. Full-attention layers keep every token;
sliding-window layers keep at most ``sliding_window_size`` tokens per sequence. The pool is
``mem_fraction × GPU memory − the largest rank's weights`` (the engines' static memory fraction
covers weights and KV; activations and CUDA graphs live in the rest). ``kv_tokens`` is how many
tokens of context fit once one sequence's sliding windows are set aside; ``sequences`` is how
many sequences of ``context`` tokens fit at once.

:func:`release_notes` compares the totals with the release cookbook's figures (about 394 GB
mixed, 623 GB MXFP8, 94 / 151 GB of experts per GPU at EP4, about 311 GB per GPU at TP2 for
MXFP8) and says where and why they differ (spec/inkling2.md: BF16 non-experts give 390.06 /
619.38 GB; F32 ``embed`` and ``unembed`` add exactly the 3.7 GB the cookbook has more).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from ..errors import PlanError
from ..model.config import InklingConfig
from ..model.inventory import Category, TensorSpec
from ..model.precision import PrecisionPlan
from ..units import GB, KB, MB, fmt_bytes
from .parallel import ShardPlan

#: GPU memory as sold, in GB (10^9 bytes). What the driver reports usable is a little different
#: (an H200 shows 143771 MiB); pass --gpu-memory to use an exact figure.
GPU_PRESETS: dict[str, int] = {
    "H200": 141, "B200": 192, "GB200": 192, "B300": 288, "GB300": 288, "MI355X": 288, "VR200": 288,
}

#: KV-cache element formats: (bytes per element, elements per scale byte or None).
KV_DTYPES: dict[str, tuple[int, int | None]] = {"bf16": (2, None), "mxfp8": (1, 32)}

CATEGORIES: tuple[str, ...] = tuple(c.value for c in Category)

#: The release cookbook's figures (seed 001), by precision plan of the release config.
COOKBOOK: dict[str, dict[str, Any]] = {
    "0-39:nvfp4,40-47:mxfp8": {"repo": "thinkingmachines/Inkling-2-Small", "total": 394, "experts_ep4": 94},
    "0-47:mxfp8": {"repo": "thinkingmachines/Inkling-2-Small-MXFP8", "total": 623, "experts_ep4": 151,
                   "per_gpu_tp2": 311},
}


def gpu_memory(name: str) -> int:
    key = name.strip().upper()
    if key not in GPU_PRESETS:
        raise PlanError(f"unknown GPU preset {name!r}; known: {', '.join(GPU_PRESETS)} (or give --gpu-memory)")
    return GPU_PRESETS[key] * GB


@dataclass(frozen=True)
class KVCost:
    """KV-cache bytes per rank."""

    dtype: str
    full_layers: int
    sliding_layers: int
    window: int
    bytes_per_token: int  # every full-attention layer, per token of context
    sliding_bytes_per_token: int  # every sliding layer, per token inside the window
    full_heads_per_rank: int
    sliding_heads_per_rank: int

    @property
    def sliding_bytes_per_sequence(self) -> int:
        """What one long sequence costs at the sliding-window layers (its window, whatever its length)."""
        return self.window * self.sliding_bytes_per_token

    def sequence_bytes(self, context: int) -> int:
        return context * self.bytes_per_token + min(context, self.window) * self.sliding_bytes_per_token


def kv_cost(cfg: InklingConfig, tp: int, kv_dtype: str = "bf16") -> KVCost:
    """K and V bytes per token per rank, sliding layers (at their window) apart from full ones."""
    if kv_dtype not in KV_DTYPES:
        raise PlanError(f"unknown KV-cache dtype {kv_dtype!r}; known: {', '.join(KV_DTYPES)}")
    per_el, per_scale = KV_DTYPES[kv_dtype]
    full = sliding = 0
    counts = {True: 0, False: 0}
    heads = {True: 0, False: 0}
    for i in range(cfg.num_hidden_layers):
        d = cfg.layer_dims(i)
        h = max(1, d.kv_heads // tp)  # tp > kv: each rank holds one (replicated) KV head
        elems = h * d.head_dim
        if per_scale and elems % per_scale:
            raise PlanError(f"{kv_dtype} KV needs {elems} elements per token (layer {i}) to be a multiple of {per_scale}")
        cost = 2 * (elems * per_el + (elems // per_scale if per_scale else 0))
        if d.sliding:
            sliding += cost
        else:
            full += cost
        counts[d.sliding] += 1
        heads[d.sliding] = h
    return KVCost(kv_dtype, counts[False], counts[True], cfg.sliding_window_size, full, sliding, heads[False],
                  heads[True])


def rank_memory(plan: ShardPlan) -> list[dict[str, Any]]:
    """Per rank: bytes by category, bytes also held by other ranks, and the total."""
    tp = plan.tp
    cats = [dict.fromkeys(CATEGORIES, 0) for _ in range(tp)]
    replicated = [0] * tp
    for p in plan.placements:
        n = p.local_nbytes
        cat = p.spec.category.value
        for r in p.ranks():
            cats[r][cat] += n
            if p.copies(r) > 1:
                replicated[r] += n
    return [{"rank": r, "ep_rank": plan.parallel.ep_rank(r), "bytes": sum(cats[r].values()),
             "by_category": cats[r], "replicated": replicated[r]} for r in range(tp)]


def bare_config_dtypes(specs: Sequence[TensorSpec], embed_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.dtype]:
    """The dtype assumption of a bare-config estimate: every non-expert tensor BF16 (the spec's
    390.06 / 619.38 GB), ``embed`` and ``unembed`` in ``embed_dtype``."""
    return {s.name: (embed_dtype if s.category is Category.EMBEDDINGS else torch.bfloat16)
            for s in specs if s.part is None}


def memory_report(cfg: InklingConfig, precision: PrecisionPlan, specs: Sequence[TensorSpec], tp: int, ep: int, *,
                  source: str, dtypes_note: str = "as stored", gpus: Sequence[str] | None = None,
                  gpu_bytes: int | None = None, mem_fraction: float = 0.9, kv_dtype: str = "bf16",
                  context: int | None = None) -> dict[str, Any]:
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
        "dtypes": dtypes_note,
        "parallel_plan": {"tp": tp, "ep": ep, "moe_tp": plan.parallel.moe_tp},
        "tensors": len(specs),
        "checkpoint_bytes": sum(by_cat.values()),
        "checkpoint_bytes_by_category": by_cat,
        "ranks": ranks,
        "max_rank_bytes": worst,
        "all_ranks_bytes": sum(r["bytes"] for r in ranks),
        "kv_cache": {"dtype": kv.dtype, "full_attention_layers": kv.full_layers,
                     "full_kv_heads_per_rank": kv.full_heads_per_rank, "sliding_layers": kv.sliding_layers,
                     "sliding_kv_heads_per_rank": kv.sliding_heads_per_rank, "sliding_window": kv.window,
                     "bytes_per_token": kv.bytes_per_token, "sliding_bytes_per_token": kv.sliding_bytes_per_token,
                     "sliding_bytes_per_sequence": kv.sliding_bytes_per_sequence, "context": ctx,
                     "bytes_per_sequence": kv.sequence_bytes(ctx)},
        "mem_fraction": mem_fraction,
        "gpus": gpu_rows,
        "notes": release_notes(cfg, precision, specs),
    }


def _embed_f32_extra(specs: Sequence[TensorSpec]) -> int:
    """Bytes ``embed`` and ``unembed`` would add if stored in F32 instead of their dtype."""
    return sum(math.prod(s.shape) * (4 - s.dtype.itemsize) for s in specs
               if s.category is Category.EMBEDDINGS and s.dtype.itemsize < 4)


def release_notes(cfg: InklingConfig, precision: PrecisionPlan, specs: Sequence[TensorSpec]) -> list[str]:
    """Where this inventory's figures differ from the release cookbook's, and why (release config only)."""
    from ..model.presets import preset_config  # the release config, as transformers' defaults

    book = COOKBOOK.get(str(precision))
    release = InklingConfig.from_dict(preset_config("full"))
    # Same tensors as the release (fields no shape depends on may differ).
    same = dataclasses.replace(cfg, max_position_embeddings=release.max_position_embeddings,
                               num_experts_per_tok=release.num_experts_per_tok) == release
    if book is None or not same:
        return []
    total = sum(s.nbytes for s in specs)
    experts = sum(s.nbytes for s in specs if s.category is Category.EXPERTS)
    extra = _embed_f32_extra(specs)
    emb = "/".join(sorted({str(s.dtype).removeprefix("torch.") for s in specs if s.category is Category.EMBEDDINGS}))
    lines = [f"{book['repo']}: the cookbook says about {book['total']} GB; this inventory totals {total / GB:.2f} GB "
             f"with embed/unembed in {emb}."]
    if extra:
        f32 = (total + extra) / GB
        lines.append(f"  The difference is F32 embed + unembed: those two [{cfg.vocab_size}, {cfg.hidden_size}] tensors "
                     f"in F32 add {extra / GB:.2f} GB -> {f32:.2f} GB"
                     + (f", which rounds to the cookbook's {book['total']}" if round(f32) == book["total"] else
                        f", still {book['total'] - f32:+.2f} GB from the cookbook's {book['total']}")
                     + " (--embed-dtype f32 on a bare config).")
    else:
        lines.append(f"  embed/unembed are F32, as the cookbook counts them: {total / GB:.2f} GB"
                     + (" rounds to its figure." if round(total / GB) == book["total"] else
                        f" is {book['total'] - total / GB:+.2f} GB from its figure."))
    lines.append(f"  Routed experts per GPU at EP4: {experts / 4 / GB:.2f} GB (cookbook about {book['experts_ep4']}).")
    if "per_gpu_tp2" in book:
        tp2 = rank_memory(ShardPlan.build(cfg, precision, 2, 2, specs))[0]
        lines.append(f"  Per GPU at TP2: {tp2['bytes'] / GB:.2f} GB (cookbook about {book['per_gpu_tp2']}, half the "
                     f"checkpoint; each GPU also keeps its own copy of the router, norms and vision tower, "
                     f"{tp2['replicated'] / GB:.2f} GB).")
    return lines


_SHORT = {"routed_experts": "experts", "attention": "attention", "embeddings_head": "embed/head",
          "router_norms": "router+norms", "vision_tower": "vision"}


def _gb(n: int) -> str:
    return f"{n / GB:.2f}"


def _tokens(n: int) -> str:
    for unit, div in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def _unit(largest: int) -> tuple[str, int]:
    for name, div in (("GB", GB), ("MB", MB), ("kB", KB)):
        if largest >= div:
            return name, div
    return "B", 1


def render_ranks(ranks: Sequence[dict[str, Any]], ckpt_bytes: int, ckpt_by_cat: Mapping[str, int] | None = None) -> str:
    """Per-rank bytes by category, with the checkpoint's own totals as the last row."""
    unit, div = _unit(ckpt_bytes)

    def f(n: int) -> str:
        return f"{n / div:.2f}"

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
    p = rep["parallel_plan"]
    lines = [
        f"{rep['source']}: {rep['variant']} ({rep['precision_plan']}), {rep['tensors']} tensors, "
        f"{_gb(rep['checkpoint_bytes'])} GB",
        f"dtypes: {rep['dtypes']}",
        f"plan: tp {p['tp']}, ep {p['ep']}, moe_tp {p['moe_tp']}",
        "",
        render_ranks(rep["ranks"], rep["checkpoint_bytes"], rep["checkpoint_bytes_by_category"]),
    ]
    kv = rep["kv_cache"]
    lines += [
        "",
        f"KV cache ({kv['dtype']}): {kv['full_attention_layers']} full-attention layers x "
        f"{kv['full_kv_heads_per_rank']} KV heads/rank = {kv['bytes_per_token']} B per token of context; "
        f"{kv['sliding_layers']} sliding layers x {kv['sliding_kv_heads_per_rank']} KV heads/rank hold "
        f"{kv['sliding_window']} tokens/sequence = {fmt_bytes(kv['sliding_bytes_per_sequence'], 'MB', digits=1)}",
        f"budget = {rep['mem_fraction']:g} x GPU memory; pool = budget - largest rank ({_gb(rep['max_rank_bytes'])} GB)",
        "",
        f"{'gpu':<8} {'memory':>8} {'budget':>8} {'fits':>5} {'KV pool':>9} {'KV tokens':>10} "
        f"{'seqs@' + _tokens(kv['context']):>10}",
    ]
    for g in rep["gpus"]:
        lines.append(f"{g['gpu']:<8} {_gb(g['memory_bytes']):>8} {_gb(g['budget_bytes']):>8} "
                     f"{'yes' if g['fits'] else 'NO':>5} {_gb(g['kv_pool_bytes']):>9} {_tokens(g['kv_tokens']):>10} "
                     f"{g['sequences']:>10}")
    if rep.get("notes"):
        lines += ["", "compared with the release cookbook (GB = 1e9 bytes):", *rep["notes"]]
    return "\n".join(lines)
