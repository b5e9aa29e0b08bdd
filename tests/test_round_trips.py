"""Round trips that need no extra flags, and errors that say what is wrong (issue 16), through the CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import FIXTURES, TINY, same_files
from inkling_ckpt.layouts.megatron import COMMON, RELEASE


def _strip_common(folder: Path) -> None:
    """A torch_dist folder as another tool writes it: no inkling-ckpt entry (config copy, preset) in common.pt."""
    path = folder / RELEASE / COMMON
    common = torch.load(path, weights_only=True)
    del common["inkling"]
    torch.save(common, path)


def _error(cli, *args) -> str:
    code, out, err = cli(*args)
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1 and lines[0].startswith("inkling-ckpt: error:"), (code, out, err)
    return lines[0]


@pytest.fixture(scope="module")
def bridge(tmp_path_factory) -> Path:
    from inkling_ckpt.cli.app import main

    out = tmp_path_factory.mktemp("rt") / "mg-bridge"
    try:
        main(["convert", "hf-to-megatron", str(TINY["mixed"]), str(out), "--preset", "bridge", "-q"])
    except SystemExit as e:
        assert not e.code
    return out


def test_megatron_to_hf_reads_the_preset_from_the_folder(cli, tmp_path, bridge):
    """The README's round trip with --preset bridge on the way out and no --preset on the way back."""
    code, _, err = cli("convert", "megatron-to-hf", bridge, tmp_path / "back", "--reference", TINY["mixed"], "-q")
    assert code == 0, err
    assert same_files(TINY["mixed"], tmp_path / "back") == []
    # --preset still overrides, and a wrong one names the preset the keys follow
    err = _error(cli, "convert", "megatron-to-hf", bridge, tmp_path / "x", "--reference", TINY["mixed"],
                 "--preset", "miles")
    assert "no preset miles rule uses decoder.final_norm.weight" in err and "--preset bridge" in err
    # a folder another tool wrote records no preset: it is detected from the keys
    foreign = tmp_path / "foreign"
    shutil.copytree(bridge, foreign)
    _strip_common(foreign)
    code, _, err = cli("convert", "megatron-to-hf", foreign, tmp_path / "back2", "--reference", TINY["mixed"], "-q")
    assert code == 0, err
    assert same_files(TINY["mixed"], tmp_path / "back2") == []


def test_a_reference_of_another_size_names_the_fields(cli, tmp_path, bridge):
    small = tmp_path / "small"
    code, _, err = cli("make-fixture", small, "--variant", "mixed", "--size", "small")
    assert code == 0, err
    err = _error(cli, "convert", "megatron-to-hf", bridge, tmp_path / "x", "--reference", small)
    assert ("describes another model than this checkpoint: reference: 8 layers, hidden 512, 16 experts, "
            "expert width 256, vocabulary 1024; checkpoint: 4 layers, hidden 256, 8 experts, expert width 64, "
            "vocabulary 512") in err, err
    assert "preset" not in err
    # a foreign folder keeps no config: the sizes its keys show
    foreign = tmp_path / "foreign"
    shutil.copytree(bridge, foreign)
    _strip_common(foreign)
    err = _error(cli, "convert", "megatron-to-hf", foreign, tmp_path / "x", "--reference", small)
    assert "reference: 8 layers, hidden 512, 16 experts; checkpoint: 4 layers, hidden 256, 8 experts" in err, err
    err = _error(cli, "inspect", foreign, "--config", small)
    assert "the config" in err and "config: 8 layers, hidden 512, 16 experts; checkpoint: 4 layers" in err, err


def test_a_folder_of_another_layout_says_which_command_takes_it(cli, tmp_path, bridge):
    for args in (["convert", "hf-to-megatron", bridge, tmp_path / "x"], ["quantize", bridge, tmp_path / "x", "--plan", "mxfp8"],
                 ["dequantize", bridge, tmp_path / "x"], ["shard", bridge, tmp_path / "x", "--tp", "2"]):
        err = _error(cli, *args)
        assert "this is a Megatron torch_dist checkpoint" in err and "convert megatron-to-hf" in err, err
    sh = tmp_path / "sh"
    code, _, err = cli("shard", TINY["mixed"], sh, "--tp", "2", "--ep", "2", "-q")
    assert code == 0, err
    err = _error(cli, "convert", "hf-to-megatron", sh, tmp_path / "x")
    assert "this is a sharded folder" in err and "shard --merge" in err, err
    assert not (tmp_path / "x").exists()


