"""Load groups and buckets of adapter tensors, in the shape of ``inkling_ckpt.sync``'s.

Same attributes and packing rule as the base-weight sync's ``LoadGroup``/``Bucket`` (a group is
never split; a bucket holds at most ``bucket_bytes`` unless one group alone is larger), so a
caller can send either the same way. Kept here so adapter syncs do not depend on the base-weight
sync machinery (re-encoding, model tables).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

DEFAULT_BUCKET_BYTES = 512 << 20


@dataclass
class AdapterGroup:
    """Tensors the engine takes together (both factors of one adapter module) and their sources."""

    tensors: list[tuple[str, torch.Tensor]]
    what: str  # the trainer names it was built from, shortened
    sources: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)


@dataclass
class Bucket:
    """Whole groups, at most ``bucket_bytes`` unless one group alone is larger."""

    groups: list[AdapterGroup] = field(default_factory=list)
    nbytes: int = 0

    def add(self, group: AdapterGroup) -> None:
        self.groups.append(group)
        self.nbytes += group.nbytes

    @property
    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """``(engine name, tensor)`` pairs, as ``load_lora_adapter_from_tensors`` takes them."""
        return [nt for g in self.groups for nt in g.tensors]

    def __iter__(self):
        return iter(self.named_tensors)

    def __len__(self) -> int:
        return sum(len(g.tensors) for g in self.groups)


def pack(groups: Iterable[AdapterGroup], bucket_bytes: int) -> Iterator[Bucket]:
    """Groups packed in order into buckets of at most ``bucket_bytes`` (a larger group alone)."""
    cur = Bucket()
    for g in groups:
        if cur.groups and cur.nbytes + g.nbytes > bucket_bytes:
            yield cur
            cur = Bucket()
        cur.add(g)
    if cur.groups:
        yield cur


def pairs(emitted) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` from buckets, groups or pairs, in order."""
    for item in emitted:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            yield item
        elif hasattr(item, "named_tensors"):
            yield from item.named_tensors
        elif hasattr(item, "tensors"):
            yield from item.tensors
        else:
            raise TypeError(f"cannot read (name, tensor) pairs from {type(item).__name__}")
