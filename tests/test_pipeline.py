"""The shared executor (inkling_ckpt.pipeline): ordering, bounds, errors, devices, ranks, resume."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import TINY, free_port, same_files, subprocess_env
from inkling_ckpt.errors import ConfigError, DeviceError
from inkling_ckpt.pipeline import Executor, Options, Unit, resolve_device
from inkling_ckpt.pipeline import executor as executor_mod

BIN = Path(sys.executable).parent
DRIVER = Path(__file__).parent / "_ranks_driver.py"


# ---- the executor ---------------------------------------------------------------------------------


def test_map_yields_in_plan_order_with_bounded_work_in_flight():
    ex = Executor(Options(device="cpu", workers=3, progress=False))
    active = 0
    peak = 0
    lock = threading.Lock()
    made: list[int] = []
    consumed: list[int] = []
    ahead = 0

    def work(i: int) -> int:
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
            made.append(i)
        time.sleep(0.01 * ((7 * i) % 5))  # finish out of order
        with lock:
            active -= 1
        return i * i

    for i, r in ex.map(list(range(40)), work):
        assert r == i * i
        consumed.append(i)
        ahead = max(ahead, len(made) - len(consumed))
    assert consumed == list(range(40))
    assert 1 < peak <= 3
    assert ahead <= ex.workers + 1  # never more than workers + 1 units produced and not yet written


def test_a_failing_transform_raises_at_its_unit_and_stops_the_rest():
    ex = Executor(Options(device="cpu", workers=2, progress=False))
    started: list[int] = []

    def work(i: int) -> int:
        started.append(i)
        if i == 5:
            raise ValueError("unit 5 is bad")
        return i

    got = []
    with pytest.raises(ValueError, match="unit 5"):
        for i, _ in ex.map(list(range(100)), work):
            got.append(i)
    assert got == [0, 1, 2, 3, 4]
    assert max(started) < 10  # the queue is bounded: the tail was never started


def test_run_counts_units_bytes_and_reused():
    ex = Executor(Options(device="cpu", workers=2, progress=False))
    units = [Unit(f"u{i}", f"layer {i + 1} of 3", read_bytes=10, write_bytes=4) for i in range(3)]
    written: list[str] = []
    ex.run(units[1:], lambda u: u.key, lambda u, r: written.append(r), reused=units[:1])
    s = ex.finish()[0]
    assert written == ["u1", "u2"]
    assert (s.units, s.units_reused, s.bytes_read, s.bytes_written, s.bytes_reused) == (2, 1, 20, 8, 4)
    assert s.where == ["layer 2 of 3", "layer 3 of 3"]


def test_ranks_on_one_node_split_its_cores():
    from inkling_ckpt.pipeline import share_cores

    # (cores, local ranks, --workers, device) -> (workers, torch threads per worker)
    assert share_cores(16, 1, 0, "cpu") == (4, 4)
    assert share_cores(16, 2, 0, "cpu") == (4, 2)  # the node still runs 16 threads, not 32
    assert share_cores(16, 4, 0, "cpu") == (4, 1)
    assert share_cores(16, 8, 0, "cpu") == (2, 1)
    assert share_cores(2, 1, 0, "cpu") == (2, 1)
    assert share_cores(2, 2, 0, "cpu") == (1, 1)
    assert share_cores(2, 4, 0, "cpu") == (1, 1)  # never below one
    assert share_cores(16, 2, 3, "cpu") == (3, 2)  # --workers kept, threads from the rank's share
    assert share_cores(16, 2, 16, "cpu") == (16, 1)
    assert share_cores(16, 1, 0, "cuda") == (8, 1)  # the host side of slices in flight: more than on the CPU
    assert share_cores(16, 2, 0, "cuda") == (8, 1)
    assert share_cores(16, 4, 0, "cuda") == (4, 1)
    assert share_cores(2, 2, 0, "cuda") == (2, 1)  # at least 2 with a GPU: reading overlaps the device
    assert share_cores(16, 2, 5, "cuda") == (5, 1)
    assert share_cores(16, 1, 0, "cuda", gpu_workers=4) == (4, 1)  # a command whose work is on the host
    assert share_cores(16, 1, 6, "cuda", gpu_workers=4) == (6, 1)  # --workers is the user's
    # units doing torch math on the host on a GPU run too (lora merge's products) split the cores as on the CPU
    assert share_cores(16, 1, 0, "cuda", gpu_workers=4, host_math=True) == (4, 4)
    assert share_cores(16, 2, 0, "cuda", gpu_workers=4, host_math=True) == (4, 2)
    assert share_cores(2, 1, 0, "cuda", gpu_workers=4, host_math=True) == (2, 1)


def test_the_executor_takes_the_ranks_per_node_from_its_world(monkeypatch):
    from inkling_ckpt.pipeline import World

    monkeypatch.setattr(executor_mod, "cores", lambda: 16)
    one = Executor(Options(device="cpu", progress=False), world=World())
    two = Executor(Options(device="cpu", progress=False), world=World(rank=1, size=2, local_rank=1, local_size=2))
    assert (one.workers, one.threads) == (4, 4)
    assert (two.workers, two.threads) == (4, 2)
    seen: list[int] = []
    list(two.map(range(6), lambda i: seen.append(torch.get_num_threads())))
    assert set(seen) == {2}
    assert two.stats.as_dict()["threads"] == 2  # in the report's "ranks"


def _concurrency(ex: Executor, units: list, hold=lambda u: 0.01, **map_options) -> tuple[list, int]:
    """Run ``units`` through ``ex.map`` with a transform that holds each unit ``hold(unit)``
    seconds; (the units in the order handed out, the most transforms that ran at once)."""
    import threading
    import time

    lock = threading.Lock()
    running = [0, 0]

    def work(u):
        with lock:
            running[0] += 1
            running[1] = max(running[1], running[0])
        time.sleep(hold(u))
        with lock:
            running[0] -= 1
        return u.key

    got = [(u.key, r) for u, r in ex.map(units, work, **map_options)]
    assert all(k == r for k, r in got)
    return [k for k, _ in got], running[1]


def test_units_in_flight_stay_within_the_memory_budget():
    """The budget, not the worker count, bounds what is in flight: 100-byte units under a 250-byte
    budget run two at a time (the one handed out counts until the writer is done with it)."""
    units = [Unit(key=f"u{i}", write_bytes=100) for i in range(12)]
    ex = Executor(Options(device="cpu", workers=6, progress=False, memory_bytes=250))
    order, most = _concurrency(ex, units)
    assert order == [u.key for u in units]  # the order never depends on the schedule
    assert ex.stats.most_in_flight == 2 and most <= 2
    assert ex.stats.as_dict()["budget_bytes"] == 250 and ex.stats.as_dict()["start_rss_bytes"] > 0
    wide = Executor(Options(device="cpu", workers=6, progress=False, memory_bytes=10**6))
    assert _concurrency(wide, units)[0] == order
    assert wide.stats.most_in_flight == 8  # as before the budget: workers + 1 queued, and the one being written


def test_a_finished_unit_is_charged_what_it_writes():
    """A transform holds what it reads and writes; once done, its result waits for the writer
    holding only what it writes: 100-byte units that write 10 under a 250-byte budget never run
    more than two transforms at once, but finished ones waiting behind a slow first unit no longer
    keep the next from starting (the charge before was 100 each: two in flight at most)."""
    def slow_first(u: Unit) -> float:
        return 0.2 if u.key == "u0" else 0.005  # the others finish and wait behind it

    units = [Unit(key=f"u{i}", read_bytes=90, write_bytes=10) for i in range(12)]
    ex = Executor(Options(device="cpu", workers=6, progress=False, memory_bytes=250))
    order, most = _concurrency(ex, units, slow_first)
    assert order == [u.key for u in units]
    assert most <= 2  # 3 x 100 bytes transforming would be over the budget
    assert ex.stats.most_in_flight >= 4  # u0 handed out, u1 done (10 each), u2 and u3 started
    charged = Executor(Options(device="cpu", workers=6, progress=False, memory_bytes=250))
    _concurrency(charged, units, slow_first, done_cost=lambda u: u.memory)  # charged in full until written
    assert charged.stats.most_in_flight == 2


def test_the_default_budget_keeps_the_process_near_one_gib():
    """--memory-mb 0: the budget is what is left of 1 GiB beside the process's own size at the
    start (less what a run holds uncounted, and on a GPU what the process grows by), never under
    256 MiB (128 MiB on a GPU) nor over 768 MiB."""
    from inkling_ckpt.pipeline.executor import default_budget

    mib = 2**20
    assert default_budget(240 * mib) == 720 * mib  # torch's CPU build
    assert default_budget(610 * mib) == 350 * mib  # a CUDA build with CUDA up
    assert default_budget(100 * mib) == 768 * mib and default_budget(900 * mib) == 256 * mib
    # on a GPU the process grows past its start by GPU_GROWTH_BYTES more; the floor is 128 MiB
    assert default_budget(610 * mib, gpu=True) == 222 * mib and default_budget(100 * mib, gpu=True) == 732 * mib
    assert default_budget(683 * mib, gpu=True) == 149 * mib and default_budget(900 * mib, gpu=True) == 128 * mib
    ex = Executor(Options(device="cpu", workers=2, progress=False))
    assert ex.budget_bytes == default_budget(ex.stats.start_rss_bytes) == ex.stats.budget_bytes
    assert Executor(Options(device="cpu", progress=False, memory_bytes=5 * mib)).budget_bytes == 5 * mib


def test_the_default_budget_is_measured_again_when_units_start(monkeypatch):
    """What a command loads after creating its executor (hf-to-megatron imports DCP then) counts:
    the start size and the default budget are taken again when the first units run."""
    import inkling_ckpt.pipeline.executor as executor_mod

    mib = 2**20
    sizes = [300 * mib, 700 * mib]
    monkeypatch.setattr(executor_mod, "resident_bytes", lambda: sizes.pop(0) if len(sizes) > 1 else sizes[0])
    ex = Executor(Options(device="cpu", workers=2, progress=False))
    assert ex.budget_bytes == executor_mod.default_budget(300 * mib)
    assert [u.key for u, _ in ex.map([Unit(key="a"), Unit(key="b")], lambda u: u)] == ["a", "b"]
    assert ex.stats.start_rss_bytes == 700 * mib and ex.budget_bytes == ex.stats.budget_bytes == 260 * mib


def test_the_default_budget_holds_units_back_while_the_process_is_near_one_gib(monkeypatch):
    """What grows the process besides the units' charges (libraries and CUDA modules loaded on first
    use) is seen in its resident size: with the default budget a unit waits while the process plus
    that unit would pass 1 GiB (at least one unit always runs); an explicit --memory-mb is not second-guessed."""
    import inkling_ckpt.pipeline.executor as executor_mod

    mib = 2**20
    size = [300 * mib]
    monkeypatch.setattr(executor_mod, "resident_bytes", lambda: size[0])
    units = [Unit(key=f"u{i}", write_bytes=10 * mib) for i in range(10)]
    roomy = Executor(Options(device="cpu", workers=4, progress=False))
    assert _concurrency(roomy, units)[0] == [u.key for u in units]
    assert roomy.stats.most_in_flight > 2 and roomy.stats.rss_holds == 0

    # The process holds 900 MiB plus 10 MiB per unit whose transform has started and whose result the
    # writer has not dropped: at most (1 GiB - 900 MiB) / 10 MiB = 12 units, and units started
    # together count before they have allocated anything.
    live = [0]
    lock = threading.Lock()
    size_of = lambda: 900 * mib + live[0] * 10 * mib  # noqa: E731
    monkeypatch.setattr(executor_mod, "resident_bytes", size_of)

    def grow(u: Unit) -> str:
        with lock:
            live[0] += 1
        time.sleep(0.01)
        return u.key

    near = Executor(Options(device="cpu", workers=16, progress=False))
    assert near.peak_rss_bytes == 2**30
    peak = 0
    for _ in near.map(units * 3, grow):
        peak = max(peak, size_of())
        with lock:
            live[0] -= 1
    assert peak <= near.peak_rss_bytes and near.stats.rss_holds > 0
    monkeypatch.setattr(executor_mod, "resident_bytes", lambda: size[0])
    size[0] = 1020 * mib  # the process grew after its start was measured: 10 MiB more would pass 1 GiB
    full = Executor(Options(device="cpu", workers=4, progress=False))
    order, most = _concurrency(full, units)
    assert order == [u.key for u in units] and most == 1
    assert full.stats.most_in_flight == 1 and full.stats.rss_holds > 0
    assert full.stats.as_dict()["rss_holds"] == full.stats.rss_holds
    asked = Executor(Options(device="cpu", workers=4, progress=False, memory_bytes=100 * mib))
    _concurrency(asked, units)
    assert asked.stats.most_in_flight > 2 and asked.stats.rss_holds == 0


def test_the_resident_size_check_gives_the_heaps_free_pages_back_before_holding_a_unit(monkeypatch):
    """Blocks the workers freed between live ones keep their pages: before holding a unit back for the
    process's size, the executor trims the heap (malloc_trim) and looks again."""
    import inkling_ckpt.pipeline.executor as executor_mod

    mib = 2**20
    size = [300 * mib]
    trims = [0]

    def trim() -> bool:  # the heap gave 720 MiB of free pages back
        trims[0] += 1
        size[0] = 300 * mib
        return True

    monkeypatch.setattr(executor_mod, "resident_bytes", lambda: size[0])
    monkeypatch.setattr(executor_mod, "trim_heap", trim)
    units = [Unit(key=f"u{i}", write_bytes=10 * mib) for i in range(10)]
    ex = Executor(Options(device="cpu", workers=4, progress=False))

    def grow(u: Unit) -> str:
        size[0] = 1020 * mib  # freed blocks left the process just under 1 GiB
        time.sleep(0.01)
        return u.key

    assert [k for _, k in ex.map(units, grow)] == [u.key for u in units]
    assert trims[0] > 0 and ex.stats.rss_holds == 0 and ex.stats.most_in_flight > 1
    monkeypatch.setattr(executor_mod, "trim_heap", lambda: False)  # nothing to give back: held as before
    held = Executor(Options(device="cpu", workers=4, progress=False))
    assert [k for _, k in held.map(units, grow)] == [u.key for u in units]
    assert held.stats.rss_holds > 0 and held.stats.most_in_flight == 1


