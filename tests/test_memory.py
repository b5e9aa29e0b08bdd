"""memory: full-size totals from a bare config, per-rank splits, KV pool, and fixture figures
equal to the bytes the headers hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from inkling_ckpt.cli.app import main
from inkling_ckpt.errors import PlanError
from inkling_ckpt.layouts.hf import HFCheckpoint, read_header
from inkling_ckpt.model.config import InklingConfig
from inkling_ckpt.model.inventory import inventory
from inkling_ckpt.model.precision import PrecisionPlan
from inkling_ckpt.model.presets import preset_config
from inkling_ckpt.plan.memory import GB, kv_cost, memory_report

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
FULL = InklingConfig.from_dict(preset_config("full"))
PLANS = {"mixed": "0-39:nvfp4,40-47:mxfp8", "mxfp8": "mxfp8"}


@pytest.fixture(scope="module")
def full_reports():
    out = {}
    for v, text in PLANS.items():
        plan = PrecisionPlan.parse(text, 48)
        specs = inventory(FULL, plan)
        for tp in (4, 8):
            out[v, tp] = memory_report(FULL, plan, specs, tp, tp, source="full")
    return out


def test_full_model_totals_match_the_release(full_reports):
    assert full_reports["mixed", 4]["checkpoint_bytes"] / GB == pytest.approx(394, abs=0.5)
    assert full_reports["mxfp8", 4]["checkpoint_bytes"] / GB == pytest.approx(623, abs=0.5)


@pytest.mark.parametrize("variant", ["mixed", "mxfp8"])
@pytest.mark.parametrize("tp", [4, 8])
def test_full_model_per_rank_breakdown(full_reports, variant, tp):
    rep = full_reports[variant, tp]
    ck = rep["checkpoint_bytes_by_category"]
    ranks = rep["ranks"]
    assert len(ranks) == tp
    # experts, attention and embeddings are split without copies: they add up exactly
    for cat in ("routed_experts", "attention", "embeddings_head"):
        assert sum(r["by_category"][cat] for r in ranks) == ck[cat], cat
        assert all(r["by_category"][cat] * tp == ck[cat] for r in ranks), cat
    # router, norms and the vision tower are on every rank
    for cat in ("router_norms", "vision_tower"):
        assert all(r["by_category"][cat] == ck[cat] for r in ranks)
        assert all(r["replicated"] >= ck[cat] for r in ranks)
    # the MTP head splits too, but its norms are on every rank
    assert ck["mtp_head"] < sum(r["by_category"]["mtp_head"] for r in ranks) < 1.01 * ck["mtp_head"]
    # what one rank holds: a 1/tp share plus the replicated parts
    replicated = ranks[0]["replicated"]
    assert replicated > ck["router_norms"] + ck["vision_tower"]
    assert rep["max_rank_bytes"] == (rep["checkpoint_bytes"] - replicated) // tp + replicated


def test_full_model_kv_cost():
    kv8, kv4 = kv_cost(FULL, 8), kv_cost(FULL, 4)
    assert (kv8.full_layers, kv8.sliding_layers) == (13, 36)  # 12 full decoder layers + the MTP head
    assert kv8.bytes_per_token == 13 * 2 * 1 * 128 * 2 and kv4.bytes_per_token == 2 * kv8.bytes_per_token
    assert kv8.sliding_bytes_per_sequence == 36 * 4096 * 512
    mx = kv_cost(FULL, 8, "mxfp8")
    assert mx.bytes_per_token_layer == 2 * (128 + 4)
    # tp 16 > 8 KV heads: one (replicated) head per rank, same cost as tp 8
    assert kv_cost(FULL, 16).bytes_per_token == kv8.bytes_per_token


def test_kv_pool_and_fit(full_reports):
    rep = full_reports["mixed", 8]
    h200 = next(g for g in rep["gpus"] if g["gpu"] == "H200")
    pool = int(141 * GB * 0.9) - rep["max_rank_bytes"]
    assert h200["fits"] and h200["kv_pool_bytes"] == pool
    kv = rep["kv_cache"]
    assert h200["kv_tokens"] == (pool - kv["sliding_bytes_per_sequence"]) // kv["bytes_per_token"]
    # the MXFP8 model at TP4 does not fit an H200
    h200_mx4 = next(g for g in full_reports["mxfp8", 4]["gpus"] if g["gpu"] == "H200")
    assert not h200_mx4["fits"] and h200_mx4["kv_tokens"] == 0


@pytest.mark.parametrize("variant", ["bf16", "mixed", "mxfp8"])
def test_fixture_figures_equal_header_bytes(variant):
    src = FIXTURES / f"tiny-{variant}"
    ckpt = HFCheckpoint.open(src)
    header_bytes = 0
    for f in src.glob("*.safetensors"):
        for shape, dtype, *_ in read_header(f).values():
            n = dtype.itemsize
            for s in shape:
                n *= s
            header_bytes += n
    rep = memory_report(ckpt.cfg, ckpt.plan, ckpt.expected(), 1, 1, source=str(src))
    assert rep["checkpoint_bytes"] == header_bytes == rep["ranks"][0]["bytes"]


def _cli(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_cli_full_config_table_and_json(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(preset_config("full")))
    code, out, _ = _cli(["memory", str(cfg), "--variant", "mixed", "--tp", "4", "--ep", "4"], capsys)
    assert code == 0 and "394.0 GB" in out and "H200" in out and "VR200" in out
    code, out, _ = _cli(["memory", str(tmp_path), "--variant", "mxfp8", "--tp", "8", "--ep", "8", "--gpu", "B200",
                         "--json"], capsys)
    rep = json.loads(out)
    assert code == 0 and [g["gpu"] for g in rep["gpus"]] == ["B200"] and len(rep["ranks"]) == 8


def test_cli_checkpoint_folder(capsys):
    code, out, _ = _cli(["memory", str(FIXTURES / "tiny-mixed"), "--tp", "2", "--ep", "2", "--json"], capsys)
    assert code == 0 and json.loads(out)["variant"] == "mixed"


@pytest.mark.parametrize("args,msg", [
    (["--variant", "mixed", "--tp", "4", "--ep", "4", "--gpu", "A100"], "unknown GPU preset 'A100'"),
    (["--tp", "4", "--ep", "4"], "--variant"),
    (["--variant", "mixed", "--tp", "4", "--ep", "5"], "--ep 5 does not divide --tp 4"),
    (["--variant", "mixed", "--tp", "5", "--ep", "5"], "does not divide the 384 routed experts"),
    (["--variant", "mixed", "--tp", "4", "--ep", "4", "--mem-fraction", "1.5"], "--mem-fraction"),
])
def test_cli_bad_input(args, msg, tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(preset_config("full")))
    code, _, err = _cli(["memory", str(cfg), *args], capsys)
    assert code != 0 and msg in err and err.count("\n") == 1


def test_unknown_gpu_is_a_plan_error():
    with pytest.raises(PlanError):
        memory_report(FULL, PrecisionPlan.parse("mxfp8", 48), [], 8, 8, source="x", gpus=["X1"])
