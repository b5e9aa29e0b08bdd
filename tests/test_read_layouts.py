"""Read what we write: inspect / verify / memory on torch_dist and sharded folders as well as HF.

Fixtures: tiny-mixed (layers 0-1 NVFP4, 2-3 MXFP8) converted by ``hf-to-megatron`` and sharded by
``shard --tp 2 --ep 2``; tiny-bf16 converted too. Expectations come from the HF side read by the
HF reader (an independent path: safetensors headers, no mapping), not from the code under test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import TINY
from inkling_ckpt.convert.megatron import hf_to_megatron
from inkling_ckpt.errors import CheckpointError, ConfigError
from inkling_ckpt.layouts import detect
from inkling_ckpt.layouts.detect import detect_layout, open_checkpoint
from inkling_ckpt.layouts.hf import HFCheckpoint
from inkling_ckpt.layouts.megatron import COMMON, RELEASE, TorchDistCheckpoint
from inkling_ckpt.layouts.sharded import MANIFEST, shard
from inkling_ckpt.model.inventory import is_vision
from inkling_ckpt.verify.compare import build_report, compare


def _strip_common(folder: Path) -> None:
    """Make a torch_dist folder look foreign: common.pt without inkling-ckpt's entry (config copy, preset)."""
    path = folder / RELEASE / COMMON
    common = torch.load(path, weights_only=True)
    del common["inkling"]
    torch.save(common, path)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layouts")
    out = {"mg": root / "mg", "mgb": root / "mgb", "sh": root / "sh", "foreign": root / "foreign",
           "bridge": root / "bridge"}
    hf_to_megatron(HFCheckpoint.open(TINY["mixed"]), out["mg"], progress=False)
    hf_to_megatron(HFCheckpoint.open(TINY["bf16"]), out["mgb"], progress=False)
    hf_to_megatron(HFCheckpoint.open(TINY["mixed"]), out["bridge"], preset="bridge", progress=False)
    shard(TINY["mixed"], out["sh"], 2, 2, progress=False)
    shutil.copytree(out["mg"], out["foreign"])
    _strip_common(out["foreign"])
    _strip_common(out["bridge"])
    return out


def _json(cli, *args) -> dict:
    code, out, err = cli(*args, "--json")
    assert code == 0, err
    return json.loads(out)


def _one_line_error(cli, *args) -> str:
    code, out, err = cli(*args)
    assert code == 2 and out == ""
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


# ---- detection ------------------------------------------------------------------------------

def test_detects_each_layout(made):
    assert detect_layout(TINY["mixed"]) == "hf"
    assert detect_layout(made["mg"]) == "torch_dist"
    assert detect_layout(made["mg"] / RELEASE) == "torch_dist"  # an iteration folder
    assert detect_layout(made["sh"]) == "sharded"
    assert detect.SHARD_MANIFEST == MANIFEST  # detection's copy of the name stays the writer's


def test_converter_keeps_the_source_config(made):
    common = TorchDistCheckpoint.open(made["mg"]).common
    assert common["inkling"]["config"] == json.loads((TINY["mixed"] / "config.json").read_text())


@pytest.mark.parametrize("make", [
    lambda p: p.mkdir(),
    lambda p: (p.mkdir(), (p / "notes.txt").write_text("hi")),
    lambda p: p.write_text("not a folder"),
    lambda p: None,  # missing
    lambda p: (p.mkdir(), (p / RELEASE).mkdir()),  # a Megatron folder without metadata
], ids=["empty", "other-files", "a-file", "missing", "release-without-metadata"])
@pytest.mark.parametrize("command", [("inspect",), ("memory", "--tp", "1"), ("verify", str(TINY["mixed"]))])
def test_none_of_the_three_is_one_line_error(cli, tmp_path, make, command):
    bad = tmp_path / "bad"
    make(bad)
    args = (command[0], bad, *command[1:]) if command[0] != "verify" else ("verify", command[1], bad, "-q")
    err = _one_line_error(cli, *args)
    assert str(bad) in err