def test_a_unit_bigger_than_the_memory_budget_still_runs_alone():
    units = [Unit(key="small", read_bytes=10), Unit(key="huge", read_bytes=10**9, hold_bytes=0), Unit(key="after")]
    ex = Executor(Options(device="cpu", workers=4, progress=False, memory_bytes=100))
    assert _concurrency(ex, units)[0] == ["small", "huge", "after"]
    assert ex.stats.most_in_flight <= 2
    assert Unit(key="x", read_bytes=5, write_bytes=7).memory == 12
    assert Unit(key="x", read_bytes=5, write_bytes=7, hold_bytes=30).memory == 30  # a command's own estimate wins


def test_a_collective_that_loses_a_rank_is_a_rank_lost_error_and_a_rank_s_own_error_comes_first(monkeypatch, tmp_path):
    from inkling_ckpt.errors import CheckpointError, RankLostError
    from inkling_ckpt.layouts.staging import Staging
    from inkling_ckpt.pipeline import world as world_mod

    def closed(*a, **k):
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234. This is typically caused by ...")

    monkeypatch.setattr(world_mod.dist, "all_gather_object", closed)
    two = world_mod.World(rank=1, size=2)
    with pytest.raises(RankLostError, match=r"rank 1 lost the other ranks .*Connection closed by peer.*rerun"):
        world_mod.all_ok(None, two)
    with pytest.raises(CheckpointError, match="bad header"):  # what this rank knows of its own failure wins
        world_mod.all_ok(CheckpointError("bad header"), two)
    with pytest.raises(TypeError, match="cannot pickle"):  # what the step was handed, not a lost rank
        with world_mod.together(0):
            raise TypeError("cannot pickle '_thread.lock' object")
    # A lost rank keeps the staging folder (a resume reuses it); bad input removes it.
    for err, kept in ((RankLostError("lost"), True), (CheckpointError("bad"), False)):
        dst = tmp_path / f"out-{kept}"
        with pytest.raises(type(err)):
            with Staging(dst, {"job": "x"}) as st:
                (st.path / "a.safetensors").write_bytes(b"x")
                raise err
        assert (tmp_path / f".{dst.name}.inkling-partial" / "a.safetensors").exists() == kept


