"""Real Megatron-Core loads what ``convert hf-to-megatron`` writes (test-only dependency).

megatron-core==0.16.1 with psutil, from the README's test command (the ``test`` extra; 0.16.1 is
the newest on PyPI for Python 3.11; its load path runs on CPU with a gloo group, see
shared/reference/megatron.md §4). Skipped, with the reason, when absent.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, TINY, free_port, oracle, subprocess_env

oracle("psutil", "psutil (needed by megatron-core)")
oracle("megatron.core", "megatron-core==0.16.1")

SCRIPT = ROOT / "tests" / "_mcore_load.py"


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    from inkling_ckpt.convert.megatron import hf_to_megatron
    from inkling_ckpt.layouts.hf import HFCheckpoint

    out = tmp_path_factory.mktemp("mcore") / "mg"
    hf_to_megatron(HFCheckpoint.open(TINY["mixed"]), out, progress=False)
    return out


def test_megatron_core_loads_every_value(converted):
    """dist_checkpointing.load, default strictness, one process: every value equals the HF source."""
    r = subprocess.run([sys.executable, str(SCRIPT), "load", str(converted / "release"), str(TINY["mixed"])],
                       capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def test_megatron_core_loads_big_tensors_stored_in_row_ranges(tmp_path):
    """Global tensors above DENSE_CHUNK_BYTES (the real embeddings) are stored as row-range chunks;
    Megatron-Core's load assembles them into its own shards (here: chunks of 48 KiB, so the
    tiny model's embeddings are split)."""
    from inkling_ckpt.convert.megatron import hf_to_megatron
    from inkling_ckpt.layouts.hf import HFCheckpoint
    from inkling_ckpt.layouts.megatron import TorchDistCheckpoint
    from inkling_ckpt.model import mapping

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mapping, "DENSE_CHUNK_BYTES", 48 * 1024)
        hf_to_megatron(HFCheckpoint.open(TINY["mixed"]), tmp_path / "mg", progress=False)
    assert len(TorchDistCheckpoint.open(tmp_path / "mg").keys["embedding.word_embeddings.weight"].chunks) > 1
    r = subprocess.run([sys.executable, str(SCRIPT), "load", str(tmp_path / "mg" / "release"), str(TINY["mixed"])],
                       capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None, reason="no torchrun")
def test_megatron_core_loads_as_expert_parallel_2(converted):
    """The same checkpoint loaded by two ranks, each holding half of every layer's experts."""
    torchrun = str(Path(sys.executable).parent / "torchrun")
    r = subprocess.run([torchrun, "--nproc_per_node", "2", "--master_port", free_port(), str(SCRIPT), "load",
                        str(converted / "release"), str(TINY["mixed"])],
                       capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert r.returncode == 0 and r.stdout.count("OK") == 2, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.parametrize("ranks", [1, 2])
def test_checkpoint_saved_by_megatron_core_converts_back_byte_identical(tmp_path, ranks):
    """Our reader on Megatron's own output: ``dist_checkpointing.save`` (one rank, or two ranks
    each saving half of every layer's experts; fc1 stored as gate and up chunks), then
    ``convert megatron-to-hf --scales keep`` gives the mixed fixture back byte for byte."""
    from inkling_ckpt.convert.megatron import megatron_to_hf
    from inkling_ckpt.layouts.hf import HFCheckpoint
    from inkling_ckpt.layouts.megatron import TorchDistCheckpoint

    ckpt = tmp_path / "saved"
    ckpt.mkdir()
    if ranks == 1:
        cmd = [sys.executable, str(SCRIPT), "save", str(ckpt), str(TINY["mixed"])]
    else:
        cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--master_port", free_port(),
               str(SCRIPT), "save", str(ckpt), str(TINY["mixed"])]
    r = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert r.returncode == 0 and r.stdout.count("SAVED") == ranks, r.stdout[-2000:] + r.stderr[-4000:]
    saved = TorchDistCheckpoint.open(ckpt)
    fc1 = saved.keys["decoder.layers.0.mlp.experts.experts.linear_fc1.weight"]
    assert len(fc1.chunks) == 2 * 8  # Megatron's swiglu split: a gate and an up chunk per expert
    ref = HFCheckpoint.open(TINY["mixed"])
    megatron_to_hf(ckpt, tmp_path / "back", ref, scales="keep", progress=False)
    back = HFCheckpoint.open(tmp_path / "back")
    differ = [n for n in ref.tensors
              if not torch.equal(ref.get(n).reshape(-1).view(torch.uint8), back.get(n).reshape(-1).view(torch.uint8))]
    assert differ == []
