"""Ranks: who this process is under ``torchrun``, and the few collectives the pipeline needs.

The ranks only exchange small Python objects (a status, an error message), so the process
group is gloo whatever the device: the bytes never travel between ranks, each rank reads and
writes its share of the files itself (one node or several on a shared filesystem).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, Mapping, TypeVar

import torch.distributed as dist

from ..errors import CheckpointError, InklingError, RankLostError

K = TypeVar("K")


@dataclass(frozen=True)
class World:
    """This process's rank among ``size`` (1 without torchrun)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1  # ranks on this node (they share its cores)

    @property
    def distributed(self) -> bool:
        return self.size > 1


def current_world() -> World:
    """The world of the initialised process group, else one process."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")),
                     local_ranks())
    return World()


def local_ranks() -> int:
    """Ranks torchrun started on this node (``LOCAL_WORLD_SIZE``; 1 outside torchrun or when unset)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def launched_ranks() -> int:
    """How many ranks torchrun started (1 outside torchrun); readable before the group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@contextmanager
def torchrun(timeout_s: float = 1800.0) -> Iterator[World]:
    """Join the process group when started by torchrun (gloo); yields this process's world.

    ``timeout_s`` bounds how long a rank waits in a collective for a rank that died without
    torchrun noticing (torchrun itself stops the others when one exits with an error).
    """
    started = False
    if launched_ranks() > 1 and not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
        started = True
    try:
        yield current_world()
    finally:
        if started:
            dist.destroy_process_group()


def broadcast(obj: Any, world: World) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not world.distributed:
        return obj
    box = [obj]
    with together(world.rank):
        dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(obj: Any, world: World) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not world.distributed:
        return [obj]
    out: list[Any] = [None] * world.size
    with together(world.rank):
        dist.all_gather_object(out, obj)
    return out


@contextmanager
def together(rank: int) -> Iterator[None]:
    """Around a collective step of rank ``rank``: a rank gone from it (gloo: "Connection closed by peer", a timeout) is a
    :class:`RankLostError`, which keeps the staging folder for a resume; as the RuntimeError it
    is, the job would take it for its own failure and remove what every rank had finished."""
    try:
        yield
    except RuntimeError as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise RankLostError(f"rank {rank} lost the other ranks in a step they take together ({first[:200]}); "
                            "nothing was published; rerun the same command to resume") from None


def all_ok(err: BaseException | None, world: World) -> None:
    """Collective: raise on every rank when any rank failed (the first failing rank's message)."""
    if not world.distributed:
        if err is not None:
            raise err
        return
    try:
        msgs = gather(None if err is None else (type(err).__name__, str(err), isinstance(err, InklingError)), world)
    except RankLostError:
        if err is not None:
            raise err from None  # this rank's own failure says more than the lost rank
        raise
    if err is not None:
        raise err
    for m in msgs:
        if m is not None:
            raise CheckpointError(f"another rank failed: {m[1]}") if m[2] else RuntimeError(f"another rank failed: {m[0]}: {m[1]}")


def assign(sizes: Mapping[K, int], ranks: int) -> dict[K, int]:
    """Item → rank: largest first onto the least-loaded rank (deterministic, ties by key order)."""
    load = [0] * ranks
    owner: dict[K, int] = {}
    for key, n in sorted(sizes.items(), key=lambda kv: (-kv[1], str(kv[0]))):
        r = min(range(ranks), key=lambda i: (load[i], i))
        owner[key] = r
        load[r] += n
    return owner


__all__ = ["World", "current_world", "launched_ranks", "local_ranks", "torchrun", "broadcast", "gather", "all_ok", "assign",
           "together"]
