"""shard -> merge on release checkpoints written by transformers: byte-identical round trips,
each rank's slices against an oracle written from parallel.md and against transformers' own
model, streaming in row blocks, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from _release_tiny import tiny_release  # noqa: F401  (pytest fixtures)
from inkling_ckpt.errors import CheckpointError, IntegrityError, PlanError
from inkling_ckpt.formats.stacked import decode_stacked
from inkling_ckpt.layouts.hf import HFCheckpoint, read_header
from inkling_ckpt.layouts.sharded import MANIFEST, ShardedCheckpoint, merge, shard

L = "model.llm.layers"


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in root.iterdir() if p.is_file() and not p.name.startswith(".")}


def expected_slice(name: str, t: torch.Tensor, rank: int, tp: int, ep: int, cfg) -> torch.Tensor:
    """What rank ``rank`` must hold of tensor ``name``: written from parallel.md, not from the plan code."""
    def cut(x, dim, n, i):
        step = x.shape[dim] // n
        return x.narrow(dim, i * step, step)

    moe_tp = tp // ep
    if ".mlp.experts." in name:
        part = name.split("_weight", 1)[1]
        if part == "_outer_scale_denominator":
            return t
        x = cut(t, 0, ep, rank // moe_tp)
        if part == "_amax" or moe_tp == 1:
            return x
        return cut(x, 1 if ".w13_weight" in name else 2, moe_tp, rank % moe_tp)
    if name.startswith("model.visual."):
        return t
    if name.endswith(("embed.weight", "unembed.weight")):
        return cut(t, 0, tp, rank)
    if ".attn." not in name:
        return t
    d = cfg.layer_dims(int(name.split(".")[3]))
    leaf = name.split(".attn.")[1]
    if leaf in ("wq_du.weight", "gate_attn.weight", "attn_sink_proj.weight", "wr_du.weight", "q_l2_clip.scale",
                "rel_l2_clip.scale"):
        return cut(t, 0, tp, rank)
    if leaf == "wo_ud.weight":
        return cut(t, 1, tp, rank)
    if leaf.startswith(("wk_dv", "wv_dv", "k_sconv", "v_sconv")):
        dim = 1 if leaf.endswith("static_w") else 0
        return cut(t, dim, tp, rank) if tp <= d.kv_heads else cut(t, dim, d.kv_heads, rank // (tp // d.kv_heads))
    return t  # rel_logits_proj.proj


def _rank_tensors(d: Path) -> dict[str, torch.Tensor]:
    index = json.loads((d / "model.safetensors.index.json").read_text())
    held = {}
    for f in sorted(set(index["weight_map"].values())):
        with safe_open(str(d / f), framework="pt") as h:
            for k in h.keys():
                held[k] = h.get_tensor(k)
    assert set(held) == set(index["weight_map"])
    return held


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _check_ranks(src: Path, dst: Path, tp: int, ep: int) -> None:
    ckpt = HFCheckpoint.open(src)
    man = json.loads((dst / MANIFEST).read_text())
    assert man["plan"] == {**man["plan"], "tp": tp, "ep": ep, "moe_tp": tp // ep}
    for rank in range(tp):
        d = dst / f"rank-{rank:02d}"
        meta = json.loads((d / "model.safetensors.index.json").read_text())["metadata"]
        assert (meta["tp_rank"], meta["ep_rank"], meta["moe_tp_rank"]) == (rank, rank // (tp // ep), rank % (tp // ep))
        held = _rank_tensors(d)
        assert set(held) == set(ckpt.tensors), f"rank {rank}"  # every rank holds a piece of every tensor
        for name in ckpt.tensors:
            assert _same(held[name], expected_slice(name, ckpt.get(name), rank, tp, ep, ckpt.cfg)), (rank, name)


CASES = [("bf16", 1, 1), ("bf16", 2, 2), ("bf16", 4, 4), ("bf16", 4, 1), ("bf16", 4, 2), ("mixed", 2, 2),
         ("mixed", 4, 4), ("mxfp8", 2, 1), ("mxfp8", 4, 2), ("mxfp8", 4, 4)]


@pytest.mark.parametrize("variant,tp,ep", CASES)
def test_shard_merge_byte_identical(tiny_release, variant, tp, ep, tmp_path):
    src = tiny_release[variant]
    res = shard(src, tmp_path / "sh", tp, ep, max_shard_size="100KB", progress=False)
    assert sum(res.rank_bytes) >= res.source_bytes > 0 and len(res.rank_bytes) == tp
    _check_ranks(src, tmp_path / "sh", tp, ep)
    merge(tmp_path / "sh", tmp_path / "back", progress=False)
    assert _files(tmp_path / "back") == _files(src)


FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


@pytest.mark.parametrize("variant,tp,ep", [("bf16", 4, 4), ("bf16", 2, 1), ("mixed", 2, 2), ("mxfp8", 4, 2)])
def test_bundled_fixtures_round_trip(variant, tp, ep, tmp_path):
    src = FIXTURES / f"tiny-{variant}"
    shard(src, tmp_path / "sh", tp, ep, progress=False)
    _check_ranks(src, tmp_path / "sh", tp, ep)
    merge(tmp_path / "sh", tmp_path / "back", progress=False)
    assert _files(tmp_path / "back") == _files(src)


def test_rank_folders_are_slices_of_the_transformers_model(tiny_release, tmp_path):
    """Each rank's tensors equal the TP/EP slices of the parameters transformers loads (tp 4, ep 2)."""
    sd = tiny_release["model"].state_dict()
    shard(tiny_release["bf16"], tmp_path / "sh", 4, 2, progress=False)
    T = "model.language_model"
    F, f = 64, 32  # moe_intermediate_size, its half per moe-TP rank
    for rank in range(4):
        held = _rank_tensors(tmp_path / "sh" / f"rank-{rank:02d}")
        kv, e0, j = rank // 2, (rank // 2) * 4, rank % 2  # full layers: 2 KV heads; 4 experts per EP rank
        full, swa = f"{T}.layers.1", f"{T}.layers.0"
        pairs = {  # on-disk name -> the transformers tensor's slice this rank holds
            f"{L}.1.attn.wq_du.weight": sd[f"{full}.self_attn.q_proj.linear.weight"][16 * rank:16 * rank + 16],
            f"{L}.1.attn.wk_dv.weight": sd[f"{full}.self_attn.k_proj.linear.weight"][8 * kv:8 * kv + 8],
            f"{L}.1.attn.k_sconv.static_w": sd[f"{full}.self_attn.k_proj.sconv.static_weight"][:, 8 * kv:8 * kv + 8],
            f"{L}.1.attn.v_sconv.weight_proj": sd[f"{full}.self_attn.v_proj.sconv.weight_proj.weight"][4 * kv:4 * kv + 4],
            f"{L}.1.attn.wo_ud.weight": sd[f"{full}.self_attn.o_proj.linear.weight"][:, 16 * rank:16 * rank + 16],
            f"{L}.1.attn.gate_attn.weight": sd[f"{full}.self_attn.o_proj.gate_proj.weight"][16 * rank:16 * rank + 16],
            f"{L}.1.attn.attn_sink_proj.weight": sd[f"{full}.self_attn.sink_proj.weight"][2 * rank:2 * rank + 2],
            f"{L}.1.attn.wr_du.weight": sd[f"{full}.self_attn.relative_position_bias.linear.weight"][16 * rank:16 * rank + 16],
            f"{L}.1.attn.rel_logits_proj.proj": sd[f"{full}.self_attn.relative_position_bias.proj"],
            f"{L}.0.attn.wq_du.weight": sd[f"{swa}.self_attn.q_proj.linear.weight"][16 * rank:16 * rank + 16],
            f"{L}.0.attn.wk_dv.weight": sd[f"{swa}.self_attn.k_proj.linear.weight"][16 * rank:16 * rank + 16],
            f"{L}.0.attn.k_sconv.weight": sd[f"{swa}.self_attn.k_proj.sconv.conv1d.weight"][16 * rank:16 * rank + 16],
            f"{L}.1.mlp.gate.weight": sd[f"{full}.mlp.gate.weight"],
            f"{L}.1.mlp.gate.bias": sd[f"{full}.mlp.gate.e_score_correction_bias"],
            f"{L}.1.mlp.experts.w2_weight": sd[f"{full}.mlp.experts.down_proj"][e0:e0 + 4, :, j * f:j * f + f],
            "model.llm.embed.weight": sd[f"{T}.embed_tokens.weight"][64 * rank:64 * rank + 64],
            "model.llm.attn_res.attn_queries.0": sd[f"{full}.attention_input.query"],
            "model.visual.proj_out.weight": sd["model.vision_tower.merger.linear_2.weight"],
        }
        for name, want in pairs.items():
            assert _same(held[name], want), (rank, name)
        # w13: this rank's rows are whole (gate, up) pairs: de-interleaved, the moe-TP slices of gate and up
        gate_up = sd[f"{full}.mlp.experts.gate_up_proj"][e0:e0 + 4]  # transformers holds [gate; up]
        w13 = held[f"{L}.1.mlp.experts.w13_weight"]
        assert _same(w13[:, 0::2], gate_up[:, j * f:j * f + f]) and _same(w13[:, 1::2], gate_up[:, F + j * f:F + j * f + f])
        # unembed: transformers drops the zero padding rows (>= 250); rank 3 holds rows 192..255
        lm = sd["lm_head.weight"]
        un = held["model.llm.unembed.weight"]
        real = min(64, max(0, 250 - 64 * rank))
        assert _same(un[:real], lm[64 * rank:64 * rank + real]) and not un[real:].any()


