"""TP/EP plans: which rank holds which slice of every tensor. Pure data, no I/O.

A plan is ``(tp, ep)``; ranks are numbered ``0..tp-1``. ``moe_tp = tp / ep`` ranks share each
EP rank's experts: rank ``r`` is EP rank ``r // moe_tp`` and moe-TP rank ``r % moe_tp`` (the
SGLang numbering, ``moe_ep_rank = tp_rank // (tp_size // ep_size)``). EP rank ``e`` owns the
contiguous experts ``[e·E/ep, (e+1)·E/ep)`` (reference/peers.md §4.1).

:func:`validate` refuses a plan the model cannot take, with a one-line reason, before anything
is read; :class:`ShardPlan` then places every tensor of an inventory: a :class:`Placement` says
along which stored dimension the tensor is cut, into how many equal pieces, and which piece
each rank holds (``None``: the rank does not hold it). Pieces are contiguous, in rank order, so
concatenating them along the dimension gives the tensor back exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

from ..errors import PlanError
from ..formats import get_format
from ..model.config import InklingConfig
from ..model.inventory import TensorSpec, nbytes
from ..model.precision import PrecisionPlan
from .rules import Rule, Split, rule_of

#: NVFP4 stores one FP8 scale per 16 inputs; the engines' NVFP4 MoE kernels additionally need
#: each rank's block-scale width to be a multiple of 16 columns (reference/peers.md §4.5).
NVFP4_SCALE_COLUMN_MULTIPLE = 16


@dataclass(frozen=True)
class ParallelPlan:
    """``(tp, ep)`` and the rank arithmetic that follows from it."""

    tp: int
    ep: int

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep

    @property
    def ranks(self) -> range:
        return range(self.tp)

    def ep_rank(self, rank: int) -> int:
        return rank // self.moe_tp

    def moe_tp_rank(self, rank: int) -> int:
        return rank % self.moe_tp

    def ep_group(self, ep_rank: int) -> range:
        """The TP ranks that share EP rank ``ep_rank``'s experts."""
        return range(ep_rank * self.moe_tp, (ep_rank + 1) * self.moe_tp)

    def experts_of(self, ep_rank: int, n_experts: int) -> range:
        per = n_experts // self.ep
        return range(ep_rank * per, (ep_rank + 1) * per)

    def owner_of(self, expert: int, n_experts: int) -> int:
        return expert // (n_experts // self.ep)

    def __str__(self) -> str:
        return f"tp {self.tp}, ep {self.ep} (moe_tp {self.moe_tp})"


def _divisors(n: int, limit: int = 64) -> str:
    return ", ".join(str(d) for d in range(1, min(n, limit) + 1) if n % d == 0)


def _layer_ranges(layers: Sequence[int]) -> str:
    out: list[str] = []
    for i in sorted(layers):
        if out and int(out[-1].split("-")[-1]) == i - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ",".join(out)