def test_shard_dry_run_plans_from_a_bare_config(cli, tmp_path):
    """Planning the full model before downloading it: the config alone, default variant mixed."""
    config = FIXTURES / "full-size" / "config.json"
    code, out, err = cli("shard", config, "--tp", "8", "--ep", "8", "--dry-run", "--json")
    assert code == 0, err
    got = json.loads(out)
    assert got["precision_plan"] == "0-39:nvfp4,40-47:mxfp8" and got["plan"] == {"tp": 8, "ep": 8, "moe_tp": 1}
    assert len(got["ranks"]) == 8 and got["experts"]["0"]["experts"] == [0, 48]
    # the same bytes per rank as `memory` reports for the same bare config
    code, out, err = cli("memory", config, "--tp", "8", "--ep", "8", "--variant", "mixed", "--json")
    assert code == 0, err
    mem = json.loads(out)
    assert [r["bytes"] for r in got["ranks"]] == [r["bytes"] for r in mem["ranks"]]
    code, out, err = cli("shard", config.parent, "--tp", "8", "--ep", "8", "--dry-run", "--variant", "mxfp8")
    assert code == 0 and "mxfp8 (0-47:mxfp8); tp 8, ep 8" in out and "assumed (bare config)" in out, err
    # weights in the folder decide the plan; no tensor data is written anywhere
    err = _error(cli, "shard", TINY["mixed"], "--tp", "2", "--ep", "2", "--dry-run", "--variant", "bf16")
    assert "holds weights" in err
    err = _error(cli, "shard", config, tmp_path / "out", "--tp", "8", "--ep", "8")
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def miles(tmp_path_factory) -> dict[str, Path]:
    """The mixed and BF16 fixtures converted to torch_dist (default preset)."""
    from inkling_ckpt.convert.megatron import hf_to_megatron
    from inkling_ckpt.layouts.hf import HFCheckpoint

    root = tmp_path_factory.mktemp("miles")
    for v in ("mixed", "bf16"):
        hf_to_megatron(HFCheckpoint.open(TINY[v]), root / v, progress=False)
    return {v: root / v for v in ("mixed", "bf16")}


def test_what_rounds_in_a_bf16_copy_of_nvfp4(miles):
    """The torch_dist experts are the release's NVFP4 decode to BF16 bit for bit; the float32 decode
    differs, and only by the final rounding to BF16 (the block-scale products are exact in float32)."""
    from inkling_ckpt.convert.experts import read_parts
    from inkling_ckpt.formats.stacked import decode_stacked
    from inkling_ckpt.layouts.detect import open_checkpoint
    from inkling_ckpt.model.inventory import expert_stacks

    rel, mg = open_checkpoint(TINY["mixed"]), open_checkpoint(miles["mixed"])
    for stack in expert_stacks(rel.cfg, rel.plan, 0):
        parts = read_parts(rel, stack, 0, stack.shape[0])
        f32 = decode_stacked("nvfp4", parts, torch.float32)
        bf16 = decode_stacked("nvfp4", parts, torch.bfloat16)
        stored = mg.get(stack.name)
        assert torch.equal(stored.view(torch.int16), bf16.view(torch.int16))
        assert torch.equal(f32.to(torch.bfloat16).view(torch.int16), bf16.view(torch.int16))
        assert not torch.equal(f32, bf16.float())  # the rounding is there: F32 values need more than 8 bits


def test_verify_exact_separates_expected_rounding_from_a_mismatch(cli, miles):
    """The README's example: a release against its torch_dist copy passes --exact, NVFP4 layers as
    expected rounding; against the torch_dist copy of other weights the same layers are mismatches."""
    code, out, err = cli("verify", TINY["mixed"], miles["mixed"], "--exact", "-q", "--json")
    assert code == 0, err
    rep = json.loads(out)
    s = rep["summary"]
    assert (s["tensors"], s["bit_exact_tensors"], s["rounding_tensors"], s["mismatch_tensors"]) == (100, 96, 4, 0)
    assert rep["formats"]["nvfp4"]["rounding_tensors"] == 4 and rep["formats"]["mxfp8"]["bit_exact_tensors"] == 4
    nv = [t for t in rep["tensors"] if t["format"] == "nvfp4"]
    assert {(t["verdict"], t["rounding"]) for t in nv} == {("rounding", "bf16-decode-of-nvfp4")}
    assert rep["rounding"]["bf16-decode-of-nvfp4"]["tensors"] == 4 and rep["thresholds"]["passed"]
    code, out, err = cli("verify", miles["mixed"], TINY["mixed"], "--exact", "-q")  # either side order
    assert code == 0 and "4 expected rounding, 0 mismatch" in out and "amax/2688, rounded to BF16" in out, out
    # the BF16 source's torch_dist copy holds other values than the release's decode: mismatches, exit 1
    code, out, err = cli("verify", TINY["mixed"], miles["bf16"], "--exact", "-q", "--json")
    rep = json.loads(out)
    assert code == 1 and rep["summary"]["mismatch_tensors"] == 8 and rep["summary"]["rounding_tensors"] == 0
    assert {t["verdict"] for t in rep["tensors"] if t["format"] != "dense"} == {"mismatch"}
    code, out, err = cli("verify", TINY["mixed"], miles["bf16"], "--exact", "-q")
    assert code == 1 and "0 expected rounding, 8 mismatch" in out and "nor the expected rounding" in out
