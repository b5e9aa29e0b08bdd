"""Buckets of load groups: what a sync hands the engine in one call (spec/weight-sync.md).

A group (``LoadGroup`` of the base-weight sync, ``AdapterGroup`` of an adapter sync: anything
with ``tensors`` and ``nbytes``) is never split; a bucket holds at most ``bucket_bytes`` unless
one group alone is larger.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

DEFAULT_BUCKET_BYTES = 512 << 20


@dataclass
class Bucket:
    """Whole load groups, at most ``bucket_bytes`` unless one group alone is larger."""

    groups: list[Any] = field(default_factory=list)
    nbytes: int = 0

    def add(self, group: Any) -> None:
        self.groups.append(group)
        self.nbytes += group.nbytes

    @property
    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` pairs, as ``update_weights_from_tensor`` / ``load_lora_adapter_from_tensors`` take them."""
        return [nt for g in self.groups for nt in g.tensors]

    def __iter__(self):
        return iter(self.named_tensors)

    def __len__(self) -> int:
        return sum(len(g.tensors) for g in self.groups)


def pack(groups: Iterable[Any], bucket_bytes: int) -> Iterator[Bucket]:
    """Groups packed in order into buckets of at most ``bucket_bytes`` (a larger group alone)."""
    cur = Bucket()
    for g in groups:
        if cur.groups and cur.nbytes + g.nbytes > bucket_bytes:
            yield cur
            cur = Bucket()
        cur.add(g)
    if cur.groups:
        yield cur


__all__ = ["DEFAULT_BUCKET_BYTES", "Bucket", "pack"]