def validate(cfg: InklingConfig, precision: PrecisionPlan, tp: int, ep: int) -> ParallelPlan:
    """The plan, or PlanError with the first reason the model cannot be split this way."""
    for flag, v in (("--tp", tp), ("--ep", ep)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise PlanError(f"{flag} must be a positive integer, got {v!r}")
    E, NH, KV = cfg.n_routed_experts, cfg.num_attention_heads, cfg.num_key_value_heads
    if tp % ep:
        raise PlanError(
            f"--ep {ep} does not divide --tp {tp}: each EP rank is a group of tp/ep TP ranks that "
            f"share its experts (use an --ep among {_divisors(tp)})"
        )
    if E % ep:
        raise PlanError(
            f"--ep {ep} does not divide the {E} routed experts: each EP rank owns an equal contiguous "
            f"block of experts (use an --ep among {_divisors(E)})"
        )
    if NH % tp:
        raise PlanError(
            f"--tp {tp} does not divide the {NH} attention heads: query heads are split whole over TP "
            f"ranks (use a --tp among {_divisors(NH)})"
        )
    if KV % tp and tp % KV:
        raise PlanError(
            f"--tp {tp} and the {KV} KV heads: tp must divide the KV heads or be a multiple of them "
            f"(KV heads are split whole, or replicated when tp exceeds them)"
        )
    if cfg.vocab_size % tp:
        raise PlanError(
            f"--tp {tp} does not divide the vocabulary of {cfg.vocab_size} rows: embed_tokens and lm_head "
            f"are split by rows over TP, and padding the vocabulary is not supported"
        )
    for what, size in (("MTP dense MLP width (intermediate_size)", cfg.intermediate_size),
                       ("hidden size (MTP eh_proj rows)", cfg.hidden_size)):
        if cfg.num_nextn_predict_layers and size % tp:
            raise PlanError(f"--tp {tp} does not divide the {what} {size}")
    plan = ParallelPlan(tp, ep)
    moe_tp = plan.moe_tp
    if moe_tp > 1:
        I = cfg.moe_intermediate_size
        nvfp4 = [i for i, f in enumerate(precision.formats) if f == "nvfp4"]
        if nvfp4:
            cols = I // moe_tp // get_format("nvfp4").block if I % moe_tp == 0 else None
            detail = (f"at moe_tp {moe_tp} down_proj's {I} inputs become {I // moe_tp} per rank, "
                      f"{cols} scale columns" if cols is not None else
                      f"down_proj's {I} inputs do not even split {moe_tp} ways")
            raise PlanError(
                f"NVFP4 experts cannot be TP-sharded: --tp {tp} --ep {ep} gives moe_tp {moe_tp}, but layers "
                f"{_layer_ranges(nvfp4)} store routed experts in NVFP4, which need moe_tp 1 - each expert's "
                f"input_scale and weight_scale_2 cover its full input width, and the engines require each "
                f"rank's block-scale width to be a multiple of {NVFP4_SCALE_COLUMN_MULTIPLE} columns ({detail}); "
                f"use --ep {tp} with --tp {tp}"
            )
        if I % moe_tp:
            raise PlanError(
                f"moe_tp {moe_tp} (--tp {tp} / --ep {ep}) does not divide the expert width "
                f"moe_intermediate_size {I}"
            )
        for fmt_name in precision.used_formats():
            block = get_format(fmt_name).block
            if (I // moe_tp) % block:
                layers = [i for i, f in enumerate(precision.formats) if f == fmt_name]
                raise PlanError(
                    f"moe_tp {moe_tp} (--tp {tp} / --ep {ep}) cuts down_proj's input width {I} into pieces of "
                    f"{I // moe_tp}, not a multiple of the {fmt_name} block of {block} (layers "
                    f"{_layer_ranges(layers)}): every split must land on a block boundary; use a larger --ep"
                )
    return plan


@dataclass(frozen=True)
class Placement:
    """Where one stored tensor goes: cut along ``dim`` into ``pieces`` equal pieces;
    ``holders[rank]`` is the piece that rank holds, or None."""

    spec: TensorSpec
    rule: Rule
    dim: int | None
    pieces: int
    holders: tuple[int | None, ...]

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.spec.shape
        s = list(self.spec.shape)
        s[self.dim] //= self.pieces
        return tuple(s)

    @property
    def local_nbytes(self) -> int:
        return nbytes(self.local_shape, self.spec.dtype)

    def piece_range(self, piece: int) -> tuple[int, int]:
        """[start, stop) of ``piece`` along ``dim``."""
        assert self.dim is not None
        step = self.spec.shape[self.dim] // self.pieces
        return piece * step, (piece + 1) * step

    def ranks(self) -> list[int]:
        return [r for r, p in enumerate(self.holders) if p is not None]

    def first_holder(self, piece: int) -> int:
        """The lowest rank holding ``piece`` (what a merge reads)."""
        return self.holders.index(piece)

    @property
    def replicated_copies(self) -> int:
        """How many ranks hold each piece (1 = no duplication)."""
        return len(self.ranks()) // self.pieces


@dataclass
class ShardPlan:
    """Placements of every tensor of a checkpoint under one parallel plan."""

    cfg: InklingConfig
    precision: PrecisionPlan
    parallel: ParallelPlan
    placements: list[Placement] = field(default_factory=list)

    @classmethod
    def build(cls, cfg: InklingConfig, precision: PrecisionPlan, tp: int, ep: int,
              specs: Iterable[TensorSpec]) -> "ShardPlan":
        parallel = validate(cfg, precision, tp, ep)
        plan = cls(cfg, precision, parallel)
        plan.placements = [place(spec, cfg, parallel) for spec in specs]
        return plan

    @property
    def tp(self) -> int:
        return self.parallel.tp

    def for_rank(self, rank: int) -> Iterator[Placement]:
        for p in self.placements:
            if p.holders[rank] is not None:
                yield p

    def rank_bytes(self) -> list[int]:
        out = [0] * self.tp
        for p in self.placements:
            n = p.local_nbytes
            for r, piece in enumerate(p.holders):
                if piece is not None:
                    out[r] += n
        return out

    def expert_ownership(self) -> dict[int, dict[str, object]]:
        """EP rank -> its experts and the TP ranks that hold them."""
        E = self.cfg.n_routed_experts
        out: dict[int, dict[str, object]] = {}
        for e in range(self.parallel.ep):
            ex = self.parallel.experts_of(e, E)
            out[e] = {"experts": [ex.start, ex.stop], "ranks": list(self.parallel.ep_group(e))}
        return out


def place(spec: TensorSpec, cfg: InklingConfig, plan: ParallelPlan) -> Placement:
    """The placement of one tensor under ``plan`` (the plan has passed :func:`validate`)."""
    rule = rule_of(spec.row)
    tp = plan.tp
    every = tuple(range(tp))
    if rule.split is Split.REPLICATE:
        return Placement(spec, rule, None, 1, (0,) * tp)
    if rule.split is Split.EXPERT:
        return _place_expert(spec, rule, cfg, plan)
    dim = rule.dim
    assert dim is not None
    size = spec.shape[dim]
    if rule.split is Split.Q_HEADS:
        heads, pieces, holders = cfg.num_attention_heads, tp, every
    elif rule.split is Split.KV_HEADS:
        heads = cfg.num_key_value_heads
        if tp <= heads:
            pieces, holders = tp, every
        else:
            pieces = heads
            holders = tuple(r // (tp // heads) for r in range(tp))
    else:  # VOCAB, TP: even pieces of rows/columns
        heads, pieces, holders = size, tp, every
    if size % heads or heads % pieces:
        raise PlanError(f"{spec.name}: dim {dim} of {list(spec.shape)} cannot be cut into {pieces} pieces "
                        f"on {heads}-way boundaries ({rule.describe()})")
    if pieces == 1:
        return Placement(spec, rule, None, 1, (0,) * tp)
    return Placement(spec, rule, dim, pieces, holders)


def _place_expert(spec: TensorSpec, rule: Rule, cfg: InklingConfig, plan: ParallelPlan) -> Placement:
    assert spec.expert is not None
    group = plan.ep_group(plan.owner_of(spec.expert, cfg.n_routed_experts))
    moe_tp = plan.moe_tp
    ndim = len(spec.shape)
    # Logical dim 0 (rows) is stored dim 0; logical dim 1 (the input width) is the stored last
    # dim, packed or not. Scalars (weight_scale_2, input_scale) travel whole with their expert.
    if moe_tp == 1 or ndim == 0:
        holders = tuple(0 if r in group else None for r in plan.ranks)
        return Placement(spec, rule, None, 1, holders)
    dim = 0 if rule.dim == 0 else ndim - 1
    if spec.shape[dim] % moe_tp:
        raise PlanError(f"{spec.name}: stored dim {dim} of {list(spec.shape)} does not split {moe_tp} ways")
    holders = tuple(plan.moe_tp_rank(r) if r in group else None for r in plan.ranks)
    return Placement(spec, rule, dim, moe_tp, holders)

