"""A sharded folder (``inkling-ckpt shard``) with the read interface every layout shares.

:class:`ShardedRelease` is :class:`~inkling_ckpt.layouts.sharded.ShardedCheckpoint` (global
tensors reassembled from the rank folders, ``read_rows`` of an EP slice from its EP rank only)
plus what ``inspect``/``verify``/``memory`` ask of any reader beyond it: ``layout`` and
``storage()``. Kept apart from the sharded writer so that module stays the writer's.
"""

from __future__ import annotations

from typing import Any

from .sharded import ShardedCheckpoint


class ShardedRelease(ShardedCheckpoint):
    """A sharded folder opened for reading (``ShardedRelease.open(path, verify_checksums=...)``)."""

    layout = "sharded"

    def storage(self) -> dict[str, Any]:
        """How the folder stores the tensors (for ``inspect``)."""
        plan = self.manifest["plan"]
        files = [rel for rel in self.manifest["files"] if rel.endswith(".safetensors")]
        return {"layout": self.layout, "files": len(files), "tp": plan.get("tp"), "ep": plan.get("ep"),
                "moe_tp": plan.get("moe_tp"), "ranks": len(self.manifest["ranks"])}


__all__ = ["ShardedRelease"]
