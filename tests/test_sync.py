"""Weight-sync API (inkling_ckpt.sync): Megatron-named tensors in, served HF tensors out."""

from __future__ import annotations

import os
import runpy
import sys

import pytest
import torch

from conftest import ROOT, TINY
from inkling_ckpt.errors import CheckpointError, PlanError
from inkling_ckpt.layouts.hf import HFCheckpoint
from inkling_ckpt.sync import WeightSync, digests, tensor_sha256, verify


@pytest.fixture(scope="module")
def megatron_tensors(tmp_path_factory):
    """The mixed fixture converted to torch_dist, read back with its Megatron names (the acceptance path)."""
    from inkling_ckpt.convert.megatron import hf_to_megatron
    from inkling_ckpt.layouts.megatron import TorchDistCheckpoint

    out = tmp_path_factory.mktemp("sync") / "mg"
    hf_to_megatron(HFCheckpoint.open(TINY["mixed"]), out, progress=False)
    reader = TorchDistCheckpoint.open(out)
    return [(k, reader.read(k)) for k in reader.keys if not k.endswith("_extra_state") and "_extra_state" not in k]


@pytest.fixture(scope="module")
def served():
    return HFCheckpoint.open(TINY["mixed"])


def _emit(sync, pairs, **kw):
    return [nt for b in sync.buckets(pairs, **kw) for nt in b.named_tensors]


def test_keep_reproduces_every_tensor_byte_for_byte(served, megatron_tensors):
    sync = WeightSync.from_checkpoint(served, scales="keep")
    rep = verify(sync.buckets(megatron_tensors), served, expected=sync.expected_names())
    assert rep.ok, rep.summary()
    text = [n for n in served.tensors if not n.startswith("model.visual.")]
    assert sorted(rep.equal) == sorted(text)  # every text tensor of the served checkpoint, nothing else
    assert all(a == b for a, b in rep.sha256.values())


def test_fresh_differs_only_in_known_corner_cases(served, megatron_tensors):
    """fresh on unchanged weights: the same values, and the same bytes except two corner cases.

    * NVFP4: an element that rounded to -0 (nibble 0x8) decodes to -0.0 and re-encodes as
      +0 (0x0): the reference takes the sign from ``x < 0``.
    * MXFP8: a block whose largest element rounded down to 224·2^s re-encodes one scale lower
      (elements doubled): same values, other bytes.
    Global scales (NVFP4 weight_scale_2) come out identical on this fixture; non-expert
    tensors are untouched.
    """
    from inkling_ckpt.formats import get_format

    sync = WeightSync.from_checkpoint(served, scales="fresh")
    emitted = dict(_emit(sync, megatron_tensors))
    rep = verify(emitted.items(), served, expected=sync.expected_names())
    assert not rep.missing and not rep.unexpected
    assert rep.differ, "expected the documented corner cases on this fixture"
    assert all(".mlp.experts." in n for n in rep.differ)
    assert not [n for n in rep.differ if n.endswith(("weight_scale_2", "input_scale"))]
    modules = {n.rsplit(".", 1)[0] for n in rep.differ}
    for m in modules:
        layer = int(m.split(".layers.")[1].split(".")[0])
        fmt = get_format(served.plan.format_of(layer))
        names = list(fmt.parts((1, fmt.block)))
        a = fmt.decode({p: served.get(f"{m}.{p}") for p in names}, torch.float32)
        b = fmt.decode({p: emitted[f"{m}.{p}"] for p in names}, torch.float32)
        assert torch.equal(a, b), m  # == : -0.0 equals 0.0
        if fmt.name == "nvfp4":
            w0, w1 = served.get(f"{m}.weight"), emitted[f"{m}.weight"]
            n0 = torch.stack((w0 & 0xF, w0 >> 4), -1)
            n1 = torch.stack((w1 & 0xF, w1 >> 4), -1)
            assert ((n0 == n1) | ((n0 == 8) & (n1 == 0))).all(), m  # only -0 -> +0 nibbles
    print(f"fresh: {len(rep.equal)} equal, {len(rep.differ)} differ in bytes, 0 in values")


def test_ep_ranks_with_offsets_give_the_same_tensors(served, megatron_tensors):
    full = dict(_emit(WeightSync.from_checkpoint(served, scales="keep"), megatron_tensors))
    E = served.cfg.n_routed_experts
    got = {}
    for rank in range(4):
        lo, hi = rank * E // 4, (rank + 1) * E // 4
        local = [(k, t[lo:hi] if ".experts.experts." in k else t) for k, t in megatron_tensors]
        sync = WeightSync.from_checkpoint(served, scales="keep", select="experts" if rank else "all")
        for n, t in _emit(sync, local, expert_offset=lo):
            assert n not in got
            if ".mlp.experts." in n:
                assert lo <= int(n.split(".experts.")[1].split(".")[0]) < hi
            got[n] = t
    assert got.keys() == full.keys()
    assert all(torch.equal(got[n].view(torch.uint8) if got[n].dim() else got[n], full[n].view(torch.uint8) if full[n].dim() else full[n]) for n in got)


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
    where = {}
    buckets = list(sync.buckets(megatron_tensors))
    for i, b in enumerate(buckets):
        assert b.nbytes <= budget or len(b.groups) == 1
        for n, _ in b:
            where[n] = i
    # an expert's gate/up/down and all their scales travel together; so do q/k/v of a layer
    for layer in range(served.cfg.num_hidden_layers):
        for e in range(served.cfg.n_routed_experts):
            pre = f"model.language_model.layers.{layer}.mlp.experts.{e}."
            assert len({i for n, i in where.items() if n.startswith(pre)}) == 1
        pre = f"model.language_model.layers.{layer}.self_attn."
        assert len({where[pre + p + ".weight"] for p in ("q_proj", "k_proj", "v_proj")}) == 1
    if budget == 512 << 20:
        assert len(buckets) == 1


