"""Re-encoding stacked routed experts into a layer's release format, with a scale policy.

Shared by every path that turns BF16 experts back into served ones (``convert megatron-to-hf``,
``quantize``, weight sync). Works on any leading slice of a layer's experts ([E', R, C], w13
rows already interleaved), so memory stays at a few experts.

``keep`` takes each NVFP4 expert's global amax from a reference checkpoint and, for every block
whose new values equal the reference's decoded block bit for bit, the reference's bytes. That
last rule is what makes an unchanged weight come back byte-identical: decoding loses what the
encoder cannot recover from values alone — an MXFP8 block whose largest element rounded down to
224·2^s re-encodes one scale lower (same values, other bytes), and an NVFP4 element that rounded
to −0 (nibble 0x8) decodes to −0.0, which the encoder writes as +0. ``fresh`` derives every scale
from the new weights.
"""

from __future__ import annotations

from typing import Literal, Mapping, Protocol

import torch

from ..errors import CheckpointError, PlanError
from ..formats.stacked import AMAX, DENOM, SCALE, WEIGHT, decode_stacked, encode_stacked, stacked_parts
from ..model.precision import PrecisionPlan

ScalePolicy = Literal["fresh", "keep"]
SCALE_POLICIES = ("fresh", "keep")


class ScaleSource(Protocol):
    """A release checkpoint the kept scales come from (an HFCheckpoint)."""

    plan: PrecisionPlan

    def get(self, name: str) -> torch.Tensor: ...


def read_expert_rows(src: object, name: str, start: int, stop: int) -> torch.Tensor:
    """Experts ``start:stop`` of a stacked part (dim 0), reading only their bytes where the source can."""
    read_rows = getattr(src, "read_rows", None)
    if read_rows is not None:
        return read_rows(name, start, stop)
    return src.get(name)[start:stop]  # type: ignore[attr-defined]


def read_stacked(src: object, name: str, fmt: str, start: int, stop: int) -> dict[str, torch.Tensor]:
    """The stored parts of experts ``start:stop`` of stacked weight ``name`` in format ``fmt``.

    Per-expert parts are sliced; the NVFP4 scalar denominator is read whole (an [E] one is sliced).
    """
    out: dict[str, torch.Tensor] = {}
    for suffix in stacked_parts(fmt, (1, 32, 32)):  # the part names only
        part = name + suffix
        if suffix == DENOM:
            d = src.get(part)  # type: ignore[attr-defined]
            out[suffix] = d[start:stop] if d.dim() == 1 else d
        else:
            out[suffix] = read_expert_rows(src, part, start, stop)
    return out


def decode_rows(src: object, name: str, fmt: str, start: int, stop: int, *, allow_nonfinite: bool = False) -> torch.Tensor:
    """Experts ``start:stop`` of a stored stacked weight, decoded to BF16 [E', R, C]."""
    parts = read_stacked(src, name, fmt, start, stop)
    return decode_stacked(fmt, parts, torch.bfloat16, name=name, allow_nonfinite=allow_nonfinite)


class ExpertEncoder:
    """Encodes BF16 stacked experts for a precision plan (``scales`` ``keep`` needs ``reference``).

    With ``keep`` every NVFP4 layer of the plan must be NVFP4 in the reference (its per-expert
    amax is kept); blocks are reused from the reference wherever its layer has the plan's format.
    """

    def __init__(self, plan: PrecisionPlan, *, scales: ScalePolicy = "fresh", reference: ScaleSource | None = None,
                 allow_nonfinite: bool = False):
        if scales not in SCALE_POLICIES:
            raise PlanError(f"scale policy {scales!r}; choose one of {', '.join(SCALE_POLICIES)}")
        if scales == "keep":
            if reference is None:
                raise PlanError("--scales keep needs a reference checkpoint to take the scales from")
            if len(reference.plan) != len(plan):
                raise PlanError(f"plan covers {len(plan)} layers, the reference has {len(reference.plan)}")
            for i in range(len(plan)):
                if plan.format_of(i) == "nvfp4" and reference.plan.format_of(i) != "nvfp4":
                    raise PlanError(f"--scales keep: layer {i} is nvfp4 in the plan but {reference.plan.format_of(i)} "
                                    "in the reference, which has no NVFP4 amax to keep (use --scales fresh)")
        self.plan = plan
        self.scales = scales
        self.reference = reference
        self.allow_nonfinite = allow_nonfinite

    def encode(self, layer: int, name: str, w: torch.Tensor, start: int = 0) -> dict[str, torch.Tensor]:
        """Experts ``start:start+len(w)`` of stacked weight ``name`` (BF16) → ``{part suffix: tensor}``."""
        fmt = self.plan.format_of(layer)
        if w.dtype != torch.bfloat16 or w.dim() != 3:
            raise CheckpointError(f"{name}: expected BF16 stacked experts, got {w.dtype} {list(w.shape)}")
        ref = None
        if self.scales == "keep" and self.reference is not None and self.reference.plan.format_of(layer) == fmt \
                and fmt != "bf16":
            ref = read_stacked(self.reference, name, fmt, start, start + w.shape[0])
        amax = ref[AMAX] if ref is not None and fmt == "nvfp4" else None
        parts = encode_stacked(fmt, w, name=name, amax=amax, allow_nonfinite=self.allow_nonfinite)
        if ref is not None:
            parts = reuse_unchanged_blocks(fmt, w, parts, ref, name=name)
        return parts


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers of the same width (so -0.0 != +0.0 and NaN == NaN)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.dtype.itemsize])


def reuse_unchanged_blocks(fmt: str, x: torch.Tensor, new: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor],
                           *, name: str = "experts") -> dict[str, torch.Tensor]:
    """``new`` with every block whose values equal the reference's decoded block taken from ``ref``.

    Blocks run along the last dimension, one ``_scale`` column each; their element bytes are the
    same share of a weight row. NVFP4 blocks are only reused in experts whose global factor
    (amax / denominator) is the reference's bit for bit: a block's bytes mean nothing under
    another factor.
    """
    out = dict(new)
    if fmt == "bf16":
        return out
    decoded = decode_stacked(fmt, ref, x.dtype, name=name, allow_nonfinite=True)
    e, rows, nblocks = ref[SCALE].shape
    same = (_bits(decoded).reshape(e, rows, nblocks, -1) == _bits(x).reshape(e, rows, nblocks, -1)).all(-1)
    if fmt == "nvfp4":
        f_new = new[AMAX].float() / new[DENOM].float().reshape(-1).expand(e)
        f_ref = ref[AMAX].float() / ref[DENOM].float().reshape(-1).expand(e)
        same &= (_bits(f_new) == _bits(f_ref))[:, None, None]
    if not bool(same.any()):
        return out
    w_new, w_ref = new[WEIGHT], ref[WEIGHT]
    picked = torch.where(same[..., None], _bits(w_ref).reshape(e, rows, nblocks, -1),
                         _bits(w_new).reshape(e, rows, nblocks, -1))
    out[WEIGHT] = picked.reshape(w_new.shape).view(w_new.dtype)
    s_new, s_ref = new[SCALE], ref[SCALE]
    out[SCALE] = torch.where(same, _bits(s_ref), _bits(s_new)).view(s_new.dtype)
    return out


__all__ = ["ExpertEncoder", "ScalePolicy", "SCALE_POLICIES", "ScaleSource", "reuse_unchanged_blocks",
           "read_stacked", "read_expert_rows", "decode_rows"]
