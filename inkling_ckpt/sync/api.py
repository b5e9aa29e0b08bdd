"""Megatron-named trainer tensors -> release-checkpoint tensors, in load groups and buckets.

Names go through the preset mapping (:mod:`inkling_ckpt.model.mapping`); routed experts are
re-encoded per layer by :class:`~inkling_ckpt.convert.experts.ExpertEncoder` (on CUDA through
the fused kernels of :mod:`._batched`, bit-identical to it), one load group per layer's stacked
experts or per EP slice of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from ..convert.experts import SCALE_POLICIES, ExpertEncoder, ScalePolicy
from ..errors import CheckpointError, NonFiniteError, PlanError
from ..model.config import InklingConfig
from ..model.inventory import ExpertStack, TensorSpec, expert_stacks, inventory
from ..model.mapping import DEFAULT_PRESET, Entry, MegatronMapping, Preset
from ..model.precision import PrecisionPlan
from .buckets import DEFAULT_BUCKET_BYTES, Bucket, pack

Selection = Literal["all", "experts", "non-experts"]
SELECTIONS = ("all", "experts", "non-experts")
_WRAPPER = "module."  # DDP / Float16Module wrappers in front of Megatron names

#: How a trainer's live module names one layer's routed experts, given the checkpoint key
#: ``{module}.experts.{leaf}`` (Megatron-Core adds the second ``experts.`` only when it builds the
#: sharded state dict; reference/megatron.md §2). ``stacked``: the checkpoint form, [E_local, …];
#: ``grouped``: TEGroupedMLP parameters ``linear_fc1.weight{e}``; ``sequential``: SequentialMLP's
#: ``local_experts.{e}.linear_fc1.weight``. ``e`` is the rank-local expert index (global = e +
#: expert_offset), each tensor one expert's [2F, H] / [H, F].
EXPERT_NAME_FORMS: dict[str, str] = {
    "stacked": "{module}.experts.{leaf}",
    "grouped": "{module}.{leaf}{e}",
    "sequential": "{module}.local_experts.{e}.{leaf}",
}


def expert_param_name(key: str, form: str, local: int | None = None) -> str:
    """The trainer's name for a stacked-expert checkpoint ``key`` in ``form`` (local expert ``local``)."""
    pattern = EXPERT_NAME_FORMS.get(form)
    if pattern is None:
        raise PlanError(f"unknown expert name form {form!r}; known: {', '.join(EXPERT_NAME_FORMS)}")
    module, sep, sub = key.rpartition(".experts.")
    if not sep:
        raise PlanError(f"expert key {key} has no '.experts.' module")
    if form != "stacked" and local is None:
        raise PlanError(f"expert name form {form!r} names one expert: give its local index")
    return pattern.format(module=module, leaf=sub, e=local)


@dataclass
class LoadGroup:
    """Tensors the engine must receive together: one Megatron key's release tensor, or one layer's
    stacked experts (``rows`` = the expert range ``(first, last)``: every part of w13 and w2 of
    those experts, the scalar ``_outer_scale_denominator`` included)."""

    tensors: list[tuple[str, torch.Tensor]]
    what: str  # e.g. "layer 3 experts 0-7" or the Megatron key
    rows: tuple[int, int] | None = None  # stacked experts: rows first:last of every [E, ...] part
    _nbytes: int | None = None

    @property
    def nbytes(self) -> int:
        if self._nbytes is None:
            self._nbytes = sum(t.numel() * t.element_size() for _, t in self.tensors)
        return self._nbytes


@dataclass(frozen=True)
class _ExpertName:
    layer: int
    leaf: str  # "fc1" (w13) or "fc2" (w2)
    local: int | None  # rank-local expert index of a per-expert form; None: stacked


