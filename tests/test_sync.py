"""Weight-sync API (inkling_ckpt.sync): Megatron-named trainer tensors in, release tensors out.

The oracle is the bundled release fixture itself: syncing its own weights, as a trainer holds
them in BF16 (the torch_dist conversion of the fixture, read back), must reproduce every tensor
of ``fixtures/tiny-mixed`` byte for byte with kept scales, whole and per EP slice; with fresh
scales the output must equal ``quantize`` of the BF16 weights.
"""

from __future__ import annotations

import os
import runpy
import sys

import pytest
import torch

from conftest import ROOT, TINY, TINY_PLAN
from inkling_ckpt.errors import CheckpointError, PlanError
from inkling_ckpt.formats.stacked import deinterleave, interleave
from inkling_ckpt.layouts.hf import HFCheckpoint
from inkling_ckpt.model.precision import PrecisionPlan
from inkling_ckpt.sync import WeightSync, digests, expert_param_name, tensor_sha256, trainer_tensors, verify

FC1 = "decoder.layers.{i}.mlp.experts.experts.linear_fc1.weight"
FC2 = "decoder.layers.{i}.mlp.experts.experts.linear_fc2.weight"


@pytest.fixture(scope="module")
def served():
    return HFCheckpoint.open(TINY["mixed"])


@pytest.fixture(scope="module")
def megatron_tensors(served, tmp_path_factory):
    """The mixed fixture converted to torch_dist and read back with its Megatron keys (BF16 experts)."""
    from inkling_ckpt.convert.megatron import hf_to_megatron
    from inkling_ckpt.layouts.megatron import TorchDistCheckpoint

    out = tmp_path_factory.mktemp("sync") / "mg"
    hf_to_megatron(served, out, progress=False)
    reader = TorchDistCheckpoint.open(out)
    return [(k, reader.read(k)) for k in reader.keys if "_extra_state" not in k]


def _emit(sync, pairs, **kw):
    return [nt for b in sync.buckets(pairs, **kw) for nt in b.named_tensors]


def _ep_local(pairs, lo, hi):
    return [(k, t[lo:hi]) for k, t in pairs if ".experts.experts." in k]


def test_keep_reproduces_every_tensor_byte_for_byte(served, megatron_tensors):
    sync = WeightSync.from_checkpoint(served, scales="keep")
    rep = verify(sync.buckets(megatron_tensors), served, expected=sync.expected_names())
    assert rep.ok, rep.summary()
    text = [n for n in served.tensors if not n.startswith("model.visual.")]
    assert sorted(rep.equal) == sorted(text)  # every text tensor of the served checkpoint, nothing else
    assert all(a == b for a, b in rep.sha256.values())
    # NVFP4 and MXFP8 layers both present, every part of them emitted
    assert {served.plan.format_of(i) for i in range(served.cfg.num_hidden_layers)} == {"nvfp4", "mxfp8"}
    assert "model.llm.layers.0.mlp.experts.w13_weight_outer_scale_denominator" in rep.equal
    assert "model.llm.layers.3.mlp.experts.w2_weight_scale" in rep.equal


