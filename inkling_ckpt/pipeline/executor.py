"""The executor: runs a command's units through read → transform → write, bounded and overlapped.

A command hands it a list of :class:`Unit` (planned from headers, in output order) and a
``transform(unit)`` that reads the unit's input bytes and returns what to write (decoding /
re-encoding / renaming / slicing on :attr:`Executor.device`); ``sink(unit, result)`` writes it.
Transforms run on a pool of worker threads (torch ops and file reads release the GIL), at most
``workers + 1`` units in flight and no more of them than the host memory budget holds
(``--memory-mb``), so memory is a few slices whatever the checkpoint size; results
reach the sink in plan order on the calling thread (the only one that writes), so writing
overlaps the next units' reading and transforming, and what is written never depends on the
schedule. On CUDA every worker has its own stream; a GPU out-of-memory becomes one
:class:`~inkling_ckpt.errors.DeviceError` naming ``--slice-mb``.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence, TypeVar

import torch

from ..layouts.pread import staging_bytes
from ..progress import ByteProgress
from .device import oom_as_error, peak_gpu_bytes, resolve_device
from .memory import resident_bytes, steady_memory, trim_heap
from .readahead import Extent, ReadAhead, read_ahead_bytes
from .world import World, current_world, gather

T = TypeVar("T")

#: BF16 bytes of routed experts one unit handles (at least one expert) by default on a GPU: the slice budget.
DEFAULT_SLICE_BYTES = 64 * 2**20
#: The same on the CPU. There a unit holds its slice several times over while it runs (read, reordered,
#: encoded), and the default budget fits only a few 64 MiB units beside a CUDA build's ~0.5 GiB: on the
#: H200 machine's 16 cores (8-layer wide grid, three runs each) 32 MiB took megatron-to-hf from
#: 20.9-24.8 s to 18.5-19.7 s and its peak RSS from 1057-1095 to 989-1015 MiB, quantize from
#: 12.9-14.4 s to 12.2-13.0 s and 981-1066 to 925-932 MiB; 16 MiB was slower again.
DEFAULT_CPU_SLICE_BYTES = 32 * 2**20
#: Parallel transforms at most by default on the CPU: each holds a few copies of its slice (the
#: memory budget, DEFAULT_MEMORY_BYTES, bounds what they hold together whatever their number).
MAX_DEFAULT_WORKERS = 4
#: The same on a GPU, where a transform holds its slice on the host only while reading, checking
#: and serializing it: the host work (reads, sha256, copies) wants more of them. On the H200
#: machine 8 took megatron-to-hf's transforms from 16.0 to 10.5 s (4 in flight kept the writer
#: waiting 86 % of the time) for ~110 MB more RSS; hf-to-megatron's stayed at 12.7 s (and an
#: earlier run of quantize, dequantize and hf-to-hf with 8 measured within noise of 4).
MAX_DEFAULT_GPU_WORKERS = 8
#: The most host bytes the units in flight may hold together by default (``--memory-mb`` 0).
DEFAULT_MEMORY_BYTES = 768 * 2**20
#: What the default budget aims the whole process at: its own size when its first units start, plus
#: the budget, plus :data:`UNCOUNTED_BYTES`. The own size is what varies: ~240 MiB with a CPU build
#: of torch, 491 MiB with a CUDA build (H200 machine) and ~610 MiB once CUDA is up, more with
#: ``torch.distributed.checkpoint`` imported; a fixed budget of 768 MiB kept CPU-build runs near
#: 1 GiB but CUDA runs at 1.0-1.25 GiB.
DEFAULT_PEAK_RSS_BYTES = 2**30
#: What a run holds besides its units' counted bytes (thread stacks, the writer's file state, heap
#: left between blocks): measured peaks stayed within ~64 MiB of start + units in flight.
UNCOUNTED_BYTES = 64 * 2**20
#: The default budget never goes below this: a few units in flight whatever the process's size.
MIN_DEFAULT_MEMORY_BYTES = 256 * 2**20
#: On a GPU the resident-size check holds units back this much below DEFAULT_PEAK_RSS_BYTES: there
#: the process grows after its start is measured by more than its units hold. H100 machine, 8-layer
#: wide fixture, sampled every 20 ms: verify's and lora merge's file-backed pages grew 49 MiB after
#: the start (CUDA and Triton libraries paged in as kernels are first used) and their host
#: transients rose ~90 MiB above the steady size, peaking at 1018-1044 MiB with no reserve.
GPU_RESERVE_BYTES = 48 * 2**20
#: On a GPU the default budget is figured as if the process had already grown this much past its
#: measured start (those libraries, the driver's transfer buffers, host transients), down to
#: :data:`MIN_DEFAULT_GPU_MEMORY_BYTES`: the CPU's 256 MiB floor left a CUDA process (~680 MiB at the
#: start) no room. H100 machine, 2026-12-06, 8-layer wide fixture: lora merge's CUDA runs peaked at
#: 1034-1066 MiB (six runs) with that floor, 995-1021 MiB (three) with ``--memory-mb 128``, as fast
#: (8.9-9.7 against 8.7-9.4 s), and 970-1000 MiB with this default; megatron-to-hf 914-915 against
#: 934 MiB, as fast (12.8-13.2 against 12.9 s); every CUDA command's peak under 1 GiB
#: (bench/README.md).
GPU_GROWTH_BYTES = 128 * 2**20
#: The least default budget on a GPU, where a unit holds its slice on the host only while reading,
#: checking and serializing it.
MIN_DEFAULT_GPU_MEMORY_BYTES = 128 * 2**20


def default_slice_bytes(device_type: str) -> int:
    """The slice budget when ``--slice-mb`` is 0: :data:`DEFAULT_CPU_SLICE_BYTES` on the CPU, else :data:`DEFAULT_SLICE_BYTES`."""
    return DEFAULT_CPU_SLICE_BYTES if device_type == "cpu" else DEFAULT_SLICE_BYTES


def default_budget(start_rss: int, *, gpu: bool = False) -> int:
    """The host memory budget when ``--memory-mb`` is 0: what keeps the process near
    :data:`DEFAULT_PEAK_RSS_BYTES`, between :data:`MIN_DEFAULT_MEMORY_BYTES` and :data:`DEFAULT_MEMORY_BYTES`
    (on a GPU, ``gpu``: counting :data:`GPU_GROWTH_BYTES` too, down to :data:`MIN_DEFAULT_GPU_MEMORY_BYTES`)."""
    grows, floor = (GPU_GROWTH_BYTES, MIN_DEFAULT_GPU_MEMORY_BYTES) if gpu else (0, MIN_DEFAULT_MEMORY_BYTES)
    return min(DEFAULT_MEMORY_BYTES, max(floor, DEFAULT_PEAK_RSS_BYTES - start_rss - grows - UNCOUNTED_BYTES))


def cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def share_cores(cores: int, local_ranks: int, workers: int, device_type: str, *,
                gpu_workers: int = MAX_DEFAULT_GPU_WORKERS, host_math: bool = False) -> tuple[int, int]:
    """``(workers, torch threads per worker)`` for one rank of ``local_ranks`` sharing ``cores``.

    The ranks on one node split its cores evenly, and a rank's workers split its share, so the
    node runs ``cores`` threads in all whatever the rank count (more oversubscribes: two ranks
    each using every core ran slower than one). ``workers`` 0 means the default: one per core of
    the rank's share, at most :data:`MAX_DEFAULT_WORKERS` (``gpu_workers`` on a GPU, by default
    :data:`MAX_DEFAULT_GPU_WORKERS`), and at least 2 on a GPU (the GPU work of a slice takes
    milliseconds; reading, checking and serializing it on the host does not, so the host side
    wants several slices in flight).
    At least 1 each. On a GPU a worker mostly waits on its stream or in I/O: one torch thread,
    unless its units do math of their own on the host (``host_math``: lora merge's products,
    formed on the CPU whatever the device), which then splits the share as on the CPU.
    """
    share = max(1, cores // max(1, local_ranks))
    if workers <= 0:
        workers = max(1, min(share, gpu_workers if device_type == "cuda" else MAX_DEFAULT_WORKERS))
        if device_type == "cuda":
            workers = max(2, workers)
    threads = max(1, share // workers) if device_type == "cpu" or host_math else 1
    return workers, threads


@dataclass(frozen=True)
class Unit:
    """One independent piece of a job: what it reads and writes, and where the job is when it runs.

    ``key`` is unique in the plan and stable across runs; ``where`` is shown by the progress bar
    ("layer 3 of 48"); ``pieces`` are the output rows it produces (``(tensor, first row, last
    row)``: resume and rank assignment of file outputs use them); ``data`` is the command's own.
    """

    key: str
    where: str = ""
    read_bytes: int = 0
    write_bytes: int = 0
    pieces: tuple[tuple[str, int, int], ...] = ()
    data: Any = None
    hold_bytes: int = 0  # host bytes its transform holds at once; 0: read_bytes + write_bytes

    @property
    def memory(self) -> int:
        """Host bytes this unit holds while in flight, for the executor's memory budget."""
        return self.hold_bytes or self.read_bytes + self.write_bytes


