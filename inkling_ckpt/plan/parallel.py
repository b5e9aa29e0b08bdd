"""TP/EP plans: which rank holds which slice of every tensor. Pure data, no I/O.

A plan is ``(tp, ep)``; ranks are numbered ``0..tp-1``. ``moe_tp = tp / ep`` ranks share each
EP rank's experts: rank ``r`` is EP rank ``r // moe_tp`` and moe-TP rank ``r % moe_tp`` (the
SGLang numbering, ``moe_ep_rank = tp_rank // (tp_size // ep_size)``). EP rank ``e`` owns the
contiguous experts ``[e·E/ep, (e+1)·E/ep)``: a slice of dim 0 of every stacked expert tensor.

:func:`validate` refuses a plan the model cannot take, with a one-line reason, before anything
is read; :class:`ShardPlan` then places every tensor of an inventory. A :class:`Placement` lists
its :class:`Cut` s (at most two: the TP or EP cut, then the moe-TP cut inside an expert) and,
per rank, the piece of each cut that rank holds (``None``: the rank holds none of the tensor).
Pieces are contiguous, equal and in order, so concatenating them gives the tensor back exactly.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence

from ..errors import PlanError
from ..formats.mxfp8 import BLOCK as MXFP8_BLOCK
from ..formats.nvfp4 import BLOCK as NVFP4_BLOCK
from ..model.config import InklingConfig
from ..model.inventory import TensorSpec, nbytes
from ..model.precision import PrecisionPlan
from .rules import EXPERT_PARTS, Rule, Split, rule_of

#: The engines' NVFP4 MoE kernels need each rank's block-scale width to be a multiple of 16
#: scale columns (spec/parallel.md).
NVFP4_SCALE_COLUMN_MULTIPLE = 16
#: Elements per block scale along an expert's input width, per expert format.
EXPERT_BLOCK = {"mxfp8": MXFP8_BLOCK, "nvfp4": NVFP4_BLOCK}


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


def layer_ranges(layers: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out: list[list[int]] = []
    for i in sorted(layers):
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in out)


def _head_sets(cfg: InklingConfig) -> dict[tuple[int, int], list[int]]:
    """(query heads, KV heads) -> the layers that have them (sliding and full layers may differ)."""
    out: dict[tuple[int, int], list[int]] = {}
    for i in range(cfg.num_hidden_layers):
        d = cfg.layer_dims(i)
        out.setdefault((d.heads, d.kv_heads), []).append(i)
    return out


def validate(cfg: InklingConfig, precision: PrecisionPlan, tp: int, ep: int) -> ParallelPlan:
    """The plan, or PlanError with the first reason the model cannot be split this way."""
    for flag, v in (("--tp", tp), ("--ep", ep)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise PlanError(f"{flag} must be a positive integer, got {v!r}")
    if len(precision) != cfg.num_hidden_layers:
        raise PlanError(f"precision plan covers {len(precision)} layers, the model has {cfg.num_hidden_layers}")
    E = cfg.n_routed_experts
    if tp % ep:
        raise PlanError(f"--ep {ep} does not divide --tp {tp}: each EP rank is a group of tp/ep TP ranks that "
                        f"share its experts (use an --ep among {_divisors(tp)})")
    if E % ep:
        raise PlanError(f"--ep {ep} does not divide the {E} routed experts: each EP rank owns an equal contiguous "
                        f"block of experts (use an --ep among {_divisors(E)})")
    for (nh, kv), layers in _head_sets(cfg).items():
        where = f"layers {layer_ranges(layers)}" if len(layers) < cfg.num_hidden_layers else "every layer"
        if nh % tp:
            raise PlanError(f"--tp {tp} does not divide the {nh} attention heads ({where}): query heads are split "
                            f"whole over TP ranks (use a --tp among {_divisors(nh)})")
        if kv % tp and tp % kv:
            raise PlanError(f"--tp {tp} and the {kv} KV heads ({where}): tp must divide the KV heads or be a "
                            "multiple of them (KV heads are split whole, or replicated when tp exceeds them)")
    if cfg.vocab_size % tp:
        raise PlanError(f"--tp {tp} does not divide the vocabulary of {cfg.vocab_size} rows: embed and unembed "
                        "are split by rows over TP, and padding the vocabulary is not supported")
    plan = ParallelPlan(tp, ep)
    moe_tp = plan.moe_tp
    if moe_tp > 1:
        F = cfg.moe_intermediate_size
        nvfp4 = [i for i, f in enumerate(precision.formats) if f == "nvfp4"]
        if nvfp4:
            full_cols = F // NVFP4_BLOCK
            detail = (f"{F}/{NVFP4_BLOCK} = {full_cols} columns at moe_tp 1, {full_cols / moe_tp:g} at moe_tp {moe_tp}")
            raise PlanError(
                f"NVFP4 experts cannot be TP-sharded: --tp {tp} --ep {ep} gives moe_tp {moe_tp}, but layers "
                f"{layer_ranges(nvfp4)} store routed experts in NVFP4, which need moe_tp 1: each expert's activation "
                f"scale must cover its full input width, and the engines require each rank's block-scale width to be "
                f"a multiple of {NVFP4_SCALE_COLUMN_MULTIPLE} scale columns ({detail}); use --ep {tp} with --tp {tp}")
        if F % moe_tp:
            raise PlanError(f"moe_tp {moe_tp} (--tp {tp} / --ep {ep}) does not divide the expert width "
                            f"moe_intermediate_size {F}: w13 rows split in whole (gate, up) pairs, w2 by columns")
        for fmt in precision.used_formats():
            block = EXPERT_BLOCK.get(fmt)
            if block and (F // moe_tp) % block:
                layers = [i for i, f in enumerate(precision.formats) if f == fmt]
                raise PlanError(
                    f"moe_tp {moe_tp} (--tp {tp} / --ep {ep}) cuts w2's input width {F} into pieces of {F // moe_tp}, "
                    f"not a multiple of the {fmt} block of {block} (layers {layer_ranges(layers)}): every split must "
                    "land on a block boundary; use a larger --ep")
    return plan


@dataclass(frozen=True)
class Cut:
    """``pieces`` equal contiguous pieces along stored dimension ``dim``."""

    dim: int
    pieces: int

    def bounds(self, size: int, piece: int) -> tuple[int, int]:
        step = size // self.pieces
        return piece * step, (piece + 1) * step


@dataclass(frozen=True)
class Placement:
    """Where one stored tensor goes: ``cuts`` divide it; ``holders[rank]`` is the piece of each
    cut that rank holds (``()`` when uncut), or None."""

    spec: TensorSpec
    rule: Rule
    cuts: tuple[Cut, ...]
    holders: tuple[tuple[int, ...] | None, ...]

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def local_shape(self) -> tuple[int, ...]:
        s = list(self.spec.shape)
        for c in self.cuts:
            s[c.dim] //= c.pieces
        return tuple(s)

    @property
    def local_nbytes(self) -> int:
        return nbytes(self.local_shape, self.spec.dtype)

    def region(self, piece: tuple[int, ...]) -> list[tuple[int, int, int]]:
        """``(dim, start, stop)`` of each cut for one piece."""
        return [(c.dim, *c.bounds(self.spec.shape[c.dim], i)) for c, i in zip(self.cuts, piece, strict=True)]

    def pieces(self) -> list[tuple[int, ...]]:
        """Every piece, in the order that reassembles the tensor (last cut fastest)."""
        return list(itertools.product(*(range(c.pieces) for c in self.cuts)))

    def ranks(self) -> list[int]:
        return [r for r, p in enumerate(self.holders) if p is not None]

    def first_holder(self, piece: tuple[int, ...]) -> int:
        """The lowest rank holding ``piece`` (what a merge reads)."""
        return self.holders.index(piece)

    def copies(self, rank: int) -> int:
        """How many ranks hold the piece ``rank`` holds (0 if it holds none)."""
        p = self.holders[rank]
        return 0 if p is None else self.holders.count(p)


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
            for r in p.ranks():
                out[r] += n
        return out

    def expert_ownership(self) -> dict[int, dict[str, object]]:
        """EP rank -> its experts [first, stop) and the TP ranks that hold them."""
        E = self.cfg.n_routed_experts
        out: dict[int, dict[str, object]] = {}
        for e in range(self.parallel.ep):
            ex = self.parallel.experts_of(e, E)
            out[e] = {"experts": [ex.start, ex.stop], "ranks": list(self.parallel.ep_group(e))}
        return out


def _cut(spec: TensorSpec, dim: int, pieces: int, unit: int, what: str) -> Cut:
    """A cut of ``dim`` into ``pieces`` whose boundaries fall on multiples of ``unit`` elements."""
    size = spec.shape[dim]
    if size % pieces or (size // pieces) % unit:
        raise PlanError(f"{spec.name}: dim {dim} of {list(spec.shape)} cannot be cut into {pieces} pieces on {what}")
    return Cut(dim, pieces)


def place(spec: TensorSpec, cfg: InklingConfig, plan: ParallelPlan) -> Placement:
    """The placement of one tensor under ``plan`` (the plan has passed :func:`validate`)."""
    rule = rule_of(spec)
    tp = plan.tp
    if rule.split is Split.REPLICATE:
        return Placement(spec, rule, (), ((),) * tp)
    if rule.split is Split.EXPERT:
        return _place_expert(spec, rule, cfg, plan)
    assert rule.dim is not None  # every splitting rule of the table names its dim
    size = spec.shape[rule.dim]
    if rule.split is Split.VOCAB:
        pieces, holders, unit, what = tp, [(r,) for r in range(tp)], 1, "vocabulary rows"
    else:
        if spec.layer is None:
            raise PlanError(f"{spec.name}: a per-head tensor outside any layer")
        dims = cfg.layer_dims(spec.layer)
        heads = dims.heads if rule.split is Split.Q_HEADS else dims.kv_heads
        if size % heads:
            raise PlanError(f"{spec.name}: dim {rule.dim} of {list(spec.shape)} is not {heads} heads")
        if rule.split is Split.KV_HEADS and tp > heads:
            pieces, holders = heads, [(r // (tp // heads),) for r in range(tp)]
        else:
            pieces, holders = tp, [(r,) for r in range(tp)]
        unit, what = size // heads, "head boundaries"
    if pieces == 1:
        return Placement(spec, rule, (), ((),) * tp)
    return Placement(spec, rule, (_cut(spec, rule.dim, pieces, unit, what),), tuple(holders))


def _place_expert(spec: TensorSpec, rule: Rule, cfg: InklingConfig, plan: ParallelPlan) -> Placement:
    part = EXPERT_PARTS.get(spec.part if spec.part is not None else "")
    if part is None:
        raise PlanError(f"{spec.name}: stored expert part {spec.part!r} has no split rule")
    cuts: list[Cut] = []
    if part.ep and plan.ep > 1:
        cuts.append(_cut(spec, 0, plan.ep, 1, "expert boundaries"))
    moe = part.moe_tp and plan.moe_tp > 1
    if moe:
        assert rule.dim is not None
        cuts.append(_cut(spec, rule.dim, plan.moe_tp, 2 if rule.pairs else 1,
                         "whole (gate, up) row pairs" if rule.pairs else "an even split"))
    holders = []
    for r in plan.ranks:
        piece: tuple[int, ...] = ()
        if part.ep and plan.ep > 1:
            piece += (plan.ep_rank(r),)
        if moe:
            piece += (plan.moe_tp_rank(r),)
        holders.append(piece)
    return Placement(spec, rule, tuple(cuts), tuple(holders))
