"""quantize / dequantize / inspect / make-fixture on the bundled tiny checkpoints."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file

from conftest import TINY, TINY_PLAN, same_files
from inkling_ckpt.layouts.hf import HFCheckpoint
from inkling_ckpt.convert.requantize import decode_linear
from inkling_ckpt.model.inventory import expert_linears, inventory


@pytest.mark.parametrize("variant,plan", [("mixed", TINY_PLAN), ("mxfp8", "mxfp8")])
def test_quantize_bf16_fixture_reproduces_bundled_variant_byte_for_byte(cli, tmp_path, variant, plan):
    code, out, err = cli("quantize", TINY["bf16"], tmp_path / "q", "--plan", plan, "--max-shard-size", "2MB", "-q")
    assert code == 0, err
    assert same_files(TINY[variant], tmp_path / "q") == []


@pytest.mark.parametrize("variant", ["bf16", "mixed", "mxfp8"])
def test_make_fixture_is_deterministic_and_matches_bundled(cli, tmp_path, variant):
    code, _, err = cli("make-fixture", tmp_path / "f", "--variant", variant, "-q")
    assert code == 0, err
    assert same_files(TINY[variant], tmp_path / "f") == []


@pytest.mark.parametrize("variant,expected_plan", [("bf16", "0-3:bf16"), ("mixed", TINY_PLAN), ("mxfp8", "0-3:mxfp8")])
def test_inspect_lists_exactly_the_inventory(cli, variant, expected_plan):
    code, out, err = cli("inspect", TINY[variant], "--json")
    assert code == 0, err
    info = json.loads(out)
    ckpt = HFCheckpoint.open(TINY[variant])
    specs = inventory(ckpt.cfg, ckpt.plan)
    assert info["plan"] == expected_plan
    assert info["variant"] == variant
    assert info["tensors"] == len(specs) == len(ckpt.tensors)
    assert set(ckpt.tensors) == {s.name for s in specs}
    assert info["bytes"] == sum(t.nbytes for t in ckpt.tensors.values())
    on_disk = sum(p.stat().st_size for p in TINY[variant].glob("*.safetensors"))
    assert info["bytes"] < on_disk < info["bytes"] + 64 * 1024  # only the headers on top
    code, text, _ = cli("inspect", TINY[variant])
    assert code == 0 and f"variant {variant}" in text


def test_non_expert_tensors_are_untouched_and_experts_decode_close():
    from inkling_ckpt.convert.requantize import decode_linear
    from inkling_ckpt.model.inventory import expert_linears

    bf16, mixed = HFCheckpoint.open(TINY["bf16"]), HFCheckpoint.open(TINY["mixed"])
    for spec in inventory(mixed.cfg, mixed.plan):
        if spec.part is None:
            assert torch.equal(bf16.get(spec.name).view(torch.uint8), mixed.get(spec.name).view(torch.uint8)), spec.name
    floor = {"nvfp4": 18.0, "mxfp8": 29.0}
    for lin in expert_linears(mixed.cfg, mixed.plan):
        ref = bf16.get(f"{lin.module}.weight").float()
        got = decode_linear(mixed, lin).float()
        sqnr = 10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum())
        assert sqnr > floor[lin.fmt], (lin.module, float(sqnr))


def test_dequantize_then_requantize_gives_the_same_values(cli, tmp_path):
    """decode → fresh re-encode keeps every MXFP8 value, though not always the bytes.

    A block whose largest element rounded down to 224·2^s re-encodes at scale s-1 with the same
    values (see convert/experts.py); this is why ``--scales keep`` reuses unchanged blocks.
    """
    code, _, err = cli("dequantize", TINY["mxfp8"], tmp_path / "d", "-q", "--max-shard-size", "2MB")
    assert code == 0, err
    code, _, err = cli("quantize", tmp_path / "d", tmp_path / "q", "--plan", "mxfp8", "-q", "--max-shard-size", "2MB")
    assert code == 0, err
    a, b = HFCheckpoint.open(TINY["mxfp8"]), HFCheckpoint.open(tmp_path / "q")
    for name in a.tensors:
        assert a.tensors[name].shape == b.tensors[name].shape
    differing = 0
    for lin in expert_linears(a.cfg, a.plan):
        va, vb = decode_linear(a, lin), decode_linear(b, lin)
        assert torch.equal(va, vb), lin.module
        differing += not torch.equal(a.get(f"{lin.module}.weight_scale"), b.get(f"{lin.module}.weight_scale"))
    assert differing > 0  # the corner case is real on trained-looking weights


def test_rerun_is_skipped_and_force_redoes(cli, tmp_path):
    dst = tmp_path / "q"
    assert cli("quantize", TINY["bf16"], dst, "--plan", "mxfp8", "-q")[0] == 0
    code, out, _ = cli("quantize", TINY["bf16"], dst, "--plan", "mxfp8", "-q")
    assert code == 0 and "nothing to do" in out
    code, _, err = cli("quantize", TINY["bf16"], dst, "--plan", TINY_PLAN, "-q")
    assert code != 0 and "--force" in err
    code, out, _ = cli("quantize", TINY["bf16"], dst, "--plan", TINY_PLAN, "-q", "--force")
    assert code == 0 and "wrote" in out
    assert HFCheckpoint.open(dst).plan.variant == "mixed"


def test_interrupted_run_resumes_to_identical_output(tmp_path, monkeypatch):
    from inkling_ckpt.convert import requantize as rq
    from inkling_ckpt.layouts import hf

    src = HFCheckpoint.open(TINY["bf16"])
    plan = src.plan.parse(TINY_PLAN, 4)
    calls = {"n": 0}
    real_write = hf.HFWriter.write

    def dying_write(self, name, tensor):
        calls["n"] += 1
        if calls["n"] == 200:
            raise KeyboardInterrupt
        return real_write(self, name, tensor)

    monkeypatch.setattr(hf.HFWriter, "write", dying_write)
    with pytest.raises(KeyboardInterrupt):
        rq.requantize(src, tmp_path / "q", plan, max_shard_size="2MB", progress=False)
    assert not (tmp_path / "q").exists()  # never published half-done
    staging = tmp_path / ".q.inkling-partial"
    finished = sorted(p.name for p in staging.glob("*.safetensors"))
    assert finished, "the first shard should have been finished before the interruption"
    monkeypatch.setattr(hf.HFWriter, "write", real_write)
    result = rq.requantize(src, tmp_path / "q", plan, max_shard_size="2MB", progress=False)
    assert result.resumed
    assert same_files(TINY["mixed"], tmp_path / "q") == []


def _assert_fails_cleanly(cli, args, needle, dst):
    code, out, err = cli(*args)
    assert code != 0
    lines = [l for l in err.strip().splitlines() if l]
    assert len(lines) == 1 and needle in lines[0], err
    assert "Traceback" not in err
    assert not dst.exists()
    assert not list(dst.parent.glob(f".{dst.name}.inkling-partial"))


def test_bad_plans_fail_with_one_line(cli, tmp_path):
    dst = tmp_path / "q"
    _assert_fails_cleanly(cli, ["quantize", TINY["bf16"], dst, "--plan", "0-5:nvfp4"], "names layer 5", dst)
    _assert_fails_cleanly(cli, ["quantize", TINY["bf16"], dst, "--plan", "0-3:nvfp5"], "known formats", dst)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_nan_in_a_weight_being_quantized_fails_and_writes_nothing(cli, tmp_path):
    src = _copy(TINY["bf16"], tmp_path / "src")
    name = "model.language_model.layers.2.mlp.experts.5.down_proj.weight"
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = src / index["weight_map"][name]
    tensors = load_file(shard)
    w = tensors[name].clone()
    w[3, 7] = float("nan")
    tensors[name] = w
    from safetensors.torch import save_file
    save_file(tensors, shard, metadata={"format": "pt"})
    dst = tmp_path / "q"
    _assert_fails_cleanly(cli, ["quantize", src, dst, "--plan", TINY_PLAN, "-q"], "down_proj", dst)
    # the same NaN is fine where the layer stays BF16
    code, _, err = cli("quantize", src, dst, "--plan", "0-1:nvfp4", "-q")
    assert code == 0, err


def test_non_multiple_of_block_width_fails(cli, tmp_path):
    src = _copy(TINY["bf16"], tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"]["moe_intermediate_size"] = 72  # not a multiple of 32 (nor the stored 64)
    (src / "config.json").write_text(json.dumps(cfg))
    dst = tmp_path / "q"
    _assert_fails_cleanly(cli, ["quantize", src, dst, "--plan", "mxfp8"], "", dst)


def test_truncated_shard_and_corrupt_header_fail_with_the_file_named(cli, tmp_path):
    src = _copy(TINY["bf16"], tmp_path / "src")
    shard = sorted(src.glob("*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 1000])
    dst = tmp_path / "q"
    _assert_fails_cleanly(cli, ["quantize", src, dst, "--plan", "mxfp8"], shard.name, dst)
    shard.write_bytes(struct.pack("<Q", 50) + b"{not json" + data[17:])
    _assert_fails_cleanly(cli, ["quantize", src, dst, "--plan", "mxfp8"], shard.name, dst)


def test_missing_source_and_config_field(cli, tmp_path):
    dst = tmp_path / "q"
    _assert_fails_cleanly(cli, ["inspect", tmp_path / "nope"], "nope", dst)
    src = _copy(TINY["bf16"], tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    del cfg["text_config"]["n_routed_experts"]
    (src / "config.json").write_text(json.dumps(cfg))
    _assert_fails_cleanly(cli, ["quantize", src, dst, "--plan", "mxfp8"], "n_routed_experts", dst)


@pytest.mark.parametrize("variant,plan", [("mixed", TINY_PLAN), ("mxfp8", "mxfp8")])
def test_keep_scales_round_trip_through_bf16_is_byte_identical(cli, tmp_path, variant, plan):
    assert cli("dequantize", TINY[variant], tmp_path / "d", "-q")[0] == 0
    code, _, err = cli("quantize", tmp_path / "d", tmp_path / "q", "--plan", plan, "--scales", "keep",
                       "--reference", TINY[variant], "--max-shard-size", "2MB", "-q")
    assert code == 0, err
    assert same_files(TINY[variant], tmp_path / "q") == []


def test_keep_without_reference_or_with_wrong_reference_fails(cli, tmp_path):
    dst = tmp_path / "q"
    _assert_fails_cleanly(cli, ["quantize", TINY["bf16"], dst, "--plan", TINY_PLAN, "--scales", "keep"], "reference", dst)
    _assert_fails_cleanly(cli, ["quantize", TINY["bf16"], dst, "--plan", TINY_PLAN, "--scales", "keep",
                                "--reference", TINY["mxfp8"]], "layer 0", dst)