@dataclass
class _Pending:
    """One layer's expert tensors received so far (stacked, or per local expert)."""

    stacked: dict[str, torch.Tensor] = field(default_factory=dict)
    single: dict[str, dict[int, torch.Tensor]] = field(default_factory=lambda: {"fc1": {}, "fc2": {}})

    def complete(self, local_experts: int | None) -> bool:
        if self.stacked:
            return len(self.stacked) == 2
        n = [len(self.single[k]) for k in ("fc1", "fc2")]
        return local_experts is not None and n[0] == n[1] == local_experts


class _OnDevice:
    """A reference checkpoint whose reads land on ``device`` (keep-scale reads meet the new weights there)."""

    def __init__(self, ref, device: torch.device):
        self.ref, self.device, self.plan = ref, device, ref.plan

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self.ref.read_rows(name, start, stop).to(self.device)

    def get(self, name: str) -> torch.Tensor:
        return self.ref.get(name).to(self.device)


class WeightSync:
    """Rename + re-encode + bucket, for one served checkpoint's config and precision plan.

    Args:
        cfg, plan: the served model's config and per-layer expert formats.
        scales: ``fresh`` (NVFP4 amax from the new weights) or ``keep`` (each expert's amax from
            ``reference``, and the reference's bytes for every unchanged block, so unchanged
            weights give the served bytes exactly).
        reference: the served checkpoint (:class:`~inkling_ckpt.layouts.hf.HFCheckpoint`); needed
            for ``keep``; its non-expert dtypes are the ones emitted.
        select: ``all``, ``experts`` (routed experts only) or ``non-experts``.
        bucket_bytes: byte budget per bucket (default 512 MiB).
        preset: the Megatron key layout (``miles`` default; see ``model.mapping.PRESETS``).
        use_kernels: encode a layer's experts through the fused GPU kernels when they are on
            CUDA (default); False always takes the reference codec path.
        allow_nonfinite: send NaN/Inf (else :class:`~inkling_ckpt.errors.NonFiniteError`, for
            every tensor, as the CLI refuses them).

    Every input must hold data (the meta device is refused). Routed experts in float32 or
    float16 (trainers keep float32 master weights) are taken as BF16 when every value is one
    exactly, which is lossless: ``keep`` then reproduces the served bytes as for BF16 input.
    Under ``keep``, float experts BF16 cannot represent are refused (the served bytes come from
    BF16 weights); under ``fresh`` they are encoded from their own values.
    """

    def __init__(self, cfg: InklingConfig, plan: PrecisionPlan, *, scales: ScalePolicy = "fresh", reference=None,
                 select: Selection = "all", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 preset: str | Preset = DEFAULT_PRESET, allow_nonfinite: bool = False, use_kernels: bool = True):
        if select not in SELECTIONS:
            raise PlanError(f"unknown selection {select!r}; choose one of {', '.join(SELECTIONS)}")
        if scales not in SCALE_POLICIES:
            raise PlanError(f"unknown scale policy {scales!r}; choose one of {', '.join(SCALE_POLICIES)}")
        if int(bucket_bytes) <= 0:
            raise PlanError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if len(plan) != cfg.num_hidden_layers:
            raise PlanError(f"precision plan covers {len(plan)} layers, the model has {cfg.num_hidden_layers}")
        self.cfg = cfg
        self.plan = plan
        self.scales = scales
        self.reference = reference
        self.select = select
        self.bucket_bytes = int(bucket_bytes)
        self.allow_nonfinite = allow_nonfinite
        self.use_kernels = use_kernels
        dtypes = reference.dtypes() if reference is not None else None
        self.mapping = MegatronMapping(cfg, preset, dtypes=dtypes)
        # Validates keep against the reference's formats once, up front.
        self.encoder = ExpertEncoder(plan, scales=scales, reference=reference if scales == "keep" else None,
                                     allow_nonfinite=allow_nonfinite)
        self._encoders: dict[str, ExpertEncoder] = {"cpu": self.encoder}
        self.specs: dict[str, TensorSpec] = {s.name: s for s in inventory(cfg, plan, dtypes=dtypes, vision=[])}
        self.stacks: dict[str, ExpertStack] = {s.name: s for s in expert_stacks(cfg, plan)}
        self._expert_entries: dict[tuple[int, str], Entry] = {}
        self._expert_names: dict[str, _ExpertName] = {}
        for e in self.mapping.entries():
            if not e.stacked or e.layer is None:  # (a stacked entry is always some layer's)
                continue
            leaf = "fc1" if self.stacks[e.hf].fused else "fc2"
            self._expert_entries[(e.layer, leaf)] = e
            for form in EXPERT_NAME_FORMS:
                if form == "stacked":
                    self._expert_names[expert_param_name(e.key, form)] = _ExpertName(e.layer, leaf, None)
                    continue
                for j in range(cfg.n_routed_experts):
                    self._expert_names[expert_param_name(e.key, form, j)] = _ExpertName(e.layer, leaf, j)
        self._batched_cache: dict = {}

    @classmethod
    def from_checkpoint(cls, served, *, scales: ScalePolicy = "keep", plan: PrecisionPlan | str | None = None,
                        **kw) -> "WeightSync":
        """A sync whose names, dtypes, plan and (with ``keep``) scales come from a served HF checkpoint."""
        from ..layouts.hf import HFCheckpoint

        ref = served if hasattr(served, "plan") else HFCheckpoint.open(Path(served))
        if isinstance(plan, str):
            plan = PrecisionPlan.parse(plan, ref.cfg.num_hidden_layers)
        return cls(ref.cfg, plan or ref.plan, scales=scales, reference=ref, **kw)

    # ---- names ------------------------------------------------------------------------------

    def expected_names(self) -> list[str]:
        """Every release tensor a full sync emits under this selection (the served text model, in order)."""
        out = []
        for name, s in self.specs.items():
            is_expert = s.part is not None
            if self.select == "experts" and not is_expert or self.select == "non-experts" and is_expert:
                continue
            out.append(name)
        return out

    @staticmethod
    def canonical(name: str) -> str:
        """Strip the wrappers Megatron puts in front of parameter names (``module.module.``)."""
        while name.startswith(_WRAPPER):
            name = name[len(_WRAPPER):]
        return name

    # ---- conversion -------------------------------------------------------------------------

    def groups(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, expert_offset: int = 0,
               local_experts: int | None = None) -> Iterator[LoadGroup]:
        """Load groups, in input order.

        Routed experts may come stacked (``…experts.experts.linear_fc1.weight`` [E_local, 2F, H])
        or one expert per tensor (TEGroupedMLP ``…experts.linear_fc1.weight{e}``, SequentialMLP
        ``…experts.local_experts.{e}.linear_fc1.weight``); local expert j is global expert
        ``expert_offset + j``. A layer's group is emitted once its fc1 and fc2 are complete:
        both stacked tensors, or ``local_experts`` experts of each (without ``local_experts``,
        when the next layer's experts start or the input ends).
        """
        if expert_offset < 0 or expert_offset >= self.cfg.n_routed_experts:
            raise CheckpointError(f"expert_offset {expert_offset} is outside 0..{self.cfg.n_routed_experts - 1}")
        pending: dict[int, _Pending] = {}
        for name, tensor in named_tensors:
            _check_data(name, tensor)
            key = self.canonical(name)
            hit = self._expert_names.get(key)
            if hit is not None:
                if self.select == "non-experts":
                    continue
                got = pending.setdefault(hit.layer, _Pending())
                if hit.local is None:
                    if got.single["fc1"] or got.single["fc2"]:
                        raise CheckpointError(f"{name}: layer {hit.layer} experts came both stacked and one per tensor")
                    if hit.leaf in got.stacked:
                        raise CheckpointError(f"{name} given twice before its layer's other expert tensor")
                    got.stacked[hit.leaf] = tensor
                else:
                    if got.stacked:
                        raise CheckpointError(f"{name}: layer {hit.layer} experts came both stacked and one per tensor")
                    if hit.local in got.single[hit.leaf]:
                        raise CheckpointError(f"{name} given twice")
                    got.single[hit.leaf][hit.local] = tensor
                if got.complete(local_experts):
                    del pending[hit.layer]
                    yield self._expert_group(hit.layer, got, expert_offset)
                elif hit.local is not None and local_experts is None:
                    # per-expert tensors without a count: a layer ends where the next one's start
                    for other in [li for li in pending if li != hit.layer and not pending[li].stacked]:
                        yield self._expert_group(other, pending.pop(other), expert_offset)
                continue
            if self.select == "experts":
                continue
            yield self._plain_group(name, key, tensor)
        for layer in list(pending):
            got = pending.pop(layer)
            if got.stacked:
                missing = "linear_fc2" if "fc1" in got.stacked else "linear_fc1"
                raise CheckpointError(f"layer {layer}: routed experts got only one of linear_fc1/linear_fc2 "
                                      f"(no {missing} followed)")
            if local_experts is not None:
                n = {k: len(v) for k, v in got.single.items()}
                raise CheckpointError(f"layer {layer}: expected {local_experts} local experts of linear_fc1 and "
                                      f"linear_fc2, got {n['fc1']} and {n['fc2']}")
            yield self._expert_group(layer, got, expert_offset)

    def buckets(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, expert_offset: int = 0,
                local_experts: int | None = None) -> Iterator[Bucket]:
        """Load groups packed in order into buckets of at most ``bucket_bytes`` (a group larger
        than the budget travels alone: groups are never split)."""
        return pack(self.groups(named_tensors, expert_offset=expert_offset, local_experts=local_experts),
                    self.bucket_bytes)

    def _plain_group(self, name: str, key: str, tensor: torch.Tensor) -> LoadGroup:
        try:
            e = self.mapping.entry(key)
        except CheckpointError:
            known = self.mapping.keys()
            raise CheckpointError(f"{name}: not a Megatron parameter of Inkling 2 under preset "
                                  f"{self.mapping.preset.name} (known keys look like {known[min(3, len(known) - 1)]})") from None
        self._finite(name, tensor)
        out = self.mapping.to_hf(key, tensor)
        return LoadGroup([(e.hf, self._checked(e.hf, out))], key)

    def _finite(self, name: str, t: torch.Tensor) -> None:
        if not self.allow_nonfinite and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise NonFiniteError(f"{name}: holds NaN or Inf; the engine would receive them "
                                 "(pass allow_nonfinite=True to send them anyway)")

    def _as_bf16(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """Float32/float16 experts as BF16 when that is exact (lossless: same values, so ``keep``
        reproduces the served bytes); under ``keep`` anything else is refused."""
        if x.dtype == torch.bfloat16 or not x.is_floating_point():
            return x
        y = x.to(torch.bfloat16)
        back = y.to(x.dtype)
        exact = bool(((back == x) | (torch.isnan(back) & torch.isnan(x))).all())
        if exact:
            return y
        if self.scales == "keep":
            raise CheckpointError(f"{key}: {str(x.dtype).removeprefix('torch.')} values that BF16 cannot represent "
                                  "exactly; scales='keep' reproduces the served bytes from BF16 weights: round "
                                  "them to BF16 in the trainer, or use scales='fresh'")
        return x

    def _checked(self, name: str, t: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        s = self.specs.get(name)
        if s is None:
            raise CheckpointError(f"sync produced {name}, which the served checkpoint does not hold")
        want = s.shape if rows is None or not s.shape else (rows, *s.shape[1:])
        if tuple(t.shape) != want or t.dtype != s.dtype:
            raise CheckpointError(f"{name}: produced {t.dtype}{list(t.shape)}, the served checkpoint has "
                                  f"{s.dtype}{list(want)} (no silent casts: hand the trainer's tensor in that dtype)")
        return t

    # ---- experts ----------------------------------------------------------------------------

    def _expert_group(self, layer: int, got: _Pending, offset: int) -> LoadGroup:
        xs = {leaf: self._as_bf16(self._expert_entries[(layer, leaf)].key, self._gathered(layer, leaf, got))
              for leaf in ("fc1", "fc2")}
        n = xs["fc1"].shape[0]
        E = self.cfg.n_routed_experts
        if xs["fc2"].shape[0] != n:
            raise CheckpointError(f"layer {layer}: linear_fc1 holds {n} experts but linear_fc2 {xs['fc2'].shape[0]}")
        if offset + n > E:
            raise CheckpointError(f"layer {layer}: experts {offset}..{offset + n - 1} are outside 0..{E - 1}")
        if xs["fc1"].device != xs["fc2"].device:
            raise CheckpointError(f"layer {layer}: linear_fc1 is on {xs['fc1'].device}, linear_fc2 on {xs['fc2'].device}")
        tensors: list[tuple[str, torch.Tensor]] = []
        for leaf in ("fc1", "fc2"):
            entry = self._expert_entries[(layer, leaf)]
            stack = self.stacks[entry.hf]
            parts = self._encode(entry, stack, offset, xs[leaf])
            for spec in stack.parts():
                t = parts[spec.part]  # type: ignore[index]
                tensors.append((spec.name, self._checked(spec.name, t, None if spec.shape == () else n)))
        return LoadGroup(tensors, f"layer {layer} experts {offset}-{offset + n - 1}", (offset, offset + n))

    def _gathered(self, layer: int, leaf: str, got: _Pending) -> torch.Tensor:
        key = self._expert_entries[(layer, leaf)].key
        if got.stacked:
            t = got.stacked[leaf]
            if t.dim() != 3:
                raise CheckpointError(f"{key}: expected stacked experts [E_local, rows, cols], got {list(t.shape)}")
            return t
        single = got.single[leaf]
        n = len(single)
        if sorted(single) != list(range(n)):
            raise CheckpointError(f"layer {layer}: local experts of {key} are not 0..{n - 1} "
                                  f"(got {sorted(single)[:8]}{'…' if n > 8 else ''})")
        first = single[0]
        if any(t.shape != first.shape or t.dtype != first.dtype or t.device != first.device for t in single.values()) \
                or first.dim() != 2:
            raise CheckpointError(f"layer {layer}: the per-expert {key} tensors differ in shape, dtype or device "
                                  f"(expert 0: {first.dtype}{list(first.shape)})")
        return torch.stack([single[j] for j in range(n)])

    def _encode(self, entry: Entry, stack: ExpertStack, first: int, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Experts ``first:first+n`` in Megatron form -> the release parts of ``stack``."""
        if self.use_kernels and stack.fmt != "bf16":
            from ._batched import batched_ok, encode_stack

            if batched_ok(x):
                want = (x.shape[0], *entry.shape[1:])
                if tuple(x.shape) != want:
                    raise CheckpointError(f"{entry.key}: {list(x.shape)}, the reference config says {list(want)}")
                parts = encode_stack(self, entry, stack, first, x)
                if parts is not None:
                    return parts
        x = self.mapping.to_hf(entry.key, x)  # fc1: [gate; up] per expert -> interleaved rows
        return self._encoder_for(x.device).encode(stack, first, x)

    def _encoder_for(self, device: torch.device) -> ExpertEncoder:
        enc = self._encoders.get(str(device))
        if enc is None:
            ref = _OnDevice(self.reference, device) if self.encoder.reference is not None else None
            enc = ExpertEncoder(self.plan, scales=self.scales, reference=ref, allow_nonfinite=self.allow_nonfinite)
            self._encoders[str(device)] = enc
        return enc


def _check_data(name: str, t: object) -> None:
    """A trainer tensor that can be sent: a tensor with data (not on the meta device)."""
    if not isinstance(t, torch.Tensor):
        raise CheckpointError(f"{name}: a {type(t).__name__}, not a tensor")
    if t.device.type == "meta":
        raise CheckpointError(f"{name}: on the meta device (no data to send); materialize it first")
