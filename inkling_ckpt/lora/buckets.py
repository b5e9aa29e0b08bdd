"""Load groups of adapter tensors, packed into the weight sync's buckets (``sync.buckets``).

``AdapterGroup`` has the attributes of the base-weight sync's ``LoadGroup``, so a caller sends
either the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..sync.buckets import DEFAULT_BUCKET_BYTES, Bucket, pack
from ..sync.verify import pairs

__all__ = ["DEFAULT_BUCKET_BYTES", "AdapterGroup", "Bucket", "pack", "pairs"]


@dataclass
class AdapterGroup:
    """Tensors the engine takes together (both factors of one adapter module) and their sources."""

    tensors: list[tuple[str, torch.Tensor]]
    what: str  # the trainer names it was built from, shortened
    sources: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)