def test_config_is_refused_for_folders_that_carry_one(cli, made):
    assert "--config is for torch_dist" in _one_line_error(cli, "inspect", TINY["mixed"], "--config", TINY["mixed"])
    assert "--config is for torch_dist" in _one_line_error(cli, "inspect", made["sh"], "--config", TINY["mixed"])


# ---- inspect --------------------------------------------------------------------------------

def test_inspect_torch_dist_is_the_bf16_text_model(cli, made):
    got = _json(cli, "inspect", made["mg"])
    hf = _json(cli, "inspect", TINY["bf16"])  # the BF16 checkpoint tiny-mixed was quantized from
    assert got["layout"] == "torch_dist" and got["variant"] == "bf16" and got["precision_plan"] == "0-3:bf16"
    assert got["storage"]["preset"] == "miles" and got["storage"]["source_plan"] == "0-1:nvfp4,2-3:mxfp8"
    assert got["storage"]["config"].endswith(COMMON)
    assert got["layers"] == hf["layers"] and got["formats"] == hf["formats"]
    vision = hf["bytes_by_category"].pop("vision_tower")
    assert got["bytes_by_category"] == hf["bytes_by_category"] and got["bytes"] == hf["bytes"] - vision
    n_vision = sum(1 for n in HFCheckpoint.open(TINY["bf16"]).tensors if is_vision(n))
    assert got["tensors"] == hf["tensors"] - n_vision
    assert got["model"] == {**hf["model"], "vision_stored": False}
    code, out, _ = cli("inspect", made["mg"])
    assert code == 0 and "Megatron torch_dist (preset miles" in out and "vision in config, not stored" in out


def test_inspect_sharded_is_its_source(cli, made):
    got = _json(cli, "inspect", made["sh"])
    hf = _json(cli, "inspect", TINY["mixed"])
    assert got["layout"] == "sharded" and hf["layout"] == "hf"
    assert {k: got["storage"][k] for k in ("tp", "ep", "ranks")} == {"tp": 2, "ep": 2, "ranks": 2}
    for key in ("variant", "precision_plan", "model", "tensors", "parameters", "bytes", "bytes_by_category", "bytes_by_dtype",
                "formats", "layers"):
        assert got[key] == hf[key], key


def test_foreign_torch_dist_needs_a_config(cli, made):
    err = _one_line_error(cli, "inspect", made["foreign"])
    assert "--config" in err and COMMON in err
    got = _json(cli, "inspect", made["foreign"], "--config", TINY["mixed"] / "config.json")
    assert got["layers"] == _json(cli, "inspect", made["mg"])["layers"]
    assert got["storage"]["config"] == str(TINY["mixed"] / "config.json") and got["storage"]["source_plan"] is None


def test_preset_detected_from_the_keys(made):
    """With no preset recorded, the one whose keys the folder holds is used (here bridge, not the default)."""
    ckpt = open_checkpoint(made["bridge"], config=TINY["mixed"])
    assert ckpt.mapping.preset.name == "bridge"
    with pytest.raises(ConfigError):
        open_checkpoint(made["bridge"])  # and without a config it says so


def test_torch_dist_reads_back_release_tensors(made):
    """Release names, shapes and bytes: the BF16 source's tensors, experts re-interleaved, read by slices."""
    hf, mg = HFCheckpoint.open(TINY["bf16"]), open_checkpoint(made["mgb"])
    assert set(mg.tensors) == {n for n in hf.tensors if not is_vision(n)}
    for name, t in mg.tensors.items():
        want = hf.get(name)
        assert (t.shape, t.dtype) == (tuple(want.shape), want.dtype)
        assert torch.equal(mg.get(name).view(torch.uint8), want.view(torch.uint8)), name
    name = "model.llm.layers.2.mlp.experts.w13_weight"
    assert torch.equal(mg.read_rows(name, 3, 6).view(torch.uint8), hf.read_rows(name, 3, 6).view(torch.uint8))
    with pytest.raises(CheckpointError):
        mg.get("model.visual.proj_in.weight")
    with pytest.raises(CheckpointError):
        mg.read_rows(name, 6, 9)


