"""LoRA adapters (spec/lora.md): export schema, sync check, merge — with transformers and peft as oracles.

Oracles (test-only): transformers 5.24 builds and saves the tiny Inkling 2 release checkpoint and
runs the forward pass; peft reads the written adapter_config.json. Quantized bases are made here
with the toolkit's per-tensor codecs in the release layout of spec/inkling2.md.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from inkling_ckpt.convert.experts import largest_piece
from inkling_ckpt.errors import AdapterError, CheckpointError, IntegrityError, OutputError
from inkling_ckpt.formats import get_format
from inkling_ckpt.formats.stacked import decode_stacked, format_of_parts
from inkling_ckpt.lora import (Adapter, LoraExport, ModelDims, build_manifest, check_manifest, export_adapter,
                               inspect_adapter, merge, verify_manifest)

transformers = pytest.importorskip("transformers", reason="transformers (test-only oracle) is not installed")

TEXT = dict(vocab_size=256, unpadded_vocab_size=250, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, swa_num_attention_heads=2, swa_num_key_value_heads=1, swa_head_dim=16,
            sliding_window_size=8, rel_extent=8, d_rel=4, moe_intermediate_size=32, n_routed_experts=4,
            num_experts_per_tok=2, max_position_embeddings=128)
VISION = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=4, posemb_grid_size=4,
              projection_hidden_dim=32, text_hidden_size=64)
R, ALPHA = 4, 8  # scaling 2.0
MIXED = {0: "nvfp4", 1: "nvfp4", 2: "nvfp4", 3: "mxfp8", 4: "mxfp8", 5: "mxfp8"}
P = "model.llm.layers.{i}.mlp.experts."


# ---- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(scope="module")
def base_bf16(work) -> Path:
    """A tiny release checkpoint written by transformers itself (BF16 everywhere)."""
    from transformers import Inkling2Config, Inkling2ForConditionalGeneration

    torch.manual_seed(0)
    model = Inkling2ForConditionalGeneration(Inkling2Config(text_config=TEXT, vision_config=VISION))
    with torch.no_grad():  # trained-looking, non-degenerate weights
        for p in model.parameters():
            p.normal_(0, 0.05)
    model.to(torch.bfloat16).save_pretrained(work / "base-raw")
    # what transformers itself writes back after loading (it keeps router, convolutions and
    # residual queries in float32): a fixpoint, so a hand-merged save compares tensor for tensor
    out = work / "base-bf16"
    Inkling2ForConditionalGeneration.from_pretrained(work / "base-raw", dtype=torch.bfloat16).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def dims(base_bf16) -> ModelDims:
    return ModelDims.from_config(json.loads((base_bf16 / "config.json").read_text()))


def quantize_release(src: Path, dst: Path, plan: dict[int, str]) -> Path:
    """The release layout of quantized experts (spec/inkling2.md), made with the per-tensor codecs."""
    dst.mkdir()
    out = {}
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        for name in f.keys():
            out[name] = f.get_tensor(name)
    for i, fmt in plan.items():
        for proj in ("w13_weight", "w2_weight"):
            n = P.format(i=i) + proj
            w = out.pop(n)
            if fmt == "nvfp4":
                amax = w.float().abs().amax(dim=(1, 2))
                den = torch.tensor(2688.0)
                parts = [get_format("nvfp4").encode(w[e], weight_scale_2=amax[e] / den) for e in range(w.shape[0])]
                out[n] = torch.stack([p["weight"] for p in parts])
                out[n + "_scale"] = torch.stack([p["weight_scale"] for p in parts])
                out[n + "_amax"] = amax
                out[n + "_outer_scale_denominator"] = den
            else:
                parts = get_format(fmt).encode(w)
                out[n], out[n + "_scale"] = parts["weight"], parts["weight_scale"]
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for p in src.iterdir():
        if p.name != "model.safetensors":
            shutil.copyfile(p, dst / p.name)
    return dst


@pytest.fixture(scope="module")
def base_mixed(work, base_bf16) -> Path:
    return quantize_release(base_bf16, work / "base-mixed", MIXED)


@pytest.fixture(scope="module")
def ad_random(work, dims) -> Path:
    """A random adapter folder, names with PEFT's ``base_model.model.`` prefix (accepted on read)."""
    eng = engine(dims, trainer_adapter(dims, seed=5))
    return write_adapter_dir(work / "ad-random", {"base_model.model." + n: t for n, t in eng.items()})


@pytest.fixture(scope="module")
def ad_zero(work, dims) -> Path:
    """An adapter whose B factors are all zero (the trainer's initial state)."""
    return write_adapter_dir(work / "ad-zero", engine(dims, trainer_adapter(dims, zero_b=True)))


@pytest.fixture(scope="module")
def merged_bf16(work, base_bf16, ad_random) -> Path:
    out = work / "merged-bf16"
    merge(base_bf16, ad_random, out, progress=False)
    return out


@pytest.fixture(scope="module")
def dump(work, dims) -> Path:
    p = work / "trainer-dump.safetensors"
    save_file(trainer_adapter(dims, seed=3), str(p), metadata={"lora_alpha": str(ALPHA)})
    return p