@dataclass
class Options:
    """How to run: the device for the codecs, the slice budget, worker threads, progress bar."""

    device: str = "auto"
    slice_bytes: int = 0  # 0: default_slice_bytes() of the device
    workers: int = 0  # 0: the default of share_cores (the rank's cores, at most MAX_DEFAULT_WORKERS, or
    #                    MAX_DEFAULT_GPU_WORKERS and at least 2 on a GPU)
    progress: bool = True
    memory_bytes: int = 0  # host bytes the units in flight may hold together; 0: default_budget()


@dataclass
class RankStats:
    """What one rank did."""

    rank: int = 0
    device: str = "cpu"
    workers: int = 1
    threads: int = 1  # torch threads per worker
    units: int = 0
    units_reused: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    bytes_reused: int = 0
    seconds: float = 0.0  # from its first units (map) to finish(): the rate once running
    peak_gpu_bytes: int = 0
    # Where the writing thread's time went: waiting for transforms (the work is the bound) or
    # handling results (writing: the sink is the bound). Measured in ``map``.
    wait_seconds: float = 0.0
    sink_seconds: float = 0.0
    # The host memory budget of the units in flight, the most units in flight at once, and the
    # process's resident size when its first units started (what the units' memory comes on top of).
    budget_bytes: int = 0
    most_in_flight: int = 0
    start_rss_bytes: int = 0
    # Times the default budget's resident-size check held the next unit back (``peak_rss_bytes``).
    rss_holds: int = 0
    # What the read-ahead read, and the units whose input it had read whole before a worker began them.
    read_ahead_bytes: int = 0
    read_ahead_units: int = 0
    where: list[str] = field(default_factory=list)  # first and last position this rank worked on

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "device": self.device, "workers": self.workers, "threads": self.threads,
                "units": self.units,
                "units_reused": self.units_reused, "bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
                "bytes_reused": self.bytes_reused, "seconds": round(self.seconds, 3),
                "peak_gpu_bytes": self.peak_gpu_bytes, "wait_seconds": round(self.wait_seconds, 3),
                "sink_seconds": round(self.sink_seconds, 3), "budget_bytes": self.budget_bytes,
                "most_in_flight": self.most_in_flight, "start_rss_bytes": self.start_rss_bytes,
                "rss_holds": self.rss_holds, "read_ahead_bytes": self.read_ahead_bytes,
                "read_ahead_units": self.read_ahead_units, "span": self.where}


