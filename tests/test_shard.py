"""shard -> merge round trips, each rank's slices against an independent oracle, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from inkling_ckpt.cli.app import main
from inkling_ckpt.errors import CheckpointError, IntegrityError, PlanError
from inkling_ckpt.layouts.hf import HFCheckpoint, read_header
from inkling_ckpt.layouts.sharded import MANIFEST, merge, shard

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
VARIANTS = ["bf16", "mixed", "mxfp8"]


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in root.iterdir() if p.is_file() and not p.name.startswith(".")}


def expected_slice(name: str, t: torch.Tensor, rank: int, tp: int, ep: int, cfg) -> torch.Tensor | None:
    """What rank ``rank`` must hold of tensor ``name``: written from parallel.md, not from the plan code."""
    def rows(x, n, i):
        step = x.shape[0] // n
        return x[i * step:(i + 1) * step]

    def cols(x, n, i):
        step = x.shape[-1] // n
        return x[..., i * step:(i + 1) * step]

    kv = cfg.num_key_value_heads
    if ".mlp.experts." in name:
        e = int(name.split(".mlp.experts.")[1].split(".")[0])
        moe_tp = tp // ep
        if rank // moe_tp != e // (cfg.n_routed_experts // ep):
            return None
        if t.dim() == 0 or moe_tp == 1:
            return t
        return rows(t, moe_tp, rank % moe_tp) if ("gate_proj" in name or "up_proj" in name) else cols(t, moe_tp, rank % moe_tp)
    leaf = name.rsplit(".", 2)[-2]
    if "visual" in name:
        return t
    if leaf in ("q_proj", "g_proj", "sink_proj", "rel_bias", "embed_tokens", "lm_head", "eh_proj") or \
            (name.startswith("mtp.") and leaf in ("gate_proj", "up_proj")):
        return rows(t, tp, rank)
    if leaf == "o_proj" or (name.startswith("mtp.") and leaf == "down_proj"):
        return cols(t, tp, rank)
    if leaf in ("k_proj", "v_proj", "k_conv", "v_conv"):
        return rows(t, tp, rank) if tp <= kv else rows(t, kv, rank // (tp // kv))
    return t


def _check_ranks(src: Path, dst: Path, tp: int, ep: int) -> None:
    ckpt = HFCheckpoint.open(src)
    man = json.loads((dst / MANIFEST).read_text())
    assert man["plan"] == {**man["plan"], "tp": tp, "ep": ep, "moe_tp": tp // ep}
    for rank in range(tp):
        d = dst / f"rank-{rank:02d}"
        index = json.loads((d / "model.safetensors.index.json").read_text())
        assert index["metadata"]["tp_rank"] == rank
        held = {}
        for f in set(index["weight_map"].values()):
            with safe_open(str(d / f), framework="pt") as h:
                for k in h.keys():
                    held[k] = h.get_tensor(k)
        want = {}
        for name in ckpt.tensors:
            s = expected_slice(name, ckpt.get(name), rank, tp, ep, ckpt.cfg)
            if s is not None:
                want[name] = s
        assert set(held) == set(want), f"rank {rank}"
        for name, s in want.items():
            assert held[name].dtype == s.dtype and held[name].shape == s.shape, name
            assert torch.equal(held[name].reshape(-1).view(torch.uint8), s.contiguous().reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_shard_merge_byte_identical(variant, tp, tmp_path):
    src = FIXTURES / f"tiny-{variant}"
    res = shard(src, tmp_path / "sh", tp, tp, max_shard_size="1MB", progress=False)
    assert sum(res.rank_bytes) >= res.source_bytes > 0
    if tp > 1:  # every rank against the independent oracle
        _check_ranks(src, tmp_path / "sh", tp, tp)
    merge(tmp_path / "sh", tmp_path / "back", progress=False)
    assert _files(tmp_path / "back") == _files(src)


@pytest.mark.parametrize("variant", ["bf16", "mxfp8"])
def test_moe_tp_split_works_on_mxfp8_and_bf16(variant, tmp_path):
    src = FIXTURES / f"tiny-{variant}"
    shard(src, tmp_path / "sh", 4, 2, progress=False)
    _check_ranks(src, tmp_path / "sh", 4, 2)
    merge(tmp_path / "sh", tmp_path / "back", progress=False)
    assert _files(tmp_path / "back") == _files(src)


def test_moe_tp_split_refused_on_mixed_with_the_reason(tmp_path):
    with pytest.raises(PlanError, match="NVFP4 experts cannot be TP-sharded.*moe_tp 2"):
        shard(FIXTURES / "tiny-mixed", tmp_path / "sh", 4, 2, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_manifest_records_rules_ownership_and_checksums(tmp_path):
    shard(FIXTURES / "tiny-mixed", tmp_path / "sh", 4, 4, progress=False)
    man = json.loads((tmp_path / "sh" / MANIFEST).read_text())
    assert man["experts"]["1"] == {"experts": [2, 4], "ranks": [1]}
    q = man["tensors"]["model.language_model.layers.0.self_attn.q_proj.weight"]
    assert q["shape"] == [256, 256] and q["split"] == "q_heads" and q["dim"] == 0 and q["holders"] == [0, 1, 2, 3]
    k = man["tensors"]["model.language_model.layers.0.self_attn.k_proj.weight"]
    assert k["pieces"] == 2 and k["holders"] == [0, 0, 1, 1]
    for rel, info in man["files"].items():
        assert (tmp_path / "sh" / rel).stat().st_size == info["bytes"] and len(info["sha256"]) == 64
    assert all(r["bytes"] > 0 for r in man["ranks"])


def test_rank_bytes_match_memory_report_and_files(tmp_path):
    from inkling_ckpt.plan.memory import memory_report

    src = FIXTURES / "tiny-mixed"
    res = shard(src, tmp_path / "sh", 2, 2, progress=False)
    ckpt = HFCheckpoint.open(src)
    rep = memory_report(ckpt.cfg, ckpt.plan, ckpt.expected(), 2, 2, source="x")
    for r in range(2):
        d = tmp_path / "sh" / f"rank-{r:02d}"
        actual = sum(t[1].itemsize * int(torch.tensor(t[0]).prod()) if t[0] else t[1].itemsize
                     for f in d.glob("*.safetensors") for t in read_header(f).values())
        assert actual == rep["ranks"][r]["bytes"] == res.rank_bytes[r]


def _cli(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


@pytest.mark.parametrize("args,msg", [
    (["--tp", "8", "--ep", "3"], "--ep 3 does not divide --tp 8"),
    (["--tp", "3", "--ep", "3"], "--ep 3 does not divide the 8 routed experts"),
    (["--tp", "6", "--ep", "2"], "--tp 6 does not divide the 8 attention heads"),
    (["--tp", "4", "--ep", "2"], "NVFP4 experts cannot be TP-sharded"),
])
def test_cli_bad_plans_one_line_nothing_published(args, msg, tmp_path, capsys):
    code, _, err = _cli(["shard", str(FIXTURES / "tiny-mixed"), str(tmp_path / "out"), *args, "-q"], capsys)
    assert code != 0 and msg in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_cli_vocab_not_divisible(tmp_path, capsys):
    cfg = json.loads((FIXTURES / "tiny-bf16" / "config.json").read_text())
    cfg["text_config"]["vocab_size"] = 500
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    code, _, err = _cli(["memory", str(tmp_path / "cfg.json"), "--variant", "bf16", "--tp", "8", "--ep", "8"], capsys)
    assert code != 0 and "vocabulary of 500 rows" in err


def test_cli_dry_run_reads_no_data_and_writes_nothing(tmp_path, capsys):
    code, out, _ = _cli(["shard", str(FIXTURES / "tiny-mixed"), str(tmp_path / "out"), "--tp", "4", "--ep", "4",
                         "--dry-run"], capsys)
    assert code == 0 and "EP rank 3: experts 6-7 on ranks [3]" in out and "split by query heads" in out
    assert "bytes per rank" in out and not (tmp_path / "out").exists()
    code, out, _ = _cli(["shard", str(FIXTURES / "tiny-mixed"), "--tp", "2", "--ep", "2", "--dry-run", "--json"], capsys)
    info = json.loads(out)
    assert code == 0 and len(info["ranks"]) == 2 and info["plan"]["moe_tp"] == 1


def test_merge_refuses_truncated_or_corrupted_ranks(tmp_path, capsys):
    sh = tmp_path / "sh"
    shard(FIXTURES / "tiny-mxfp8", sh, 2, 2, progress=False)
    f = sorted((sh / "rank-01").glob("*.safetensors"))[0]
    data = f.read_bytes()
    # same size, one byte flipped: only the checksum can tell
    f.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    code, _, err = _cli(["shard", "--merge", str(sh), str(tmp_path / "out"), "-q"], capsys)
    assert code != 0 and "does not match the manifest" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    with pytest.raises(IntegrityError):
        merge(sh, tmp_path / "out", progress=False)
    f.write_bytes(data[: len(data) // 2])  # truncated
    code, _, err = _cli(["shard", "--merge", str(sh), str(tmp_path / "out"), "-q"], capsys)
    assert code != 0 and "truncated" in err and not (tmp_path / "out").exists()
    f.unlink()  # missing
    with pytest.raises(CheckpointError, match="missing"):
        merge(sh, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_merge_of_a_non_sharded_folder(tmp_path, capsys):
    code, _, err = _cli(["shard", "--merge", str(FIXTURES / "tiny-bf16"), str(tmp_path / "out")], capsys)
    assert code != 0 and "not a sharded checkpoint" in err


def test_rerun_is_skipped_and_an_interrupted_run_resumes(tmp_path, monkeypatch):
    import inkling_ckpt.layouts.sharded as sharded

    src = FIXTURES / "tiny-mixed"
    real = sharded._shard_file
    calls = []

    def flaky(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(sharded, "_shard_file", flaky)
    with pytest.raises(KeyboardInterrupt):
        shard(src, tmp_path / "sh", 2, 2, max_shard_size="500KB", progress=False)
    assert not (tmp_path / "sh").exists() and (tmp_path / ".sh.inkling-partial").is_dir()
    monkeypatch.setattr(sharded, "_shard_file", real)
    res = shard(src, tmp_path / "sh", 2, 2, max_shard_size="500KB", progress=False)
    assert res.resumed and not res.skipped
    assert shard(src, tmp_path / "sh", 2, 2, max_shard_size="500KB", progress=False).skipped
    merge(tmp_path / "sh", tmp_path / "back", progress=False)
    assert _files(tmp_path / "back") == _files(src)


@pytest.mark.parametrize("damage", ["drop_files", "bad_holders", "not_json", "edited_sha"])
def test_merge_refuses_a_damaged_manifest(damage, tmp_path, capsys):
    sh = tmp_path / "sh"
    shard(FIXTURES / "tiny-bf16", sh, 2, 2, progress=False)
    path = sh / MANIFEST
    man = json.loads(path.read_text())
    if damage == "drop_files":
        del man["files"]
    elif damage == "bad_holders":
        man["tensors"]["lm_head.weight"]["holders"] = [0, 0]
    elif damage == "edited_sha":
        rel = next(r for r in man["files"] if r.startswith("rank-00/") and r.endswith(".safetensors"))
        man["files"][rel]["sha256"] = "0" * 64
    path.write_text("{" if damage == "not_json" else json.dumps(man))
    code, _, err = _cli(["shard", "--merge", str(sh), str(tmp_path / "out"), "-q"], capsys)
    assert code != 0 and err.count("\n") == 1 and not (tmp_path / "out").exists()


def test_sharded_folder_is_a_tensor_source(tmp_path):
    """A sharded folder can feed the converters: requantize it to MXFP8 straight from the ranks."""
    from inkling_ckpt.convert.requantize import requantize
    from inkling_ckpt.layouts.sharded import ShardedCheckpoint
    from inkling_ckpt.model.precision import PrecisionPlan

    shard(FIXTURES / "tiny-bf16", tmp_path / "sh", 4, 4, progress=False)
    src = ShardedCheckpoint.open(tmp_path / "sh")
    assert set(src.extra_files()) == {"generation_config.json"}
    requantize(src, tmp_path / "mx", PrecisionPlan.parse("mxfp8", 4), max_shard_size="2MB", progress=False)
    src.close()
    ref = HFCheckpoint.open(FIXTURES / "tiny-mxfp8")
    out = HFCheckpoint.open(tmp_path / "mx")
    for name in ref.tensors:
        assert torch.equal(out.get(name).reshape(-1).view(torch.uint8), ref.get(name).reshape(-1).view(torch.uint8)), name


def test_interrupted_merge_resumes(tmp_path, monkeypatch):
    import inkling_ckpt.layouts.sharded as sharded

    src = FIXTURES / "tiny-bf16"
    shard(src, tmp_path / "sh", 2, 2, progress=False)
    real = sharded._merge_file
    calls = []

    def flaky(*args, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(sharded, "_merge_file", flaky)
    with pytest.raises(KeyboardInterrupt):
        merge(tmp_path / "sh", tmp_path / "back", progress=False)
    assert not (tmp_path / "back").exists()
    monkeypatch.setattr(sharded, "_merge_file", real)
    merge(tmp_path / "sh", tmp_path / "back", progress=False)
    assert _files(tmp_path / "back") == _files(src)
    assert merge(tmp_path / "sh", tmp_path / "back", progress=False).skipped
