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
    assert got["precision_plan"] == "0-39:nvfp4,40-47:mxfp8" and got["parallel_plan"] == {"tp": 8, "ep": 8, "moe_tp": 1}
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
    err = _error(cli, "shard", TINY["mixed"], tmp_path / "out", "--tp", "2", "--ep", "2", "--variant", "bf16")
    assert "with --dry-run" in err
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


# ---- float32 / float16 checkpoints (a fine-tune saved without bf16) --------------------------------


def _wide_copy(src: Path, out: Path, dtype: torch.dtype) -> Path:
    """The tiny BF16 fixture as transformers saves a float32 (float16) model: every tensor in that dtype,
    with values BF16 cannot hold (so narrowing them rounds), written by the project's own HF writer."""
    from inkling_ckpt.layouts.hf import HFCheckpoint
    from inkling_ckpt.pipeline import Executor, Options, dense_units, write_hf

    ckpt = HFCheckpoint.open(src)
    gen = torch.Generator().manual_seed(16)
    values = {}
    for name in ckpt.tensors:
        t = ckpt.get(name).float()
        values[name] = (t * (1 + torch.rand(t.shape, generator=gen) * 2.0**-10)).to(dtype)
    from inkling_ckpt.model.inventory import TensorSpec

    specs = [TensorSpec(n, tuple(v.shape), v.dtype, s.category, s.row, layer=s.layer, fmt=s.fmt, part=s.part)
             for s in ckpt.expected() for n, v in [(s.name, values[s.name])]]
    config = json.loads((src / "config.json").read_text())
    config["dtype"] = {torch.float32: "float32", torch.float16: "float16"}[dtype]

    def transform(unit):
        return {n: values[n][a:b] if values[n].dim() else values[n] for n, a, b in unit.pieces}

    ex = Executor(Options(device="cpu", progress=False), desc="test")
    units = dense_units(specs, ex.slice_bytes, ckpt.cfg.num_hidden_layers)
    write_hf(ex, out, {"command": "test"}, specs, config, {}, units, transform, max_shard_size="2MB")
    return out


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("wide")
    return {"f32": _wide_copy(TINY["bf16"], root / "f32", torch.float32),
            "f16": _wide_copy(TINY["bf16"], root / "f16", torch.float16)}


def test_float32_and_float16_checkpoints_are_read(cli, wide):
    for v in ("f32", "f16"):
        code, out, err = cli("inspect", wide[v], "--json")
        assert code == 0, err
        got = json.loads(out)
        assert got["variant"] == v and got["precision_plan"] == f"0-3:{v}", got["precision_plan"]
        code, out, err = cli("verify", wide[v], wide[v], "--exact", "-q")
        assert code == 0 and "126 tensors: 126 bit-exact" in out, out


def test_quantize_encodes_float32_values_directly(cli, tmp_path, wide):
    """quantize from F32: the experts are the codec's bytes for the F32 values (never narrowed to BF16 first)."""
    from inkling_ckpt.convert.experts import read_parts
    from inkling_ckpt.formats.stacked import encode_stacked
    from inkling_ckpt.layouts.hf import HFCheckpoint
    from inkling_ckpt.model.inventory import expert_stacks

    code, _, err = cli("quantize", wide["f32"], tmp_path / "q", "--plan", "0-1:nvfp4,2-3:mxfp8", "-q")
    assert code == 0, err
    src, q = HFCheckpoint.open(wide["f32"]), HFCheckpoint.open(tmp_path / "q")
    assert str(q.plan) == "0-1:nvfp4,2-3:mxfp8"
    for st_in, st_out in zip(expert_stacks(src.cfg, src.plan), expert_stacks(q.cfg, q.plan), strict=True):
        x = read_parts(src, st_in, 0, st_in.shape[0])[""]
        assert x.dtype == torch.float32
        want = encode_stacked(st_out.fmt, x)
        got = read_parts(q, st_out, 0, st_out.shape[0])
        assert all(torch.equal(got[k].reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8))
                   for k in want), st_out.name
        bf16_first = encode_stacked(st_out.fmt, x.to(torch.bfloat16))
        assert not torch.equal(got[""].view(torch.uint8), bf16_first[""].view(torch.uint8))  # the F32 values count
    for name in src.tensors:  # non-experts: as stored, F32
        if name in q.tensors and q.tensors[name].dtype == torch.float32:
            assert torch.equal(q.get(name), src.get(name))
    # a plan leaving layers unquantized would narrow them: refused, naming --dtype; --dtype f32 keeps them
    err = _error(cli, "quantize", wide["f32"], tmp_path / "q2", "--plan", "0-1:nvfp4", "-q")
    assert "layer 2's routed experts are F32" in err and "--dtype bf16" in err and "--dtype f32" in err
    code, _, err = cli("quantize", wide["f32"], tmp_path / "q2", "--plan", "0-1:nvfp4", "--dtype", "f32", "-q")
    assert code == 0 and str(HFCheckpoint.open(tmp_path / "q2").plan) == "0-1:nvfp4,2-3:f32", err
    code, _, err = cli("quantize", wide["f16"], tmp_path / "q3", "--plan", "mxfp8", "-q")
    assert code == 0, err


