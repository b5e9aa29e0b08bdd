"""Prove the engine serves what the trainer trained: bitwise comparison and sha256 per tensor."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's raw bytes (row-major, as stored in safetensors): dtype and shape not included."""
    data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(data).hexdigest()  # type: ignore[arg-type]  # numpy types ndarray as a Buffer on 3.12+ only


def _items(emitted, expert_offset: int | None) -> Iterable[tuple[str, torch.Tensor, tuple[int, int | None] | None]]:
    """(name, tensor, rows) from buckets, load groups or pairs, in order. ``rows``: the expert rows
    a stacked-expert slice holds (from its load group, or ``expert_offset`` for bare pairs);
    None for whole tensors."""
    for item in emitted:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            yield item[0], item[1], None if expert_offset is None else (expert_offset, None)
        elif hasattr(item, "groups"):
            for g in item.groups:
                yield from ((n, t, getattr(g, "rows", None)) for n, t in g.tensors)
        elif hasattr(item, "tensors"):
            yield from ((n, t, getattr(item, "rows", None)) for n, t in item.tensors)
        else:
            raise TypeError(f"cannot read (name, tensor) pairs from {type(item).__name__}")


def pairs(emitted) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` from buckets, groups (load or adapter groups) or pairs, in order."""
    return ((n, t) for n, t, _ in _items(emitted, None))


def digests(emitted) -> dict[str, str]:
    """``{hf_name: sha256}`` of everything emitted (buckets, load groups or pairs); an expert
    slice's key carries its rows: ``name[first:last]``."""
    out = {}
    for n, t, rows in _items(emitted, None):
        sliced = rows is not None and t.dim() > 0
        out[f"{n}[{rows[0]}:{rows[0] + t.shape[0]}]" if rows is not None and sliced else n] = tensor_sha256(t)
    return out


@dataclass
class VerifyReport:
    """Outcome of :func:`verify`. ``ok`` when every emitted tensor (or expert slice) equals the
    stored one (or the matching rows) byte for byte, dtype and shape too, nothing expected is
    missing and nothing was emitted twice."""

    equal: list[str] = field(default_factory=list)
    differ: dict[str, str] = field(default_factory=dict)  # name -> reason
    missing: list[str] = field(default_factory=list)  # expected but not emitted
    unexpected: list[str] = field(default_factory=list)  # emitted, not in the checkpoint
    duplicated: list[str] = field(default_factory=list)
    sha256: dict[str, tuple[str, str]] = field(default_factory=dict)  # name (slices: name[a:b]) -> (emitted, stored)

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


def verify(emitted, checkpoint, *, expected: Iterable[str] | None = None, expert_offset: int | None = None) -> VerifyReport:
    """Compare emitted ``(hf_name, tensor)`` (buckets, groups or pairs; streamed, not kept) with a
    checkpoint on disk: names, dtypes, shapes, bytes, and sha256 of both sides.

    An EP slice of stacked experts (``[n, …]`` of an ``[E, …]`` tensor) is compared with the
    matching rows of the stored tensor: the rows its load group names, or, for bare pairs, rows
    ``expert_offset:expert_offset+n``. Scalars are compared whole. ``expected``: the names a
    complete sync must emit (e.g. ``WeightSync.expected_names()``); those not emitted at all are
    reported missing.
    """
    from ..layouts.hf import HFCheckpoint

    ck = checkpoint if hasattr(checkpoint, "get") else HFCheckpoint.open(Path(checkpoint))
    stored = ck.tensors
    rep = VerifyReport()
    seen: set[str] = set()
    slices: dict[str, list[tuple[int, int]]] = {}
    for name, t, rows in _items(emitted, expert_offset):
        got = t.detach().cpu()
        st = stored.get(name)
        if st is None:
            rep.unexpected.append(name)
            seen.add(name)
            continue
        # a tensor at its stored shape compares whole; a shorter one is a slice of expert rows
        whole = not st.shape or tuple(got.shape) == tuple(st.shape)
        if rows is None or whole:
            label = name
            if name in seen:
                rep.duplicated.append(name)
                continue
            ref = ck.get(name)
        else:
            a = rows[0]
            b = a + (got.shape[0] if got.dim() else 0)
            label = f"{name}[{a}:{b}]"
            if any(a < y and x < b for x, y in slices.get(name, [])) or (name in seen and name not in slices):
                rep.duplicated.append(label)
                continue
            slices.setdefault(name, []).append((a, b))
            if got.dim() == 0 or b > st.shape[0] or tuple(got.shape[1:]) != tuple(st.shape[1:]):
                rep.differ[label] = f"shape {list(got.shape)} does not fit rows {a}: of stored {list(st.shape)}"
                seen.add(name)
                continue
            ref = ck.read_rows(name, a, b)
        seen.add(name)
        h_got, h_ref = tensor_sha256(got), tensor_sha256(ref)
        rep.sha256[label] = (h_got, h_ref)
        if got.dtype != ref.dtype:
            rep.differ[label] = f"dtype {got.dtype}, stored {ref.dtype}"
        elif tuple(got.shape) != tuple(ref.shape):
            rep.differ[label] = f"shape {list(got.shape)}, stored {list(ref.shape)}"
        elif h_got != h_ref:
            x = got.contiguous().reshape(-1).view(torch.uint8)
            y = ref.contiguous().reshape(-1).view(torch.uint8)
            nd = int((x != y).sum())
            rep.differ[label] = f"{nd} of {y.numel()} bytes differ"
        else:
            rep.equal.append(label)
    if expected is not None:
        rep.missing = [n for n in expected if n not in seen]
    return rep