def test_a_single_rank_folder_loads_in_transformers(tiny_release, tmp_path):
    """At tp 1 the rank folder is the whole model: with the source's config it loads in transformers
    with no missing or unexpected keys, and its parameters equal the source's."""
    from _tiny_tf import load

    shard(tiny_release["bf16"], tmp_path / "sh", 1, 1, progress=False)
    rank = tmp_path / "sh" / "rank-00"
    (rank / "config.json").write_bytes((tmp_path / "sh" / "source" / "config.json").read_bytes())
    model, info = load(rank)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    want = tiny_release["model"].state_dict()
    assert all(_same(t, want[k]) for k, t in model.state_dict().items())


def test_moe_tp_block_scales_follow_their_rows(tiny_release, tmp_path):
    """MXFP8 at tp 4, ep 2: a rank's (w13, scale) decodes to its moe-TP slice of the decoded layer."""
    src = HFCheckpoint.open(tiny_release["mxfp8"])
    shard(tiny_release["mxfp8"], tmp_path / "sh", 4, 2, progress=False)
    base = f"{L}.2.mlp.experts"
    whole = {k: decode_stacked("mxfp8", {"": src.get(f"{base}.{k}_weight"), "_scale": src.get(f"{base}.{k}_weight_scale")})
             for k in ("w13", "w2")}
    for rank in range(4):
        held = _rank_tensors(tmp_path / "sh" / f"rank-{rank:02d}")
        e0, j = (rank // 2) * 4, rank % 2
        for k in ("w13", "w2"):
            got = decode_stacked("mxfp8", {"": held[f"{base}.{k}_weight"], "_scale": held[f"{base}.{k}_weight_scale"]})
            want = whole[k][e0:e0 + 4, 64 * j:64 * j + 64] if k == "w13" else whole[k][e0:e0 + 4, :, 32 * j:32 * j + 32]
            assert torch.equal(got, want), (rank, k)


def test_tensors_move_in_row_blocks_and_ep_slices_read_only_their_rank(tiny_release, tmp_path, monkeypatch):
    import inkling_ckpt.layouts.sharded as sharded

    src = tiny_release["mixed"]
    monkeypatch.setattr(sharded, "CHUNK_BYTES", 2048)
    reads: list[str] = []
    real = HFCheckpoint.read_rows

    def spy(self, name, start, stop, **kw):
        st = self.tensors[name]
        row = st.nbytes // st.shape[0] if st.shape else st.nbytes
        assert (stop - start) * row <= max(2048, row), name  # one block, never a whole layer
        reads.append(name)
        return real(self, name, start, stop, **kw)

    monkeypatch.setattr(HFCheckpoint, "read_rows", spy)
    shard(src, tmp_path / "sh", 4, 4, progress=False)
    monkeypatch.setattr(HFCheckpoint, "read_rows", real)
    assert len(reads) > len(HFCheckpoint.open(src).tensors)  # large tensors came in several blocks
    merge(tmp_path / "sh", tmp_path / "back", progress=False)  # blocks both ways
    assert _files(tmp_path / "back") == _files(src)

    sc = ShardedCheckpoint.open(tmp_path / "sh")
    ranks: list[int] = []
    real_local = ShardedCheckpoint._local_rows
    monkeypatch.setattr(ShardedCheckpoint, "_local_rows", lambda self, r, *a: (ranks.append(r), real_local(self, r, *a))[1])
    w13 = f"{L}.3.mlp.experts.w13_weight"
    got = sc.read_rows(w13, 4, 6)  # experts 4, 5: EP rank 2's
    assert set(ranks) == {2} and _same(got, HFCheckpoint.open(src).read_rows(w13, 4, 6))
    ranks.clear()
    assert _same(sc.read_rows(w13, 1, 5), HFCheckpoint.open(src).read_rows(w13, 1, 5)) and set(ranks) == {0, 1, 2}
    sc.close()


def test_sharded_folder_reads_back_as_the_source(tiny_release, tmp_path):
    src = HFCheckpoint.open(tiny_release["mxfp8"])
    shard(tiny_release["mxfp8"], tmp_path / "sh", 4, 2, progress=False)
    sc = ShardedCheckpoint.open(tmp_path / "sh")
    assert sc.plan == src.plan and sc.cfg == src.cfg
    assert [(s.name, s.shape, s.dtype, s.part) for s in sorted(sc.expected(), key=lambda s: s.name)] == \
        [(s.name, s.shape, s.dtype, s.part) for s in sorted(src.expected(), key=lambda s: s.name)]
    for name in src.tensors:
        assert _same(sc.get(name), src.get(name)), name
    # row ranges across piece boundaries: vocab rows, a column cut, EP x moe-TP cuts, KV replication
    for name, a, b in (("model.llm.embed.weight", 60, 200), (f"{L}.1.attn.wo_ud.weight", 3, 10),
                       (f"{L}.2.mlp.experts.w2_weight", 3, 6), (f"{L}.2.mlp.experts.w13_weight_scale", 2, 7),
                       (f"{L}.1.attn.wk_dv.weight", 5, 13), (f"{L}.3.mlp.experts.w2_weight", 4, 4)):
        assert _same(sc.read_rows(name, a, b), src.read_rows(name, a, b)), name
    with pytest.raises(CheckpointError, match="outside"):
        sc.read_rows(f"{L}.2.mlp.experts.w2_weight", 6, 9)
    assert set(sc.extra_files()) == {"generation_config.json"}
    sc.close()


def test_moe_tp_split_refused_on_mixed_with_the_reason(tiny_release, tmp_path):
    with pytest.raises(PlanError, match="NVFP4 experts cannot be TP-sharded.*moe_tp 2"):
        shard(tiny_release["mixed"], tmp_path / "sh", 4, 2, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_manifest_records_rules_ownership_and_checksums(tiny_release, tmp_path):
    shard(tiny_release["mxfp8"], tmp_path / "sh", 4, 2, progress=False)
    man = json.loads((tmp_path / "sh" / MANIFEST).read_text())
    assert man["experts"]["1"] == {"experts": [4, 8], "ranks": [2, 3]}
    q = man["tensors"][f"{L}.1.attn.wq_du.weight"]
    assert (q["shape"], q["local_shape"], q["split"], q["dim"], q["holders"]) == ([64, 64], [16, 64], "q_heads", 0, [0, 1, 2, 3])
    k = man["tensors"][f"{L}.1.attn.wk_dv.weight"]
    assert k["pieces"] == 2 and k["holders"] == [0, 0, 1, 1]
    w13 = man["tensors"][f"{L}.1.mlp.experts.w13_weight"]
    assert (w13["dim"], w13["pieces"], w13["holders"]) == (0, 2, [0, 0, 1, 1])
    assert w13["inner"] == {"dim": 1, "pieces": 2, "holders": [0, 1, 0, 1]} and w13["local_shape"] == [4, 64, 64]
    assert man["rules"][f"{L}.{{layer}}.mlp.experts.w13_weight"]["pairs"] is True
    assert man["version"] == 2 and man["expert_parts"]["_amax"] == {"ep": True, "moe_tp": False}
    assert man["expert_parts"]["_outer_scale_denominator"] == {"ep": False, "moe_tp": False}
    for rel, info in man["files"].items():
        assert (tmp_path / "sh" / rel).stat().st_size == info["bytes"] and len(info["sha256"]) == 64
    assert all(r["bytes"] > 0 for r in man["ranks"])


def test_rank_bytes_match_memory_report_and_files(tiny_release, tmp_path):
    from inkling_ckpt.plan.memory import memory_report

    src = tiny_release["mixed"]
    res = shard(src, tmp_path / "sh", 2, 2, progress=False)
    ckpt = HFCheckpoint.open(src)
    rep = memory_report(ckpt.cfg, ckpt.plan, ckpt.expected(), 2, 2, source="x")
    for r in range(2):
        d = tmp_path / "sh" / f"rank-{r:02d}"
        actual = sum(dtype.itemsize * int(torch.tensor(shape).prod()) for f in d.glob("*.safetensors")
                     for shape, dtype, _ in read_header(f).values())
        assert actual == rep["ranks"][r]["bytes"] == res.rank_bytes[r]
    # the bytes written count each rank's pieces (replicated tensors once per rank), not the source's
    assert res.bytes_written == sum(res.rank_bytes) > res.bytes_read == ckpt.total_bytes()


@pytest.mark.parametrize("args,msg", [
    (["--tp", "4", "--ep", "3"], "--ep 3 does not divide --tp 4"),
    (["--tp", "3", "--ep", "1"], "--tp 3 does not divide the 4 attention heads"),
    (["--tp", "8", "--ep", "8"], "--tp 8 does not divide the 4 attention heads"),
    (["--tp", "4", "--ep", "2"], "NVFP4 experts cannot be TP-sharded"),
])
def test_cli_bad_plans_one_line_nothing_published(tiny_release, cli, args, msg, tmp_path):
    code, _, err = cli("shard", tiny_release["mixed"], tmp_path / "out", *args, "-q")
    assert code != 0 and msg in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_cli_shard_dry_run_and_merge(tiny_release, cli, tmp_path):
    src = tiny_release["mxfp8"]
    code, out, _ = cli("shard", src, tmp_path / "out", "--tp", "4", "--ep", "2", "--dry-run")
    assert code == 0 and "EP rank 1: experts 4-7 on ranks [2, 3]" in out and "whole (gate, up) pairs" in out
    assert "bytes per rank" in out and not (tmp_path / "out").exists()
    code, out, _ = cli("shard", src, "--tp", "2", "--ep", "2", "--dry-run", "--json")
    info = json.loads(out)
    assert code == 0 and len(info["ranks"]) == 2 and info["parallel_plan"]["moe_tp"] == 1
    code, out, _ = cli("shard", src, tmp_path / "sh", "--tp", "2", "--ep", "1", "-q")
    assert code == 0 and "2 ranks" in out
    code, out, _ = cli("shard", "--merge", tmp_path / "sh", tmp_path / "back", "-q")
    assert code == 0 and "byte-identical" in out and _files(tmp_path / "back") == _files(src)


def test_ranks_split_the_manifest_checksums():
    from inkling_ckpt.layouts.sharded import checked_by
    from inkling_ckpt.pipeline import World

    files = {f"rank-{i:02d}/model.safetensors": {"bytes": 100 * (i + 1), "sha256": "0" * 64} for i in range(5)}
    shares = [checked_by(files, World(rank=r, size=2)) for r in range(2)]
    assert sorted(shares[0] + shares[1]) == sorted(files) and not set(shares[0]) & set(shares[1])
    assert all(shares)  # each rank checks some
    assert checked_by(files, World()) == sorted(files)


def test_a_rank_hashes_only_its_share(tiny_release, tmp_path, monkeypatch):
    from inkling_ckpt.layouts import sharded
    from inkling_ckpt.pipeline import World

    sh = tmp_path / "sh"
    shard(tiny_release["mxfp8"], sh, 2, 2, progress=False)
    files = json.loads((sh / MANIFEST).read_text())["files"]
    hashed: list[str] = []
    real = sharded.sha256_file
    monkeypatch.setattr(sharded, "sha256_file",
                        lambda p, *a: hashed.append(str(Path(p).relative_to(sh))) or real(p, *a))
    gathered: list[object] = []
    monkeypatch.setattr(sharded, "all_ok", lambda err, world: gathered.append(err))  # the collective, one rank's side
    for rank in range(2):
        hashed.clear()
        sharded.check_files(sh, files, world=World(rank=rank, size=2))
        assert sorted(hashed) == sharded.checked_by(files, World(rank=rank, size=2)) != sorted(files)
    assert gathered == [None, None]


def test_two_ranks_refuse_a_corrupted_rank_file_checked_by_either(tiny_release, tmp_path):
    """Each rank checks a share of the sha256s; a mismatch on one fails both, in one line, before anything is written."""
    import subprocess
    import sys

    from conftest import free_port, subprocess_env

    sh = tmp_path / "sh"
    shard(tiny_release["mxfp8"], sh, 2, 2, progress=False)
    f = sorted((sh / "rank-01").glob("*.safetensors"))[0]
    data = f.read_bytes()
    f.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    spec = tmp_path / "jobs.json"
    spec.write_text(json.dumps([["shard", "--merge", str(sh), str(tmp_path / "out"), "-q"]]))
    r = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--master_port",
                        free_port(), str(Path(__file__).parent / "_ranks_driver.py"), str(spec)],
                       env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("inkling-ckpt: error:")]
    assert len(lines) == 2 and all("does not match the manifest" in ln for ln in lines), r.stderr[-3000:]
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_merge_refuses_truncated_or_corrupted_ranks(tiny_release, cli, tmp_path):
    sh = tmp_path / "sh"
    shard(tiny_release["mxfp8"], sh, 2, 2, progress=False)
    f = sorted((sh / "rank-01").glob("*.safetensors"))[0]
    data = f.read_bytes()
    f.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, one byte flipped: only the checksum can tell
    code, _, err = cli("shard", "--merge", sh, tmp_path / "out", "-q")
    assert code != 0 and "does not match the manifest" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
    with pytest.raises(IntegrityError):
        merge(sh, tmp_path / "out", progress=False)
    f.write_bytes(data[: len(data) // 2])  # truncated
    code, _, err = cli("shard", "--merge", sh, tmp_path / "out", "-q")
    assert code != 0 and "truncated" in err and not (tmp_path / "out").exists()
    f.unlink()  # missing
    with pytest.raises(CheckpointError, match="missing"):
        merge(sh, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_merge_refuses_a_damaged_copy_it_does_not_read(tiny_release, cli, tmp_path):
    """The manifest's checksums run beside the copy in one process, yet nothing is published before
    all have passed: a flipped byte in rank 1's copy of a replicated tensor (the merge reads rank 0's,
    so the rebuilt files still match the source) fails the merge, naming the rank file."""
    from inkling_ckpt.layouts.sharded import raw_header

    sh = tmp_path / "sh"
    shard(tiny_release["mxfp8"], sh, 2, 2, progress=False)
    man = json.loads((sh / MANIFEST).read_text())
    name = next(n for n, t in man["tensors"].items() if t["dim"] is None and t["holders"] == [0, 0])  # replicated
    f = next(p for p in sorted((sh / "rank-01").glob("*.safetensors")) if name in raw_header(p).entries)
    h = raw_header(f)
    at = h.data_start + h.entries[name][2]
    data = bytearray(f.read_bytes())
    data[at] ^= 1
    f.write_bytes(bytes(data))
    code, _, err = cli("shard", "--merge", sh, tmp_path / "out", "-q")
    assert code != 0 and "rank-01" in err and "does not match the manifest" in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.parametrize("where", ["rank file", "header copy"])
def test_a_damaged_header_is_reported_as_the_damaged_file_it_is(tiny_release, cli, tmp_path, where):
    """With the checksums beside the copy, a header that no longer parses fails the open or the
    plan first: the merge still names the file whose sha256 does not match, not what it broke."""
    sh = tmp_path / "sh"
    shard(tiny_release["mxfp8"], sh, 2, 2, progress=False)
    f = sorted((sh / "rank-01").glob("*.safetensors"))[0] if where == "rank file" else \
        sorted((sh / "source" / "headers").glob("*.header"))[0]
    data = bytearray(f.read_bytes())
    data[8] ^= 0x20  # the header's opening brace: no longer JSON
    f.write_bytes(bytes(data))
    code, _, err = cli("shard", "--merge", sh, tmp_path / "out", "-q")
    assert code != 0 and f.name in err and "does not match the manifest" in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_background_checks_name_the_first_damaged_file_and_wait_for_all(tmp_path):
    import hashlib

    from inkling_ckpt.layouts.sharded import SumChecks

    files = {}
    for i, size in enumerate((3 << 20, 1, 0, 5 << 20)):  # over and under the read buffer, an empty file
        data = bytes((i * 7 + k) % 251 for k in range(size))
        (tmp_path / f"f{i}").write_bytes(data)
        files[f"f{i}"] = {"bytes": size, "sha256": hashlib.sha256(data).hexdigest()}
    checks = SumChecks(tmp_path, files, workers=2)
    checks.result(progress=True)
    checks.failed()
    checks.close()
    for rel in ("f3", "f1"):  # two damaged: the first by name is reported, after all have run
        files[rel] = {**files[rel], "sha256": "0" * 64}
    checks = SumChecks(tmp_path, files, workers=2)
    with pytest.raises(IntegrityError, match=r"f1: sha256 .* does not match the manifest's 0000"):
        checks.result()
    with pytest.raises(IntegrityError, match="does not match the manifest"):
        checks.failed()
    checks.close()


def test_merge_of_a_non_sharded_folder(tiny_release, cli, tmp_path):
    code, _, err = cli("shard", "--merge", tiny_release["bf16"], tmp_path / "out")
    assert code != 0 and "not a sharded checkpoint" in err


@pytest.mark.parametrize("damage", ["drop_files", "bad_holders", "not_json", "edited_sha", "bad_inner", "inner_holes"])
def test_merge_refuses_a_damaged_manifest(tiny_release, cli, damage, tmp_path):
    sh = tmp_path / "sh"
    shard(tiny_release["bf16"], sh, 4, 2, progress=False)
    path = sh / MANIFEST
    man = json.loads(path.read_text())
    w13 = man["tensors"][f"{L}.0.mlp.experts.w13_weight"]
    if damage == "drop_files":
        del man["files"]
    elif damage == "bad_holders":
        man["tensors"]["model.llm.unembed.weight"]["holders"] = [0, 0, 0, 0]
    elif damage == "edited_sha":
        rel = next(r for r in man["files"] if r.startswith("rank-00/") and r.endswith(".safetensors"))
        man["files"][rel]["sha256"] = "0" * 64
    elif damage == "bad_inner":
        w13["inner"]["dim"] = 0
    elif damage == "inner_holes":
        w13["inner"]["holders"] = [0, 0, 1, 1]
    path.write_text("{" if damage == "not_json" else json.dumps(man))
    code, _, err = cli("shard", "--merge", sh, tmp_path / "out", "-q")
    assert code != 0 and err.count("\n") == 1 and not (tmp_path / "out").exists()
    if damage.startswith(("bad_inner", "inner")):
        assert "inner cut" in err


def test_rerun_is_skipped_and_an_interrupted_run_resumes(tiny_release, tmp_path, monkeypatch):
    import inkling_ckpt.layouts.sharded as sharded

    src = tiny_release["mixed"]
    real = sharded._shard_file
    calls = []

    def flaky(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(sharded, "_shard_file", flaky)
    with pytest.raises(KeyboardInterrupt):
        shard(src, tmp_path / "sh", 2, 2, max_shard_size="50KB", progress=False)
    assert not (tmp_path / "sh").exists() and (tmp_path / ".sh.inkling-partial").is_dir()
    monkeypatch.setattr(sharded, "_shard_file", real)
    res = shard(src, tmp_path / "sh", 2, 2, max_shard_size="50KB", progress=False)
    assert res.resumed and not res.skipped
    assert shard(src, tmp_path / "sh", 2, 2, max_shard_size="50KB", progress=False).skipped
    merge(tmp_path / "sh", tmp_path / "back", progress=False)
    assert _files(tmp_path / "back") == _files(src)


def test_interrupted_merge_resumes(tiny_release, tmp_path, monkeypatch):
    import inkling_ckpt.layouts.sharded as sharded

    src = tiny_release["bf16"]
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


def test_two_ranks_shard_and_merge_the_one_process_bytes(tiny_release, cli, tmp_path):
    """``shard`` and ``shard --merge`` under torchrun: each process writes whole rank folders (and
    hashes some source files) / rebuilds some source files; the folders are the one-process ones
    byte for byte (the manifest included), the merge gives the source back, each process did a share."""
    import subprocess
    import sys

    from conftest import free_port, subprocess_env

    from transformers import Inkling2ForConditionalGeneration

    src = tmp_path / "src"  # several source shard files, so both processes hash and rebuild some
    Inkling2ForConditionalGeneration.from_pretrained(tiny_release["bf16"], dtype=torch.bfloat16).save_pretrained(
        src, max_shard_size="150KB")
    assert len(list(src.glob("model-*.safetensors"))) > 2

    def jobs(out: Path) -> list[list[str]]:
        return [["shard", str(src), str(out / "sh"), "--tp", "2", "--ep", "2", "--max-shard-size", "50KB", "-q"],
                ["shard", "--merge", str(out / "sh"), str(out / "back"), "-q"]]

    for job in jobs(tmp_path / "one"):
        code, out, err = cli(*job, "--workers", "2")
        assert code == 0, err
        assert " MB/s; cpu)" in out and "; 2 ranks;" not in out
    spec = tmp_path / "jobs.json"
    spec.write_text(json.dumps(jobs(tmp_path / "two")))
    r = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--master_port",
                        free_port(), str(Path(__file__).parent / "_ranks_driver.py"), str(spec)],
                       env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    one, two = tmp_path / "one" / "sh", tmp_path / "two" / "sh"
    rels = sorted(str(p.relative_to(one)) for p in one.rglob("*") if p.is_file() and ".cache" not in p.parts)
    assert rels == sorted(str(p.relative_to(two)) for p in two.rglob("*") if p.is_file() and ".cache" not in p.parts)
    assert [rel for rel in rels if (one / rel).read_bytes() != (two / rel).read_bytes()] == []
    assert _files(tmp_path / "two" / "back") == _files(src)
    assert "; 2 ranks;" in r.stdout
    reports = json.loads(r.stdout.split("RESULT ", 1)[1])
    for rep in reports:
        assert rep["ranks"]["count"] == 2 and all(each["bytes_written"] > 0 for each in rep["ranks"]["each"]), rep
    sharded = reports[0]  # each process wrote its own rank folders' pieces: together, every rank's
    assert sum(each["bytes_written"] for each in sharded["ranks"]["each"]) == sharded["bytes"] == sum(sharded["rank_bytes"])


def test_the_hash_lane_keeps_order_bounds_what_it_holds_and_reports_failures():
    """shard hashes its source on one background lane (layouts.lane, which the writers' fsyncs use too): steps run in the order given, the writing
    thread waits once more than ``limit`` bytes of blocks are queued, and a failing step is raised
    at the writing thread (at a later hand-over or at settle), never lost."""
    import threading

    from inkling_ckpt.layouts.lane import Lane

    gate = threading.Event()
    seen: list[int] = []
    lane = Lane("test-hash", hold_limit=100)

    def step(i: int) -> None:
        gate.wait(5)
        seen.append(i)

    try:
        for i in range(3):
            lane.submit(step, i, hold=40)  # 120 > 100 after the third: that hand-over must wait for the first
            if i < 2:  # nothing has run yet: the gate is shut
                assert lane.held == 40 * (i + 1)
            if i == 1:
                gate.set()
        assert lane.held <= 100 and seen[:1] == [0]
        lane.settle()
        assert seen == [0, 1, 2] and lane.held == 0

        def boom() -> None:
            raise CheckpointError("cannot read")

        lane.submit(boom)
        with pytest.raises(CheckpointError, match="cannot read"):
            lane.settle()
    finally:
        gate.set()
        lane.close()


def test_shard_names_for_read_ahead_exactly_the_source_bytes_it_reads(tiny_release, tmp_path, monkeypatch, file_reads):
    """The extents ``shard`` hands the executor's read-ahead cover the source rows it reads, every
    byte and no other (the manifest's hashing reads the files whole on its own)."""
    from conftest import byte_ranges
    from inkling_ckpt.pipeline import executor as executor_mod
    from inkling_ckpt.pipeline.readahead import ReadAhead

    named: list[tuple[str, int, int]] = []

    class Recording(ReadAhead):
        def __init__(self, items, extents, ahead_bytes):
            named.extend(e for u in items for e in extents(u))
            super().__init__(items, extents, ahead_bytes)

    monkeypatch.setattr(executor_mod, "ReadAhead", Recording)
    monkeypatch.setenv("INKLING_CKPT_READ_AHEAD_MB", "256")  # on the CPU too (by default on a GPU only)
    src = tiny_release["mixed"]
    shard(src, tmp_path / "sh", 2, 2, progress=False)
    got = [r for r in file_reads if Path(r[0]).parent == src.resolve()]
    assert named and byte_ranges(named) == byte_ranges(got)
