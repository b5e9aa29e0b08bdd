"""Prove the engine serves what the trainer trained: bitwise comparison and sha256 per tensor."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's raw bytes (row-major, as stored in safetensors): dtype and shape not included."""
    b = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(b).hexdigest()


def _pairs(emitted) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) from buckets, load groups or pairs, in order."""
    for item in emitted:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            yield item
        elif hasattr(item, "named_tensors"):
            yield from item.named_tensors
        elif hasattr(item, "tensors"):
            yield from item.tensors
        else:
            raise TypeError(f"cannot read (name, tensor) pairs from {type(item).__name__}")


def digests(emitted) -> dict[str, str]:
    """``{hf_name: sha256}`` of everything emitted (buckets, load groups or pairs)."""
    return {n: tensor_sha256(t) for n, t in _pairs(emitted)}


@dataclass
class VerifyReport:
    """Outcome of :func:`verify`. ``ok`` when every emitted tensor equals the stored one byte for
    byte (dtype and shape too), nothing expected is missing and nothing was emitted twice."""

    equal: list[str] = field(default_factory=list)
    differ: dict[str, str] = field(default_factory=dict)  # name -> reason
    missing: list[str] = field(default_factory=list)  # expected but not emitted
    unexpected: list[str] = field(default_factory=list)  # emitted, not in the checkpoint
    duplicated: list[str] = field(default_factory=list)
    sha256: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (emitted, stored)

    @property
    def ok(self) -> bool:
        return not (self.differ or self.missing or self.unexpected or self.duplicated)

    def summary(self) -> str:
        s = f"{len(self.equal)} equal, {len(self.differ)} differ, {len(self.missing)} missing, {len(self.unexpected)} unexpected"
        if self.duplicated:
            s += f", {len(self.duplicated)} emitted twice"
        if self.differ:
            name, why = next(iter(self.differ.items()))
            s += f"; first difference: {name}: {why}"
        return s


def verify(emitted, checkpoint, *, expected: Iterable[str] | None = None) -> VerifyReport:
    """Compare emitted ``(hf_name, tensor)`` (buckets, groups or pairs; streamed, not kept) with a
    checkpoint on disk: names, dtypes, shapes, bytes, and sha256 of both sides.

    ``expected``: the names a complete sync must emit (e.g. ``WeightSync.expected_names()``);
    those not emitted are reported missing.
    """
    from ..layouts.hf import HFCheckpoint

    ck = checkpoint if hasattr(checkpoint, "get") else HFCheckpoint.open(Path(checkpoint))
    stored = set(ck.tensors)
    rep = VerifyReport()
    seen: set[str] = set()
    for name, t in _pairs(emitted):
        if name in seen:
            rep.duplicated.append(name)
            continue
        seen.add(name)
        if name not in stored:
            rep.unexpected.append(name)
            continue
        ref = ck.get(name)
        got = t.detach().cpu()
        h_got, h_ref = tensor_sha256(got), tensor_sha256(ref)
        rep.sha256[name] = (h_got, h_ref)
        if got.dtype != ref.dtype:
            rep.differ[name] = f"dtype {got.dtype}, stored {ref.dtype}"
        elif tuple(got.shape) != tuple(ref.shape):
            rep.differ[name] = f"shape {list(got.shape)}, stored {list(ref.shape)}"
        elif h_got != h_ref:
            a = got.contiguous().reshape(-1).view(torch.uint8)
            b = ref.contiguous().reshape(-1).view(torch.uint8)
            nd = int((a != b).sum())
            rep.differ[name] = f"{nd} of {b.numel()} bytes differ"
        else:
            rep.equal.append(name)
    if expected is not None:
        rep.missing = [n for n in expected if n not in seen]
    return rep
