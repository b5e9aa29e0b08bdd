"""memory: the release figures from transformers' default config (spec/inkling2.md: 390.06 / 619.38 GB
with BF16 non-experts, the cookbook's 394 / 623 with F32 embed+unembed, 94.02 / 151.35 GB of
experts per GPU at EP4), per-rank splits, the KV cache per layer kind, and checkpoint figures
equal to the bytes the headers hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _release_tiny import tiny_config, tiny_release  # noqa: F401  (pytest fixtures)
from inkling_ckpt.errors import PlanError
from inkling_ckpt.layouts.hf import HFCheckpoint, read_header
from inkling_ckpt.model.config import InklingConfig
from inkling_ckpt.model.inventory import inventory
from inkling_ckpt.model.precision import PrecisionPlan
from inkling_ckpt.plan.memory import GB, bare_config_dtypes, kv_cost, memory_report

CONFIG = Path(__file__).resolve().parent.parent / "fixtures" / "full-size" / "config.json"
FULL = InklingConfig.from_file(CONFIG)
PLANS = {"mixed": "0-39:nvfp4,40-47:mxfp8", "mxfp8": "mxfp8"}


def _specs(variant: str, embed: torch.dtype = torch.bfloat16):
    plan = PrecisionPlan.parse(PLANS[variant], 48)
    return plan, inventory(FULL, plan, dtypes=bare_config_dtypes(inventory(FULL, plan), embed))


@pytest.fixture(scope="module")
def full_reports():
    out = {}
    for v in PLANS:
        plan, specs = _specs(v)
        for tp, ep in ((4, 4), (8, 8), (2, 2)):
            out[v, tp] = memory_report(FULL, plan, specs, tp, ep, source="full")
    return out


def test_full_config_is_the_release():
    assert FULL.num_hidden_layers == 48 and FULL.n_routed_experts == 384 and len(FULL.full_layers()) == 8


def test_release_totals_and_the_cookbook_difference(full_reports):
    # spec/inkling2.md: BF16 everywhere but the experts
    assert round(full_reports["mixed", 4]["checkpoint_bytes"] / GB, 2) == 390.06
    assert round(full_reports["mxfp8", 4]["checkpoint_bytes"] / GB, 2) == 619.38
    experts = {v: full_reports[v, 4]["ranks"][0]["by_category"]["routed_experts"] for v in PLANS}
    assert round(experts["mixed"] / GB, 2) == 94.02 and round(experts["mxfp8"] / GB, 2) == 151.35
    # the cookbook's "about 394 / 623" are F32 embed + unembed: exactly 2 x 201024 x 4608 x 2 bytes more
    for v, book in (("mixed", 394), ("mxfp8", 623)):
        plan, specs = _specs(v, torch.float32)
        total = sum(s.nbytes for s in specs)
        assert total - full_reports[v, 4]["checkpoint_bytes"] == 2 * 201024 * 4608 * 2
        assert round(total / GB) == book
    # MXFP8 at TP2: about 311 GB per GPU
    tp2 = full_reports["mxfp8", 2]["max_rank_bytes"] / GB
    assert 310 < tp2 < 311 and round(tp2, 2) == 310.11
    plan, specs = _specs("mxfp8", torch.float32)
    assert round(memory_report(FULL, plan, specs, 2, 2, source="x")["max_rank_bytes"] / GB, 2) == 311.96


def test_release_notes_say_where_and_why(full_reports):
    notes = "\n".join(full_reports["mixed", 4]["notes"])
    assert "about 394 GB" in notes and "390.06 GB" in notes and "F32 embed + unembed" in notes
    assert "3.71 GB -> 393.76 GB" in notes and "--embed-dtype f32" in notes and "EP4: 94.02 GB" in notes
    notes = "\n".join(full_reports["mxfp8", 4]["notes"])
    assert "about 623 GB" in notes and "623.08 GB" in notes and "EP4: 151.35 GB" in notes
    assert "Per GPU at TP2: 310.11 GB (cookbook about 311" in notes
    # not the release config, or not a release plan: nothing to compare
    plan = PrecisionPlan.parse("bf16", 4)
    assert memory_report(tiny_config(), plan, inventory(tiny_config(), plan), 1, 1, source="x")["notes"] == []


@pytest.mark.parametrize("variant", ["mixed", "mxfp8"])
@pytest.mark.parametrize("tp", [4, 8])
def test_full_model_per_rank_breakdown(full_reports, variant, tp):
    rep = full_reports[variant, tp]
    ck = rep["checkpoint_bytes_by_category"]
    ranks = rep["ranks"]
    assert len(ranks) == tp
    # embeddings are split without copies; attention too (tp <= 8 KV heads) but for rel_logits_proj,
    # which every head shares (48 layers x [16, 1024] BF16)
    assert all(r["by_category"]["embeddings_head"] * tp == ck["embeddings_head"] for r in ranks)
    rel = 48 * 16 * 1024 * 2
    assert all(r["by_category"]["attention"] * tp == ck["attention"] + (tp - 1) * rel for r in ranks)
    # experts too, but for the NVFP4 denominators every rank keeps (4 bytes, 2 per NVFP4 layer)
    den = 40 * 2 * 4 if variant == "mixed" else 0
    assert all(r["by_category"]["routed_experts"] * tp == ck["routed_experts"] + (tp - 1) * den for r in ranks)
    # router, norms and the vision tower are on every rank
    for cat in ("router_norms", "vision_tower"):
        assert all(r["by_category"][cat] == ck[cat] for r in ranks)
    replicated = ranks[0]["replicated"]
    assert replicated == ck["router_norms"] + ck["vision_tower"] + den + rel
    assert rep["max_rank_bytes"] == (rep["checkpoint_bytes"] - replicated) // tp + replicated


def test_full_model_kv_cost():
    kv8, kv4, kv16 = kv_cost(FULL, 8), kv_cost(FULL, 4), kv_cost(FULL, 16)
    assert (kv8.full_layers, kv8.sliding_layers, kv8.window) == (8, 40, 1024)
    assert kv8.bytes_per_token == 8 * 2 * 1 * 128 * 2 and kv4.bytes_per_token == 2 * kv8.bytes_per_token
    assert kv8.sliding_bytes_per_sequence == 40 * 1024 * (2 * 1 * 128 * 2)
    assert kv8.sequence_bytes(100) == 100 * kv8.bytes_per_token + 100 * kv8.sliding_bytes_per_token
    assert kv8.sequence_bytes(4096) == 4096 * kv8.bytes_per_token + kv8.sliding_bytes_per_sequence
    assert kv_cost(FULL, 8, "mxfp8").bytes_per_token == 8 * 2 * (128 + 4)
    # tp 16 > 8 KV heads: one (replicated) head per rank, the same cost as tp 8
    assert kv16.bytes_per_token == kv8.bytes_per_token and kv16.full_heads_per_rank == 1


def test_kv_cost_uses_each_layer_kinds_heads():
    cfg = tiny_config()  # full layers 1, 3: 2 KV heads of 8; sliding layers 0, 2: 4 KV heads of 16, window 32
    kv = kv_cost(cfg, 2)
    assert kv.full_heads_per_rank == 1 and kv.sliding_heads_per_rank == 2
    assert kv.bytes_per_token == 2 * (2 * 1 * 8 * 2)
    assert kv.sliding_bytes_per_sequence == 32 * 2 * (2 * 2 * 16 * 2)
    with pytest.raises(PlanError, match="multiple of 32"):
        kv_cost(cfg, 2, "mxfp8")


def test_kv_pool_and_fit(full_reports):
    rep = full_reports["mixed", 8]
    h200 = next(g for g in rep["gpus"] if g["gpu"] == "H200")
    pool = int(141 * GB * 0.9) - rep["max_rank_bytes"]
    assert h200["fits"] and h200["kv_pool_bytes"] == pool
    kv = rep["kv_cache"]
    assert h200["kv_tokens"] == (pool - kv["sliding_bytes_per_sequence"]) // kv["bytes_per_token"]
    assert h200["sequences"] == pool // kv["bytes_per_sequence"]
    # the MXFP8 model at TP4 does not fit an H200
    h200_mx4 = next(g for g in full_reports["mxfp8", 4]["gpus"] if g["gpu"] == "H200")
    assert not h200_mx4["fits"] and h200_mx4["kv_tokens"] == 0


@pytest.mark.parametrize("variant", ["bf16", "mixed", "mxfp8"])
def test_checkpoint_figures_equal_header_bytes(tiny_release, variant):
    src = tiny_release[variant]
    ckpt = HFCheckpoint.open(src)
    header_bytes = sum(dtype.itemsize * int(torch.tensor(shape).prod()) for f in src.glob("*.safetensors")
                       for shape, dtype, _ in read_header(f).values())
    rep = memory_report(ckpt.cfg, ckpt.plan, ckpt.expected(), 1, 1, source=str(src))
    assert rep["checkpoint_bytes"] == header_bytes == rep["ranks"][0]["bytes"]
    assert rep["ranks"][0]["by_category"]["vision_tower"] > 0


def test_cli_full_config_table_and_json(cli, tmp_path):
    code, out, _ = cli("memory", CONFIG, "--variant", "mixed", "--tp", "4", "--ep", "4")
    assert code == 0 and "390.06 GB" in out and "H200" in out and "VR200" in out
    assert "every non-expert tensor BF16" in out and "about 394 GB" in out and "393.76 GB" in out
    code, out, _ = cli("memory", CONFIG, "--variant", "mxfp8", "--tp", "2", "--ep", "2", "--embed-dtype", "f32",
                       "--gpu", "B300", "--json")
    rep = json.loads(out)
    assert code == 0 and [g["gpu"] for g in rep["gpus"]] == ["B300"] and len(rep["ranks"]) == 2
    assert round(rep["checkpoint_bytes"] / GB, 2) == 623.08 and round(rep["max_rank_bytes"] / GB, 2) == 311.96
    assert "embed/unembed F32" in rep["dtypes"]
    (tmp_path / "config.json").write_bytes(CONFIG.read_bytes())  # a folder holding only a config
    code, out, _ = cli("memory", tmp_path, "--plan", "0-39:nvfp4,40-47:mxfp8", "--tp", "8", "--ep", "8", "--json")
    assert code == 0 and json.loads(out)["variant"] == "mixed"


def test_cli_checkpoint_folder(tiny_release, cli):
    code, out, _ = cli("memory", tiny_release["mixed"], "--tp", "2", "--ep", "2", "--json")
    rep = json.loads(out)
    assert code == 0 and rep["variant"] == "mixed" and rep["dtypes"].startswith("as stored") and rep["notes"] == []
    code, _, err = cli("memory", tiny_release["mixed"], "--tp", "2", "--embed-dtype", "f32")
    assert code != 0 and "holds weights" in err and err.count("\n") == 1


@pytest.mark.parametrize("args,msg", [
    (["--variant", "mixed", "--tp", "4", "--ep", "4", "--gpu", "A100"], "unknown GPU preset 'A100'"),
    (["--tp", "4", "--ep", "4"], "--variant"),
    (["--variant", "mixed", "--tp", "4", "--ep", "5"], "--ep 5 does not divide --tp 4"),
    (["--variant", "mixed", "--tp", "5", "--ep", "5"], "does not divide the 384 routed experts"),
    (["--variant", "mixed", "--tp", "4", "--ep", "2"], "NVFP4 experts cannot be TP-sharded"),
    (["--variant", "mixed", "--tp", "4", "--ep", "4", "--mem-fraction", "1.5"], "--mem-fraction"),
    (["--variant", "mixed", "--tp", "4", "--ep", "4", "--kv-dtype", "fp4"], "'fp4' is not one of 'bf16', 'mxfp8'"),
])
def test_cli_bad_input(cli, args, msg):
    code, _, err = cli("memory", CONFIG, *args)
    assert code != 0 and msg in err and err.count("\n") == 1


def test_unknown_gpu_is_a_plan_error():
    with pytest.raises(PlanError):
        memory_report(FULL, PrecisionPlan.parse("mxfp8", 48), [], 8, 8, source="x", gpus=["X1"])