# ---- verify ---------------------------------------------------------------------------------

def test_verify_hf_against_its_torch_dist(cli, made):
    """Non-expert tensors bit-exact; experts decoded on the HF side, BF16 on the other.

    MXFP8 values (E4M3 x 2^k) are BF16 numbers, so those layers come back bit-exact; NVFP4 values
    carry the per-expert F32 factor, so the BF16 copy rounds them: about 2^-9 relative, ~55 dB.
    """
    rep = _json(cli, "verify", TINY["mixed"], made["mg"], "-q")
    assert (rep["a"]["layout"], rep["b"]["layout"]) == ("hf", "torch_dist")
    f = rep["formats"]
    assert set(f) == {"dense", "nvfp4", "mxfp8"}  # the label names the quantized side's format
    assert f["dense"]["bit_exact_tensors"] == f["dense"]["tensors"] == 92
    assert f["mxfp8"]["bit_exact_tensors"] == f["mxfp8"]["tensors"] == 4
    assert f["nvfp4"]["bit_exact_tensors"] == 0 and 50 < f["nvfp4"]["sqnr_db"] < 60
    vision = sorted(n for n in HFCheckpoint.open(TINY["mixed"]).tensors if is_vision(n))
    assert rep["not_compared"] == {"only_a": vision, "only_b": []}
    code, out, _ = cli("verify", TINY["mixed"], made["mg"], "-q")
    assert code == 0 and f"not compared: {len(vision)} vision tensors only in A" in out


def test_verify_quantization_error_is_the_same_through_torch_dist(made):
    """BF16 source vs the torch_dist copy of its mixed quantization ≈ vs the mixed HF checkpoint itself."""
    direct = build_report(compare(TINY["bf16"], TINY["mixed"], progress=False))
    via = build_report(compare(TINY["bf16"], made["mg"], progress=False))
    by_layer = {r["layer"]: r for r in direct["layers"]}
    for row in via["layers"]:
        want = by_layer[row["layer"]]
        assert row["format"] == "bf16"  # both sides hold BF16 experts
        if want["format"] == "mxfp8":  # decoded MXFP8 is exact in BF16: the same error to the last bit
            assert row["sqnr_db"] == pytest.approx(want["sqnr_db"], rel=1e-12)
        else:  # the ~55 dB BF16 rounding adds almost nothing to NVFP4's ~20 dB
            assert row["sqnr_db"] == pytest.approx(want["sqnr_db"], abs=0.05) and row["sqnr_db"] < 25


def test_verify_bf16_round_trip_exact_both_ways(cli, made):
    code, out, err = cli("verify", TINY["bf16"], made["mgb"], "--exact", "-q")
    assert code == 0 and "threshold bit-exact: passed" in out, err
    rep = _json(cli, "verify", made["mgb"], TINY["bf16"], "--exact", "-q")
    assert rep["summary"]["bit_exact_tensors"] == rep["summary"]["tensors"] == 100
    assert rep["not_compared"]["only_a"] == [] and len(rep["not_compared"]["only_b"]) > 0


def test_verify_sharded_against_torch_dist_and_hf(cli, made):
    rep = _json(cli, "verify", made["sh"], made["mg"], "-q")
    assert (rep["a"]["layout"], rep["b"]["layout"]) == ("sharded", "torch_dist")
    assert rep["formats"] == _json(cli, "verify", TINY["mixed"], made["mg"], "-q")["formats"]
    assert _json(cli, "verify", TINY["mixed"], made["sh"], "--exact", "-q")["thresholds"]["passed"]


def test_verify_foreign_torch_dist_borrows_the_other_config(cli, made):
    rep = _json(cli, "verify", TINY["mixed"], made["foreign"], "-q")
    assert rep["formats"] == _json(cli, "verify", TINY["mixed"], made["mg"], "-q")["formats"]
    assert "--config" in _one_line_error(cli, "verify", made["foreign"], made["foreign"], "-q")
    rep = _json(cli, "verify", made["foreign"], made["mg"], "--config", TINY["mixed"], "--exact", "-q")
    assert rep["thresholds"]["passed"]
    # Two torch_dist sides: the one keeping no config borrows the other's, in either order.
    assert _json(cli, "verify", made["foreign"], made["mg"], "--exact", "-q")["thresholds"]["passed"]
    assert _json(cli, "verify", made["mg"], made["foreign"], "--exact", "-q")["thresholds"]["passed"]