@pytest.mark.parametrize("ep", [2, 4])
def test_keep_per_ep_slice_matches_the_stored_rows(served, megatron_tensors, ep):
    E = served.cfg.n_routed_experts
    covered: dict[str, list[tuple[int, int]]] = {}
    for rank in range(ep):
        lo, hi = rank * E // ep, (rank + 1) * E // ep
        sync = WeightSync.from_checkpoint(served, scales="keep", select="experts")
        groups = list(sync.groups(_ep_local(megatron_tensors, lo, hi), expert_offset=lo))
        assert len(groups) == served.cfg.num_hidden_layers  # one load group per layer slice
        for g in groups:
            assert g.rows == (lo, hi)
            for n, t in g.tensors:
                if t.dim():
                    assert t.shape[0] == hi - lo
                    covered.setdefault(n, []).append(g.rows)
        rep = verify(groups, served, expected=sync.expected_names())
        assert rep.ok, rep.summary()
        assert all(a == b for a, b in rep.sha256.values())
        # bare pairs with the rank's offset compare the same way
        pairs = [nt for g in groups for nt in g.tensors]
        assert verify(pairs, served, expert_offset=lo).ok
    for n, rows in covered.items():
        assert sorted(rows) == [(r * E // ep, (r + 1) * E // ep) for r in range(ep)], n


def test_fresh_equals_quantize_of_the_bf16_weights(served, megatron_tensors, tmp_path):
    """fresh scales: the sync emits exactly what ``quantize`` writes from the same BF16 weights."""
    from inkling_ckpt.convert.requantize import requantize

    bf16 = tmp_path / "bf16"
    requantize(served, bf16, PrecisionPlan.uniform("bf16", served.cfg.num_hidden_layers), progress=False)
    quantized = tmp_path / "q"
    requantize(HFCheckpoint.open(bf16), quantized, served.plan, scales="fresh", progress=False)
    q = HFCheckpoint.open(quantized)
    sync = WeightSync.from_checkpoint(served, scales="fresh")
    rep = verify(sync.buckets(megatron_tensors), q, expected=sync.expected_names())
    assert rep.ok, rep.summary()
    # and per EP slice
    for lo, hi in ((0, 4), (4, 8)):
        s = WeightSync.from_checkpoint(served, scales="fresh", select="experts")
        assert verify(s.buckets(_ep_local(megatron_tensors, lo, hi), expert_offset=lo), q).ok


def test_fresh_from_the_bf16_fixture_equals_quantize(tmp_path):
    """The BF16 fixture's trainer tensors, synced to the mixed plan with fresh scales (no served
    reference for the scales) = ``quantize --plan`` of that fixture."""
    from inkling_ckpt.convert.requantize import requantize

    src = HFCheckpoint.open(TINY["bf16"])
    plan = PrecisionPlan.parse(TINY_PLAN, src.cfg.num_hidden_layers)
    requantize(src, tmp_path / "q", plan, scales="fresh", progress=False)
    sync = WeightSync.from_checkpoint(src, scales="fresh", plan=plan)
    rep = verify(sync.buckets(trainer_tensors(src)), tmp_path / "q", expected=sync.expected_names())
    assert rep.ok, rep.summary()


def test_keep_with_changed_weights_keeps_amax_and_changes_only_touched_blocks(served, megatron_tensors):
    """A trained step on one expert: kept amax, kept bytes of every untouched block, new bytes where changed."""
    key = FC1.format(i=0)
    pairs = [(k, t.clone() if k == key else t) for k, t in megatron_tensors]
    x = dict(pairs)[key]
    x[2, 0, :16] *= 1.5  # gate row 0 of expert 2: the first NVFP4 block of interleaved row 0
    out = dict(_emit(WeightSync.from_checkpoint(served, scales="keep", select="experts"), pairs))
    w13 = "model.llm.layers.0.mlp.experts.w13_weight"
    assert torch.equal(out[w13 + "_amax"], served.get(w13 + "_amax"))
    old, new = served.get(w13), out[w13]
    diff = (old != new).nonzero()
    assert len(diff) and all((int(e), int(r)) == (2, 0) and int(c) < 8 for e, r, c in diff)  # 16 elements = 8 bytes
    assert torch.equal(out[w13 + "_scale"][torch.arange(8) != 2], served.get(w13 + "_scale")[torch.arange(8) != 2])


def test_w13_is_gate_up_interleaved(served, megatron_tensors):
    """A BF16 layer emits w13 = interleave(gate, up) of Megatron's [gate; up] fc1 rows, exactly."""
    plan = PrecisionPlan.uniform("bf16", served.cfg.num_hidden_layers)
    sync = WeightSync(served.cfg, plan, select="experts")
    fc1 = dict(megatron_tensors)[FC1.format(i=1)]
    out = dict(_emit(sync, [(FC1.format(i=1), fc1), (FC2.format(i=1), dict(megatron_tensors)[FC2.format(i=1)])]))
    w13 = out["model.llm.layers.1.mlp.experts.w13_weight"]
    F = served.cfg.moe_intermediate_size
    assert torch.equal(w13, interleave(fc1[:, :F], fc1[:, F:]))
    gate, up = deinterleave(w13)
    assert torch.equal(gate, fc1[:, :F]) and torch.equal(up, fc1[:, F:])
    assert sorted(out) == ["model.llm.layers.1.mlp.experts.w13_weight", "model.llm.layers.1.mlp.experts.w2_weight"]


@pytest.mark.parametrize("form", ["grouped", "sequential"])
@pytest.mark.parametrize("count", [True, False])
def test_per_expert_trainer_names(served, megatron_tensors, form, count):
    """TEGroupedMLP ``linear_fc1.weight{e}`` / SequentialMLP ``local_experts.{e}.linear_fc1.weight``, local
    indices plus the EP offset, give the same load groups as the stacked form."""
    E = served.cfg.n_routed_experts
    lo, hi = 4, 8
    pairs = list(trainer_tensors(served, experts=(lo, hi), form=form, select="experts"))
    assert pairs[0][0] == expert_param_name(FC1.format(i=0), form, 0)
    assert pairs[0][0] == {"grouped": "decoder.layers.0.mlp.experts.linear_fc1.weight0",
                           "sequential": "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"}[form]
    sync = WeightSync.from_checkpoint(served, scales="keep", select="experts")
    groups = list(sync.groups([("module." + k, t) for k, t in pairs], expert_offset=lo,
                              local_experts=(hi - lo) if count else None))
    stacked = list(sync.groups(_ep_local(megatron_tensors, lo, hi), expert_offset=lo))
    assert [g.rows for g in groups] == [(lo, hi)] * served.cfg.num_hidden_layers
    assert [[(n, tensor_sha256(t)) for n, t in g.tensors] for g in groups] == \
        [[(n, tensor_sha256(t)) for n, t in g.tensors] for g in stacked]
    assert verify(groups, served).ok
    assert E == 8


def test_selection_partitions_the_output(served, megatron_tensors):
    names = {s: [n for n, _ in _emit(WeightSync.from_checkpoint(served, select=s), megatron_tensors)]
             for s in ("all", "experts", "non-experts")}
    assert sorted(names["experts"] + names["non-experts"]) == sorted(names["all"])
    assert all(".mlp.experts." in n for n in names["experts"])
    assert not any(".mlp.experts." in n for n in names["non-experts"])
    for s, got in names.items():
        assert sorted(got) == sorted(WeightSync.from_checkpoint(served, select=s).expected_names())


@pytest.mark.parametrize("budget", [1, 40_000, 300_000, 512 << 20])
def test_buckets_respect_budget_and_never_split_groups(served, megatron_tensors, budget):
    sync = WeightSync.from_checkpoint(served, scales="keep", bucket_bytes=budget)
    buckets = list(sync.buckets(megatron_tensors))
    where: dict[str, int] = {}
    for i, b in enumerate(buckets):
        assert b.nbytes <= budget or len(b.groups) == 1
        assert b.nbytes == sum(t.numel() * t.element_size() for _, t in b)
        for n, _ in b:
            where[n] = i
    # a layer's w13 and w2, every part (scales, amax, denominator), travel together
    for layer in range(served.cfg.num_hidden_layers):
        pre = f"model.llm.layers.{layer}.mlp.experts."
        parts = [n for n in where if n.startswith(pre)]
        assert len(parts) == (8 if served.plan.format_of(layer) == "nvfp4" else 4)
        assert len({where[n] for n in parts}) == 1
    if budget == 512 << 20:
        assert len(buckets) == 1


def test_input_forms(served, megatron_tensors):
    sync = WeightSync.from_checkpoint(served, scales="keep")
    plain = dict(_emit(sync, megatron_tensors))
    wrapped = dict(_emit(sync, [("module.module." + k, t) for k, t in megatron_tensors]))
    assert plain.keys() == wrapped.keys()
    rev = dict(_emit(sync, list(reversed(megatron_tensors))))  # fc2 before fc1, layers backwards
    assert rev.keys() == plain.keys()
    assert all(torch.equal(rev[n].view(torch.uint8), plain[n].view(torch.uint8)) for n in plain if plain[n].dim())
    # a Megatron-padded vocabulary: rows past the release's are dropped
    emb = dict(megatron_tensors)["embedding.word_embeddings.weight"]
    padded = torch.cat([emb, torch.ones(16, emb.shape[1], dtype=emb.dtype)])
    got = dict(_emit(WeightSync.from_checkpoint(served, select="non-experts"), [("embedding.word_embeddings.weight", padded)]))
    assert torch.equal(got["model.llm.embed.weight"], served.get("model.llm.embed.weight"))


def test_errors(served, megatron_tensors):
    with pytest.raises(PlanError):
        WeightSync(served.cfg, served.plan, scales="keep")  # keep needs a reference
    with pytest.raises(PlanError):
        WeightSync.from_checkpoint(served, select="attention")
    with pytest.raises(PlanError):
        WeightSync.from_checkpoint(HFCheckpoint.open(TINY["mxfp8"]), scales="keep", plan=TINY_PLAN)  # no NVFP4 amax to keep
    sync = WeightSync.from_checkpoint(served)
    with pytest.raises(CheckpointError, match="not a Megatron parameter"):
        list(sync.groups([("decoder.layers.0.nonsense.weight", torch.zeros(2))]))
    d = dict(megatron_tensors)
    with pytest.raises(CheckpointError, match="only one of"):
        list(sync.groups([(FC1.format(i=0), d[FC1.format(i=0)])]))
    with pytest.raises(CheckpointError, match="outside"):
        list(sync.groups([(FC1.format(i=0), d[FC1.format(i=0)]), (FC2.format(i=0), d[FC2.format(i=0)])], expert_offset=5))
    with pytest.raises(CheckpointError, match="holds 8 experts but linear_fc2 4"):
        list(sync.groups([(FC1.format(i=0), d[FC1.format(i=0)]), (FC2.format(i=0), d[FC2.format(i=0)][:4])]))
    with pytest.raises(CheckpointError, match="no silent casts"):
        list(sync.groups([("decoder.final_layernorm.weight", d["decoder.final_layernorm.weight"].float())]))
    per = list(trainer_tensors(served, form="grouped", select="experts"))
    with pytest.raises(CheckpointError, match="expected 4 local experts"):
        list(sync.groups(per[:16], local_experts=4))
    with pytest.raises(CheckpointError, match="not 0..6"):
        list(sync.groups([nt for nt in per[:16] if not nt[0].endswith("weight3")]))
    with pytest.raises(CheckpointError, match="both stacked and one per tensor"):
        list(sync.groups([per[0], (FC2.format(i=0), d[FC2.format(i=0)])]))


def test_nonfinite_input_names_the_expert(served, megatron_tensors):
    from inkling_ckpt.errors import NonFiniteError

    pairs = [(k, t.clone()) for k, t in megatron_tensors if ".layers.0.mlp.experts." in k]
    dict(pairs)[FC1.format(i=0)][3, 5, 7] = float("nan")
    with pytest.raises(NonFiniteError, match=r"layers\.0\.mlp\.experts\.w13_weight\[expert 3\]"):
        _emit(WeightSync.from_checkpoint(served, scales="fresh"), pairs)
    got = dict(_emit(WeightSync.from_checkpoint(served, scales="fresh", allow_nonfinite=True), pairs))
    amax = got["model.llm.layers.0.mlp.experts.w13_weight_amax"]
    assert bool(torch.isfinite(amax).all())  # the finite values' amax


def test_verify_reports_differences(served, megatron_tensors):
    sync = WeightSync.from_checkpoint(served, scales="keep")
    pairs = _emit(sync, megatron_tensors)
    name, t = pairs[0]
    changed = t.clone()
    changed.view(-1)[0] += 1
    rep = verify([(name, changed)] + pairs[1:-1] + [("model.nope.weight", t)], served, expected=sync.expected_names())
    assert not rep.ok
    assert list(rep.differ) == [name] and rep.missing == [pairs[-1][0]] and rep.unexpected == ["model.nope.weight"]
    d = digests(pairs[:3])
    assert d[pairs[0][0]] == tensor_sha256(served.get(pairs[0][0]))
    # a slice compared at the wrong rows differs; the same slice twice is a duplicate
    groups = list(WeightSync.from_checkpoint(served, select="experts").groups(_ep_local(megatron_tensors, 0, 4)))
    w13 = [(n, t) for n, t in groups[2].tensors if n.endswith("w13_weight")]
    assert not verify(w13, served, expert_offset=4).ok
    rep = verify(w13 + w13, served, expert_offset=0)
    assert rep.duplicated == ["model.llm.layers.2.mlp.experts.w13_weight[0:4]"] and rep.equal
    assert digests(groups[2:3])["model.llm.layers.2.mlp.experts.w13_weight[0:4]"] == \
        tensor_sha256(served.read_rows("model.llm.layers.2.mlp.experts.w13_weight", 0, 4))


def test_example_runs(capsys):
    for argv in (["--ep", "2", "--bucket-mib", "0.1"], ["--ep", "4", "--form", "grouped"]):
        old = sys.argv
        sys.argv = ["weight_sync.py", *argv]
        try:
            with pytest.raises(SystemExit) as e:
                runpy.run_path(str(ROOT / "examples" / "weight_sync.py"), run_name="__main__")
        finally:
            sys.argv = old
        assert e.value.code == 0
        out = capsys.readouterr().out
        assert "0 differ, 0 missing, 0 unexpected" in out and "rank 1 (experts" in out


# -- the batched GPU path equals the reference path ---------------------------------------------

_INTERP = os.environ.get("INKLING_CKPT_GPU_CODECS", "").lower() == "interpret"


def _needs_gpu():
    if not (torch.cuda.is_available() or _INTERP):
        pytest.skip("needs a CUDA device (or Triton's interpreter)")
    pytest.importorskip("triton", reason="Triton is not installed (it comes with CUDA builds of torch)")
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["keep", "fresh"])
@pytest.mark.parametrize("rows", [(0, 8), (2, 6)])
def test_gpu_layer_batches_match_reference(served, megatron_tensors, scales, rows):
    dev = _needs_gpu()
    from inkling_ckpt.formats import gpu
    import inkling_ckpt.sync._batched as B

    lo, hi = rows
    pairs = megatron_tensors if rows == (0, 8) else _ep_local(megatron_tensors, lo, hi)
    with gpu.kernels_disabled():
        ref = dict(_emit(WeightSync.from_checkpoint(served, scales=scales, use_kernels=False), pairs, expert_offset=lo))
    calls = []
    orig = B.encode_stack
    B.encode_stack = lambda *a, **k: calls.append(1) or orig(*a, **k)
    try:
        got = dict(_emit(WeightSync.from_checkpoint(served, scales=scales), [(k, t.to(dev)) for k, t in pairs],
                         expert_offset=lo))
    finally:
        B.encode_stack = orig
    assert len(calls) == 2 * served.cfg.num_hidden_layers  # w13 and w2 of every layer through the kernels
    assert got.keys() == ref.keys()
    for n in ref:
        assert got[n].device.type == dev
        assert tensor_sha256(got[n]) == tensor_sha256(ref[n]), n
    if scales == "keep":
        assert verify(got.items(), served, expert_offset=lo).ok


@pytest.mark.gpu
def test_gpu_nonfinite_falls_back_and_raises(served, megatron_tensors):
    dev = _needs_gpu()
    from inkling_ckpt.errors import NonFiniteError

    pairs = [(k, t.clone().to(dev)) for k, t in megatron_tensors if ".layers.0.mlp.experts." in k]
    dict(pairs)[FC1.format(i=0)][3, 5, 7] = float("nan")
    with pytest.raises(NonFiniteError, match=r"w13_weight\[expert 3\]"):
        _emit(WeightSync.from_checkpoint(served, scales="fresh"), pairs)
    got = dict(_emit(WeightSync.from_checkpoint(served, scales="fresh", allow_nonfinite=True), pairs))
    ref = dict(_emit(WeightSync.from_checkpoint(served, scales="fresh", allow_nonfinite=True, use_kernels=False),
                     [(k, t.cpu()) for k, t in pairs]))
    assert all(tensor_sha256(got[n]) == tensor_sha256(ref[n]) for n in ref)
