"""A layer's stacked routed experts (or an EP slice) through the fused GPU kernels in a few launches.

The reference is :class:`~inkling_ckpt.convert.experts.ExpertEncoder` (``encode_stacked`` plus
``reuse_unchanged_blocks``) on the interleaved slice; this path takes the trainer's slice as it
is (fc1 rows [gate; up] per expert), one kernel group per expert (gate and up share the expert's NVFP4 amax because they are one group), and
gives the same bytes (tests/test_sync.py checks it against the reference path). ``keep`` compares
with the reference's blocks through the reference's own ``reuse_unchanged_blocks`` on the device
(its NVFP4 decode order is the release's, which the decode kernel's is not). Anything the
reference would reject or treat specially (non-finite input, a kept amax that is not finite and
positive) returns None and the caller takes the reference path, which raises the precise error.
"""

from __future__ import annotations

import torch

from ..convert.experts import reuse_unchanged_blocks
from ..formats import gpu
from ..formats._base import FLOAT_INPUTS
from ..formats.nvfp4 import MIN_GLOBAL_AMAX
from ..formats.stacked import AMAX, DENOM, NVFP4_DENOMINATOR, SCALE, WEIGHT
from ..model.inventory import ExpertStack
from ..model.mapping import Entry


def batched_ok(x: torch.Tensor) -> bool:
    return x.dtype in FLOAT_INPUTS and x.dim() == 3 and x.numel() > 0 and gpu.wants(x)


def _kept(sync, stack: ExpertStack) -> bool:
    ref = sync.reference
    return sync.scales == "keep" and ref is not None and ref.plan.format_of(stack.layer) == stack.fmt


def _ref_rows(sync, stack: ExpertStack, part: str, first: int, last: int, device) -> torch.Tensor:
    return sync.reference.read_rows(stack.name + part, first, last).to(device)


def _ref_blocks(sync, entry: Entry, stack: ExpertStack, first: int, last: int, device) -> dict[str, torch.Tensor]:
    """The reference's weight and block scales of the slice, rows in Megatron order."""
    return {p: _rows(entry.rule.to_megatron, _ref_rows(sync, stack, p, first, last, device)) for p in (WEIGHT, SCALE)}


def encode_stack(sync, entry: Entry, stack: ExpertStack, first: int, x: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """The release parts of experts ``first:first+n`` of ``stack`` from ``x`` [n, R, C] in Megatron form, or None.

    The mapping rule's row transform (fc1's [gate; up] -> interleaved rows) commutes with
    encoding, which is row by row under one global factor per expert, so it is applied to the
    encoded rows and block scales (a quarter to a half of the BF16 bytes), and inverted on the
    reference's rows for ``keep``.
    """
    parts = _encode_rows(sync, entry, stack, first, x)
    if parts is None:
        return None
    out = dict(parts)
    out[WEIGHT] = _rows(entry.rule.to_hf, parts[WEIGHT])
    out[SCALE] = _rows(entry.rule.to_hf, parts[SCALE])
    return out


def _rows(transform, t: torch.Tensor) -> torch.Tensor:
    """A row transform (dims 0 and 1) applied with each row viewed as the widest integers that
    tile it: one-byte elements would make torch's strided copies several times slower."""
    nbytes = t.shape[-1] * t.element_size()
    for dt in (torch.int64, torch.int32, torch.int16, torch.uint8):
        if nbytes % dt.itemsize == 0 and t.is_contiguous():
            return transform(t.view(torch.uint8).view(dt)).view(torch.uint8).view(t.dtype)
    return transform(t)


def _encode_rows(sync, entry: Entry, stack: ExpertStack, first: int, x: torch.Tensor) -> dict[str, torch.Tensor] | None:
    ops = gpu._load()
    n, r, c = x.shape
    g = x.contiguous().view(n, r * c)
    keep = _kept(sync, stack)
    if stack.fmt == "nvfp4":
        if keep:
            amax = kept = _ref_rows(sync, stack, AMAX, first, first + n, x.device)
            flags = []
            if not bool((torch.isfinite(amax) & (amax > 0)).all()):
                return None
        else:
            amax, bad_amax = ops.group_amax(g)
            flags = [bad_amax.amax()]
        # the reference's zero-expert policy: an amax below 2^-126 is encoded (and stored) as 1.0
        amax = torch.where(amax < MIN_GLOBAL_AMAX, torch.ones_like(amax), amax)
        s2 = ops.nvfp4_global_scales(amax)
        w, sc, bad = ops.nvfp4_encode(g, s2)
        if bool(torch.stack(flags + [bad.amax()]).amax() > 0):  # the one host synchronization
            return None
        parts = {WEIGHT: w.view(n, r, c // 2), SCALE: sc.view(n, r, c // 16), AMAX: amax.contiguous(),
                 DENOM: torch.tensor(NVFP4_DENOMINATOR, dtype=torch.float32, device=x.device)}
        if keep:
            ref = {**_ref_blocks(sync, entry, stack, first, first + n, x.device),
                   AMAX: kept, DENOM: sync.reference.get(stack.name + DENOM).to(x.device)}
            parts = reuse_unchanged_blocks("nvfp4", x, parts, ref)
        return parts
    if stack.fmt == "mxfp8":
        q, sc, bad = ops.mxfp8_encode(g)
        if bool(bad.amax() > 0):
            return None
        parts = {WEIGHT: q.view(n, r, c), SCALE: sc.view(n, r, c // 32)}
        if keep:
            ref = _ref_blocks(sync, entry, stack, first, first + n, x.device)
            parts = reuse_unchanged_blocks("mxfp8", x, parts, ref)
        return parts
    return None
