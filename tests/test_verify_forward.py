"""verify --forward: the layer-streamed forward against transformers' own from_pretrained + forward.

Tiny Inkling 2 models are built with transformers (every parameter drawn at random from a fixed
seed, so attention-residual queries, router biases and convolution weights are not their zero
init) and written with ``save_pretrained``; those are release-layout checkpoints by definition.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="verify --forward needs the 'forward' extra (transformers)")
if not hasattr(transformers, "Inkling2ForConditionalGeneration"):
    pytest.skip("this transformers has no Inkling 2 model (needs 5.24)", allow_module_level=True)

from safetensors.torch import load_file, save_file  # noqa: E402

from inkling_ckpt.errors import CheckpointError  # noqa: E402
from inkling_ckpt.formats.stacked import decode_stacked, encode_stacked  # noqa: E402
from inkling_ckpt.verify import forward as fwd  # noqa: E402

E, F, H = 8, 32, 64
LAYERS = 4
SEQ = 40  # longer than the sliding window, so the sliding masks and relative extents matter


def tiny_config():
    return transformers.Inkling2Config(
        text_config=dict(
            hidden_size=H, num_hidden_layers=LAYERS, vocab_size=256, unpadded_vocab_size=250,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4,
            swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=16, rel_extent=48, d_rel=8,
            n_routed_experts=E, num_experts_per_tok=2, moe_intermediate_size=F, n_layers_per_attn_res_block=2,
            layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"], eos_token_id=1,
        ),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
                           posemb_grid_size=4, projection_hidden_dim=48, text_hidden_size=H),
    )


def build_tiny(path: Path, dtype: torch.dtype, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = transformers.Inkling2ForConditionalGeneration(tiny_config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            # small random values everywhere (norm weights near 1), not the zero/one init
            base = 1.0 if name.endswith("norm.weight") or "layernorm" in name else 0.0
            p.copy_(base + 0.08 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    model.to(dtype).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("fwd")
    return {d: build_tiny(root / str(d).removeprefix("torch."), d) for d in (torch.bfloat16, torch.float32)}


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 250, (2, SEQ), generator=torch.Generator().manual_seed(1))


def reference_logits(path: Path, dtype: torch.dtype, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.Inkling2ForConditionalGeneration.from_pretrained(path, dtype=dtype)
    with torch.no_grad():
        return model(input_ids=ids).logits


def rewrite(src: Path, dst: Path, edit, config_edit=None) -> Path:
    """Copy a single-file checkpoint with its tensors passed through ``edit(dict) -> dict``."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    save_file(edit(load_file(src / "model.safetensors")), dst / "model.safetensors", metadata={"format": "pt"})
    if config_edit is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config_edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def experts(layer: int, which: str) -> str:
    return f"model.llm.layers.{layer}.mlp.experts.{which}_weight"


# -- exactness -------------------------------------------------------------------------------


#: BF16 bytes of one tiny expert (gate/up and down): slices of 1 byte hold one expert each.
EXPERT_BYTES = (2 * F * H + H * F) * 2


def _slices_read(streamed: "fwd.StreamedModel") -> list[tuple[int, int]]:
    """Record the expert ranges the streamed layers read (and check nothing else is materialised)."""
    seen: list[tuple[int, int]] = []
    read = streamed._expert_slice

    def spy(params, first, last):
        seen.append((first, last))
        for src in params.values():  # the whole stacked parameter is never materialised
            assert streamed.model.get_parameter(src.target).is_meta
        return read(params, first, last)

    streamed._expert_slice = spy  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("slice_bytes", [None, 1, 3 * EXPERT_BYTES, 10**9], ids=["whole", "1", "3", "all"])
