"""Which layout a folder holds, and one way to open any of them for reading.

The read-only commands (``inspect``, ``verify``, ``memory``) accept every layout the toolkit
writes. :func:`open_checkpoint` looks at the folder's marker files — nothing else is read to
decide — and returns a reader with one interface, release tensor names throughout:

==============  ==============================================  =========================================
layout          marker                                          reader
==============  ==============================================  =========================================
``sharded``     ``inkling-shard.json`` (``inkling-ckpt shard``)  :class:`~.sharded_release.ShardedRelease`
``torch_dist``  ``latest_checkpointed_iteration.txt``,            :class:`~.torch_dist_release.TorchDistRelease`
                ``metadata.json``/``.metadata`` or ``release/``
``hf``          ``config.json``, ``model.safetensors[.index.json]``  :class:`~.hf.HFCheckpoint`
==============  ==============================================  =========================================

A name that is no local path but looks like ``org/name`` is an HF hub repo. The common
interface (:class:`Checkpoint`): ``layout``, ``root``, ``config``, ``cfg``, ``plan``,
``tensors`` (keyed by the stored release names; what each value holds is the layout's own),
``expected()`` (the inventory as :class:`~inkling_ckpt.model.inventory.TensorSpec` rows: use
this for shapes and dtypes), ``dtypes()``, ``vision_specs()``, ``get(name)``,
``read_rows(name, start, stop)``, ``storage()``, ``describe()``, ``close()``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Protocol

import torch

from ..errors import CheckpointError, ConfigError
from ..model.config import InklingConfig
from ..model.inventory import TensorSpec
from ..model.precision import PrecisionPlan
from .hf import INDEX, SINGLE, HFCheckpoint, split_repo_id
from .megatron_names import DCP_METADATA, METADATA_JSON, RELEASE, TRACKER

HF, TORCH_DIST, SHARDED = "hf", "torch_dist", "sharded"
LAYOUTS = (HF, TORCH_DIST, SHARDED)
#: The sharded layout's manifest (kept here so detection does not import the sharded writer).
SHARD_MANIFEST = "inkling-shard.json"


class Checkpoint(Protocol):
    """What every reader offers (release tensor names; experts as stored in that layout)."""

    # Read-only members (properties), so each reader may narrow their types.
    @property
    def layout(self) -> str: ...
    @property
    def root(self) -> Path: ...
    @property
    def config(self) -> dict[str, Any]: ...
    @property
    def cfg(self) -> InklingConfig: ...
    @property
    def plan(self) -> PrecisionPlan: ...
    @property
    def tensors(self) -> Mapping[str, Any]: ...  # stored release names; values are layout-specific


    def expected(self) -> list[TensorSpec]: ...
    def dtypes(self) -> dict[str, torch.dtype]: ...
    def vision_specs(self) -> list[TensorSpec]: ...
    def get(self, name: str) -> torch.Tensor: ...
    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor: ...
    def storage(self) -> dict[str, Any]: ...
    def describe(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


def detect_layout(path: str | Path) -> str:
    """``hf``, ``torch_dist`` or ``sharded``, from the folder's marker files; CheckpointError for anything else."""
    p = Path(path)
    if not p.exists():
        if split_repo_id(str(path)) is not None:
            return HF  # a hub repo id (org/name or org/name@REV): HFCheckpoint fetches it
        raise CheckpointError(f"{p}: no such checkpoint folder")
    if not p.is_dir():
        raise CheckpointError(f"{p}: a file, not a checkpoint folder (give the folder that holds it)")
    if (p / SHARD_MANIFEST).is_file():
        return SHARDED
    if (p / TRACKER).is_file() or (p / METADATA_JSON).is_file() or (p / DCP_METADATA).is_file() or (p / RELEASE).is_dir():
        return TORCH_DIST
    if (p / "config.json").is_file() or (p / INDEX).is_file() or (p / SINGLE).is_file():
        return HF
    raise CheckpointError(
        f"{p}: not a checkpoint folder: no config.json or model.safetensors (HF), no {SHARD_MANIFEST} (sharded by "
        f"inkling-ckpt shard), no {TRACKER} or {RELEASE}/{METADATA_JSON} (Megatron torch_dist)")


#: What to do with a folder of another layout given where an HF checkpoint is read.
NOT_HF: dict[str, str] = {
    TORCH_DIST: "this is a Megatron torch_dist checkpoint, not an HF one: use `inkling-ckpt convert megatron-to-hf "
                "SRC DST --reference HF` to make an HF checkpoint of it (inspect, verify and memory read it as it is)",
    SHARDED: f"this is a sharded folder ({SHARD_MANIFEST}), not an HF checkpoint: use `inkling-ckpt shard --merge "
             "SRC DST` to rebuild the HF checkpoint (inspect, verify and memory read it as it is)",
}


def not_hf_hint(kind: str) -> str:
    """The one-line advice for a ``kind`` folder given to a command that reads HF checkpoints."""
    return NOT_HF.get(kind, f"a {kind} folder, not an HF checkpoint")


def open_checkpoint(path: str | Path, *, config: Any = None, default_config: Any = None, layout: str | None = None,
                    verify_checksums: bool = False) -> Checkpoint:
    """Open any layout the toolkit writes, detected from the folder (headers and metadata only).

    ``config`` (a ``config.json``, a folder holding one, or a dict) is the model config of a
    torch_dist folder that keeps no copy of its own; HF and sharded folders carry theirs, and
    giving one for them is refused rather than silently ignored. ``default_config``: a torch_dist
    folder's config when neither ``config`` nor a kept copy is there. ``verify_checksums``: hash every
    file of a sharded folder against its manifest (sizes are always checked).
    """
    kind = layout or detect_layout(path)
    if kind not in LAYOUTS:
        raise CheckpointError(f"unknown layout {kind!r}; known: {', '.join(LAYOUTS)}")
    if kind == TORCH_DIST:
        from .torch_dist_release import TorchDistRelease

        return TorchDistRelease.open(path, config=config, default_config=default_config)
    if config is not None:
        raise ConfigError(f"{path}: a {kind} checkpoint carries its own config.json; --config is for torch_dist "
                          "folders")
    if kind == SHARDED:
        from .sharded_release import ShardedRelease  # imported only when needed

        return ShardedRelease.open(path, verify_checksums=verify_checksums)
    return HFCheckpoint.open(path)


__all__ = ["open_checkpoint", "detect_layout", "not_hf_hint", "NOT_HF", "Checkpoint", "HF", "TORCH_DIST", "SHARDED", "LAYOUTS",
           "SHARD_MANIFEST"]
