"""Re-encoding one routed expert into its layer's format, with a scale policy.

Shared by every path that produces served experts: ``quantize``/``convert hf-to-hf``,
``convert megatron-to-hf`` and the weight-sync library. gate/up form one fused group (one
NVFP4 global scale); ``keep`` takes NVFP4 global and input scales from a reference checkpoint
so unchanged weights reproduce the reference bytes exactly.
"""

from __future__ import annotations

from typing import Literal, Mapping, Protocol

import torch

from ..errors import CheckpointError, PlanError
from ..formats import get_format
from ..model.inventory import EXPERT_PROJS, EXPERT_ROWS, FUSED_GROUP
from ..model.precision import PrecisionPlan

ScalePolicy = Literal["fresh", "keep"]
SCALE_POLICIES = ("fresh", "keep")
NVFP4_CARRIED = ("weight_scale_2", "input_scale")


class ScaleSource(Protocol):
    """Anything that can hand out stored tensors by HF name (an HFCheckpoint)."""

    plan: PrecisionPlan

    def get(self, name: str) -> torch.Tensor: ...


def expert_module(layer: int, expert: int, proj: str) -> str:
    """The HF module name of one routed-expert linear (from the model table)."""
    return EXPERT_ROWS[proj].pattern.format(layer=layer, expert=expert)


class ExpertEncoder:
    """Encodes routed experts for a precision plan.

    ``scales="keep"`` needs ``reference``: each NVFP4 linear reuses the reference's
    ``weight_scale_2`` and ``input_scale`` (the reference layer must be NVFP4 too), and every
    block whose new values equal the reference's decoded values bit for bit keeps the
    reference's bytes. That last rule is what makes an unchanged weight come back byte-identical:
    decoding loses two things the encoder cannot recover from values alone — MXFP8 blocks
    whose largest element rounded down to 224·2^s re-encode one scale lower (same values,
    other bytes), and NVFP4 elements that rounded to -0 (nibble 0x8) decode to -0.0, which the
    ModelOpt convention encodes as +0 (0x0). With ``fresh`` the global scale comes from the new
    weights (gate/up share the max) and ``input_scale`` from the reference when one is given,
    else 1.0 (no calibration data).
    """

    def __init__(self, plan: PrecisionPlan, *, scales: ScalePolicy = "fresh", reference: ScaleSource | None = None,
                 allow_nonfinite: bool = False):
        if scales not in SCALE_POLICIES:
            raise PlanError(f"scale policy {scales!r}; choose one of {', '.join(SCALE_POLICIES)}")
        if scales == "keep":
            if reference is None:
                raise PlanError("--scales keep needs a reference checkpoint to take the scales from")
            for i in range(len(plan)):
                if plan.format_of(i) == "nvfp4" and reference.plan.format_of(i) != "nvfp4":
                    raise PlanError(
                        f"--scales keep: layer {i} is nvfp4 in the plan but {reference.plan.format_of(i)} in the "
                        f"reference, which has no NVFP4 scales to keep"
                    )
        self.plan = plan
        self.scales = scales
        self.reference = reference
        self.allow_nonfinite = allow_nonfinite
        self.used_default_input_scale = False

    def encode(self, layer: int, expert: int, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``{proj: logical weight}`` (all three projections) → ``{hf_name: stored tensor}``."""
        missing = [p for p in EXPERT_PROJS if p not in weights]
        if missing:
            raise CheckpointError(f"layer {layer} expert {expert}: missing {', '.join(missing)}")
        fmt_name = self.plan.format_of(layer)
        fmt = get_format(fmt_name)
        modules = {p: expert_module(layer, expert, p) for p in EXPERT_PROJS}
        out: dict[str, torch.Tensor] = {}
        if fmt_name == "bf16":
            for p in EXPERT_PROJS:
                w = weights[p]
                if w.dtype != torch.bfloat16:
                    raise CheckpointError(f"{modules[p]}: expected a BF16 weight, got {w.dtype}")
                out[f"{modules[p]}.weight"] = w
            return out
        if fmt_name == "nvfp4":
            parts = self._encode_nvfp4(fmt, layer, modules, weights)
        else:
            parts = {p: fmt.encode(weights[p], name=modules[p], allow_nonfinite=self.allow_nonfinite) for p in EXPERT_PROJS}
        if self.scales == "keep" and self.reference is not None and self.reference.plan.format_of(layer) == fmt_name:
            for p in EXPERT_PROJS:
                ref = {part: self.reference.get(f"{modules[p]}.{part}") for part in parts[p]}
                parts[p] = reuse_unchanged_blocks(fmt, weights[p], parts[p], ref)
        for p in EXPERT_PROJS:
            for part, t in parts[p].items():
                out[f"{modules[p]}.{part}"] = t
        return out

    def _encode_nvfp4(self, fmt, layer: int, modules: dict[str, str], weights: Mapping[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        ref = self.reference
        ref_has_scales = ref is not None and ref.plan.format_of(layer) == "nvfp4"
        inputs: dict[str, torch.Tensor | None] = {
            p: ref.get(f"{modules[p]}.input_scale") if ref_has_scales else None for p in EXPERT_PROJS  # type: ignore[union-attr]
        }
        self.used_default_input_scale |= not ref_has_scales
        if self.scales == "keep":  # __init__ made sure the reference holds NVFP4 scales here
            return {
                p: fmt.encode(weights[p], name=modules[p], weight_scale_2=ref.get(  # type: ignore[union-attr]
                                  f"{modules[p]}.weight_scale_2"),
                              input_scale=inputs[p], allow_nonfinite=self.allow_nonfinite)
                for p in EXPERT_PROJS
            }
        out: dict[str, dict[str, torch.Tensor]] = {}
        group = fmt.encode_group([weights[p] for p in FUSED_GROUP], names=[modules[p] for p in FUSED_GROUP],
                                 allow_nonfinite=self.allow_nonfinite)
        for p, parts in zip(FUSED_GROUP, group):
            out[p] = parts
        for p in EXPERT_PROJS:
            if p not in out:
                out[p] = fmt.encode(weights[p], name=modules[p], allow_nonfinite=self.allow_nonfinite)
        for p in EXPERT_PROJS:
            if inputs[p] is not None:
                out[p]["input_scale"] = inputs[p].to(torch.float32).reshape(())
        return out



def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers of the same width (so -0.0 != +0.0 and NaN == NaN)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.dtype.itemsize])


def reuse_unchanged_blocks(fmt, x: torch.Tensor, new: dict[str, torch.Tensor],
                           ref: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``new`` with every block whose values equal the reference's decoded block taken from ``ref``.

    Blocks run along the last dimension, one ``weight_scale`` column each; the element bytes of
    a block are the same share of a ``weight`` row. Global scales are taken as they are in
    ``new`` (the caller passes the reference's when keeping them).
    """
    decoded = fmt.decode(ref, x.dtype)
    rows, nblocks = ref["weight_scale"].shape
    same = (_bits(decoded).reshape(rows, nblocks, -1) == _bits(x).reshape(rows, nblocks, -1)).all(-1)
    if not bool(same.any()):
        return new
    out = dict(new)
    w_new, w_ref = new["weight"], ref["weight"]
    picked = torch.where(same[..., None], _bits(w_ref).reshape(rows, nblocks, -1), _bits(w_new).reshape(rows, nblocks, -1))
    out["weight"] = picked.reshape(w_new.shape).view(w_new.dtype)
    s_new, s_ref = new["weight_scale"], ref["weight_scale"]
    out["weight_scale"] = torch.where(same, _bits(s_ref), _bits(s_new)).view(s_new.dtype)
    return out