def test_streamed_logits_equal_from_pretrained_bit_for_bit(tiny, ids, dtype, slice_bytes):
    ref = reference_logits(tiny[dtype], dtype, ids)
    streamed = fwd.StreamedModel(tiny[dtype], dtype=dtype, expert_slice_bytes=slice_bytes)
    seen = _slices_read(streamed)
    got = streamed.forward(ids)
    assert got.dtype == ref.dtype == torch.float32 and got.shape == (2, SEQ, 250)
    assert torch.equal(got, ref)
    # everything went back to meta: nothing of the checkpoint is held after the run
    assert all(p.is_meta for p in streamed.model.parameters())
    assert all("forward" not in vars(m) for m in streamed.model.modules())  # the experts' own forward again
    step = {None: None, 1: 1, 3 * EXPERT_BYTES: 3, 10**9: E}[slice_bytes]
    if step is None:
        assert seen == [] and not any(u.streamed for u in streamed.units)
    else:  # each layer's experts a slice at a time (slices no token is routed to are not read)
        assert seen and set(seen) <= {(a, min(E, a + step)) for a in range(0, E, step)}
        assert len(seen) > LAYERS * (E // step > 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_streamed_logits_equal_from_pretrained_on_cuda(tiny, mixed, ids):
    ref = transformers.Inkling2ForConditionalGeneration.from_pretrained(
        tiny[torch.bfloat16], dtype=torch.bfloat16, device_map="cuda")
    with torch.no_grad():
        want = ref(input_ids=ids.cuda()).logits
    got = fwd.StreamedModel(tiny[torch.bfloat16], dtype=torch.bfloat16, device="cuda").forward(ids)
    assert got.device.type == "cuda" and torch.equal(got, want)
    sliced = fwd.StreamedModel(tiny[torch.bfloat16], dtype=torch.bfloat16, device="cuda", expert_slice_bytes=1)
    assert torch.equal(sliced.forward(ids), want)
    # quantized experts decoded on the GPU give what the CPU decode gives
    _, q, _ = mixed
    on_gpu = fwd.StreamedModel(q, dtype=torch.bfloat16, device="cuda")
    on_cpu = fwd.StreamedModel(q, dtype=torch.bfloat16, device="cpu")
    for unit_gpu, _ in zip(on_gpu.units[1:-1], on_cpu.units[1:-1], strict=True):
        for src in unit_gpu.sources:
            if src.fmt in fwd.QUANTIZED:
                parts = {p: on_cpu.reader.get(src.base + p) for p in src.parts}
                a = decode_stacked(src.fmt, parts, torch.bfloat16)
                b = decode_stacked(src.fmt, {p: t.cuda() for p, t in parts.items()}, torch.bfloat16)
                assert torch.equal(a, b.cpu())
    cmp = fwd.compare_forward(tiny[torch.bfloat16], q, input_ids=ids, device="cuda", progress=False)
    assert cmp["run"]["device"] == "cuda" and cmp["logits"]["kl_mean"] > 0


def test_self_comparison_is_exact(tiny, ids):
    rep = fwd.compare_forward(tiny[torch.bfloat16], tiny[torch.bfloat16], input_ids=ids, progress=False)
    assert rep["schema"] == fwd.SCHEMA
    assert rep["run"]["dtype"] == "bfloat16" and rep["run"]["batch"] == 2 and rep["run"]["seq_len"] == SEQ
    lg = rep["logits"]
    assert (lg["kl_mean"], lg["kl_max"], lg["top1_agreement"], lg["max_abs_diff"]) == (0.0, 0.0, 1.0, 0.0)
    assert [r["layer"] for r in rep["layers"]] == list(range(LAYERS))
    assert [r["kind"] for r in rep["layers"]] == ["sliding", "full", "sliding", "full"]
    assert all(r["rel_error"] == 0.0 and r["max_abs_diff"] == 0.0 for r in rep["layers"])
    assert rep["logits"]["first_diverging_layer"] is None
    assert rep["a"]["expert_formats"] == {"bf16": LAYERS}  # unquantized, stored BF16
    json.dumps(rep)  # JSON-serialisable as is


def test_perturbed_expert_layer_starts_the_divergence(tiny, ids, tmp_path):
    src = tiny[torch.bfloat16]

    def edit(sd):
        name = experts(2, "w13")
        sd[name] = (sd[name].float() * 1.5).to(sd[name].dtype)
        return sd

    b = rewrite(src, tmp_path / "perturbed", edit)
    rep = fwd.compare_forward(src, b, input_ids=ids, progress=False)
    errs = [r["rel_error"] for r in rep["layers"]]
    assert errs[0] == errs[1] == 0.0
    assert errs[2] > 1e-3 and errs[3] > 0.0
    assert rep["logits"]["first_diverging_layer"] == 2
    assert rep["logits"]["kl_mean"] > 0.0 and rep["logits"]["max_abs_diff"] > 0.0
    text = fwd.render_forward_report(rep)
    assert "KL(A||B)" in text and "top-1 agreement" in text and "first differ after layer 2" in text


def test_at_most_one_unit_in_memory_at_a_time(tiny, ids, monkeypatch):
    live, peak = [0], [0]
    load, unload = fwd.StreamedModel.load, fwd.StreamedModel.unload

    def counting_load(self, unit, stored=None):
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        return load(self, unit, stored)

    def counting_unload(self, unit):
        live[0] -= 1
        return unload(self, unit)

    monkeypatch.setattr(fwd.StreamedModel, "load", counting_load)
    monkeypatch.setattr(fwd.StreamedModel, "unload", counting_unload)
    fwd.compare_forward(tiny[torch.bfloat16], tiny[torch.bfloat16], input_ids=ids[:, :8], progress=False)
    assert peak[0] == 1 and live[0] == 0


# -- quantized experts ---------------------------------------------------------------------


def _oracle_decode(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """transformers' own dequantization of the Inkling family's stacked experts (its Loop model's op)."""
    from transformers.core_model_loading import Inkling2LoopDequantizeExperts

    names = ["w", "s", "a", "d"]
    order = ["", "_scale", "_amax", "_outer_scale_denominator"]
    inputs = {n: parts[o] for n, o in zip(names, order, strict=True) if o in parts}
    return next(iter(Inkling2LoopDequantizeExperts().convert(inputs, names, ["out"]).values()))


@pytest.fixture(scope="module")
def mixed(tiny, tmp_path_factory):
    """The bf16 tiny model with layers 0-1 in NVFP4 and 2-3 in MXFP8 (release layout), and the same
    model with those experts decoded back to BF16 by transformers' dequantizer."""
    src = tiny[torch.bfloat16]
    root = tmp_path_factory.mktemp("mixed")
    plan = {0: "nvfp4", 1: "nvfp4", 2: "mxfp8", 3: "mxfp8"}

    def quantize(sd):
        for layer, fmt in plan.items():
            for which in ("w13", "w2"):
                base = experts(layer, which)
                for suffix, t in encode_stacked(fmt, sd.pop(base), name=base).items():
                    sd[base + suffix] = t.contiguous()
        return sd

    def add_quant_config(cfg):  # what the MXFP8 release's config carries; the forward must ignore it
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                      "weight_block_size": [1, 32], "scale_fmt": "ue8m0"}

    q = rewrite(src, root / "mixed", quantize, add_quant_config)
    qsd = load_file(q / "model.safetensors")

    def decoded(sd):
        for layer in plan:
            for which in ("w13", "w2"):
                base = experts(layer, which)
                sd[base] = _oracle_decode({s: qsd[base + s] for s in ("", "_scale", "_amax", "_outer_scale_denominator")
                                           if base + s in qsd})
        return sd

    d = rewrite(src, root / "decoded", decoded)
    return src, q, d


@pytest.mark.parametrize("slice_bytes", [None, 1, 3 * EXPERT_BYTES], ids=["whole", "1", "3"])
def test_quantized_checkpoint_runs_as_its_decoded_bf16(mixed, ids, slice_bytes):
    src, q, d = mixed
    ref = reference_logits(d, torch.bfloat16, ids)
    streamed = fwd.StreamedModel(q, dtype=torch.bfloat16, expert_slice_bytes=slice_bytes)
    seen = _slices_read(streamed)
    assert torch.equal(streamed.forward(ids), ref)
    assert bool(seen) == (slice_bytes is not None)


def test_mixed_vs_bf16_per_layer_table(mixed, ids):
    src, q, _ = mixed
    rep = fwd.compare_forward(src, q, input_ids=ids, progress=False)
    assert rep["b"]["expert_formats"] == {"nvfp4": 2, "mxfp8": 2}
    assert [r["format_b"] for r in rep["layers"]] == ["nvfp4", "nvfp4", "mxfp8", "mxfp8"]
    assert all(r["rel_error"] > 0 for r in rep["layers"])
    assert 0 < rep["logits"]["kl_mean"] <= rep["logits"]["kl_max"]
    assert 0 < rep["logits"]["top1_agreement"] <= 1


# -- the bundled fixtures (release layout, written by the toolkit) ---------------------------

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def test_bundled_bf16_fixture_is_bit_exact_with_from_pretrained(ids):
    ids = ids[:1] % 500
    ref = reference_logits(FIXTURES / "tiny-bf16", torch.bfloat16, ids)
    assert torch.equal(fwd.StreamedModel(FIXTURES / "tiny-bf16", dtype=torch.bfloat16).forward(ids), ref)


def test_bundled_fixtures_self_and_mixed_vs_bf16(cli):
    code, out, err = cli("verify", FIXTURES / "tiny-bf16", FIXTURES / "tiny-bf16", "--forward", "--random", "16",
                         "--batch", "1", "--json", "-q")
    assert code == 0, err
    rep = json.loads(out)
    assert rep["logits"]["kl_max"] == 0.0 and rep["logits"]["top1_agreement"] == 1.0
    code, out, err = cli("verify", FIXTURES / "tiny-bf16", FIXTURES / "tiny-mixed", "--forward", "--random", "16",
                         "--batch", "1", "--json", "-q")
    assert code == 0, err
    rep = json.loads(out)
    assert set(rep["b"]["expert_formats"]) == {"nvfp4", "mxfp8"}
    assert rep["logits"]["first_diverging_layer"] == 0  # every layer's experts are quantized
    assert all(r["rel_error"] > 0 for r in rep["layers"]) and rep["logits"]["kl_mean"] > 0


# -- bad input ------------------------------------------------------------------------------


def test_missing_tensor_is_found_before_any_work(tiny, tmp_path):
    def drop(sd):
        del sd["model.llm.layers.3.mlp_norm.weight"]
        return sd

    b = rewrite(tiny[torch.bfloat16], tmp_path / "broken", drop)
    with pytest.raises(CheckpointError, match="layer.3.*missing"):
        fwd.StreamedModel(b, dtype=torch.bfloat16)


@pytest.mark.parametrize("suffix, tensor, message", [
    ("_amax", torch.ones(E), "not a BF16, MXFP8 or NVFP4 expert"),  # weight + amax: no format has that
    ("_scale", torch.zeros(E, H, F // 32, dtype=torch.uint8), "not a BF16, MXFP8 or NVFP4 expert"),
])
def test_unknown_expert_parts_are_rejected(tiny, tmp_path, suffix, tensor, message):
    def odd(sd):
        sd[experts(1, "w2") + suffix] = tensor
        return sd

    b = rewrite(tiny[torch.bfloat16], tmp_path / "odd", odd)
    with pytest.raises(CheckpointError, match=message):
        fwd.StreamedModel(b, dtype=torch.bfloat16)


def test_index_may_not_point_outside_the_folder(tiny, tmp_path):
    b = tmp_path / "escape"
    shutil.copytree(tiny[torch.bfloat16], b)
    (b / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../elsewhere.safetensors"}}))
    with pytest.raises(CheckpointError, match="outside"):
        fwd.SafetensorsFolder(b)


def test_non_finite_outputs_are_null_and_fail_the_threshold():
    la = torch.zeros(3, 5)
    lb = la.clone()
    lb[1, 2] = float("nan")
    st = fwd.logit_stats(la, lb)
    assert st["kl_max"] is None and st["kl_mean"] is None and st["max_abs_diff"] is None
    assert fwd.hidden_stats(torch.zeros(2, 3), torch.ones(2, 3))["rel_error"] is None  # ||h_A|| = 0
    json.dumps(st, allow_nan=False)


def test_read_tokens(tmp_path):
    (tmp_path / "t.json").write_text("[[1, 2, 3], [4, 5, 6]]")
    assert fwd.read_tokens(tmp_path / "t.json", 10).tolist() == [[1, 2, 3], [4, 5, 6]]
    (tmp_path / "t.txt").write_text("7 8\n9 1\n")
    assert fwd.read_tokens(tmp_path / "t.txt", 10).tolist() == [[7, 8], [9, 1]]
    (tmp_path / "bad.txt").write_text("1 2 99\n")
    with pytest.raises(CheckpointError, match="outside the vocabulary"):
        fwd.read_tokens(tmp_path / "bad.txt", 10)
    (tmp_path / "ragged.json").write_text("[[1, 2], [3]]")
    with pytest.raises(CheckpointError, match="differ in length"):
        fwd.read_tokens(tmp_path / "ragged.json", 10)


# -- the command ----------------------------------------------------------------------------


def test_cli_schemas_match_the_modules():
    from inkling_ckpt.cli import verify as cli_verify
    from inkling_ckpt.verify import compare

    assert cli_verify.SCHEMA == compare.SCHEMA and cli_verify._FORWARD_SCHEMA == fwd.SCHEMA


def test_cli_forward_json_and_table(cli, tiny, tmp_path):
    a = tiny[torch.bfloat16]
    code, out, err = cli("verify", a, a, "--forward", "--random", "12", "--batch", "1", "--json", "-q")
    assert code == 0, err
    rep = json.loads(out)
    assert rep["schema"] == fwd.SCHEMA and rep["logits"]["kl_max"] == 0.0 and rep["run"]["seq_len"] == 12
    (tmp_path / "ids.txt").write_text("5 6 7 8\n")
    code, out, err = cli("verify", a, a, "--forward", "--tokens", tmp_path / "ids.txt", "-q")
    assert code == 0, err
    assert "top-1 agreement 1.0000" in out and "layer" in out


def test_cli_forward_threshold_and_bad_options(cli, tiny, mixed):
    src, q, _ = mixed
    code, out, err = cli("verify", src, q, "--forward", "--random", "8", "--max-kl", "0", "--json", "-q")
    assert code == 1 and "exceeds" in err
    code, out, err = cli("verify", src, q, "--forward", "--random", "8", "--tokens", "x.txt")
    assert code == 2 and err.strip().count("\n") == 0 and "not both" in err
    code, out, err = cli("verify", src, q, "--random", "8")
    assert code == 2 and "only applies with --forward" in err
    for bad in ("nan", "-1", "inf"):  # refused before the forward pass, not a FAIL (or a pass) after it
        code, out, err = cli("verify", src, q, "--forward", "--random", "8", "--max-kl", bad)
        assert code == 2 and err.strip().count("\n") == 0 and "--max-kl" in err and "finite number >= 0" in err, err


def test_cli_without_transformers_is_one_line(cli, tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    a = tiny[torch.bfloat16]
    code, out, err = cli("verify", a, a, "--forward")
    assert code == 2
    assert err.strip().count("\n") == 0 and "inkling-ckpt[forward]" in err and "Traceback" not in err


def test_streamed_reads_map_no_checkpoint_file(tiny):
    """Tensors are read with positioned reads: no checkpoint file stays memory-mapped after a forward
    (a mapped file's touched pages count in RSS and grew with every layer read)."""
    path = tiny[torch.bfloat16]
    s = fwd.StreamedModel(path, dtype=torch.bfloat16)
    try:
        s.forward(torch.zeros(1, 4, dtype=torch.int64))
        maps = Path("/proc/self/maps")
        if not maps.is_file():
            pytest.skip("no /proc/self/maps on this platform")
        mapped = {line.split(maxsplit=5)[-1].strip() for line in maps.read_text().splitlines()
                  if len(line.split(maxsplit=5)) == 6}
        files = {str(p.resolve()) for p in Path(path).glob("*.safetensors")}
        assert files and not files & mapped
    finally:
        s.close()


def test_block_reads_equal_whole_reads(tiny):
    """The GPU read path (rows in blocks into a preallocated tensor) gives the stored tensor exactly;
    run here on the CPU with blocks of one row and of a few rows."""
    r = fwd.SafetensorsFolder(tiny[torch.bfloat16])
    try:
        names = [n for n, (shape, _) in r.meta.items() if len(shape) >= 2][:6]
        names += [n for n, (shape, _) in r.meta.items() if len(shape) == 1][:2]
        assert any(len(r.meta[n][0]) == 3 for n in names)  # a stacked expert tensor among them
        for n in names:
            whole = r.get(n)
            for block in (1, 3 * whole[0].numel() * whole.dtype.itemsize + 1):
                got = r.read_blocks(n, "cpu", block_bytes=block)
                assert got.dtype == whole.dtype and torch.equal(got.view(torch.uint8), whole.view(torch.uint8)), n
    finally:
        r.close()