def trainer_adapter(dims: ModelDims, *, seed: int = 1, zero_b: bool = False, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """Megatron-Bridge-named LoRA factors of every target (whole tensors; unembed B padded to V rows)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    def zb(*shape):
        return torch.zeros(*shape, dtype=torch.bfloat16) if zero_b else rnd(*shape)

    out = {}
    for i in range(dims.num_layers):
        d = dims.dims(i)
        L = f"decoder.layers.{i}."
        for key, rows in (("q", "q_out"), ("k", "kv_out"), ("v", "kv_out"), ("r", "r_out")):
            out[L + f"self_attention.linear_qkv.adapter.adapter_{key}.linear_in.weight"] = rnd(R, d["H"])
            out[L + f"self_attention.linear_qkv.adapter.adapter_{key}.linear_out.weight"] = zb(d[rows], R)
        out[L + "self_attention.linear_proj.adapter.linear_in.weight"] = rnd(R, d["o_in"])
        out[L + "self_attention.linear_proj.adapter.linear_out.weight"] = zb(d["H"], R)
        out[L + "self_attention.linear_gate.adapter.linear_in.weight"] = rnd(R, d["H"])
        out[L + "self_attention.linear_gate.adapter.linear_out.weight"] = zb(d["q_out"], R)
        out[L + "mlp.experts.linear_fc1.adapter.linear_in.weight"] = rnd(R, d["H"])
        out[L + "mlp.experts.linear_fc1.adapter.linear_out.weight"] = zb(d["E"], 2 * d["F"], R)
        out[L + "mlp.experts.linear_fc2.adapter.linear_in.weight"] = rnd(d["E"], R, d["F"])
        out[L + "mlp.experts.linear_fc2.adapter.linear_out.weight"] = zb(d["H"], R)
    d = dims.dims(None)
    out["output_layer.adapter.linear_in.weight"] = rnd(R, d["H"])
    out["output_layer.adapter.linear_out.weight"] = zb(d["V"], R)
    return out


def engine(dims: ModelDims, tr: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    conv = LoraExport(alpha=ALPHA, dims=dims)
    return {n: t for g in conv.groups(tr.items()) for n, t in g.tensors}


def write_adapter_dir(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": R, "lora_alpha": ALPHA, "target_modules": "all-linear", "lora_dropout": 0.0,
           "bias": "none", "task_type": "CAUSAL_LM"}
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return path


def stored_parts(tensors: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """A stacked expert weight's stored parts (suffix -> tensor) from a checkpoint's tensors."""
    return {n[len(name):]: t for n, t in tensors.items() if n == name or n.startswith(name + "_")}


def read_all(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {n: f.get_tensor(n) for n in f.keys()}


# ---- export: names and shapes of the spec's table ------------------------------------------


def test_export_names_and_shapes_follow_the_spec(dims):
    tr = trainer_adapter(dims)
    eng = engine(dims, tr)
    d0 = dims.dims(0)
    E, F, H = d0["E"], d0["F"], d0["H"]
    expected = {}
    for i in range(dims.num_layers):
        d = dims.dims(i)
        p = f"language_model.layers.{i}."
        for mod, out, inp in (("attn.wq_du", "q_out", "H"), ("attn.wk_dv", "kv_out", "H"), ("attn.wv_dv", "kv_out", "H"),
                              ("attn.wr_du", "r_out", "H"), ("attn.wo_ud", "H", "o_in"), ("attn.gate_attn", "q_out", "H")):
            expected[p + mod + ".lora_A.weight"] = (R, d[inp])
            expected[p + mod + ".lora_B.weight"] = (d[out], R)
        expected[p + "mlp.experts.w1.lora_A.weight"] = (1, R, H)
        expected[p + "mlp.experts.w3.lora_A.weight"] = (1, R, H)
        expected[p + "mlp.experts.w1.lora_B.weight"] = (E, F, R)
        expected[p + "mlp.experts.w3.lora_B.weight"] = (E, F, R)
        expected[p + "mlp.experts.w2.lora_A.weight"] = (E, R, F)
        expected[p + "mlp.experts.w2.lora_B.weight"] = (1, H, R)
    expected["language_model.lm_head.lora_A.weight"] = (R, H)
    expected["language_model.lm_head.lora_B.weight"] = (TEXT["unpadded_vocab_size"], R)
    assert {n: tuple(t.shape) for n, t in eng.items()} == expected
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in eng.values())
    # sliding and full layers have different head counts: the table resolves both
    assert dims.dims(0)["q_out"] != dims.dims(5)["q_out"]
    # values: shared A once per projection, fc1 rows split gate-then-up (never interleaved)
    L, p = "decoder.layers.2.mlp.experts.", "language_model.layers.2.mlp.experts."
    a, b1 = tr[L + "linear_fc1.adapter.linear_in.weight"], tr[L + "linear_fc1.adapter.linear_out.weight"]
    assert torch.equal(eng[p + "w1.lora_A.weight"][0], a) and torch.equal(eng[p + "w3.lora_A.weight"][0], a)
    assert torch.equal(eng[p + "w1.lora_B.weight"], b1[:, :F]) and torch.equal(eng[p + "w3.lora_B.weight"], b1[:, F:])
    assert torch.equal(eng[p + "w2.lora_A.weight"], tr[L + "linear_fc2.adapter.linear_in.weight"])
    assert torch.equal(eng[p + "w2.lora_B.weight"][0], tr[L + "linear_fc2.adapter.linear_out.weight"])
    assert torch.equal(eng["language_model.lm_head.lora_B.weight"], tr["output_layer.adapter.linear_out.weight"][:250])


def test_ep_slices_assemble_to_the_whole_export(dims):
    tr = trainer_adapter(dims)
    whole = engine(dims, tr)
    conv = LoraExport(alpha=ALPHA, dims=dims)
    items = []
    for rank, (lo, hi) in enumerate(((0, 2), (2, 4))):  # EP2: each rank holds 2 experts + a copy of the shared factors
        for n, t in tr.items():
            per_expert = n.endswith("linear_fc1.adapter.linear_out.weight") or n.endswith("linear_fc2.adapter.linear_in.weight")
            if per_expert:
                items.append((n, t[lo:hi], lo))
            elif "mlp.experts" in n or rank == 0:
                items.append((n, t))
    got = {n: t for g in conv.groups(items) for n, t in g.tensors}
    assert got.keys() == whole.keys()
    assert all(torch.equal(got[n], whole[n]) for n in whole)


def test_buckets_respect_the_budget_and_never_split_a_module(dims):
    tr = trainer_adapter(dims)
    conv = LoraExport(alpha=ALPHA, dims=dims, bucket_bytes=4000)
    buckets = list(conv.buckets(tr.items()))
    assert len(buckets) > 3
    for b in buckets:
        assert b.nbytes <= 4000 or len(b.groups) == 1
        for g in b.groups:  # a group is one module: both halves of every pair
            sides = {n.rsplit(".", 2)[-2] for n, _ in g.tensors}
            assert sides == {"lora_A", "lora_B"}
    assert sum(len(b) for b in buckets) == len(engine(dims, tr))


@pytest.mark.parametrize("case, needle", [
    ("rank", "decoder.layers.1.self_attention.linear_proj.adapter.linear_out.weight: rank 3 differs from its A factor "
             "decoder.layers.1.self_attention.linear_proj.adapter.linear_in.weight (rank 4)"),
    ("rank_global", "decoder.layers.2.self_attention.linear_gate.adapter.linear_in.weight: rank 3, but the adapter's rank is 4"),
    ("missing", "decoder.layers.0.self_attention.linear_gate.adapter.linear_in.weight: its other half"),
    ("sink", "decoder.layers.0.self_attention.sink_proj.adapter.linear_in.weight: the attention sink projection gets no adapter"),
    ("shared_axis", "decoder.layers.0.mlp.experts.linear_fc1.adapter.linear_in.weight: shared factor differs across experts"),
    ("shared_slices", "decoder.layers.3.mlp.experts.linear_fc2.adapter.linear_out.weight: shared factor differs across expert slices"),
    ("unknown", "decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight: a LoRA factor on a module the schema does not know"),
    ("shape", "decoder.layers.0.self_attention.linear_qkv.adapter.adapter_k.linear_out.weight: shape [15, 4]"),
    ("dtype", "decoder.layers.0.self_attention.linear_proj.adapter.linear_in.weight: dtype torch.float32"),
])
def test_export_errors_name_the_tensor(dims, case, needle):
    tr = trainer_adapter(dims)
    items = list(tr.items())
    if case == "rank":
        items = [(n, t[:, :3] if n.endswith("1.self_attention.linear_proj.adapter.linear_out.weight") else t) for n, t in items]
    elif case == "rank_global":  # A and B agree with each other, not with the rest of the adapter
        items = [(n, t[:3] if n.endswith("2.self_attention.linear_gate.adapter.linear_in.weight") else
                  t[:, :3] if n.endswith("2.self_attention.linear_gate.adapter.linear_out.weight") else t) for n, t in items]
    elif case == "missing":
        items = [(n, t) for n, t in items if n != "decoder.layers.0.self_attention.linear_gate.adapter.linear_out.weight"]
    elif case == "sink":
        items.insert(3, ("decoder.layers.0.self_attention.sink_proj.adapter.linear_in.weight", torch.zeros(R, 64, dtype=torch.bfloat16)))
    elif case == "shared_axis":
        n = "decoder.layers.0.mlp.experts.linear_fc1.adapter.linear_in.weight"
        stacked = tr[n].unsqueeze(0).repeat(4, 1, 1)
        stacked[2, 0, 0] += 1
        items = [(k, stacked if k == n else t) for k, t in items]
    elif case == "shared_slices":
        n = "decoder.layers.3.mlp.experts.linear_fc2.adapter.linear_out.weight"
        items = [(k, t) for k, t in items if not k.startswith("decoder.layers.3.mlp.experts.linear_fc2")]
        a = tr["decoder.layers.3.mlp.experts.linear_fc2.adapter.linear_in.weight"]
        items += [("decoder.layers.3.mlp.experts.linear_fc2.adapter.linear_in.weight", a[:2], 0), (n, tr[n], 0),
                  ("decoder.layers.3.mlp.experts.linear_fc2.adapter.linear_in.weight", a[2:], 2), (n, tr[n] + 1, 2)]
    elif case == "unknown":
        items.insert(0, ("decoder.layers.0.self_attention.linear_qkv.adapter.linear_in.weight", torch.zeros(R, 64, dtype=torch.bfloat16)))
    elif case == "shape":
        items = [(n, t[:15] if n.endswith("0.self_attention.linear_qkv.adapter.adapter_k.linear_out.weight") else t) for n, t in items]
    elif case == "dtype":
        items = [(n, t.float() if n.endswith("0.self_attention.linear_proj.adapter.linear_in.weight") else t) for n, t in items]
    with pytest.raises(AdapterError) as ei:
        list(LoraExport(alpha=ALPHA, dims=dims).groups(items))
    msg = str(ei.value)
    assert needle in msg and "\n" not in msg


def test_non_adapter_names_are_skipped_not_converted(dims):
    tr = trainer_adapter(dims)
    items = [("module.decoder.layers.0.self_attention.linear_proj.to_wrap.weight", torch.zeros(64, 64))]
    items += [("module." + n, t) for n, t in tr.items()]  # DDP wrapper prefix
    conv = LoraExport(alpha=ALPHA, dims=dims)
    got = {n: t for g in conv.groups(items) for n, t in g.tensors}
    assert got.keys() == engine(dims, tr).keys()
    assert conv.skipped == ["module.decoder.layers.0.self_attention.linear_proj.to_wrap.weight"]


# ---- the sync check ---------------------------------------------------------------------------


def test_sha256_check_catches_flip_missing_extra_by_name(dims):
    tr = trainer_adapter(dims)
    sent = list(LoraExport(alpha=ALPHA, dims=dims, bucket_bytes=1 << 16).buckets(tr.items()))
    manifest = build_manifest(sent)
    received = {n: t.clone() for b in sent for n, t in b}
    assert check_manifest(manifest, received).ok
    flip, gone = "language_model.layers.3.mlp.experts.w3.lora_B.weight", "language_model.layers.5.attn.wr_du.lora_A.weight"
    received[flip].view(-1).view(torch.uint8)[7] ^= 0x01  # one flipped bit of one byte
    del received[gone]
    received["language_model.layers.0.attn.attn_sink_proj.lora_A.weight"] = torch.zeros(R, 64, dtype=torch.bfloat16)
    rep = verify_manifest(manifest, received)
    assert rep.changed == [flip] and rep.missing == [gone]
    assert rep.extra == ["language_model.layers.0.attn.attn_sink_proj.lora_A.weight"]
    with pytest.raises(IntegrityError, match=r"1 changed: language_model\.layers\.3\.mlp\.experts\.w3\.lora_B\.weight"):
        check_manifest(manifest, received)
    # the digest is the spec's expression, as the engine computes it
    import hashlib
    t = received["language_model.lm_head.lora_A.weight"]
    assert manifest["language_model.lm_head.lora_A.weight"] == hashlib.sha256(
        t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()


# ---- export job, CLI, peft oracle -------------------------------------------------------------


def _torch_dist(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    from inkling_ckpt.layouts.megatron import ChunkItem, common_state, finish_iteration_dir, write_tracker
    from inkling_ckpt.layouts.megatron_writer import write_dcp

    it = folder / "release"
    it.mkdir(parents=True)
    chunks = []
    for u, (n, t) in enumerate(tensors.items()):
        if t.dim() == 3 and t.shape[0] > 1:  # per-expert factors stored as two EP ranks' chunks
            h = t.shape[0] // 2
            chunks += [ChunkItem(n, (0, 0, 0), (h, *t.shape[1:]), tuple(t.shape), t.dtype, u),
                       ChunkItem(n, (h, 0, 0), (t.shape[0] - h, *t.shape[1:]), tuple(t.shape), t.dtype, u)]
        else:
            chunks.append(ChunkItem(n, (0,) * t.dim(), tuple(t.shape), tuple(t.shape), t.dtype, u))
    write_dcp(it, chunks, [], lambda c: tensors[c.key][c.offsets[0]:c.offsets[0] + c.sizes[0]] if c.sizes else tensors[c.key])
    finish_iteration_dir(it, common_state())
    write_tracker(folder)
    return folder


def test_cli_export_from_safetensors_and_torch_dist_peft_reads_it(work, dims, base_bf16, dump, cli):
    tr = trainer_adapter(dims, seed=3)
    tdist = _torch_dist(work / "trainer-tdist", tr)
    out1, out2 = work / "exp-st", work / "exp-td"
    code, out, err = cli("lora", "export", dump, out1, "--config", base_bf16, "--dry-run")
    assert code == 0 and "would write" in out and "r=4, alpha=8" in out and not out1.exists(), out + err
    code, out, err = cli("lora", "export", dump, out1, "--config", base_bf16, "-q")
    assert code == 0, err
    assert "r=4, alpha=8" in out
    code, out, err = cli("lora", "export", tdist, out2, "--config", base_bf16, "--alpha", "8", "-q")
    assert code == 0, err
    for f in ("adapter_model.safetensors", "adapter_config.json", "adapter_sha256.json"):
        assert (out1 / f).read_bytes() == (out2 / f).read_bytes(), f
    got = read_all_adapter(out1)
    want = engine(dims, tr)
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    code, out, _ = cli("lora", "export", dump, out1, "--config", base_bf16, "-q")  # same job: nothing to do
    assert code == 0 and "nothing to do" in out
    peft = pytest.importorskip("peft", reason="peft (test-only oracle) is not installed")
    cfg = peft.PeftConfig.from_pretrained(str(out1))
    assert (cfg.peft_type.value, cfg.r, cfg.lora_alpha, cfg.target_modules) == ("LORA", R, ALPHA, "all-linear")
    # inspect, and its sha256 verify
    info = inspect_adapter(out1, verify=True)
    assert info["r"] == R and info["shared_outer_experts"] is True and info["manifest"]["ok"]
    assert info["modules"]["fc1"]["layers"] == list(range(6)) and info["tensors"] == len(want)
    code, out, _ = cli("lora", "inspect", out1, "--verify")
    assert code == 0 and "all match" in out


def read_all_adapter(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "adapter_model.safetensors"), "pt") as f:
        return {n: f.get_tensor(n) for n in f.keys()}


def test_cli_errors_are_one_line(work, dims, base_bf16, ad_random, cli):
    tr = trainer_adapter(dims)
    tr["decoder.layers.2.self_attention.sink_proj.adapter.linear_in.weight"] = torch.zeros(R, 64, dtype=torch.bfloat16)
    dump = work / "bad-dump.safetensors"
    save_file(tr, str(dump))
    code, _, err = cli("lora", "export", dump, work / "bad-out", "--config", base_bf16, "--alpha", "8")
    assert code == 2 and err.count("\n") == 1 and "sink_proj" in err and "Traceback" not in err
    assert not (work / "bad-out").exists() and not list(work.glob(".bad-out*"))
    code, _, err = cli("lora", "export", dump, work / "bad-out", "--config", base_bf16)
    assert code == 2 and "give --alpha" in err
    code, _, err = cli("lora", "export", dump, work / "bad-out", "--config", base_bf16, "--alpha", "-1")
    assert code == 2 and "lora_alpha must be a positive number" in err
    code, _, err = cli("lora", "merge", base_bf16, ad_random, base_bf16 / "sub")
    assert code == 2 and "inside the input" in err


def test_inspect_verify_reports_a_changed_file(work, dims, base_bf16, dump):
    d = work / "tamper"
    export_adapter(dump, d, config=base_bf16, progress=False)
    raw = bytearray((d / "adapter_model.safetensors").read_bytes())
    raw[-3] ^= 0xFF
    (d / "adapter_model.safetensors").write_bytes(bytes(raw))
    info = inspect_adapter(d, verify=True)
    assert not info["manifest"]["ok"] and info["manifest"]["changed"] == ["language_model.lm_head.lora_B.weight"]


# ---- merge ------------------------------------------------------------------------------------


def _hand_merge(model, eng: dict[str, torch.Tensor], scale: float) -> None:
    """W + scale * B @ A on the transformers model's own parameters (float32, then its dtype)."""
    lm = model.model.language_model
    mods = {"attn.wq_du": "self_attn.q_proj.linear", "attn.wk_dv": "self_attn.k_proj.linear",
            "attn.wv_dv": "self_attn.v_proj.linear", "attn.wr_du": "self_attn.relative_position_bias.linear",
            "attn.wo_ud": "self_attn.o_proj.linear", "attn.gate_attn": "self_attn.o_proj.gate_proj"}

    def add(w: torch.Tensor, B: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
        return (w.float() + scale * (B.float() @ A.float())).to(w.dtype)

    with torch.no_grad():
        for i, layer in enumerate(lm.layers):
            p = f"language_model.layers.{i}."
            for ours, theirs in mods.items():
                lin = layer.get_submodule(theirs)
                lin.weight.copy_(add(lin.weight, eng[p + ours + ".lora_B.weight"], eng[p + ours + ".lora_A.weight"]))
            ex = layer.mlp.experts
            F = ex.gate_up_proj.shape[1] // 2
            for e in range(ex.gate_up_proj.shape[0]):  # in memory: gate rows, then up rows
                g = ex.gate_up_proj[e]
                g[:F] = add(g[:F], eng[p + "mlp.experts.w1.lora_B.weight"][e], eng[p + "mlp.experts.w1.lora_A.weight"][0])
                g[F:] = add(g[F:], eng[p + "mlp.experts.w3.lora_B.weight"][e], eng[p + "mlp.experts.w3.lora_A.weight"][0])
                ex.down_proj[e] = add(ex.down_proj[e], eng[p + "mlp.experts.w2.lora_B.weight"][0],
                                      eng[p + "mlp.experts.w2.lora_A.weight"][e])
        model.lm_head.weight.copy_(add(model.lm_head.weight, eng["language_model.lm_head.lora_B.weight"],
                                       eng["language_model.lm_head.lora_A.weight"]))


def _logits(model) -> torch.Tensor:
    ids = torch.tensor([[3, 17, 101, 42, 7, 200, 5, 9, 11, 64, 128, 33]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_merge_bf16_equals_hand_merged_transformers_model(work, dims, base_bf16, ad_random, cli):
    from transformers import Inkling2ForConditionalGeneration

    eng = engine(dims, trainer_adapter(dims, seed=5))
    code, out, err = cli("lora", "merge", base_bf16, ad_random, work / "merged-cli", "--dry-run")
    assert code == 0 and "49 base tensors merged" in out and not (work / "merged-cli").exists(), out + err
    code, out, err = cli("lora", "merge", base_bf16, ad_random, work / "merged-cli", "-q")
    assert code == 0, err
    model = Inkling2ForConditionalGeneration.from_pretrained(base_bf16, dtype=torch.bfloat16)
    before = _logits(model)
    _hand_merge(model, eng, ALPHA / R)
    hand = _logits(model)
    model.save_pretrained(work / "hand-bf16")
    ours, theirs = read_all(work / "merged-cli"), read_all(work / "hand-bf16")
    assert ours.keys() == theirs.keys()
    differ = [n for n in ours if ours[n].dtype != theirs[n].dtype or not torch.equal(ours[n].view(torch.uint8) if ours[n].dtype == torch.uint8 else ours[n], theirs[n])]
    assert differ == []
    base = read_all(base_bf16)
    assert sum(not torch.equal(base[n], ours[n]) for n in ours) == 6 * 8 + 1  # every adapted tensor changed
    merged = Inkling2ForConditionalGeneration.from_pretrained(work / "merged-cli", dtype=torch.bfloat16)
    got = _logits(merged)
    assert torch.equal(got, hand)  # bit for bit
    assert not torch.equal(got, before)


def test_zero_adapter_merges_to_the_base_byte_for_byte(work, dims, base_bf16, base_mixed, ad_zero):
    ad = ad_zero
    for base in (base_bf16, base_mixed):
        out = work / f"zero-{base.name}"
        res = merge(base, ad, out, progress=False)
        assert res.changed == [] and res.unchanged_experts == 6 * 2 * 4
        names = sorted(p.name for p in base.iterdir())
        assert names == sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
        for n in names:
            assert (base / n).read_bytes() == (out / n).read_bytes(), n


def test_reencoding_a_zero_delta_keeps_values_not_always_bytes(work, dims, base_mixed, ad_zero):
    """Why the merge keeps the bytes of zero-delta experts. Re-encoding the decoded base gives the
    same values, but not always the same bytes: NVFP4 turns a negative value that rounded to zero
    (nibble 0x8, -0.0) into +0 (0x0); MXFP8's fresh block scale of a block whose maximum decoded
    to exactly 2^k * 448 / 2 drops one exponent step (the elements double: same values)."""
    out = work / "zero-reencoded"
    merge(base_mixed, ad_zero, out, progress=False, passthrough_zero=False)
    base, ours = read_all(base_mixed), read_all(out)
    byte_diffs = {}
    for i, fmt in MIXED.items():
        for proj in ("w13_weight", "w2_weight"):
            n = P.format(i=i) + proj
            pa, pb = stored_parts(base, n), stored_parts(ours, n)
            assert format_of_parts({s: t.dtype for s, t in pa.items()}) == fmt
            assert torch.equal(decode_stacked(fmt, pa, torch.float32), decode_stacked(fmt, pb, torch.float32)), n
            for s in ("_amax", "_outer_scale_denominator"):
                if s in pa:
                    assert torch.equal(pa[s], pb[s])
            if fmt == "nvfp4":
                assert torch.equal(base[n + "_scale"].view(torch.uint8), ours[n + "_scale"].view(torch.uint8))
                a, b = base[n].reshape(-1), ours[n].reshape(-1)
                na, nb = torch.stack((a & 0xF, a >> 4), -1), torch.stack((b & 0xF, b >> 4), -1)
                d = na != nb
                assert bool((na[d] == 0x8).all()) and bool((nb[d] == 0x0).all()), n  # only -0 -> +0
            byte_diffs[fmt] = byte_diffs.get(fmt, 0) + int((base[n].view(torch.uint8) != ours[n].view(torch.uint8)).sum())
    assert byte_diffs["nvfp4"] > 0 and byte_diffs["mxfp8"] > 0  # both cases occur on these weights


def test_merge_quantized_layers_sqnr_and_kept_scales(work, dims, base_bf16, base_mixed, capsys):
    eng = engine(dims, trainer_adapter(dims, seed=7))
    ad = write_adapter_dir(work / "ad-q", eng)
    res = merge(base_mixed, ad, work / "merged-mixed", progress=False, measure=True)
    base, ours = read_all(base_mixed), read_all(work / "merged-mixed")
    for i, fmt in MIXED.items():
        for proj in ("w13_weight", "w2_weight"):
            n = P.format(i=i) + proj
            assert not torch.equal(base[n], ours[n])
            for kept in ("_amax", "_outer_scale_denominator"):
                if fmt == "nvfp4":
                    assert torch.equal(base[n + kept], ours[n + kept])  # global factors kept verbatim
    # non-expert tensors: identical to the BF16 merge of the same adapter (same float math)
    merged_bf16 = merge(base_bf16, ad, work / "merged-bf16-q", progress=False)
    assert merged_bf16.changed
    bf = read_all(work / "merged-bf16-q")
    for n in ours:
        if ".mlp.experts." not in n:
            assert torch.equal(ours[n], bf[n]), n
    # per-layer SQNR of the merged experts vs the float reference (float merge of the decoded base),
    # recomputed here independently of merge(), beside a fresh quantization of the same reference
    s = ALPHA / R
    rows = []
    for i, fmt in MIXED.items():
        p = f"language_model.layers.{i}.mlp.experts."
        for proj in ("w13_weight", "w2_weight"):
            n = P.format(i=i) + proj
            xs = decode_stacked(fmt, stored_parts(base, n), torch.float32)
            qs = decode_stacked(fmt, stored_parts(ours, n), torch.float32)
            sig = err_kept = err_fresh = 0.0
            for e in range(base[n].shape[0]):
                x = xs[e].clone()
                if proj == "w13_weight":
                    g = eng[p + "w1.lora_B.weight"][e].float() @ eng[p + "w1.lora_A.weight"][0].float()
                    u = eng[p + "w3.lora_B.weight"][e].float() @ eng[p + "w3.lora_A.weight"][0].float()
                    x.view(-1, 2, x.shape[1])[:, 0] += s * g
                    x.view(-1, 2, x.shape[1])[:, 1] += s * u
                else:
                    x += s * (eng[p + "w2.lora_B.weight"][0].float() @ eng[p + "w2.lora_A.weight"][e].float())
                q = qs[e]
                codec = get_format(fmt)
                fresh = codec.decode(codec.encode(x), dtype=torch.float32)
                sig += float(x.double().square().sum())
                err_kept += float((q - x).double().square().sum())
                err_fresh += float((fresh - x).double().square().sum())
            db = 10 * math.log10(sig / err_kept)
            assert abs(db - res.sqnr[n]) < 1e-6  # merge()'s own report agrees
            rows.append((i, fmt, proj, db, 10 * math.log10(sig / err_fresh)))
    with capsys.disabled():
        print("\nLoRA merge, SQNR of merged experts vs the float reference (dB), kept scales | fresh quantization:")
        for i, fmt, proj, db, fr in rows:
            print(f"  layer {i} {fmt:5s} {proj:10s} {db:6.2f} | {fr:6.2f}")
    assert len(res.sqnr) == 12
    for i, fmt, proj, db, fr in rows:  # kept scales cost at most ~1 dB against a fresh quantization here
        assert math.isfinite(db) and db > (15 if fmt == "nvfp4" else 25) and db > fr - 1.0, (i, proj, db, fr)


def test_merge_rejects_incomplete_or_mismatched_adapters(work, dims, base_bf16, ad_zero):
    eng = engine(dims, trainer_adapter(dims))
    bad = dict(eng)
    del bad["language_model.layers.1.mlp.experts.w3.lora_B.weight"]
    with pytest.raises(AdapterError, match=r"language_model\.layers\.1\.mlp\.experts\..*incomplete.*w3\.lora_B"):
        merge(base_bf16, write_adapter_dir(work / "ad-bad1", bad), work / "never1", progress=False)
    bad = dict(eng)
    bad["language_model.layers.0.attn.wq_du.lora_A.weight"] = torch.zeros(R + 1, 64, dtype=torch.bfloat16)
    with pytest.raises(AdapterError, match=r"language_model\.layers\.0\.attn\.wq_du\.lora_A\.weight: shape \[5, 64\]"):
        merge(base_bf16, write_adapter_dir(work / "ad-bad2", bad), work / "never2", progress=False)
    bad = dict(eng)
    bad["language_model.layers.0.attn.attn_sink_proj.lora_A.weight"] = torch.zeros(R, 64, dtype=torch.bfloat16)
    with pytest.raises(AdapterError, match="attn_sink_proj.lora_A.weight: the attention sink projection gets no adapter"):
        merge(base_bf16, write_adapter_dir(work / "ad-bad3", bad), work / "never3", progress=False)
    assert not any((work / f"never{i}").exists() for i in (1, 2, 3))
    with pytest.raises(OutputError):
        merge(base_bf16, ad_zero, base_bf16, progress=False, force=True)


def test_merge_refuses_a_non_finite_scale_and_an_overflow(work, dims, base_bf16, base_mixed, cli):
    """A NaN or infinite ``lora_alpha`` (JSON as Python reads it takes both) is refused when the
    adapter is opened; a merge whose W + (alpha/r) * B @ A overflows the stored dtype, in a linear,
    in BF16 experts or in experts it re-encodes, fails in one line naming the tensor and publishes
    nothing (it used to write infinities into BF16 weights and exit 0)."""
    eng = engine(dims, trainer_adapter(dims))
    for bad in ("NaN", "Infinity"):
        d = write_adapter_dir(work / f"ad-alpha-{bad}", eng)
        (d / "adapter_config.json").write_text((d / "adapter_config.json").read_text().replace(
            f'"lora_alpha": {ALPHA}', f'"lora_alpha": {bad}'))
        with pytest.raises(AdapterError, match="lora_alpha must be a positive finite number"):
            Adapter.open(d)
        code, _, err = cli("lora", "merge", base_bf16, d, work / "never-alpha")
        assert code == 2 and err.count("\n") == 1 and "positive finite" in err
    big = write_adapter_dir(work / "ad-alpha-big", eng)
    (big / "adapter_config.json").write_text((big / "adapter_config.json").read_text().replace(
        f'"lora_alpha": {ALPHA}', '"lora_alpha": 1e300'))
    with pytest.raises(AdapterError, match=r"model\.llm\.layers\.\d+\..* overflows bfloat16 \(alpha/r = 2\.5e\+299\)"):
        merge(base_bf16, big, work / "never-big", progress=False)
    # only one layer's experts change, with factors whose products overflow float32
    L = "language_model.layers.3.mlp.experts."
    huge = {n: (t.float() * 1e20).to(torch.bfloat16) if n.startswith(L) else
            (torch.zeros_like(t) if ".lora_B." in n else t) for n, t in eng.items()}
    ad = write_adapter_dir(work / "ad-huge-experts", huge)
    for base in (base_bf16, base_mixed):  # BF16 experts cast back; MXFP8 experts re-encoded (layer 3)
        with pytest.raises(AdapterError, match=r"model\.llm\.layers\.3\.mlp\.experts\.w(13|2)_weight experts \[.*overflows"):
            merge(base, ad, work / "never-huge", progress=False)
    code, _, err = cli("lora", "merge", base_mixed, ad, work / "never-huge")
    assert code == 2 and err.count("\n") == 1 and "overflows" in err and "Traceback" not in err
    # a base holding a NaN (an E4M3 element 0x7F) where a sane adapter changes it: named as the base's
    tensors = read_all(base_mixed)
    tensors[P.format(i=3) + "w2_weight"].view(torch.uint8)[0, 0, 0] = 0x7F
    nan_base = work / "base-nan-block"
    shutil.copytree(base_mixed, nan_base)
    save_file(tensors, str(nan_base / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"layers\.3\.mlp\.experts\.w2_weight: the base holds non-finite values"):
        merge(nan_base, write_adapter_dir(work / "ad-sane", eng), work / "never-nan", progress=False)
    assert not any(p.name.startswith(("never", ".never")) for p in work.iterdir())


def test_merge_resumes_and_skips_a_finished_job(work, dims, base_bf16, ad_zero, ad_random):
    ad = ad_zero
    out = work / "resume"
    first = merge(base_bf16, ad, out, progress=False)
    assert not first.skipped
    again = merge(base_bf16, ad, out, progress=False)
    assert again.skipped
    with pytest.raises(OutputError):
        merge(base_bf16, ad_random, out, progress=False)  # another job: refuse without --force


def test_adapter_reader_accepts_the_peft_prefix(ad_random):
    ad = Adapter.open(ad_random)
    assert all(not n.startswith("base_model.model.") for n in ad.tensors)
    assert ad.scale == ALPHA / R


def test_sharded_base_merges_like_one_file_and_an_interrupted_run_resumes(work, dims, base_bf16, ad_random, merged_bf16,
                                                                         monkeypatch):
    from transformers import Inkling2ForConditionalGeneration

    import importlib

    merge_mod = importlib.import_module("inkling_ckpt.lora.merge")

    sharded = work / "base-sharded"
    Inkling2ForConditionalGeneration.from_pretrained(base_bf16, dtype=torch.bfloat16).save_pretrained(
        sharded, max_shard_size="150KB")
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 3 and (sharded / "model.safetensors.index.json").is_file()
    ad = ad_random
    whole = read_all(merged_bf16)  # the one-file merge of the same adapter

    calls = {"n": 0}
    real_finish = merge_mod.Stage.finish

    def flaky_finish(self, rel):  # the process dies after two shard files were published in staging
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_finish(self, rel)

    out = work / "merged-sharded"
    monkeypatch.setattr(merge_mod.Stage, "finish", flaky_finish)
    with pytest.raises(KeyboardInterrupt):
        merge(sharded, ad, out, progress=False)
    monkeypatch.setattr(merge_mod.Stage, "finish", real_finish)
    assert not out.exists()
    res = merge(sharded, ad, out, progress=False)
    assert res.resumed and res.files < len(shards)  # finished shards were kept, not redone
    got = {}
    for f in sorted(out.glob("model-*.safetensors")):
        with safe_open(str(f), "pt") as h:
            got.update({n: h.get_tensor(n) for n in h.keys()})
    assert got.keys() == whole.keys()
    assert all(torch.equal(got[n], whole[n]) for n in whole)
    assert (out / "model.safetensors.index.json").read_bytes() == (sharded / "model.safetensors.index.json").read_bytes()


# ---- properties ------------------------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=25, deadline=None)
@given(E=st.integers(1, 6), F=st.integers(1, 5), H=st.integers(1, 6), r=st.integers(1, 4), data=st.data())
def test_any_ep_split_in_any_order_gives_the_whole_export(E, F, H, r, data):
    g = torch.Generator().manual_seed(E * 1000 + F * 100 + H * 10 + r)
    L = "decoder.layers.0.mlp.experts."
    a1 = torch.randn(r, H, generator=g).to(torch.bfloat16)
    b1 = torch.randn(E, 2 * F, r, generator=g).to(torch.bfloat16)
    a2 = torch.randn(E, r, F, generator=g).to(torch.bfloat16)
    b2 = torch.randn(H, r, generator=g).to(torch.bfloat16)
    whole = [(L + "linear_fc1.adapter.linear_in.weight", a1), (L + "linear_fc1.adapter.linear_out.weight", b1),
             (L + "linear_fc2.adapter.linear_in.weight", a2), (L + "linear_fc2.adapter.linear_out.weight", b2)]
    want = {n: t for grp in LoraExport(alpha=1, num_experts=E).groups(whole) for n, t in grp.tensors}
    cuts = sorted(data.draw(st.sets(st.integers(1, E - 1), max_size=E - 1)) if E > 1 else [])
    bounds = list(zip([0, *cuts], [*cuts, E], strict=True))
    items = []
    for lo, hi in bounds:  # each EP rank: its expert slices and its copy of the shared factors
        items += [(whole[0][0], a1.clone()), (whole[1][0], b1[lo:hi].clone(), lo),
                  (whole[2][0], a2[lo:hi].clone(), lo), (whole[3][0], b2.clone())]
    items = data.draw(st.permutations(items))
    got = {n: t for grp in LoraExport(alpha=1, num_experts=E).groups(items) for n, t in grp.tensors}
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n], want[n]) for n in want)
    p = "language_model.layers.0.mlp.experts."
    assert torch.equal(got[p + "w1.lora_B.weight"], b1[:, :F]) and torch.equal(got[p + "w3.lora_B.weight"], b1[:, F:])


def test_per_expert_stacked_shared_factors_merge_like_shared_outer(work, dims, base_mixed):
    """Engines also accept the shared factors stacked per expert ([E, r, H] / [E, H, r]); with equal
    entries the merge is the same, byte for byte."""
    eng = engine(dims, trainer_adapter(dims, seed=11))
    shared = write_adapter_dir(work / "ad-so", eng)
    stacked = {n: (t.expand(4, *t.shape[1:]).contiguous() if t.dim() == 3 and t.shape[0] == 1 else t) for n, t in eng.items()}
    per = write_adapter_dir(work / "ad-pe", stacked)
    assert inspect_adapter(per)["shared_outer_experts"] is False and inspect_adapter(shared)["shared_outer_experts"] is True
    merge(base_mixed, shared, work / "m-so", progress=False)
    merge(base_mixed, per, work / "m-pe", progress=False)
    assert (work / "m-so" / "model.safetensors").read_bytes() == (work / "m-pe" / "model.safetensors").read_bytes()


def test_expert_slices_do_not_change_the_merge(work, dims, base_mixed):
    """Experts are merged a slice at a time (``--slice-mb``); slices of 1 and 3 w13 experts (2 and 6
    of w2: partial last slices, some experts with a zero delta) give the bytes of the one-slice merge."""
    from inkling_ckpt.layouts.hf import HFCheckpoint
    from inkling_ckpt.pipeline import Options

    cfg = HFCheckpoint.open(base_mixed).cfg
    w13_expert = 2 * cfg.moe_intermediate_size * cfg.hidden_size * 2  # BF16 bytes of one w13 expert
    eng = engine(dims, trainer_adapter(dims, seed=13))
    for n, t in eng.items():  # zero deltas for some experts: w13 of experts 1, 3; w2 of expert 2
        if n.endswith(("w1.lora_B.weight", "w3.lora_B.weight")):
            t[[1, 3]] = 0
        elif n.endswith("w2.lora_A.weight"):
            t[2] = 0
    ad = write_adapter_dir(work / "ad-slices", eng)
    whole = merge(base_mixed, ad, work / "slices-all", progress=False)
    assert whole.unchanged_experts == 6 * 3
    for k in (1, 3):
        res = merge(base_mixed, ad, work / f"slices-{k}",
                    options=Options(device="cpu", slice_bytes=k * w13_expert, progress=False))
        assert res.unchanged_experts == whole.unchanged_experts
        assert res.ranks[0]["units"] > whole.ranks[0]["units"]  # more, smaller units
        assert (work / f"slices-{k}" / "model.safetensors").read_bytes() == \
            (work / "slices-all" / "model.safetensors").read_bytes()


def test_row_pieces_do_not_change_the_merge(work, dims, base_bf16, base_mixed, monkeypatch):
    """Experts bigger than a piece (``ROW_CHUNK_ELEMS``: real-size ones) are merged a few rows at a
    time, written over the slice's stored parts; shrunk here so the tiny experts split into row
    pieces (w13: gate/up pairs), on a mixed and a BF16 base with some zero-delta experts (kept
    bytes beside rewritten rows): the bytes and the reported SQNR of the whole-expert merge."""
    import importlib

    from inkling_ckpt.layouts.hf import HFCheckpoint

    merge_mod = importlib.import_module("inkling_ckpt.lora.merge")
    eng = engine(dims, trainer_adapter(dims, seed=17))
    for n, t in eng.items():
        if n.endswith("w1.lora_B.weight"):
            t[[0, 2]] = 0  # experts 0 and 2: no gate (w1) product, only the up (w3) one
        elif n.endswith("w3.lora_B.weight"):
            t[2] = 0  # expert 2: no delta at all
        elif n.endswith("w2.lora_A.weight"):
            t[1] = 0
    ad = write_adapter_dir(work / "ad-pieces", eng)
    cfg = HFCheckpoint.open(base_mixed).cfg
    F, H = cfg.moe_intermediate_size, cfg.hidden_size
    for name, base in (("mixed", base_mixed), ("bf16", base_bf16)):
        whole = merge(base, ad, work / f"pieces-whole-{name}", progress=False, measure=True)
        with monkeypatch.context() as m:
            m.setattr(merge_mod, "ROW_CHUNK_ELEMS", 6 * H)  # w13: 6 rows (3 gate/up pairs) a piece
            cut = merge_mod._pieces([0, 1, 3], 2 * F, H)
            assert len(cut) == 3 * -(-2 * F // 6) and all(len(js) == 1 and r0 % 2 == 0 for js, r0, _ in cut)
            pieces = merge(base, ad, work / f"pieces-rows-{name}", progress=False, measure=True)
        assert pieces.unchanged_experts == whole.unchanged_experts > 0
        assert pieces.sqnr.keys() == whole.sqnr.keys()
        assert all(abs(pieces.sqnr[n] - whole.sqnr[n]) < 1e-9 for n in whole.sqnr)
        assert (work / f"pieces-rows-{name}" / "model.safetensors").read_bytes() == \
            (work / f"pieces-whole-{name}" / "model.safetensors").read_bytes()


def test_whole_slices_with_products_a_piece_at_a_time_do_not_change_the_merge(work, dims, base_bf16, base_mixed,
                                                                               monkeypatch):
    """A GPU decodes, adds into and re-encodes a slice's live experts in one piece while forming
    the products B @ A a row piece at a time, the CPU's calls. Forced here on the CPU (the path is
    the same code) with row pieces of 6 rows and zero-delta experts between live ones: the bytes
    of the piece-at-a-time merge."""
    import importlib

    merge_mod = importlib.import_module("inkling_ckpt.lora.merge")
    eng = engine(dims, trainer_adapter(dims, seed=19))
    for n, t in eng.items():
        if n.endswith("w1.lora_B.weight"):
            t[[0, 2]] = 0  # experts 0 and 2: only the up (w3) product
        elif n.endswith("w3.lora_B.weight"):
            t[2] = 0  # expert 2: no delta at all (not decoded, its bytes kept)
        elif n.endswith("w2.lora_A.weight"):
            t[1] = 0
    ad = write_adapter_dir(work / "ad-whole", eng)
    H = json.loads((base_mixed / "config.json").read_text())["text_config"]["hidden_size"]
    real = merge_mod._Merger.__init__

    def whole(self, *a, **k):
        real(self, *a, **k)
        self.whole_slices = True

    for name, base in (("mixed", base_mixed), ("bf16", base_bf16)):
        with monkeypatch.context() as m:
            m.setattr(merge_mod, "ROW_CHUNK_ELEMS", 6 * H)
            pieces = merge(base, ad, work / f"whole-pieces-{name}", progress=False)
            m.setattr(merge_mod._Merger, "__init__", whole)
            slices = merge(base, ad, work / f"whole-slices-{name}", progress=False)
        assert slices.unchanged_experts == pieces.unchanged_experts > 0
        assert (work / f"whole-slices-{name}" / "model.safetensors").read_bytes() == \
            (work / f"whole-pieces-{name}" / "model.safetensors").read_bytes()


def test_merge_charges_each_step_what_it_holds(work, base_mixed, ad_random, monkeypatch):
    """The memory budget sees what a step holds on the host: a copy the bytes it moves (once), an
    expert slice its stored parts and, on the CPU, a piece of it decoded to float32 (more with
    ``measure``, which decodes the merged result again), a linear's rows beside their float32 copy."""
    import importlib

    from inkling_ckpt.pipeline import Options

    merge_mod = importlib.import_module("inkling_ckpt.lora.merge")
    planned: dict[bool, list] = {}
    real = merge_mod._plan_steps

    def spy(*args, **kw):  # type: ignore[no-untyped-def]
        planned[kw["measure"]] = steps = real(*args, **kw)
        return steps

    monkeypatch.setattr(merge_mod, "_plan_steps", spy)
    for measure in (False, True):
        merge(base_mixed, ad_random, work / f"charged-{measure}", measure=measure,
              options=Options(device="cpu", progress=False))
    for measure, steps in planned.items():
        kinds = {u.data.kind for u in steps}
        assert {"copy", "experts", "linear"} <= kinds
        for u in steps:
            if u.data.kind == "copy":
                assert u.memory == u.read_bytes == u.write_bytes
            elif u.data.kind == "experts":
                _, rows, cols = u.data.unit.stack.shape
                f32 = largest_piece(u.data.hi - u.data.lo, rows, cols, merge_mod.ROW_CHUNK_ELEMS,
                                    row_multiple=2) * 4  # a piece at a time
                assert u.memory >= u.read_bytes + u.write_bytes + f32 * (2 if measure else 1)
            elif u.data.kind == "linear":
                assert u.memory >= u.read_bytes + u.write_bytes + 2 * (u.data.hi - u.data.lo) * 4
    experts = {m: sum(u.memory for u in steps if u.data.kind == "experts") for m, steps in planned.items()}
    assert experts[True] > experts[False]


# ---- the pipeline: devices, workers, ranks ---------------------------------------------------


def test_cli_merge_takes_the_slice_budget(work, dims, base_mixed, ad_random, cli, monkeypatch):
    """--slice-mb as on every rewriting command (the shared option), handed to the pipeline."""
    import importlib

    merge_mod = importlib.import_module("inkling_ckpt.lora.merge")
    seen: list[int] = []
    real = merge_mod.Executor

    def executor(options, **kw):  # type: ignore[no-untyped-def]
        seen.append(options.slice_bytes)
        return real(options, **kw)

    monkeypatch.setattr(merge_mod, "Executor", executor)
    code, _, err = cli("lora", "merge", base_mixed, ad_random, work / "sliced", "--slice-mb", "3", "--device", "cpu", "-q")
    assert code == 0, err
    assert seen == [3 * 2**20]


def test_two_ranks_merge_the_one_process_bytes_and_report_both(work, dims, base_bf16, base_mixed, ad_random, cli):
    """Under torchrun the ranks split the base's shard files; the output is the one-process
    merge's, byte for byte, for a sharded BF16 base and a one-file mixed base; the closing line
    carries the figures and "2 ranks"."""
    import subprocess
    import sys

    from transformers import Inkling2ForConditionalGeneration

    from conftest import free_port, same_files, subprocess_env

    sharded = work / "ranks-base"
    Inkling2ForConditionalGeneration.from_pretrained(base_bf16, dtype=torch.bfloat16).save_pretrained(
        sharded, max_shard_size="150KB")
    assert len(list(sharded.glob("model-*.safetensors"))) > 3
    one, two = work / "ranks-one", work / "ranks-two"
    jobs = [[b, str(ad_random), name] for b, name in ((str(sharded), "sharded"), (str(base_mixed), "mixed"))]
    for b, ad, name in jobs:
        code, out, err = cli("lora", "merge", b, ad, one / name, "--device", "cpu", "--workers", "2")
        assert code == 0, err
        assert out.startswith("wrote ") and " MB/s; cpu)" in out and " 2 ranks" not in out
    spec = work / "ranks-jobs.json"
    spec.write_text(json.dumps([["lora", "merge", b, ad, str(two / name), "-q", "--device", "cpu"] for b, ad, name in jobs]))
    r = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--master_port",
                        free_port(), str(Path(__file__).parent / "_ranks_driver.py"), str(spec)],
                       env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    for _, _, name in jobs:
        assert same_files(one / name, two / name) == [], name
    assert "2 ranks" in r.stdout
    results = json.loads(r.stdout.split("RESULT ", 1)[1])
    sharded_rep = results[0]
    assert sharded_rep["ranks"]["count"] == 2
    assert all(each["bytes_written"] > 0 for each in sharded_rep["ranks"]["each"])  # each rank wrote its files
    assert sharded_rep["changed"] and sharded_rep["files"] == len(list(sharded.glob("model-*.safetensors")))


def test_merge_takes_the_cpu_default_of_workers_on_a_gpu_too(work, base_mixed, ad_random, monkeypatch):
    """A merge's steps work mostly on the host even with --device cuda (copies, float linears,
    deltas): it asks the executor for at most the CPU's default workers there, not the GPU's."""
    import importlib

    from conftest import executor_gpu_workers
    from inkling_ckpt.pipeline import executor as executor_mod

    seen = executor_gpu_workers(monkeypatch, importlib.import_module("inkling_ckpt.lora.merge"))
    merge(base_mixed, ad_random, work / "gpu-workers", progress=False)
    assert seen == [executor_mod.MAX_DEFAULT_WORKERS] and executor_mod.MAX_DEFAULT_WORKERS < executor_mod.MAX_DEFAULT_GPU_WORKERS


@pytest.mark.parametrize("slice_bytes", [1, 1 << 20])
def test_merge_steps_name_exactly_the_base_bytes_they_read(work, base_mixed, ad_random, file_reads, slice_bytes):
    """What the executor reads ahead for a merge step (its extents) is what the step then reads of
    the base: every byte, no other (recorded at the positioned reads themselves)."""
    import importlib

    from conftest import byte_ranges

    merge_mod = importlib.import_module("inkling_ckpt.lora.merge")  # the package exports merge(), the function
    b = merge_mod._Base(base_mixed)
    ad = Adapter.open(ad_random)
    try:
        units = merge_mod.plan_units(b, ad)
        steps = merge_mod._plan_steps(b, units, merge_mod._file_groups(b, units), slice_bytes)
        merger = merge_mod._Merger(b, ad, torch.device("cpu"), False, True)
        kinds = set()
        for step in steps:
            file_reads.clear()
            merger(step)
            base_reads = [r for r in file_reads if Path(r[0]).parent == base_mixed.resolve()]
            want = merge_mod._extents(b, step)
            assert byte_ranges(base_reads) == byte_ranges(want), step.key
            kinds.add(step.data.kind)
        assert kinds == {"open", "copy", "linear", "experts"}
    finally:
        b.close()
        ad.close()