def test_verify_refuses_a_different_model(cli, made, tmp_path):
    cfg = json.loads((TINY["mixed"] / "config.json").read_text())
    cfg["text_config"]["num_experts_per_tok"] = 4  # same tensors, another model
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    err = _one_line_error(cli, "verify", TINY["mixed"], made["foreign"], "--config", tmp_path, "-q")
    assert "not the same model" in err


# ---- memory ---------------------------------------------------------------------------------

def _ranks(rep: dict) -> list:
    return rep["ranks"] if "ranks" in rep else rep


def test_memory_torch_dist_is_the_bf16_model(cli, made):
    got = _json(cli, "memory", made["mgb"], "--tp", "2", "--ep", "2")
    hf = _json(cli, "memory", TINY["bf16"], "--tp", "2", "--ep", "2")
    assert _ranks(got) == _ranks(hf)  # vision counted from the config: the same shapes the release stores
    assert "torch_dist" in json.dumps(got)


def test_memory_sharded_is_its_source(cli, made):
    got = _json(cli, "memory", made["sh"], "--tp", "2", "--ep", "2")
    hf = _json(cli, "memory", TINY["mixed"], "--tp", "2", "--ep", "2")
    assert _ranks(got) == _ranks(hf)


def test_memory_foreign_torch_dist_with_config(cli, made):
    assert "--config" in _one_line_error(cli, "memory", made["foreign"], "--tp", "2")
    got = _json(cli, "memory", made["foreign"], "--tp", "2", "--config", TINY["mixed"])
    assert _ranks(got) == _ranks(_json(cli, "memory", made["mg"], "--tp", "2"))


def test_config_given_must_match_the_kept_one(cli, made, tmp_path):
    cfg = json.loads((TINY["mixed"] / "config.json").read_text())
    cfg["text_config"]["num_experts_per_tok"] = 4
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert "num_experts_per_tok" in _one_line_error(cli, "inspect", made["mg"], "--config", tmp_path)
    assert _json(cli, "inspect", made["mg"], "--config", TINY["mixed"])["layout"] == "torch_dist"


def test_verify_config_without_a_torch_dist_side_is_refused(cli, made):
    assert "neither checkpoint" in _one_line_error(cli, "verify", TINY["mixed"], made["sh"], "--config", TINY["mixed"])


def test_torch_dist_of_mxfp8_reads_as_bf16_with_its_config(tmp_path):
    """The kept config.json is the MXFP8 source's; the view's config drops its quantization_config."""
    hf_to_megatron(HFCheckpoint.open(TINY["mxfp8"]), tmp_path / "mg", progress=False)
    src = json.loads((TINY["mxfp8"] / "config.json").read_text())
    assert "quantization_config" in src
    ckpt = open_checkpoint(tmp_path / "mg")
    assert str(ckpt.plan) == "0-3:bf16" and ckpt.config == {k: v for k, v in src.items() if k != "quantization_config"}
    rep = build_report(compare(TINY["mxfp8"], tmp_path / "mg", progress=False), exact=True)
    assert rep["thresholds"]["passed"]  # MXFP8 values are BF16 numbers: bit-exact after decoding


@pytest.mark.parametrize("side", ["mg", "sh"])
def test_forward_mode_names_the_layout_it_cannot_run(cli, made, side):
    err = _one_line_error(cli, "verify", TINY["mixed"], made[side], "--forward", "-q")
    assert str(made[side]) in err and ("torch_dist" in err if side == "mg" else "sharded" in err)
    assert "does not apply with --forward" in _one_line_error(cli, "verify", TINY["mixed"], made["mg"], "--forward",
                                                              "--config", TINY["mixed"], "-q")