def test_input_forms(served, megatron_tensors):
    sync = WeightSync.from_checkpoint(served, scales="keep")
    plain = dict(_emit(sync, megatron_tensors))
    wrapped = dict(_emit(sync, [("module.module." + k, t) for k, t in megatron_tensors]))
    assert plain.keys() == wrapped.keys()
    # fc2 before fc1, layers interleaved: still fine
    rev = dict(_emit(sync, list(reversed(megatron_tensors))))
    assert rev.keys() == plain.keys()


def test_errors(served, megatron_tensors):
    with pytest.raises(PlanError):
        WeightSync(served.cfg, served.plan, scales="keep")  # keep needs a reference
    with pytest.raises(PlanError):
        WeightSync.from_checkpoint(served, select="attention")
    sync = WeightSync.from_checkpoint(served)
    with pytest.raises(CheckpointError, match="not a Megatron parameter"):
        list(sync.groups([("decoder.layers.0.nonsense.weight", torch.zeros(2))]))
    fc1 = [(k, t) for k, t in megatron_tensors if k.endswith("linear_fc1.weight") and ".experts.experts." in k][:1]
    with pytest.raises(CheckpointError, match="only one of"):
        list(sync.groups(fc1))
    with pytest.raises(CheckpointError, match="outside"):
        list(sync.groups([(k, t) for k, t in megatron_tensors if ".layers.0.mlp.experts.experts." in k], expert_offset=5))
    bad = [(k, t.float()) for k, t in megatron_tensors if k.endswith("final_layernorm.weight")][:1]
    with pytest.raises(CheckpointError):
        list(sync.groups(bad))


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


def test_example_runs(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["weight_sync.py", "--ep", "2", "--bucket-mib", "0.1"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(ROOT / "examples" / "weight_sync.py"), run_name="__main__")
    assert e.value.code == 0
    assert "0 differ, 0 missing, 0 unexpected" in capsys.readouterr().out


# -- the batched GPU path equals the per-expert path -------------------------------------------

_INTERP = os.environ.get("INKLING_CKPT_GPU_CODECS", "").lower() == "interpret"


@pytest.mark.gpu
@pytest.mark.parametrize("scales", ["keep", "fresh"])
def test_gpu_layer_batches_match_per_expert(served, megatron_tensors, scales):
    if not (torch.cuda.is_available() or _INTERP):
        pytest.skip("needs a CUDA device (or Triton's interpreter)")
    pytest.importorskip("triton", reason="Triton is not installed (it comes with CUDA builds of torch)")
    from inkling_ckpt.formats import gpu

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    on_dev = [(k, t.to(dev)) for k, t in megatron_tensors]
    batched = WeightSync.from_checkpoint(served, scales=scales)
    with gpu.kernels_disabled():
        ref = dict(_emit(WeightSync.from_checkpoint(served, scales=scales, use_kernels=False), megatron_tensors))
    calls = []
    import inkling_ckpt.sync._batched as B
    orig = B.encode_layer
    B.encode_layer = lambda *a, **k: calls.append(1) or orig(*a, **k)
    try:
        got = dict(_emit(batched, on_dev))
    finally:
        B.encode_layer = orig
    assert len(calls) == served.cfg.num_hidden_layers
    assert got.keys() == ref.keys()
    for n in ref:
        assert got[n].device.type == dev
        assert tensor_sha256(got[n]) == tensor_sha256(ref[n]), n
    if scales == "keep":
        assert verify(got.items(), served, expected=batched.expected_names()).ok


@pytest.mark.gpu
def test_gpu_nonfinite_falls_back_and_raises(served, megatron_tensors):
    if not (torch.cuda.is_available() or _INTERP):
        pytest.skip("needs a CUDA device (or Triton's interpreter)")
    pytest.importorskip("triton", reason="Triton is not installed (it comes with CUDA builds of torch)")
    from inkling_ckpt.errors import NonFiniteError

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    key = "decoder.layers.0.mlp.experts.experts.linear_fc1.weight"
    pairs = [(k, t.clone().to(dev)) for k, t in megatron_tensors if ".layers.0.mlp.experts." in k]
    dict(pairs)[key][3, 5, 7] = float("nan")
    with pytest.raises(NonFiniteError, match="experts.3.gate_proj"):
        _emit(WeightSync.from_checkpoint(served, scales="fresh"), pairs)
    got = dict(_emit(WeightSync.from_checkpoint(served, scales="fresh", allow_nonfinite=True), pairs))
    ref = dict(_emit(WeightSync.from_checkpoint(served, scales="fresh", allow_nonfinite=True, use_kernels=False),
                     [(k, t.cpu()) for k, t in pairs]))
    assert all(tensor_sha256(got[n]) == tensor_sha256(ref[n]) for n in ref)
