"""Writing an HF checkpoint through the executor, on one rank or several.

A command gives the output inventory, the configs and pass-through files, and its units: each
:class:`~inkling_ckpt.pipeline.executor.Unit` lists in ``pieces`` the output rows it produces
(``(tensor, first row, last row)``; a scalar is ``(name, 0, 1)``) and ``transform(unit)``
returns ``{tensor: rows}`` for them. The shard files follow from the inventory; each rank
writes the shards it owns (:class:`~inkling_ckpt.layouts.hf.HFWriter`), computing a unit when
any of its pieces lands there, and skipping pieces an interrupted run finished.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from ..layouts.hf import HFWriter, write_extra_files, write_json
from ..model.inventory import TensorSpec
from .executor import Executor, Unit
from .readahead import Extent
from .publish import Stage, run_staged
from .report import Result

Piece = tuple[str, int, int]


def piece_bytes(spec: TensorSpec, start: int, stop: int) -> int:
    rows = spec.shape[0] if spec.shape else 1
    return spec.nbytes * (stop - start) // max(1, rows)


def write_hf(ex: Executor, dst: str | Path, job: dict[str, Any], specs: Sequence[TensorSpec], config: Mapping[str, Any],
             extra_files: Mapping[str, Any], units: Sequence[Unit], transform: Callable[[Unit], Mapping[str, torch.Tensor]],
             *, max_shard_size: int | str, files: Mapping[str, str] | None = None, force: bool = False,
             inputs: Iterable[str | Path | None] = (), extents: Callable[[Unit], Sequence[Extent]] | None = None) -> Result:
    """Publish the HF checkpoint of ``specs`` at ``dst`` (atomic, resumable, collective under torchrun).

    ``files``: tensor → file (a reference's sharding, :func:`~inkling_ckpt.layouts.hf.reference_sharding`)
    instead of splitting by ``max_shard_size``. ``extents``: what each unit reads, for the read-ahead."""
    t0 = time.perf_counter()
    by_name = {s.name: s for s in specs}
    planned = {p[0] for u in units for p in u.pieces}
    missing = [s.name for s in specs if s.name not in planned]
    if missing:
        raise ValueError(f"write_hf: no unit produces {missing[0]}")  # a planning bug, not bad input

    def work(stage: Stage) -> None:
        writer = HFWriter(stage, specs, max_shard_size, files, rank=stage.rank, ranks=stage.ranks)
        todo: list[Unit] = []
        reused: list[Unit] = []
        for u in units:
            mine = [p for p in u.pieces if writer.owns(p[0])]
            if not mine:
                continue
            u = dataclasses.replace(u, write_bytes=sum(piece_bytes(by_name[n], a, b) for n, a, b in mine))
            (todo if any(writer.piece_needed(*p) for p in mine) else reused).append(u)

        def sink(u: Unit, got: Mapping[str, torch.Tensor]) -> None:
            for name, a, b in u.pieces:
                if writer.owns(name) and writer.piece_needed(name, a, b):
                    t = got[name]
                    if by_name[name].shape == ():
                        writer.write(name, t)
                    else:
                        writer.write_rows(name, a, t)

        try:
            ex.run(todo, transform, sink, reused=reused, extents=extents)
        except BaseException:
            writer.abort()  # an interruption keeps the pieces written so far for a resume
            raise
        ex.stats.bytes_reused = writer.reused_bytes()
        writer.close(index=False)

    def finish(stage: Stage, _: None) -> None:
        HFWriter(stage, specs, max_shard_size, files).write_index()
        write_json(stage.path / "config.json", dict(config))
        write_extra_files(dict(extra_files), stage.path)

    outcome = run_staged(dst, job, ex.world, work, finish, force=force, inputs=inputs)
    result = Result(Path(dst), skipped=outcome.skipped)
    stats = ex.finish() if not outcome.skipped else []
    if outcome.skipped:
        return result
    result.add_ranks(stats, seconds=time.perf_counter() - t0)
    result.tensors = len(specs)
    result.bytes = sum(s.nbytes for s in specs)
    return result


__all__ = ["write_hf", "piece_bytes", "Piece"]
