"""What every HF-writing converter shares: the source protocol, the result, and publishing a folder."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import torch

from ..layouts.hf import HFWriter, write_extra_files, write_json
from ..layouts.staging import Staging
from ..model.config import InklingConfig
from ..model.inventory import TensorSpec
from ..model.precision import PrecisionPlan
from ..progress import ByteProgress


class TensorSource(Protocol):
    """A release checkpoint that hands out its stored tensors by name (an HFCheckpoint)."""

    config: dict[str, Any]
    cfg: InklingConfig
    plan: PrecisionPlan
    tensors: Mapping[str, Any]

    def get(self, name: str) -> torch.Tensor: ...
    def dtypes(self) -> dict[str, torch.dtype]: ...
    def extra_files(self) -> dict[str, bytes]: ...
    def describe(self) -> dict[str, Any]: ...


@dataclass
class Result:
    """What a conversion did."""

    dst: Path
    skipped: bool = False
    resumed: bool = False
    tensors: int = 0
    bytes: int = 0
    notes: list[str] = field(default_factory=list)


def write_hf_checkpoint(
    dst: str | Path,
    job: dict[str, Any],
    specs: list[TensorSpec],
    config: dict[str, Any],
    extra_files: dict[str, bytes],
    produce: Callable[[HFWriter, Callable[[int], None]], None],
    *,
    max_shard_size: int | str,
    force: bool,
    progress: bool,
    desc: str,
) -> Result:
    """Publish an HF checkpoint of ``specs`` at ``dst``.

    ``produce(writer, advance)`` writes the tensors ``writer.needed()`` still asks for (a resumed
    job skips finished shards). ``config.json`` and pass-through files follow; the folder is
    published atomically, or skipped when ``dst`` already holds this job.
    """
    result = Result(Path(dst))
    with Staging(dst, job, force=force) as st:
        if st.done:
            result.skipped = True
            return result
        result.resumed = st.resumed
        writer = HFWriter(st, specs, max_shard_size)
        total = sum(s.nbytes for s in specs)
        todo = sum(s.nbytes for s in specs if writer.needed(s.name))
        with ByteProgress(total, desc=desc, enabled=progress, initial=total - todo) as bar:
            try:
                produce(writer, bar.advance)
            finally:
                writer.abort()
            writer.close()
        write_json(st.path / "config.json", config)
        write_extra_files(extra_files, st.path)
        result.tensors = len(specs)
        result.bytes = total
    return result


__all__ = ["TensorSource", "Result", "write_hf_checkpoint"]
