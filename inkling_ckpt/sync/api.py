"""Megatron-named trainer tensors -> served-checkpoint (HF) tensors, in load groups and buckets."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from ..convert.experts import SCALE_POLICIES, ExpertEncoder, ScalePolicy, expert_module
from ..errors import CheckpointError, PlanError
from ..model.config import InklingConfig
from ..model.inventory import EXPERT_PROJS, TensorSpec, inventory
from ..model.mapping import InklingMapping, StackedExperts
from ..model.precision import PrecisionPlan

Selection = Literal["all", "experts", "non-experts"]
SELECTIONS = ("all", "experts", "non-experts")
DEFAULT_BUCKET_BYTES = 512 << 20
_PREFIXES = ("module.",)  # DDP / Float16Module wrappers in front of Megatron names


@dataclass
class LoadGroup:
    """Tensors the engine must receive together (one expert's parts; one Megatron key's outputs)."""

    tensors: list[tuple[str, torch.Tensor]]
    what: str  # e.g. "layer 3 expert 5" or the Megatron key
    _nbytes: int | None = None

    @property
    def nbytes(self) -> int:
        if self._nbytes is None:
            self._nbytes = sum(t.numel() * t.element_size() for _, t in self.tensors)
        return self._nbytes


@dataclass
class Bucket:
    """Whole load groups, at most ``bucket_bytes`` unless one group alone is larger."""

    groups: list[LoadGroup] = field(default_factory=list)
    nbytes: int = 0

    def add(self, group: LoadGroup) -> None:
        self.groups.append(group)
        self.nbytes += group.nbytes

    @property
    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """What ``update_weights_from_tensor`` takes."""
        return [nt for g in self.groups for nt in g.tensors]

    def __iter__(self):
        return iter(self.named_tensors)

    def __len__(self) -> int:
        return sum(len(g.tensors) for g in self.groups)


class WeightSync:
    """Rename + re-encode + bucket, for one served checkpoint's config and precision plan.

    Args:
        cfg, plan: the served model's config and per-layer expert formats.
        scales: ``fresh`` (global scales from the new weights) or ``keep`` (NVFP4 global and
            input scales from ``reference``, so unchanged weights give the served bytes).
        reference: the served checkpoint (an :class:`~inkling_ckpt.layouts.hf.HFCheckpoint`);
            needed for ``keep``; with ``fresh`` its NVFP4 input scales are carried.
        select: ``all``, ``experts`` (routed experts only) or ``non-experts``.
        bucket_bytes: byte budget per bucket (default 512 MiB).
        vocab_rows: rows of the trainer's embedding/output layer if padded (default: any;
            rows past ``vocab_size`` are dropped).
        use_kernels: batch a layer's experts through the fused GPU kernels when the tensors are
            on CUDA (default); False encodes expert by expert through the codec.
    """

    def __init__(self, cfg: InklingConfig, plan: PrecisionPlan, *, scales: ScalePolicy = "fresh", reference=None,
                 select: Selection = "all", bucket_bytes: int = DEFAULT_BUCKET_BYTES, allow_nonfinite: bool = False,
                 use_kernels: bool = True):
        if select not in SELECTIONS:
            raise PlanError(f"unknown selection {select!r}; choose one of {', '.join(SELECTIONS)}")
        if scales not in SCALE_POLICIES:
            raise PlanError(f"unknown scale policy {scales!r}; choose one of {', '.join(SCALE_POLICIES)}")
        if int(bucket_bytes) <= 0:
            raise PlanError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.cfg = cfg
        self.plan = plan
        self.scales = scales
        self.reference = reference
        self.select = select
        self.bucket_bytes = int(bucket_bytes)
        self.allow_nonfinite = allow_nonfinite
        self.use_kernels = use_kernels
        self.mapping = InklingMapping(cfg)
        ref_for_encoder = reference if (scales == "keep" or (reference is not None and reference.plan.variant != "bf16")) else None
        self.encoder = ExpertEncoder(plan, scales=scales, reference=ref_for_encoder, allow_nonfinite=allow_nonfinite)
        self.specs: dict[str, TensorSpec] = {s.name: s for s in inventory(cfg, plan)}
        self._stacked: dict[str, tuple[int, str]] = {}  # megatron key -> (layer, "fc1" | "fc2")
        for e in self.mapping.entries():
            if isinstance(e.rule, StackedExperts):
                self._stacked[e.key] = (e.idx["layer"], "fc1" if len(e.rule.hf) == 2 else "fc2")
        self._batched_cache: dict = {}

    @classmethod
    def from_checkpoint(cls, served, *, scales: ScalePolicy = "keep", plan: PrecisionPlan | str | None = None,
                        **kw) -> "WeightSync":
        """A sync whose names, plan and (with ``keep``) scales come from a served HF checkpoint."""
        from ..layouts.hf import HFCheckpoint

        ref = served if hasattr(served, "plan") else HFCheckpoint.open(Path(served))
        if isinstance(plan, str):
            plan = PrecisionPlan.parse(plan, ref.cfg.num_hidden_layers)
        return cls(ref.cfg, plan or ref.plan, scales=scales, reference=ref, **kw)

    # ---- names ------------------------------------------------------------------------------

    def expected_names(self) -> list[str]:
        """Every HF tensor a full sync emits under this selection (the served text model, in order)."""
        out = []
        for name, s in self.specs.items():
            if name.startswith("model.visual."):
                continue  # the vision tower is not in the trainer's module tree (spec/megatron.md)
            is_expert = s.part is not None
            if self.select == "experts" and not is_expert or self.select == "non-experts" and is_expert:
                continue
            out.append(name)
        return out

    @staticmethod
    def canonical(name: str) -> str:
        """Strip the wrappers Megatron puts in front of parameter names (``module.module.``)."""
        while name.startswith(_PREFIXES):
            name = name[len("module."):]
        return name

    # ---- conversion -------------------------------------------------------------------------

    def groups(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, expert_offset: int = 0) -> Iterator[LoadGroup]:
        """Load groups in input order. Stacked experts ``[E_local, ...]`` start at global expert
        ``expert_offset``; a layer's experts are emitted once both its fc1 and fc2 arrived."""
        pending: dict[int, dict[str, tuple[torch.Tensor, int]]] = {}  # layer -> the expert tensor that came first
        for name, tensor in named_tensors:
            key = self.canonical(name)
            if key in self._stacked:
                if self.select == "non-experts":
                    continue
                layer, fc = self._stacked[key]
                got = pending.setdefault(layer, {})
                if fc in got:
                    raise CheckpointError(f"{key} given twice before its layer's other expert tensor")
                got[fc] = (tensor, expert_offset)
                if len(got) == 2:
                    del pending[layer]
                    yield from self._expert_groups(layer, got)
                continue
            if self.select == "experts":
                continue
            try:
                outs = self.mapping.to_hf(key, tensor)
            except CheckpointError:
                if key not in self.mapping.megatron_keys():
                    raise CheckpointError(f"{name}: not a Megatron parameter of Inkling 2 (known keys look like "
                                          f"{self.mapping.megatron_keys()[1]})") from None
                raise
            yield LoadGroup([(n, self._checked(n, t)) for n, t in outs.items()], key)
        if pending:
            layer, got = next(iter(pending.items()))
            missing = "linear_fc2" if "fc1" in got else "linear_fc1"
            raise CheckpointError(f"layer {layer}: routed experts got only one of linear_fc1/linear_fc2 "
                                  f"(no {missing} followed)")

    def buckets(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, expert_offset: int = 0) -> Iterator[Bucket]:
        """Load groups packed in order into buckets of at most ``bucket_bytes`` (a group larger
        than the budget travels alone: groups are never split)."""
        cur = Bucket()
        for g in self.groups(named_tensors, expert_offset=expert_offset):
            if cur.groups and cur.nbytes + g.nbytes > self.bucket_bytes:
                yield cur
                cur = Bucket()
            cur.add(g)
        if cur.groups:
            yield cur

    def _checked(self, name: str, t: torch.Tensor) -> torch.Tensor:
        s = self.specs.get(name)
        if s is None:
            raise CheckpointError(f"sync produced {name}, which the served checkpoint does not hold")
        if tuple(t.shape) != s.shape or t.dtype != s.dtype:
            raise CheckpointError(f"{name}: produced {t.dtype}{list(t.shape)}, the served checkpoint has "
                                  f"{s.dtype}{list(s.shape)}")
        return t

    # ---- experts ----------------------------------------------------------------------------

    def _expert_groups(self, layer: int, got: dict[str, tuple[torch.Tensor, int]]) -> Iterator[LoadGroup]:
        (fc1, off1), (fc2, off2) = got["fc1"], got["fc2"]
        E = self.cfg.n_routed_experts
        if fc1.dim() != 3 or fc2.dim() != 3 or fc1.shape[0] != fc2.shape[0] or off1 != off2:
            raise CheckpointError(f"layer {layer}: linear_fc1 {list(fc1.shape)} and linear_fc2 {list(fc2.shape)} "
                                  f"do not hold the same experts")
        n = fc1.shape[0]
        if off1 < 0 or off1 + n > E:
            raise CheckpointError(f"layer {layer}: experts {off1}..{off1 + n - 1} are outside 0..{E - 1}")
        fmt = self.plan.format_of(layer)
        from ._batched import batched_ok, encode_layer

        if self.use_kernels and fmt != "bf16" and batched_ok(fc1, fc2):
            res = encode_layer(self, layer, fc1, fc2, off1)
            if res is not None:
                names, tensors = res
                # every expert's parts are views of the same per-layer buffers: check one expert's
                # names, dtypes and shapes, and size the groups once
                first = [(k, self._checked(k, v)) for k, v in zip(names[0], tensors[0])]
                nbytes = sum(v.numel() * v.element_size() for _, v in first)
                for j in range(n):
                    yield LoadGroup(list(zip(names[j], tensors[j])), f"layer {layer} expert {off1 + j}", nbytes)
                return
        keys = {fc: k for k, (li, fc) in self._stacked.items() if li == layer}
        logical = {**self.mapping.experts_to_hf(keys["fc1"], fc1, off1),
                   **self.mapping.experts_to_hf(keys["fc2"], fc2, off1)}
        for j in range(n):
            e = off1 + j
            weights = {p: logical[f"{expert_module(layer, e, p)}.weight"] for p in EXPERT_PROJS}
            out = self.encoder.encode(layer, e, weights)
            yield LoadGroup([(k, self._checked(k, v)) for k, v in out.items()], f"layer {layer} expert {e}")
