"""One staged, atomically published output written by one or several ranks.

Rank 0 owns the :class:`~inkling_ckpt.layouts.staging.Staging` folder (lock, fingerprint,
publish); every rank writes its share into it through a :class:`Stage` (the same
``partial``/``finish``/``is_finished`` contract). Collective points, in the same order on every
rank: broadcast(status), all_ok(written), all_ok(published). A rank that fails makes every rank
raise, and nothing is published; an interrupted job (a kill, Ctrl-C, torchrun stopping the
others) keeps the staging folder, and a rerun resumes from what was finished.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

from ..errors import CheckpointError, InklingError
from ..layouts.paths import check_name
from ..layouts.staging import Staging
from .world import World, all_ok, broadcast

T = TypeVar("T")


@dataclass
class Stage:
    """A rank's view of the job's staging folder (the write side of :class:`Staging`)."""

    path: Path
    resumed: bool
    rank: int = 0
    ranks: int = 1

    def is_finished(self, relpath: str) -> bool:
        """Whether a file of the output is already complete (an earlier run of this job finished it)."""
        return self.resumed and (self.path / _rel(relpath)).is_file()

    def partial(self, relpath: str) -> Path:
        """Where to write a file before :meth:`finish` makes it count as complete. A regular file
        already there is kept (its finished pieces resume); anything else (a link) is removed first."""
        p = self.path / (_rel(relpath) + ".partial")
        p.parent.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(p) and (p.is_symlink() or not p.is_file()):
            p.unlink()
        return p

    def finish(self, relpath: str) -> None:
        """Mark a file written through :meth:`partial` as complete (fsync, then an atomic rename)."""
        src = self.path / (_rel(relpath) + ".partial")
        fd = os.open(src, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(src, self.path / relpath)


def _rel(relpath: str) -> str:
    return check_name(relpath, "staging", "output file")  # names come from our plans; never let one leave


@dataclass
class Outcome:
    """How a staged job ended on this rank."""

    skipped: bool = False  # DST already held this job's finished output
    stage: Stage | None = None
    value: Any = None  # what ``work`` returned on this rank


def run_staged(dst: str | Path, job: dict[str, Any], world: World, work: Callable[[Stage], T],
               finish: Callable[[Stage, T], None], *, force: bool = False,
               inputs: Iterable[str | Path | None] = ()) -> Outcome:
    """Run ``work(stage)`` on every rank, then ``finish(stage, value)`` on rank 0, then publish.

    ``work`` returns normally or raises; an :class:`InklingError` or ``OSError`` on any rank is
    raised on every rank (the others as "another rank failed: ..."), and the staging folder is
    removed. Call on every rank with the same ``dst`` and ``job``.
    """
    if world.rank == 0:
        return _rank0(dst, job, world, work, finish, force, inputs)
    status = broadcast(None, world)
    if "error" in status:
        raise CheckpointError(f"rank 0 could not start: {status['error']}")
    if status["done"]:
        return Outcome(skipped=True)
    stage = Stage(Path(status["path"]), status["resumed"], world.rank, world.size)
    value, err = _attempt(work, stage)
    all_ok(err, world)  # written
    all_ok(None, world)  # published
    return Outcome(stage=stage, value=value)


def _rank0(dst: str | Path, job: dict[str, Any], world: World, work: Callable[[Stage], T],
           finish: Callable[[Stage, T], None], force: bool, inputs: Iterable[str | Path | None]) -> Outcome:
    written = False
    out = Outcome()
    try:
        try:
            st = Staging(dst, job, force=force, inputs=inputs)
            st.__enter__()
        except BaseException as e:
            broadcast({"error": str(e)}, world)
            raise
        try:
            broadcast({"done": st.done, "path": str(st.path), "resumed": st.resumed}, world)
            if st.done:
                out.skipped = True
            else:
                out.stage = Stage(st.path, st.resumed, 0, world.size)
                value, err = _attempt(work, out.stage)
                all_ok(err, world)  # every rank has written its share
                written = True
                out.value = value
                finish(out.stage, value)  # type: ignore[arg-type]
        except BaseException as e:
            if not st.__exit__(type(e), e, e.__traceback__):
                raise
        else:
            st.__exit__(None, None, None)  # publishes
    except BaseException as e:
        if written:
            all_ok(e if isinstance(e, Exception) else RuntimeError(str(e)), world)  # tell the others; re-raises here
        raise
    if not out.skipped:
        all_ok(None, world)
    return out


def _attempt(work: Callable[[Stage], T], stage: Stage) -> tuple[T | None, BaseException | None]:
    """``work(stage)``, or the error it raised (bad input, I/O) so every rank can learn of it."""
    try:
        return work(stage), None
    except (InklingError, OSError) as e:
        return None, e


__all__ = ["Stage", "Outcome", "run_staged"]