class Executor:
    """Runs units for one command on one rank; see the module docstring."""

    def __init__(self, options: Options | None = None, *, desc: str = "", world: World | None = None,
                 gpu_workers: int = MAX_DEFAULT_GPU_WORKERS, host_math: bool = False):
        """``gpu_workers``: the most workers by default on a GPU, for a command whose units do most
        of their work on the host even there (lora merge: copies, float linears, deltas; verify).
        ``host_math``: the units' host work is torch math (lora merge's products), which gets the
        workers' share of the cores on a GPU too (:func:`share_cores`)."""
        steady_memory()  # every command that streams tensors: freed slices go back to the OS
        self.options = options or Options()
        self.desc = desc
        self.world = world or current_world()
        self.device = resolve_device(self.options.device)
        asked = int(self.options.slice_bytes)
        self.slice_bytes = asked if asked > 0 else default_slice_bytes(self.device.type)
        self.workers, self.threads = share_cores(cores(), self.world.local_size, self.options.workers, self.device.type,
                                                 gpu_workers=gpu_workers, host_math=host_math)
        self.stats = RankStats(rank=self.world.rank, device=str(self.device), workers=self.workers,
                               threads=self.threads)
        self._t0 = time.perf_counter()
        self._local = threading.local()
        self._mapped = False  # map() has run (the start size and default budget are re-measured then)
        if self.device.type == "cuda":
            # The allocator keeps statistics only once it has served an allocation on the device: resetting
            # them before gives "Invalid device argument" (seen with torch 2.11 on an H200).
            torch.empty(1, device=self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            # The codecs import Triton on their first CUDA tensor: importing it now puts its libraries
            # in the size the default budget is taken from, instead of on top of the budget.
            from ..formats.gpu import kernels_available

            kernels_available()
        #: Host bytes the units in flight may hold together (at least one unit always runs).
        self.budget_bytes = 0
        #: With the default budget, the resident size a new unit must fit under (0: no such check).
        self.peak_rss_bytes = 0
        self._measure_start()

    def _measure_start(self) -> None:
        """The process's size now, and the default budget from it; again when the first units run,
        so what a command imports or builds after creating its executor (hf-to-megatron: DCP) counts."""
        self.stats.start_rss_bytes = resident_bytes()
        asked = int(self.options.memory_bytes)
        gpu = self.device.type == "cuda"
        # On a GPU each worker reads through its own pinned buffers (layouts.pread), allocated on its
        # first read, and the writer brings results down through its own: part of the process's size,
        # not of any unit's.
        staged = staging_bytes(self.workers + 1) if gpu else 0
        self.budget_bytes = asked if asked > 0 else default_budget(self.stats.start_rss_bytes + staged, gpu=gpu)
        self.stats.budget_bytes = self.budget_bytes
        # The budget counts what units are charged; what grows the process besides (libraries loaded on
        # first use, CUDA modules, heap kept between blocks) is only seen in its resident size, so the
        # default also holds a unit back while the process, plus the units no worker has begun yet, plus
        # that unit would pass DEFAULT_PEAK_RSS_BYTES. A check of the size alone let the H200 node's runs
        # peak 0-55 MiB over 1 GiB; keeping 64 MiB more in reserve held them at 974-1021 MiB on CUDA but
        # slowed megatron-to-hf 86 -> 68 % of plain (full-size layer) and left the CPU runs over (their
        # codec temporaries grow inside running units, which no check before a unit starts can stop).
        # An explicit --memory-mb is the user's own bound: no second guess.
        reserve = GPU_RESERVE_BYTES if gpu else 0
        self.peak_rss_bytes = 0 if asked > 0 else DEFAULT_PEAK_RSS_BYTES - reserve

    # ---- running units -----------------------------------------------------------------------

    def map(self, units: Sequence[Any], transform: Callable[[Any], T], *,
            cost: Callable[[Any], int] | None = None,
            done_cost: Callable[[Any], int] | None = None,
            extents: Callable[[Any], Sequence[Extent]] | None = None) -> Iterator[tuple[Any, T]]:
        """``(unit, transform(unit))`` in order; transforms run ahead on the workers, bounded.

        Works on any items (a :class:`Unit` or a storage writer's own items). ``cost(item)``: the
        host bytes an item holds while its transform runs (default: a :class:`Unit`'s ``memory``,
        else 0); ``done_cost(item)``: what its result holds once the transform is done, waiting
        for the writer (default: a :class:`Unit`'s ``write_bytes``, else ``cost``). Items start
        while those in flight, the one being handed out included, fit the budget (the next in
        order always starts when nothing else is in flight). An error in a transform is raised
        here, at its unit, after the work in flight is cancelled. ``extents(item)``: the byte
        ranges its transform will read, which a :class:`~.readahead.ReadAhead` reads into the page
        cache ahead of the workers (on a GPU by default; ``INKLING_CKPT_READ_AHEAD_MB`` sets how far, 0 off).
        """
        if not units:
            return
        ahead = read_ahead_bytes(self.device.type) if extents is not None else 0
        ra = ReadAhead(units, extents, ahead) if extents is not None and ahead > 0 else None
        try:
            yield from self._map(units, transform, cost, done_cost, ra)
        finally:
            if ra is not None:
                ra.close()
                self.stats.read_ahead_bytes += ra.bytes_read
                self.stats.read_ahead_units += ra.items_ready

    def _map(self, units: Sequence[Any], transform: Callable[[Any], T], cost: Callable[[Any], int] | None,
             done_cost: Callable[[Any], int] | None, ra: ReadAhead | None) -> Iterator[tuple[Any, T]]:
        if not self._mapped:
            # The rank's time, start size and default budget count from its first units: what a
            # command does before (importing DCP, planning) is a fixed cost, not the rate it runs at.
            self._mapped = True
            self._t0 = time.perf_counter()
            self._measure_start()
        cost = cost or _memory
        if done_cost is None:
            done_cost = _result_memory if cost is _memory else cost
        threads = self.threads
        main_threads = torch.get_num_threads()
        clock = time.perf_counter
        stats = self.stats
        if self.workers == 1 and self.device.type == "cpu":
            stats.most_in_flight = max(stats.most_in_flight, 1)
            torch.set_num_threads(threads)  # this rank's share of the node's cores
            try:
                for i, u in enumerate(units):  # no thread: the simplest schedule, same results
                    if ra is not None:
                        ra.started(i + 1)
                    t = clock()
                    with oom_as_error():
                        r = transform(u)
                    t1 = clock()
                    stats.wait_seconds += t1 - t
                    yield u, r
                    del r
                    stats.sink_seconds += clock() - t1
            finally:
                torch.set_num_threads(main_threads)
            return

        def init() -> None:
            torch.set_num_threads(threads)  # per worker: the ranks' workers together use the cores once

        pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="inkling-unit", initializer=init)
        # (item, bytes while transforming, bytes once done, its future, [a worker has begun it])
        pending: deque[tuple[Any, int, int, Future[T], list[bool]]] = deque()
        it = iter(units)
        submitted = 0  # items handed to the pool (the read-ahead runs past them)
        held: list[Any] = []  # the next item, when the budget held it back
        handed = 0  # bytes of the result with the caller (counted until it comes back)
        handing_out = False  # a result is with the caller

        def in_flight() -> int:
            # A finished transform holds only its result: a unit waiting for the writer is charged
            # what it will write, not what it read and worked on (megatron-to-hf's CPU slices: a
            # third), so the budget keeps the workers busy instead of the queue.
            return handed + sum(d if f.done() else c for _, c, d, f, _ in pending)

        def not_begun() -> int:
            # What pending units charge but cannot have allocated yet: a worker has not picked them up.
            return sum(c for _, c, _, _, begun in pending if not begun[0])

        def fits(c: int) -> bool:
            room = self.peak_rss_bytes - not_begun() - c
            if resident_bytes() <= room:
                return True
            # Blocks freed between live ones keep their pages (one heap for all the workers: verify's
            # held ~190 MiB free at its peak on the 2-core box); give them back, then look again.
            # verify (its larger charge either way), 4 workers, node-sized process: 1043-1084 MiB peak,
            # held 80-128 times, without this; 962-991 MiB, never held, with it (same time).
            return trim_heap() and resident_bytes() <= room

        def start(u: Any, begun: list[bool]) -> T:
            begun[0] = True
            return self._run_one(transform, u)

        def fill() -> None:
            nonlocal submitted
            while len(pending) <= self.workers:
                if not held:
                    nxt = next(it, _END)
                    if nxt is _END:
                        return
                    held.append(nxt)
                c = max(0, int(cost(held[0])))
                if pending or handing_out:  # else it starts whatever it costs: at least one unit runs
                    if in_flight() + c > self.budget_bytes:
                        return
                    if self.peak_rss_bytes and not fits(c):
                        stats.rss_holds += 1
                        return
                u = held.pop()
                begun = [False]
                submitted += 1
                if ra is not None:
                    ra.started(submitted)
                pending.append((u, c, min(c, max(0, int(done_cost(u)))), pool.submit(start, u, begun), begun))
                stats.most_in_flight = max(stats.most_in_flight, len(pending) + handing_out)

        try:
            with oom_as_error():
                fill()
                while pending:
                    u, _, d, fut, _ = pending.popleft()
                    t = clock()
                    result = fut.result()
                    t1 = clock()
                    stats.wait_seconds += t1 - t
                    handing_out, handed = True, d
                    fill()
                    yield u, result
                    del result
                    handing_out, handed = False, 0
                    fill()
                    stats.sink_seconds += clock() - t1
        finally:
            for _, _, _, fut, _ in pending:
                fut.cancel()
            pool.shutdown(wait=True, cancel_futures=True)
            torch.set_num_threads(main_threads)

    def _run_one(self, transform: Callable[[Any], T], unit: Any) -> T:
        if self.device.type != "cuda":
            return transform(unit)
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            out = transform(unit)
            stream.synchronize()
        return out

    def run(self, units: Sequence[Unit], transform: Callable[[Unit], T], sink: Callable[[Unit, T], None], *,
            reused: Sequence[Unit] = (), total_bytes: int | None = None, read_only: bool = False,
            extents: Callable[[Unit], Sequence[Extent]] | None = None) -> RankStats:
        """Transform every unit and hand each result to ``sink`` in order, with a progress bar.

        ``reused`` are this rank's units an interrupted run already wrote (counted, not redone).
        ``read_only``: a job that writes nothing (``verify``); the bar counts the bytes read.
        ``extents``: what each unit reads, for the read-ahead (:meth:`map`).
        """
        def size(u: Unit) -> int:
            return u.read_bytes if read_only else u.write_bytes

        done_bytes = sum(size(u) for u in reused)
        total = total_bytes if total_bytes is not None else done_bytes + sum(size(u) for u in units)
        self.note_reused(reused)
        with self.progress(total, initial=done_bytes) as bar:
            for u, result in self.map(units, transform, extents=extents):
                sink(u, result)
                self.note_done(u)
                bar.advance(size(u), u.where)
        return self.stats

    def progress(self, total: int, *, initial: int = 0) -> ByteProgress:
        """This run's progress bar (rank 0 only)."""
        return ByteProgress(total, desc=self.desc, enabled=self.options.progress and self.world.rank == 0,
                            initial=initial)

    # ---- bookkeeping -------------------------------------------------------------------------

    def note_done(self, unit: Unit) -> None:
        """Count a unit this rank transformed and wrote."""
        s = self.stats
        s.units += 1
        s.bytes_read += unit.read_bytes
        s.bytes_written += unit.write_bytes
        if unit.where:
            s.where = [s.where[0] if s.where else unit.where, unit.where]

    def note_reused(self, units: Sequence[Unit]) -> None:
        """Count units an interrupted run had finished (a resume reused them)."""
        self.stats.units_reused += len(units)
        self.stats.bytes_reused += sum(u.write_bytes for u in units)

    def finish(self) -> list[RankStats]:
        """Collective: every rank's stats (rank order), this rank's elapsed time and peak GPU memory filled in."""
        self.stats.seconds = time.perf_counter() - self._t0
        self.stats.peak_gpu_bytes = peak_gpu_bytes(self.device)
        return [RankStats(**d) if isinstance(d, dict) else d for d in gather(self.stats, self.world)]

    # ---- device helpers for transforms -------------------------------------------------------

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the executor's device (a no-op on the CPU)."""
        if self.device.type == "cpu":
            return t
        return t.to(self.device, non_blocking=False)


_END = object()


def _memory(item: Any) -> int:
    return item.memory if isinstance(item, Unit) else 0


def _result_memory(item: Any) -> int:
    return item.write_bytes if isinstance(item, Unit) else 0


__all__ = ["Executor", "Options", "Unit", "RankStats", "DEFAULT_SLICE_BYTES", "DEFAULT_CPU_SLICE_BYTES", "default_slice_bytes", "DEFAULT_MEMORY_BYTES", "default_budget", "MAX_DEFAULT_WORKERS",
           "MAX_DEFAULT_GPU_WORKERS", "cores",
           "share_cores"]