def test_stacked_float32_encode_is_modelopts(wide):
    """Differential: NVFP4 and MXFP8 of F32 expert values, expert by expert, equal ModelOpt 0.47's bytes."""
    import warnings

    from conftest import oracle
    from inkling_ckpt.formats.stacked import encode_stacked
    from inkling_ckpt.layouts.hf import HFCheckpoint

    oracle("modelopt", "nvidia-modelopt==0.47.0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.quantization.qtensor.mxfp8_tensor import MXFP8QTensor
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    x = HFCheckpoint.open(wide["f32"]).get("model.llm.layers.0.mlp.experts.w13_weight")
    assert x.dtype == torch.float32
    nv, mx = encode_stacked("nvfp4", x), encode_stacked("mxfp8", x)
    for e in range(x.shape[0]):
        qt, sb, s2 = NVFP4QTensor.quantize(x[e].clone(), 16)
        assert torch.equal(nv[""][e], qt._quantized_data)
        assert torch.equal(nv["_scale"][e].view(torch.uint8), sb.view(torch.uint8))
        assert torch.equal(nv["_amax"][e] / nv["_outer_scale_denominator"], s2.reshape(()).float())
        qt, s = MXFP8QTensor.quantize(x[e].clone())
        assert torch.equal(mx[""][e].view(torch.uint8), qt._quantized_data.view(torch.uint8))
        assert torch.equal(mx["_scale"][e], s.reshape(mx["_scale"][e].shape))


def test_narrowing_needs_dtype(cli, tmp_path, wide):
    """dequantize, hf-to-hf, hf-to-megatron and megatron-to-hf round F32 experts only when --dtype says so."""
    from inkling_ckpt.layouts.hf import HFCheckpoint

    f32 = wide["f32"]
    for args in (["dequantize", f32, tmp_path / "x"], ["convert", "hf-to-hf", f32, tmp_path / "x", "--plan", "bf16"],
                 ["convert", "hf-to-megatron", f32, tmp_path / "x"]):
        err = _error(cli, *args, "-q")
        assert "routed experts are F32" in err and "--dtype bf16" in err, err
        assert not (tmp_path / "x").exists()
    code, _, err = cli("dequantize", f32, tmp_path / "d", "--dtype", "bf16", "-q")
    assert code == 0, err
    src, d = HFCheckpoint.open(f32), HFCheckpoint.open(tmp_path / "d")
    name = "model.llm.layers.1.mlp.experts.w2_weight"
    assert torch.equal(d.get(name).view(torch.int16), src.get(name).to(torch.bfloat16).view(torch.int16))
    code, out, err = cli("verify", f32, tmp_path / "d", "--exact", "-q", "--json")
    rep = json.loads(out)
    assert code == 0 and rep["summary"]["rounding_tensors"] == 8 and rep["summary"]["mismatch_tensors"] == 0
    assert {t["rounding"] for t in rep["tensors"] if t["format"] != "dense"} == {"narrowed"}
    # hf-to-hf keeping the F32 experts comes back file for file; to Megatron and back with --dtype bf16
    code, _, err = cli("convert", "hf-to-hf", f32, tmp_path / "same", "--plan", "f32", "-q")
    assert code == 0 and same_files(f32, tmp_path / "same") == [], err
    code, _, err = cli("convert", "hf-to-megatron", f32, tmp_path / "mg", "--dtype", "bf16", "-q")
    assert code == 0, err
    code, _, err = cli("convert", "megatron-to-hf", tmp_path / "mg", tmp_path / "back", "--reference", f32, "-q")
    assert code == 0, err
    back = HFCheckpoint.open(tmp_path / "back")
    assert str(back.plan) == "0-3:f32"  # the reference's format; BF16 -> F32 is exact
    assert torch.equal(back.get(name), src.get(name).to(torch.bfloat16).float())
    err = _error(cli, "convert", "megatron-to-hf", tmp_path / "mg", tmp_path / "x", "--reference", wide["f16"], "-q")
    assert "--dtype f16" in err