def test_local_ranks_come_from_torchrun(monkeypatch):
    from inkling_ckpt.pipeline import local_ranks

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert local_ranks() == 3
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert local_ranks() == 1


def test_every_executor_steadies_memory_once_per_process(monkeypatch):
    from inkling_ckpt.pipeline import memory

    calls: list[tuple[int, int]] = []

    class Libc:
        def mallopt(self, param: int, value: int) -> int:
            calls.append((param, value))
            return 1

    monkeypatch.setattr(memory, "_applied", False)
    monkeypatch.setattr(memory, "_glibc", lambda: Libc())
    Executor(Options(device="cpu", progress=False))
    Executor(Options(device="cpu", progress=False))
    assert calls == [(memory.M_MMAP_THRESHOLD, 8 << 20), (memory.M_TRIM_THRESHOLD, 32 << 20),
                     (memory.M_ARENA_MAX, 1)]


def test_glibc_takes_every_setting_steady_memory_makes():
    """mallopt returns 1 for a parameter it knows and a value it accepts (0 otherwise: silently ignored)."""
    from inkling_ckpt.pipeline import memory

    libc = memory._glibc()
    if libc is None:
        pytest.skip("not glibc")
    for param, value in ((memory.M_MMAP_THRESHOLD, memory.MMAP_THRESHOLD),
                         (memory.M_TRIM_THRESHOLD, memory.TRIM_THRESHOLD), (memory.M_ARENA_MAX, memory.ARENA_MAX)):
        assert libc.mallopt(param, value) == 1, param


def test_steady_memory_is_a_no_op_off_glibc(monkeypatch):
    from inkling_ckpt.pipeline import memory

    def no_glibc(name: str) -> str:
        raise ValueError(name)  # what os.confstr says where the C library is not glibc

    monkeypatch.setattr(memory.os, "confstr", no_glibc)
    assert memory._glibc() is None
    monkeypatch.setattr(memory, "_applied", False)
    memory.steady_memory()  # nothing to call, nothing raised
    assert memory.trim_heap() is False


def test_trimming_the_heap_gives_freed_pages_back_on_glibc():
    """Freed blocks between live ones stay resident until malloc_trim: trim_heap returns them."""
    from inkling_ckpt.pipeline import memory

    if memory._glibc() is None:
        pytest.skip("not glibc")
    memory.steady_memory()
    blocks = [torch.ones(1 << 18) for _ in range(64)]  # 1 MiB each: from the heap (below the mmap threshold)
    keep = blocks[1::2]
    del blocks  # every other block freed: 32 MiB of holes between live blocks
    before = memory.resident_bytes()
    assert memory.trim_heap() is True
    assert memory.resident_bytes() < before
    del keep


