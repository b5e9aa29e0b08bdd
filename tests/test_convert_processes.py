"""Conversions as real processes: torchrun with 2 ranks, and kill -9 then rerun."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TINY, free_port, same_files, subprocess_env
from inkling_ckpt.errors import CheckpointError
from inkling_ckpt.layouts.megatron import TorchDistCheckpoint

BIN = Path(sys.executable).parent


def _cli(*args: object) -> list[str]:
    return [sys.executable, "-m", "inkling_ckpt", *map(str, args)]


def _same_tree(a: Path, b: Path) -> list[str]:
    """Relative paths that differ between two folder trees (byte for byte, hidden files included; the
    done record under .cache/huggingface, which holds this run's file times, both sides must have)."""
    import filecmp

    from inkling_ckpt.layouts.staging import done_marker

    assert done_marker(a).is_file() and done_marker(b).is_file()
    record = done_marker(a).relative_to(a)
    files = {p.relative_to(a) for p in a.rglob("*") if p.is_file()} | {p.relative_to(b) for p in b.rglob("*") if p.is_file()}
    files.discard(record)
    return sorted(str(f) for f in files
                  if not (a / f).is_file() or not (b / f).is_file() or not filecmp.cmp(a / f, b / f, shallow=False))


@pytest.fixture(scope="module")
def small_mixed(tmp_path_factory) -> Path:
    """A bigger mixed checkpoint (8 layers, 16 experts) so a conversion takes a few seconds."""
    out = tmp_path_factory.mktemp("small") / "small-mixed"
    subprocess.run(_cli("make-fixture", out, "--size", "small", "--variant", "mixed", "--max-shard-size", "8MB", "-q"),
                   check=True, env=subprocess_env(), capture_output=True)
    return out


def test_torchrun_two_ranks_write_the_one_process_checkpoint(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    subprocess.run(_cli("convert", "hf-to-megatron", TINY["mixed"], one, "-q"), check=True, env=subprocess_env(), capture_output=True)
    r = subprocess.run([str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", free_port(), "-m", "inkling_ckpt",
                        "convert", "hf-to-megatron", str(TINY["mixed"]), str(two), "-q"],
                       env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # Same files, same bytes: tensors, .metadata, common.pt, metadata.json and the done marker.
    assert _same_tree(one, two) == []


def _kill_midway(cmd: list[str], dst: Path, staging: Path, rng: random.Random, window: float) -> bool:
    """Start ``cmd``, wait until it is writing, kill -9 at a random moment; True if it died unfinished."""
    p = subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not staging.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.002)
    time.sleep(rng.uniform(0.0, window))
    p.send_signal(signal.SIGKILL)
    p.wait()
    if dst.exists():  # it had published already: start over
        subprocess.run(["rm", "-rf", str(dst), str(staging)], check=True)
        return False
    return True


@pytest.mark.parametrize("seed", [1, 2])
def test_kill_9_then_rerun_gives_the_uninterrupted_output(tmp_path, small_mixed, seed):
    rng = random.Random(seed)
    ref, out = tmp_path / "ref", tmp_path / "out"
    subprocess.run(_cli("convert", "hf-to-megatron", small_mixed, ref, "-q"), check=True, env=subprocess_env(), capture_output=True)
    staging = tmp_path / ".out.inkling-partial"
    killed = False
    window = 1.0
    for _ in range(6):
        killed = _kill_midway(_cli("convert", "hf-to-megatron", small_mixed, out, "-q"), out, staging, rng, window)
        if killed:
            break
        window /= 2
    assert killed, "the conversion always finished before the kill"
    # An interrupted conversion is never taken for a finished one.
    assert not out.exists()
    with pytest.raises(CheckpointError):
        TorchDistCheckpoint.open(staging)
    r = subprocess.run(_cli("convert", "hf-to-megatron", small_mixed, out), env=subprocess_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert _same_tree(ref, out) == []


def test_kill_9_during_megatron_to_hf_then_rerun(tmp_path):
    mg, ref, out = tmp_path / "mg", tmp_path / "ref", tmp_path / "out"
    subprocess.run(_cli("convert", "hf-to-megatron", TINY["mixed"], mg, "-q"), check=True, env=subprocess_env(), capture_output=True)
    args = ("convert", "megatron-to-hf", mg, "--reference", TINY["mixed"], "--max-shard-size", "1MB", "-q")
    subprocess.run(_cli(*args[:3], ref, *args[3:]), check=True, env=subprocess_env(), capture_output=True)
    rng = random.Random(7)
    staging = tmp_path / ".out.inkling-partial"
    window, killed = 0.5, False
    for _ in range(6):
        killed = _kill_midway(_cli(*args[:3], out, *args[3:]), out, staging, rng, window)
        if killed:
            break
        window /= 2
    assert killed and not out.exists()
    r = subprocess.run(_cli(*args[:3], out, *args[3:]), env=subprocess_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert same_files(ref, out) == []