@pytest.mark.skipif(not Path("/proc/self/statm").exists() or not hasattr(os, "fork"), reason="Linux only")
def test_the_resident_size_is_read_fresh_each_time_and_a_forked_child_reads_its_own():
    """resident_bytes keeps /proc/self/statm open: each read must see the size now, and a child must
    not read its parent's file (it would see the parent's size)."""
    from inkling_ckpt.pipeline import memory

    before = memory.resident_bytes()
    block = bytearray(96 << 20)
    block[:: 4096] = b"x" * (len(block) // 4096)  # every page touched
    grown = memory.resident_bytes()
    assert grown - before >= 90 << 20
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop the block (its own copy), report its own size
        try:
            del block
            os.write(w, str(memory.resident_bytes()).encode())
        finally:
            os._exit(0)
    os.close(w)
    child = int(os.read(r, 64))
    os.close(r)
    os.waitpid(pid, 0)
    assert child < grown - (64 << 20)  # the parent still holds the block: its size is not the child's
    assert memory.resident_bytes() >= grown - (8 << 20)
    del block


def test_each_local_rank_takes_its_own_gpu(monkeypatch):
    """Under torchrun, --device cuda/auto is the rank's LOCAL_RANK GPU (modulo the GPUs there are)."""
    from inkling_ckpt.pipeline import device as device_mod

    monkeypatch.setattr(device_mod, "_cuda_usable", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for local, want in (("0", 0), ("1", 1), ("3", 1)):
        monkeypatch.setenv("LOCAL_RANK", local)
        assert resolve_device("cuda") == torch.device("cuda", want)
        assert resolve_device("auto") == torch.device("cuda", want)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)  # an explicit GPU is kept


def test_device_choice():
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(DeviceError, match="not a device"):
        resolve_device("tpu")


def test_the_default_slice_depends_on_the_device_and_an_asked_one_wins():
    """--slice-mb 0 (the default): 32 MiB of BF16 experts per unit on the CPU, 64 on a GPU; a given size is kept."""
    from inkling_ckpt.pipeline.executor import default_slice_bytes

    assert default_slice_bytes("cpu") == 32 * 2**20 and default_slice_bytes("cuda") == 64 * 2**20
    assert Executor(Options(device="cpu", progress=False)).slice_bytes == 32 * 2**20
    assert Executor(Options(device="cpu", slice_bytes=3 * 2**20, progress=False)).slice_bytes == 3 * 2**20


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_device_cuda_without_a_gpu_is_one_line_and_publishes_nothing(cli, tmp_path):
    code, out, err = cli("quantize", TINY["bf16"], tmp_path / "q", "--plan", "mxfp8", "--device", "cuda", "-q")
    assert code != 0
    assert err.strip().count("\n") == 0 and "--device cuda: no usable GPU" in err
    assert not (tmp_path / "q").exists() and not (tmp_path / ".q.inkling-partial").exists()


def test_slice_and_workers_do_not_change_the_bytes(cli, tmp_path):
    args = ("--plan", "0-1:nvfp4,2-3:mxfp8", "--max-shard-size", "1MB", "-q", "--device", "cpu")
    assert cli("quantize", TINY["bf16"], tmp_path / "a", *args, "--workers", "1")[0] == 0
    code, out, _ = cli("quantize", TINY["bf16"], tmp_path / "b", *args, "--workers", "3", "--slice-mb", "1",
                       "--memory-mb", "1")
    assert code == 0
    assert same_files(tmp_path / "a", tmp_path / "b") == []
    # The closing line: time, bytes read and written, rate; nothing claimed as resumed.
    assert "wrote" in out and " in " in out and "read " in out and "MB/s" in out and "resum" not in out


def test_expert_slices_read_and_written_on_a_gpu_charge_the_host_nothing():
    """On a GPU an expert slice's stored parts go straight onto it and its result is written from
    there (through the writer's pinned buffers, counted in the process's size): the memory budget
    charges it nothing (1 byte); dense units (read on the host), every unit on the CPU and every unit
    of a source that reads on the host (then copies the slice up) keep their charge."""
    from inkling_ckpt.convert.requantize import plan_units
    from inkling_ckpt.layouts.hf import HFCheckpoint
    from inkling_ckpt.model.inventory import inventory
    from inkling_ckpt.model.precision import PrecisionPlan
    from inkling_ckpt.pipeline import expert_slice, read_on_device

    src = HFCheckpoint.open(TINY["mixed"])
    plan = PrecisionPlan.uniform("bf16", src.cfg.num_hidden_layers)
    units = plan_units(src, inventory(src.cfg, plan, dtypes=src.dtypes()), plan, 1 << 20)
    assert read_on_device(units, "cpu", [src]) == units
    gpu = read_on_device(units, "cuda", [src])
    experts = [(u, g) for u, g in zip(units, gpu, strict=True) if expert_slice(u) is not None]
    assert experts and all(g.memory == 1 < u.write_bytes < u.memory for u, g in experts)
    assert all(g == u for u, g in zip(units, gpu, strict=True) if expert_slice(u) is None)

    class HostReads:  # reads on the host only (no reads_to_device): read_parts copies each slice up
        pass
    assert read_on_device(units, "cuda", [src, HostReads()]) == units


def test_requantize_charges_a_unit_what_it_holds_on_the_cpu():
    """A unit that re-encodes nothing holds what it read, which is what it writes (dense tensors, a
    layer keeping its format: charged once, not twice); an encode adds its chunk temporaries; one
    between two quantized formats adds the BF16 values decoded between them; a decode into the
    output holds what it reads and writes."""
    from inkling_ckpt.convert.requantize import ENCODE_WORKSPACE_BYTES, plan_units
    from inkling_ckpt.layouts.hf import HFCheckpoint
    from inkling_ckpt.model.inventory import inventory
    from inkling_ckpt.model.precision import PrecisionPlan
    from inkling_ckpt.pipeline import expert_slice

    def charges(variant: str, plan_name: str) -> tuple[list, dict]:
        src = HFCheckpoint.open(TINY[variant])
        plan = PrecisionPlan.parse(plan_name, src.cfg.num_hidden_layers) if plan_name != "same" else src.plan
        units = plan_units(src, inventory(src.cfg, plan, dtypes=src.dtypes()), plan, 1 << 20)
        dense = [u for u in units if expert_slice(u) is None]
        by_fmt: dict = {}
        for u in units:
            if expert_slice(u) is not None:
                out, first, last = expert_slice(u)
                by_fmt.setdefault((src.plan.format_of(out.layer), out.fmt), []).append((u, (last - first) * out.shape[1] * out.shape[2]))
        return dense, by_fmt

    dense, kept = charges("mixed", "same")
    assert dense and all(u.memory == u.write_bytes == u.read_bytes for u in dense)
    assert kept and all(u.memory == u.write_bytes for us in kept.values() for u, _ in us)
    _, bf16_to = charges("bf16", "mxfp8")
    assert all(u.memory == u.read_bytes + u.write_bytes + ENCODE_WORKSPACE_BYTES for u, _ in bf16_to[("bf16", "mxfp8")])
    _, mixed_to = charges("mixed", "mxfp8")
    assert all(u.memory == u.read_bytes + u.write_bytes + ENCODE_WORKSPACE_BYTES + 2 * n
               for u, n in mixed_to[("nvfp4", "mxfp8")])
    assert all(u.memory == u.write_bytes for u, _ in mixed_to[("mxfp8", "mxfp8")])
    _, mixed_dq = charges("mixed", "bf16")
    assert all(u.memory == u.read_bytes + u.write_bytes for us in mixed_dq.values() for u, _ in us)


def test_verify_charges_a_unit_its_reads_and_on_the_cpu_its_comparison():
    """A verify unit writes nothing; it holds what it reads of both sides and, on the CPU, a piece of
    each side decoded to float32 with the statistics' temporaries (COMPARE_WORKSPACE_BYTES)."""
    from inkling_ckpt.verify.compare import COMPARE_WORKSPACE_BYTES, DECODE_ELEMENTS, open_pair, plan_units

    a, b = open_pair(TINY["bf16"], TINY["mixed"])
    try:
        cpu, gpu = plan_units(a, b, 1 << 20, "cpu"), plan_units(a, b, 1 << 20, "cuda")
    finally:
        a.close()
        b.close()
    assert COMPARE_WORKSPACE_BYTES >= 2 * DECODE_ELEMENTS * 4
    assert cpu and all(u.write_bytes == 0 and u.memory == u.read_bytes + COMPARE_WORKSPACE_BYTES for u in cpu)
    assert all(g.memory == g.read_bytes == u.read_bytes for u, g in zip(cpu, gpu, strict=True))


def test_dense_tensors_cut_in_row_slices_keep_their_bytes(tmp_path):
    """A dense tensor bigger than the slice (the real embeddings: 1.85 GB against 64 MiB) is read and
    written in row slices; every slice must be its own rows (a slice past the first once came out
    empty, and the writer refused the unfinished tensor). Tiny tensors cut with a 40 KiB slice."""
    from inkling_ckpt.convert.requantize import requantize
    from inkling_ckpt.layouts.hf import HFCheckpoint
    from inkling_ckpt.model.precision import PrecisionPlan

    src = HFCheckpoint.open(TINY["mixed"])
    plan = PrecisionPlan.uniform("bf16", src.cfg.num_hidden_layers)
    assert src.tensors["model.llm.embed.weight"].nbytes > 4 * 40 * 1024
    for name, slice_bytes in (("whole", 64 * 2**20), ("rows", 40 * 1024)):
        requantize(src, tmp_path / name, plan, max_shard_size="1MB",
                   options=Options(device="cpu", slice_bytes=slice_bytes, workers=2, progress=False))
    assert same_files(tmp_path / "whole", tmp_path / "rows") == []


# ---- unit-grain resume -----------------------------------------------------------------------------


def test_an_interrupted_single_shard_job_resumes_from_its_pieces(cli, tmp_path, monkeypatch):
    """One output shard: the rerun reuses the pieces written before the interruption (not from zero)."""
    from inkling_ckpt.layouts import hf as hf_mod

    args = ("--plan", "mxfp8", "-q", "--device", "cpu", "--workers", "1", "--slice-mb", "1")
    assert cli("quantize", TINY["bf16"], tmp_path / "ref", *args)[0] == 0
    monkeypatch.setattr(hf_mod, "CHECKPOINT_BYTES", 1)  # record pieces after every write
    calls = {"n": 0}
    done = executor_mod.Executor.note_done

    def interrupt_after_some(self, unit):
        done(self, unit)
        calls["n"] += 1
        if calls["n"] == 8:
            raise KeyboardInterrupt

    monkeypatch.setattr(executor_mod.Executor, "note_done", interrupt_after_some)
    code, _, err = cli("quantize", TINY["bf16"], tmp_path / "out", *args)
    assert code == 130 and not (tmp_path / "out").exists()
    assert len(list((tmp_path / ".out.inkling-partial").glob("*.pieces"))) == 1
    monkeypatch.setattr(executor_mod.Executor, "note_done", done)
    code, out, _ = cli("quantize", TINY["bf16"], tmp_path / "out", *args)
    assert code == 0, out
    assert out.startswith("resumed and finished") and "the resume reused" in out
    assert same_files(tmp_path / "ref", tmp_path / "out") == []


def test_a_rerun_that_reuses_nothing_does_not_claim_a_resume(cli, tmp_path, monkeypatch):
    from inkling_ckpt.convert import requantize as rq

    args = ("--plan", "mxfp8", "-q", "--device", "cpu", "--workers", "1")

    def interrupted(*a, **k):
        def run(unit):
            raise KeyboardInterrupt  # before anything is written
        return run

    with monkeypatch.context() as mp:
        mp.setattr(rq, "transform", interrupted)
        assert cli("quantize", TINY["bf16"], tmp_path / "out", *args)[0] == 130
    assert (tmp_path / ".out.inkling-partial").is_dir()  # kept for a resume, but it holds nothing
    code, out, _ = cli("quantize", TINY["bf16"], tmp_path / "out", *args)
    assert code == 0 and out.startswith("wrote ") and "resum" not in out


# ---- ranks -------------------------------------------------------------------------------------------


def _torchrun(jobs: list[list[str]], tmp_path: Path, *extra: str, ranks: int = 2,
              launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    spec = tmp_path / f"jobs-{len(list(tmp_path.glob('jobs-*')))}.json"
    spec.write_text(json.dumps([[str(a) for a in j] for j in jobs]))
    return subprocess.run([str(BIN / "torchrun"), "--nproc_per_node", str(ranks), "--master_port", free_port(),
                           *launcher, str(DRIVER), str(spec), *extra], env=subprocess_env(), capture_output=True,
                          text=True, timeout=600)


def _jobs(out: Path) -> list[list[str]]:
    common = ["-q", "--device", "cpu", "--max-shard-size", "1MB"]
    return [
        ["quantize", str(TINY["bf16"]), str(out / "quantize"), "--plan", "0-1:nvfp4,2-3:mxfp8", *common],
        ["dequantize", str(TINY["mixed"]), str(out / "dequantize"), *common],
        ["convert", "hf-to-hf", str(TINY["mixed"]), str(out / "hf-to-hf"), "--plan", "mxfp8", *common],
        ["convert", "hf-to-megatron", str(TINY["mixed"]), str(out / "megatron"), "-q", "--device", "cpu"],
        ["convert", "megatron-to-hf", str(out / "megatron"), str(out / "back"), "--reference", str(TINY["mixed"]),
         *common],
    ]


def _same_tree(a: Path, b: Path) -> list[str]:
    """Files that differ, the done record excepted (it digests the files' times, not the checkpoint)."""
    import filecmp

    def files_of(root: Path) -> set[Path]:
        return {p.relative_to(root) for p in root.rglob("*") if p.is_file() and ".cache" not in p.relative_to(root).parts}

    files = files_of(a) | files_of(b)
    return sorted(str(f) for f in files
                  if not (a / f).is_file() or not (b / f).is_file() or not filecmp.cmp(a / f, b / f, shallow=False))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_resident_size_check_keeps_a_reserve_on_a_gpu():
    from inkling_ckpt.layouts.pread import staging_bytes
    from inkling_ckpt.pipeline.executor import DEFAULT_PEAK_RSS_BYTES, GPU_RESERVE_BYTES, default_budget

    ex = Executor(Options(device="cuda", progress=False))
    assert ex.peak_rss_bytes == DEFAULT_PEAK_RSS_BYTES - GPU_RESERVE_BYTES
    # the budget counts the GPU's growth too
    assert ex.budget_bytes == default_budget(ex.stats.start_rss_bytes + staging_bytes(ex.workers + 1), gpu=True)
    assert Executor(Options(device="cpu", progress=False)).peak_rss_bytes == DEFAULT_PEAK_RSS_BYTES
    assert Executor(Options(device="cuda", memory_bytes=2**30, progress=False)).peak_rss_bytes == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_command_writes_the_cpu_bytes_on_the_gpu(cli, tmp_path):
    """--device cuda (reads straight onto the GPU, the codecs' kernels there) against --device cpu."""
    for device in ("cpu", "cuda"):
        for job in _jobs(tmp_path / device):
            job = [a if a != "cpu" else device for a in job]
            code, _, err = cli(*job)
            assert code == 0, err
    for name in ("quantize", "dequantize", "hf-to-hf", "megatron", "back"):
        assert _same_tree(tmp_path / "cpu" / name, tmp_path / "cuda" / name) == [], name


def test_two_ranks_write_the_one_process_bytes_for_every_command(cli, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    for job in _jobs(one):
        code, out, err = cli(*job)
        assert code == 0, err
    r = _torchrun(_jobs(two), tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    for name in ("quantize", "dequantize", "hf-to-hf", "megatron", "back"):
        assert _same_tree(one / name, two / name) == [], name
    results = json.loads(r.stdout.split("RESULT ", 1)[1])
    for res in results:
        ranks = res["ranks"]
        assert ranks["count"] == 2
        # Each rank did a share, not the whole job.
        assert all(0 < each["bytes_written"] < res["bytes"] for each in ranks["each"]), res
        assert sum(each["bytes_written"] for each in ranks["each"]) >= res["bytes"] * 0.95
        # The two ranks on this node split its cores.
        assert all(each["threads"] == max(1, executor_mod.cores() // 2 // each["workers"]) for each in ranks["each"])
    assert "2 ranks" in r.stdout


def _run_free(rep: dict) -> dict:
    """A verify report without what depends on the run (time, who did what)."""
    return {k: v for k, v in rep.items() if k not in ("seconds", "ranks")}


def test_two_ranks_verify_as_one_process_and_exit_alike(cli, tmp_path):
    # mixed vs bf16: inexact experts, exact dense tensors. The small fixture's 512 x 512 experts make
    # each stacked weight 16 units at a 1 MiB slice: sums that would move with the order of pooling.
    for variant in ("bf16", "mixed"):
        code, _, err = cli("make-fixture", tmp_path / variant, "--size", "small", "--layers", "2", "--variant", variant,
                           "-q")
        assert code == 0, err
    args = ["verify", str(tmp_path / "bf16"), str(tmp_path / "mixed"), "-q", "--device", "cpu", "--slice-mb", "1",
            "--json"]
    code, out, err = cli(*args, "--workers", "1")
    assert code == 0, err
    one = json.loads(out)
    r = _torchrun([[*args, "--workers", "2"], [*args, "--exact"]], tmp_path, "--keep-going")
    assert r.returncode != 0  # the --exact job fails ...
    # ... on both ranks (the ranks share stdout: their lines may interleave with the reports)
    assert sorted(re.findall(r"RANK (\d) EXIT (\d)", r.stdout)) == [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")], \
        r.stdout + r.stderr[-2000:]
    two, failed = json.loads(r.stdout.split("RESULT ", 1)[1])  # rank 0's reports only: one per job
    assert not failed["thresholds"]["passed"] and _run_free(failed)["summary"] == one["summary"]
    assert _run_free(two) == _run_free(one)
    assert one["ranks"]["count"] == 1 and two["ranks"]["count"] == 2
    each = two["ranks"]["each"]
    assert all(0 < e["units"] < one["ranks"]["each"][0]["units"] for e in each)  # a share each, not the whole job
    assert sum(e["units"] for e in each) == one["ranks"]["each"][0]["units"]
    assert sum(e["bytes_read"] for e in each) == two["bytes_read"] == one["bytes_read"]


def test_two_ranks_write_big_tensors_in_row_ranges_as_one_process(cli, tmp_path, monkeypatch):
    """The torch_dist layout of global tensors over DENSE_CHUNK_BYTES (row-range chunks; 48 KiB here, so
    the tiny embeddings are split) is the same from 1 and 2 ranks, both ways."""
    from inkling_ckpt.layouts.megatron import TorchDistCheckpoint
    from inkling_ckpt.model import mapping

    def jobs(out: Path) -> list[list[str]]:
        return [["convert", "hf-to-megatron", str(TINY["mixed"]), str(out / "megatron"), "-q", "--device", "cpu"],
                ["convert", "megatron-to-hf", str(out / "megatron"), str(out / "back"), "--reference",
                 str(TINY["mixed"]), "-q", "--device", "cpu"]]

    one, two = tmp_path / "one", tmp_path / "two"
    monkeypatch.setattr(mapping, "DENSE_CHUNK_BYTES", 48 * 1024)
    for job in jobs(one):
        code, out, err = cli(*job)
        assert code == 0, err
    assert len(TorchDistCheckpoint.open(one / "megatron").keys["output_layer.weight"].chunks) > 1
    r = _torchrun(jobs(two), tmp_path, "--dense-chunk-bytes", str(48 * 1024))
    assert r.returncode == 0, r.stderr[-3000:]
    assert _same_tree(one / "megatron", two / "megatron") == []
    assert _same_tree(one / "back", two / "back") == []
    assert same_files(TINY["mixed"], two / "back") == []


def test_a_rank_that_dies_publishes_nothing_and_the_rerun_resumes(cli, tmp_path):
    ref, out = tmp_path / "ref", tmp_path / "out"
    job = ["dequantize", str(TINY["mixed"]), str(out), "-q", "--device", "cpu", "--max-shard-size", "300KB",
           "--workers", "1", "--slice-mb", "1"]
    assert cli(*[job[0], job[1], str(ref), *job[3:]])[0] == 0
    r = _torchrun([job], tmp_path, "--die-after", "3")
    assert r.returncode != 0
    assert not out.exists()
    staging = tmp_path / ".out.inkling-partial"
    # What reached the disk before the kill depends on timing (rank 0 is stopped by torchrun at once,
    # rank 1's buffered writes die with it): a resume is claimed exactly when pieces were kept.
    kept = staging.is_dir() and any(p.suffix == ".safetensors" for p in staging.iterdir())
    code, text, err = cli(*job)  # one process resumes what two ranks left
    assert code == 0, err
    if kept:
        assert text.startswith("resumed and finished") and "the resume reused" in text
    else:
        assert not text.startswith("resumed"), text
    assert same_files(ref, out) == []


@pytest.mark.parametrize("command", [["dequantize"], ["convert", "hf-to-megatron"]])
def test_a_rank_lost_in_a_step_taken_together_keeps_the_finished_work_for_the_rerun(cli, tmp_path, command):
    """Rank 1 dies while rank 0 waits for it in the step after writing (the pipeline's, or DCP's
    for torch_dist; gloo: "Connection closed by peer", a RuntimeError). Rank 0 says so in one line
    and keeps the staging folder: what both ranks had finished is reused by the rerun (taken for
    rank 0's own failure, the folder was removed)."""
    ref, out = tmp_path / "ref", tmp_path / "out"
    job = [*command, str(TINY["mixed"]), str(out), "-q", "--device", "cpu", "--workers", "1"]
    job += ["--max-shard-size", "300KB"] if command == ["dequantize"] else []
    assert cli(*[a if a != str(out) else str(ref) for a in job])[0] == 0
    # torchrun stops the surviving rank 5 s after the lost one exits (not at once): time for its own line.
    r = _torchrun([job], tmp_path, "--die-in-step", str(tmp_path), launcher=("--monitor-interval", "5"))
    assert "RANK 0 EXIT 2" in r.stdout, (r.stdout, r.stderr[-3000:])
    said = [ln for ln in r.stderr.splitlines() if ln.startswith("inkling-ckpt: error:")]
    assert len(said) == 1 and "rank 0 lost the other ranks" in said[0] and "rerun" in said[0], r.stderr[-3000:]
    assert not out.exists()
    staging = tmp_path / ".out.inkling-partial"
    assert staging.is_dir() and any(staging.iterdir())
    code, text, err = cli(*job)
    assert code == 0, err
    assert text.startswith("resumed and finished") and "the resume reused" in text, text
    assert _same_tree(ref, out) == []


@pytest.mark.parametrize("layer,byte", [(0, 0x7F), (3, 0xFF)])  # a NaN block scale: NVFP4 (E4M3), MXFP8 (E8M0)
def test_bad_data_on_one_rank_of_hf_to_megatron_stops_every_rank_with_its_message(cli, tmp_path, layer, byte):
    """hf-to-megatron writes its data before DCP's collective step: a rank whose data fails must still
    reach that step, so every rank stops with the first rank's one-line error (none waits for a
    collective the failed rank never joins), and nothing is published."""
    import shutil

    from test_bad_inputs import _poison_scale

    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(TINY["mixed"], src)
    _poison_scale(src, layer, byte)  # in one layer: only the rank converting it fails
    r = _torchrun([["convert", "hf-to-megatron", str(src), str(out), "-q", "--device", "cpu"]], tmp_path)
    codes = re.findall(r"RANK (\d) EXIT (\d+)", r.stdout)
    assert len(codes) == 2 and all(c != "0" for _, c in codes), r.stdout
    # Each rank's own one line (torchrun adds its ChildFailedError report after them).
    said = [ln for ln in r.stderr.splitlines() if ln.startswith("inkling-ckpt: error:")]
    assert len(said) == 2 and all(f"layers.{layer}.mlp.experts.w13_weight_scale" in ln for ln in said), r.stderr[-3000:]
    assert not out.exists()


def test_a_gpu_out_of_memory_is_one_line_naming_the_slice_option_and_publishes_nothing(cli, tmp_path, monkeypatch):
    from inkling_ckpt.convert import requantize as rq

    def out_of_memory(*a, **k):
        def run(unit):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return run

    monkeypatch.setattr(rq, "transform", out_of_memory)
    code, out, err = cli("quantize", TINY["bf16"], tmp_path / "q", "--plan", "mxfp8", "-q", "--device", "cpu")
    assert code != 0
    assert err.strip().count("\n") == 0 and "out of memory" in err and "--slice-mb" in err
    assert not (tmp_path / "q").exists() and not (tmp_path / ".q.inkling-partial").exists()


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("error", [
    MemoryError(),
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                 "tried to allocate 1125899906842624 bytes. Error code 12 (Cannot allocate memory)"),
])
def test_a_host_out_of_memory_is_one_line_naming_the_memory_budget_and_publishes_nothing(cli, tmp_path, monkeypatch,
                                                                                         error, workers):
    from inkling_ckpt.convert import requantize as rq

    def out_of_memory(*a, **k):
        def run(unit):
            raise error
        return run

    monkeypatch.setattr(rq, "transform", out_of_memory)
    code, out, err = cli("quantize", TINY["bf16"], tmp_path / "q", "--plan", "mxfp8", "-q", "--device", "cpu",
                         "--workers", workers)
    assert code != 0
    assert err.strip().count("\n") == 0 and "host ran out of memory" in err and "--memory-mb" in err, err
    assert not (tmp_path / "q").exists() and not (tmp_path / ".q.inkling-partial").exists()


def test_another_runtime_error_in_a_transform_is_not_called_out_of_memory():
    def broken(u):
        raise RuntimeError("something else")

    ex = Executor(Options(device="cpu", workers=2, progress=False))
    with pytest.raises(RuntimeError, match="something else"):
        list(ex.map([Unit(key="a"), Unit(key="b")], broken))


def test_dry_run_estimates_time_from_the_rates_this_machine_measured(cli, tmp_path, monkeypatch):
    from inkling_ckpt.pipeline.estimate import save_rates

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    code, out, _ = cli("convert", "hf-to-megatron", TINY["mixed"], tmp_path / "m", "--dry-run", "--device", "cpu", "--json")
    est = json.loads(out)["estimate"]
    assert code == 0 and est["seconds"] is None and "no measured rate" in est["estimate"]
    save_rates({"hf-to-megatron": {"cpu": 2.0}}, 100.0, "test box")  # 2 MB/s
    code, out, _ = cli("convert", "hf-to-megatron", TINY["mixed"], tmp_path / "m", "--dry-run", "--device", "cpu", "--json")
    est = json.loads(out)["estimate"]
    assert est["seconds"] == pytest.approx((est["bytes_read"] + est["bytes_written"]) / 2e6, abs=0.1)
    assert "2 MB/s measured here" in est["estimate"]
    assert not (tmp_path / "m").exists()


def _sharded_and_adapter(cli, tmp_path: Path, tp: int) -> tuple[Path, Path]:
    """The tiny mixed fixture split ``--tp tp --ep tp``, and a LoRA adapter for it (make-fixture --lora, lora export)."""
    sharded, adapter = tmp_path / "sh", tmp_path / "ad"
    assert cli("shard", TINY["mixed"], sharded, "--tp", str(tp), "--ep", str(tp), "-q")[0] == 0
    assert cli("make-fixture", tmp_path / "dump", "--lora", "-q")[0] == 0
    assert cli("lora", "export", tmp_path / "dump", adapter, "--config", TINY["mixed"], "-q")[0] == 0
    return sharded, adapter


def test_the_dry_runs_of_shard_merge_and_lora_merge_estimate_too(cli, tmp_path, monkeypatch):
    """shard, shard --merge and lora merge carry the same estimate as the other rewriting commands, at
    the rate bench/pipeline.py filed under their names (shard's on the CPU: it decodes nothing)."""
    from inkling_ckpt.pipeline.estimate import save_rates

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    save_rates({"shard": {"cpu": 1.0}, "shard-merge": {"cpu": 2.0}, "lora-merge": {"cpu": 4.0}}, 100.0, "test box")
    sharded, adapter = _sharded_and_adapter(cli, tmp_path, 2)
    runs = {"shard": ("shard", TINY["mixed"], tmp_path / "x", "--tp", "2", "--ep", "2"),
            "shard-merge": ("shard", sharded, tmp_path / "x", "--merge"),
            "lora-merge": ("lora", "merge", TINY["mixed"], adapter, tmp_path / "x", "--device", "cpu")}
    for (name, args), rate in zip(runs.items(), (1.0, 2.0, 4.0), strict=True):
        code, out, _ = cli(*args, "--dry-run", "--json")
        est = json.loads(out)["estimate"]
        assert code == 0 and est["bytes_read"] > 0 and est["bytes_written"] > 0, name
        assert est["seconds"] == pytest.approx((est["bytes_read"] + est["bytes_written"]) / (rate * 1e6), abs=0.1), name
        assert f"measured here for {name} on cpu" in est["estimate"], name
        code, out, _ = cli(*args, "--dry-run")
        assert code == 0 and "estimate: reads" in out, name
    assert not (tmp_path / "x").exists()


def test_every_bench_command_line_is_one_the_cli_accepts(cli, tmp_path):
    """bench/pipeline.py's grid drives the real CLI: each of its command lines, with the flags it adds
    (--device and --slice-mb only where a command takes them), passes the CLI's parsing and
    validation on the tiny fixtures (--dry-run; verify, which writes nothing, runs); so does
    --mode full-layer's chain of five steps, run on the tiny BF16 fixture."""
    import argparse
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("bench_pipeline", ROOT / "bench" / "pipeline.py")
    bench = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    sharded, adapter = _sharded_and_adapter(cli, tmp_path, 4)
    src = {"bf16": TINY["bf16"], "mixed": TINY["mixed"], "mg": tmp_path / "mg", "sharded": sharded, "adapter": adapter}
    assert cli("convert", "hf-to-megatron", TINY["mixed"], src["mg"], "-q")[0] == 0
    args = argparse.Namespace(legacy=False, slice_mb=1, workers=2)
    layers = json.loads((TINY["mixed"] / "config.json").read_text())["text_config"]["num_hidden_layers"]
    for command in (*bench.COMMANDS, *bench.MORE_COMMANDS):
        cmd_args, inputs, out = bench.step_args(command, src, tmp_path, layers, "2MB")
        assert inputs and all(p.exists() for p in inputs), command
        extra = [] if out is None else ["--dry-run"]
        code, _, err = cli(*cmd_args, *bench.flags(command, "cpu", args, memory_mb=512), *extra)
        assert code == 0, (command, err)
    # --mode full-layer's chain, run for real (each step reads the one before's output)
    for command, cmd_args, _, out in bench.layer_steps(tmp_path / "layer", TINY["bf16"], "2MB"):
        code, _, err = cli(*cmd_args, *bench.flags(command, "cpu", args))
        assert code == 0 and out.is_dir(), (command, err)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux only (/proc/self/clear_refs)")
def test_the_unit_memory_bench_measures_every_unit_of_a_command(tmp_path):
    """bench/unit_memory.py runs a command one unit at a time and prints each kind of unit's charge
    beside its measured peak (a smoke check: it wraps the executor's map, whose signature it relies on)."""
    bench = Path(__file__).resolve().parents[1] / "bench" / "unit_memory.py"
    out = subprocess.run([sys.executable, str(bench), "quantize", str(TINY["bf16"]), str(tmp_path / "q"),
                          "--plan", "nvfp4", "--device", "cpu", "-q"],
                         capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert out.returncode == 0, out.stderr
    # "<kind> <n> <charge MiB> <peak MiB> <median> <most over>", one line per kind of unit
    rows = {line.rsplit(None, 5)[0]: [float(x) for x in line.rsplit(None, 5)[1:]] for line in out.stdout.splitlines()
            if line.startswith(("dense", "experts ->"))}
    assert set(rows) == {"dense", "experts -> nvfp4"}, out.stdout
    assert all(n >= 1 and charge > 0 for n, charge, *_ in rows.values()), out.stdout
    assert any((tmp_path / "q").glob("*.safetensors"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_lora_merge_writes_the_cpu_bytes_on_the_gpu(cli, tmp_path, monkeypatch):
    """lora merge --device cuda (experts decoded, merged and re-encoded there, whole and a few rows
    a piece) against --device cpu, on the tiny mixed fixture (NVFP4 and MXFP8 experts)."""
    import importlib

    from inkling_ckpt.lora.merge import merge
    from inkling_ckpt.pipeline import Options

    merge_mod = importlib.import_module("inkling_ckpt.lora.merge")
    _, adapter = _sharded_and_adapter(cli, tmp_path, 2)
    hidden = json.loads((TINY["mixed"] / "config.json").read_text())["text_config"]["hidden_size"]
    for chunk in (merge_mod.ROW_CHUNK_ELEMS, 6 * hidden):
        monkeypatch.setattr(merge_mod, "ROW_CHUNK_ELEMS", chunk)
        for device in ("cpu", "cuda"):
            merge(TINY["mixed"], adapter, tmp_path / f"{device}-{chunk}", progress=False,
                  options=Options(device=device, progress=False))
        assert _same_tree(tmp_path / f"cpu-{chunk}", tmp_path / f"cuda-{chunk}") == [], chunk


# ---- the read-ahead -------------------------------------------------------------------------------


def _settled(read, want: int) -> int:
    """``read()`` once it reaches ``want`` (or 5 s pass), checked again after a pause: a reader
    that overshoots shows it."""
    end = time.monotonic() + 5
    while read() < want and time.monotonic() < end:
        time.sleep(0.005)
    time.sleep(0.1)
    return read()


def test_the_read_ahead_reads_the_units_past_the_started_ones_up_to_its_bound(tmp_path):
    from inkling_ckpt.pipeline.readahead import ReadAhead

    f = tmp_path / "data.bin"
    f.write_bytes(bytes(range(256)) * (40 * 1024))  # 10 MiB
    mib = 2**20
    items = list(range(10))
    asked: list[int] = []
    ra = ReadAhead(items, lambda i: asked.append(i) or [(f, i * mib, mib)], 3 * mib)
    try:
        assert _settled(lambda: ra.bytes_read, 3 * mib) == 3 * mib  # items 0-2, then it waits
        assert _settled(lambda: ra.items_ready, 3) == 3
        assert asked == [0, 1, 2, 3]  # ranges are asked for as the reader gets there, not all at the start
        ra.started(6)  # 3-5 are the workers' now: it skips them
        assert _settled(lambda: ra.bytes_read, 6 * mib) == 6 * mib  # 6-8
        assert asked == [0, 1, 2, 3, 6, 7, 8, 9]
        ra.started(10)
        assert _settled(lambda: ra.bytes_read, 7 * mib) == 6 * mib  # nothing is left to read ahead
        assert _settled(lambda: ra.items_ready, 6) == 6
    finally:
        ra.close()


def test_the_read_ahead_leaves_unreadable_ranges_to_the_workers(tmp_path):
    from inkling_ckpt.pipeline.readahead import ReadAhead

    f = tmp_path / "short.bin"
    f.write_bytes(b"x" * 1000)
    extents = {0: [(tmp_path / "missing.bin", 0, 10)], 1: [(f, 500, 2000)], 2: [(f, 0, 100)]}
    ra = ReadAhead([0, 1, 2], extents.__getitem__, 2**20)
    try:
        assert _settled(lambda: ra.bytes_read, 600) == 600  # 500 of item 1 (the file ends), 100 of item 2
    finally:
        ra.close()


def test_map_reads_ahead_only_when_asked_and_its_results_do_not_change(tmp_path, monkeypatch):
    from inkling_ckpt.pipeline import readahead

    f = tmp_path / "data.bin"
    data = bytes(range(256)) * 4096  # 1 MiB
    f.write_bytes(data)
    seen: list[int] = []
    real = readahead.ReadAhead

    class Counting(real):  # type: ignore[misc, valid-type]
        def close(self) -> None:
            super().close()
            seen.append(self.bytes_read)

    monkeypatch.setattr(executor_mod, "ReadAhead", Counting)
    units = [Unit(f"u{i}", "", 65536, 65536, (), i) for i in range(16)]

    def transform(u: Unit) -> bytes:
        time.sleep(0.01)  # the read-ahead gets ahead of the workers
        return f.read_bytes()[u.data * 65536:(u.data + 1) * 65536]

    ex = Executor(Options(device="cpu", workers=2, progress=False))
    want = [data[i * 65536:(i + 1) * 65536] for i in range(16)]
    extents = lambda u: [(f, u.data * 65536, 65536)]  # noqa: E731
    assert [r for _, r in ex.map(units, transform)] == want and seen == []
    assert [r for _, r in ex.map(units, transform, extents=extents)] == want and seen == []  # off on the CPU by default
    monkeypatch.setenv(readahead.ENV, "1")  # asked for: 1 MiB ahead
    got = [r for _, r in ex.map(units, transform, extents=extents)]
    assert got == want and len(seen) == 1 and 0 < seen[0] <= len(data)
    # the rank's figures say what it read ahead and how many units it had ready (each is 64 KiB)
    assert ex.stats.read_ahead_bytes == seen[0] and 0 < ex.stats.read_ahead_units <= seen[0] // 65536
    assert ex.stats.as_dict()["read_ahead_units"] == ex.stats.read_ahead_units
    monkeypatch.setenv(readahead.ENV, "0")  # turned off (a benchmark's baseline on a GPU)
    assert [r for _, r in ex.map(units, transform, extents=extents)] == want
    assert len(seen) == 1
    monkeypatch.delenv(readahead.ENV)
    assert readahead.read_ahead_bytes("cuda") == readahead.READ_AHEAD_BYTES and readahead.read_ahead_bytes("cpu") == 0
    monkeypatch.setenv(readahead.ENV, "0.5")
    assert readahead.read_ahead_bytes("cpu") == 2**19
    for bad in ("abc", "-1", "nan", "inf", "256MB"):  # refused, not the default
        monkeypatch.setenv(readahead.ENV, bad)
        with pytest.raises(ConfigError, match=readahead.ENV):
            readahead.read_ahead_bytes("cuda")
        with pytest.raises(ConfigError, match=readahead.ENV):
            list(ex.map(units, transform, extents=extents))
