"""convert hf-to-megatron / megatron-to-hf (and hf-to-hf) on the bundled tiny release fixtures.

The oracle for the round trip is transformers' own Inkling 2 model: a checkpoint written by its
``save_pretrained`` goes to torch_dist and back and ``from_pretrained`` gives the same logits,
bit for bit; quantized references come back byte for byte with ``--scales keep``.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch

from conftest import TINY, byte_ranges, same_files, within
from inkling_ckpt.formats.stacked import decode_stacked
from inkling_ckpt.layouts.hf import HFCheckpoint
from inkling_ckpt.layouts.megatron import BACKEND, TorchDistCheckpoint
from inkling_ckpt.model.mapping import MegatronMapping


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _differing(a: Path, b: Path) -> list[str]:
    x, y = HFCheckpoint.open(a), HFCheckpoint.open(b)
    assert set(x.tensors) == set(y.tensors)
    return [n for n in x.tensors if x.tensors[n].dtype != y.tensors[n].dtype or not torch.equal(_bits(x.get(n)), _bits(y.get(n)))]


def _decoded(ckpt: HFCheckpoint, base: str, layer: int) -> torch.Tensor:
    """A stacked expert weight decoded to BF16 with the reference codec."""
    parts = {n[len(base):]: ckpt.get(n) for n in ckpt.tensors if n == base or n.startswith(base + "_")}
    return decode_stacked(ckpt.plan.format_of(layer), parts, torch.bfloat16)


@pytest.fixture(scope="module")
def megatron(tmp_path_factory) -> dict[str, Path]:
    """Each tiny fixture converted to torch_dist once for the module."""
    from inkling_ckpt.convert.megatron import hf_to_megatron

    root = tmp_path_factory.mktemp("mg")
    out = {}
    for v, src in TINY.items():
        hf_to_megatron(HFCheckpoint.open(src), root / v, progress=False)
        out[v] = root / v
    return out


def test_transformers_logits_survive_the_round_trip(tmp_path):
    """save_pretrained → hf-to-megatron → megatron-to-hf → from_pretrained: bit-identical logits."""
    from _tiny_tf import load, logits, save_tiny
    from inkling_ckpt.convert.megatron import hf_to_megatron, megatron_to_hf

    src = save_tiny(tmp_path / "tf", seed=3)
    ref = HFCheckpoint.open(src)
    assert ref.plan.variant == "bf16"
    hf_to_megatron(ref, tmp_path / "mg", progress=False)
    megatron_to_hf(tmp_path / "mg", tmp_path / "back", ref, progress=False)
    assert _differing(src, tmp_path / "back") == []
    a, _ = load(src)
    b, info = load(tmp_path / "back")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    la, lb = logits(a), logits(b)
    assert torch.equal(_bits(la), _bits(lb))


@pytest.mark.parametrize("variant", ["bf16", "mixed", "mxfp8"])
def test_round_trip_with_kept_scales_is_byte_identical(cli, tmp_path, megatron, variant):
    code, out, err = cli("convert", "megatron-to-hf", megatron[variant], tmp_path / "back",
                         "--reference", TINY[variant], "--scales", "keep", "--max-shard-size", "2MB", "-q")
    assert code == 0, err
    assert _differing(TINY[variant], tmp_path / "back") == []
    assert same_files(TINY[variant], tmp_path / "back") == []  # the very files make-fixture wrote (2MB shards)
    # Configs (the MXFP8 quantization_config included) and pass-through files too.
    for name in ("config.json", "generation_config.json"):
        assert json.loads((TINY[variant] / name).read_text()) == json.loads((tmp_path / "back" / name).read_text())
    assert not (tmp_path / "back" / "hf_quant_config.json").exists()


def test_fresh_scales_change_bytes_not_values(tmp_path, megatron):
    """--scales fresh: which tensors differ, and why.

    Every difference is an equal value written with other bytes: NVFP4 elements that rounded to
    -0 decode to -0.0 and re-encode as +0, MXFP8 blocks whose largest element rounded down to
    224·2^s re-encode one scale lower, and a fresh NVFP4 amax is each expert's own max |x| of the
    decoded weights. Nothing outside the routed experts changes, and the decoded values stay
    within one NVFP4 step (exactly equal for MXFP8).
    """
    from inkling_ckpt.convert.megatron import megatron_to_hf

    ref = HFCheckpoint.open(TINY["mixed"])
    megatron_to_hf(megatron["mixed"], tmp_path / "fresh", ref, scales="fresh", progress=False)
    out = HFCheckpoint.open(tmp_path / "fresh")
    differ = _differing(TINY["mixed"], tmp_path / "fresh")
    assert differ and all(".mlp.experts." in n for n in differ)
    for layer in (2, 3):  # MXFP8: same values
        for w in ("w13_weight", "w2_weight"):
            base = f"model.llm.layers.{layer}.mlp.experts.{w}"
            assert torch.equal(_decoded(ref, base, layer), _decoded(out, base, layer))
    print(f"--scales fresh: {len(differ)} of {len(ref.tensors)} tensors differ in bytes")


def test_torch_dist_folder_matches_the_spec(megatron):
    root = megatron["mixed"]
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "release"
    rel = root / "release"
    assert json.loads((rel / "metadata.json").read_text()) == BACKEND
    common = torch.load(rel / "common.pt", weights_only=True)
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == 0
    assert common["content_metadata"] == {"non_homogeneous_layers": True}
    assert common["inkling"]["preset"] == "miles"
    ckpt = TorchDistCheckpoint.open(root)
    src = HFCheckpoint.open(TINY["mixed"])
    cfg = src.cfg
    m = MegatronMapping(cfg)
    assert set(ckpt.keys) == set(m.keys())
    assert set(ckpt.objects) == {o.key for o in m.extra_state()}
    assert ckpt.read_object(m.extra_state()[0].key)[0].numel() == 0
    E, F, H = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    fc1 = ckpt.keys["decoder.layers.0.mlp.experts.experts.linear_fc1.weight"]
    assert fc1.shape == (E, 2 * F, H) and fc1.dtype == torch.bfloat16
    assert len(fc1.chunks) == E and ((3, 0, 0), (1, 2 * F, H)) in fc1.chunks  # one chunk per (layer, expert)
    # Non-expert tensors: the source's bytes in the source's dtype (router, sconv, queries F32).
    for e in m.entries():
        if e.stacked:
            continue
        st = ckpt.keys[e.key]
        assert len(st.chunks) == 1 and st.dtype == src.tensors[e.hf].dtype, e.key
        assert torch.equal(_bits(ckpt.read(e.key)), _bits(src.get(e.hf))), e.key
    assert ckpt.keys["decoder.layers.0.mlp.router.weight"].dtype == torch.float32
    assert ckpt.keys["decoder.layers.1.attn_res_query"].shape == (3, H)  # layer 1 is full: attn_queries.0
    # Experts: decoded, then gate rows followed by up rows per expert.
    for layer in range(cfg.num_hidden_layers):
        w13 = _decoded(src, f"model.llm.layers.{layer}.mlp.experts.w13_weight", layer)
        w2 = _decoded(src, f"model.llm.layers.{layer}.mlp.experts.w2_weight", layer)
        got = ckpt.read(f"decoder.layers.{layer}.mlp.experts.experts.linear_fc1.weight")
        assert torch.equal(_bits(got[:, :F]), _bits(w13[:, 0::2])) and torch.equal(_bits(got[:, F:]), _bits(w13[:, 1::2]))
        assert torch.equal(_bits(ckpt.read(f"decoder.layers.{layer}.mlp.experts.experts.linear_fc2.weight")), _bits(w2))
    assert not any(k.startswith("model.visual") or "visual" in k for k in ckpt.keys)


def test_bridge_preset_round_trips(tmp_path):
    from inkling_ckpt.convert.megatron import hf_to_megatron, megatron_to_hf
    from inkling_ckpt.errors import CheckpointError

    ref = HFCheckpoint.open(TINY["mixed"])
    hf_to_megatron(ref, tmp_path / "mg", preset="bridge", progress=False)
    ckpt = TorchDistCheckpoint.open(tmp_path / "mg")
    assert "decoder.layers.7.mlp.experts.experts.linear_fc1.weight" in ckpt.keys  # layer 3's MoE at 2·3+1
    assert "decoder.layers.6.self_attention.linear_qkv.weight.q" in ckpt.keys
    assert "decoder.final_norm.weight" in ckpt.keys
    megatron_to_hf(tmp_path / "mg", tmp_path / "back", ref, preset="bridge", progress=False)
    assert _differing(TINY["mixed"], tmp_path / "back") == []
    megatron_to_hf(tmp_path / "mg", tmp_path / "auto", ref, progress=False)  # the preset recorded in common.pt
    assert _differing(TINY["mixed"], tmp_path / "auto") == []
    with pytest.raises(CheckpointError, match="no preset miles rule uses .*; its keys follow preset bridge"):
        megatron_to_hf(tmp_path / "mg", tmp_path / "wrong", ref, preset="miles", progress=False)


def test_plan_change_on_the_way_back(cli, tmp_path, megatron):
    """megatron-to-hf --plan: every layer in the new format; layers that were MXFP8 keep their values."""
    from inkling_ckpt.convert.megatron import megatron_to_hf
    from inkling_ckpt.model.precision import PrecisionPlan

    ref = HFCheckpoint.open(TINY["mixed"])
    megatron_to_hf(megatron["mixed"], tmp_path / "mx", ref, plan=PrecisionPlan.uniform("mxfp8", 4), scales="fresh",
                   progress=False)
    out = HFCheckpoint.open(tmp_path / "mx")
    assert str(out.plan) == "0-3:mxfp8"
    assert out.config["quantization_config"]["quant_method"] == "fp8"  # the MXFP8 release's config
    base = "model.llm.layers.3.mlp.experts.w2_weight"
    assert torch.equal(_decoded(ref, base, 3), _decoded(out, base, 3))
    # BF16 layers out of a quantized reference: the decoded values themselves.
    megatron_to_hf(megatron["mixed"], tmp_path / "bf", ref, plan=PrecisionPlan.uniform("bf16", 4), scales="fresh",
                   progress=False)
    bf = HFCheckpoint.open(tmp_path / "bf")
    assert "quantization_config" not in bf.config
    base = "model.llm.layers.0.mlp.experts.w13_weight"
    assert torch.equal(_bits(bf.get(base)), _bits(_decoded(ref, base, 0)))
    # keep needs the reference's NVFP4 amax: one line, nothing written.
    code, _, err = cli("convert", "megatron-to-hf", megatron["bf16"], tmp_path / "dst", "--reference", TINY["bf16"],
                       "--plan", "0-1:nvfp4,2-3:bf16", "-q")
    assert code != 0 and "layer 0 is nvfp4 in the plan but bf16 in the reference" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "dst").exists()


def test_skip_when_done_force_and_other_job(cli, tmp_path):
    dst = tmp_path / "mg"
    assert cli("convert", "hf-to-megatron", TINY["bf16"], dst, "-q")[0] == 0
    stamp = (dst / "release" / ".metadata").stat().st_mtime_ns
    code, out, _ = cli("convert", "hf-to-megatron", TINY["bf16"], dst, "-q")
    assert code == 0 and "nothing to do" in out
    assert (dst / "release" / ".metadata").stat().st_mtime_ns == stamp
    code, _, err = cli("convert", "hf-to-megatron", TINY["mixed"], dst, "-q")
    assert code != 0 and "--force" in err and len(err.strip().splitlines()) == 1
    code, out, err = cli("convert", "hf-to-megatron", TINY["mixed"], dst, "-q", "--force")
    assert code == 0, err
    assert TorchDistCheckpoint.open(dst).common["inkling"]["source_plan"] == "0-1:nvfp4,2-3:mxfp8"


def test_resume_reuses_finished_units(tmp_path, monkeypatch):
    """A conversion that dies part-way resumes: finished units are not rebuilt, output identical."""
    from inkling_ckpt.convert import megatron as conv
    from inkling_ckpt.layouts import megatron as layout

    src = HFCheckpoint.open(TINY["mixed"])
    conv.hf_to_megatron(src, tmp_path / "ref", progress=False)

    real = MegatronMapping.to_megatron

    def dying(self, key, t):
        if key.startswith("decoder.layers.2."):
            raise KeyboardInterrupt  # not an InklingError: staging is kept for a resume
        return real(self, key, t)

    monkeypatch.setattr(MegatronMapping, "to_megatron", dying)
    with pytest.raises(KeyboardInterrupt):
        conv.hf_to_megatron(src, tmp_path / "out", progress=False)
    staging = tmp_path / ".out.inkling-partial"
    assert not (tmp_path / "out").exists() and staging.is_dir()
    assert not (staging / "release" / "metadata.json").exists()
    with pytest.raises(Exception, match="metadata.json"):
        TorchDistCheckpoint.open(staging)
    finished = sorted(p.name for p in (staging / "release" / layout.UNITS_DIR).glob("*.json"))
    assert finished == ["0.json", "1.json", "2.json"]  # globals, layers 0 and 1

    built: list[str] = []

    def counting(self, key, t):
        built.append(key)
        return real(self, key, t)

    monkeypatch.setattr(MegatronMapping, "to_megatron", counting)
    result = conv.hf_to_megatron(src, tmp_path / "out", progress=False)
    assert result.resumed and built
    assert not any(k.startswith(("decoder.layers.0.", "decoder.layers.1.", "embedding.")) for k in built)
    assert same_files(tmp_path / "ref" / "release", tmp_path / "out" / "release", ignore_hidden=False) == []


def test_hf_to_hf_reproduces_the_bundled_variants(cli, tmp_path):
    code, _, err = cli("convert", "hf-to-hf", TINY["bf16"], tmp_path / "mx", "--plan", "mxfp8", "--max-shard-size", "2MB", "-q")
    assert code == 0, err
    assert same_files(TINY["mxfp8"], tmp_path / "mx") == []
    code, _, err = cli("convert", "hf-to-hf", TINY["mixed"], tmp_path / "bf", "--plan", "bf16", "-q")
    assert code == 0, err
    back = HFCheckpoint.open(tmp_path / "bf")
    assert back.plan.variant == "bf16"


# ---- bad input: one line naming the file or tensor, exit != 0, nothing published ------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _fails(cli, tmp_path, *args, match: str) -> str:
    code, out, err = cli(*args)
    assert code != 0, out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("inkling-ckpt: error:"), err
    assert match in lines[0], lines[0]
    assert not (tmp_path / "dst").exists()
    assert not any(p.name.startswith(".dst.") for p in tmp_path.iterdir())
    return lines[0]


def _shard(folder: Path, i: int = 1) -> Path:
    return sorted(folder.glob("model-*.safetensors"))[i]


def test_bad_hf_inputs(cli, tmp_path):
    dst = tmp_path / "dst"
    # truncated shard
    src = _copy(TINY["mixed"], tmp_path / "trunc")
    shard = _shard(src)
    shard.write_bytes(shard.read_bytes()[:-1000])
    _fails(cli, tmp_path, "convert", "hf-to-megatron", src, dst, match=shard.name)
    # corrupted header
    src = _copy(TINY["mixed"], tmp_path / "hdr")
    shard = _shard(src)
    data = bytearray(shard.read_bytes())
    data[8:20] = b"\x00garbage!!!\x01"
    shard.write_bytes(bytes(data))
    _fails(cli, tmp_path, "convert", "hf-to-megatron", src, dst, match=shard.name)
    # shard missing from disk
    src = _copy(TINY["mixed"], tmp_path / "missing")
    gone = _shard(src, 0)
    gone.unlink()
    _fails(cli, tmp_path, "convert", "hf-to-megatron", src, dst, match=gone.name)
    # index entry pointing outside the folder
    src = _copy(TINY["mixed"], tmp_path / "outside")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../" + index["weight_map"][name]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    _fails(cli, tmp_path, "convert", "hf-to-megatron", src, dst, match="outside")
    # a tensor whose shape disagrees with the config
    src = _copy(TINY["bf16"], tmp_path / "shape")
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"]["moe_intermediate_size"] = 32
    (src / "config.json").write_text(json.dumps(cfg))
    _fails(cli, tmp_path, "convert", "hf-to-megatron", src, dst, match="config")
    # a config missing a required field
    src = _copy(TINY["bf16"], tmp_path / "field")
    cfg = json.loads((src / "config.json").read_text())
    del cfg["text_config"]["head_dim"]
    (src / "config.json").write_text(json.dumps(cfg))
    _fails(cli, tmp_path, "convert", "hf-to-megatron", src, dst, match="head_dim")


def _reference(tmp_path: Path, name: str, *, layers: int | None = None, experts: int | None = None) -> Path:
    """The mixed fixture cut down to fewer layers or experts: a reference of another model."""
    from safetensors.torch import save_file

    src = HFCheckpoint.open(TINY["mixed"])
    config = json.loads((TINY["mixed"] / "config.json").read_text())
    text = config["text_config"]
    tensors = {}
    for n in src.tensors:
        t = src.get(n)
        m = re.match(r"model\.llm\.(?:layers\.(\d+)\.|attn_res\.(attn|mlp)_queries\.(\d+))", n)
        if layers is not None and m:
            layer = int(m.group(1)) if m.group(1) else int(m.group(3)) + (m.group(2) == "attn")
            if layer >= layers:
                continue
        if experts is not None and (".mlp.experts." in n or ".mlp.gate." in n) and t.dim() >= 1:
            t = t[:experts]
        tensors[n] = t.contiguous()
    if layers is not None:
        text["num_hidden_layers"], text["layer_types"] = layers, text["layer_types"][:layers]
    if experts is not None:
        text["n_routed_experts"] = experts
    out = tmp_path / name
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    HFCheckpoint.open(out)  # a valid release checkpoint of another shape
    return out


def test_bad_torch_dist_inputs(cli, tmp_path, megatron):
    dst = tmp_path / "dst"
    ref = TINY["mixed"]
    # no metadata.json: an unfinished save
    mg = _copy(megatron["mixed"], tmp_path / "nometa")
    (mg / "release" / "metadata.json").unlink()
    _fails(cli, tmp_path, "convert", "megatron-to-hf", mg, dst, "--reference", ref, match="metadata.json")
    # common.pt that needs unsafe unpickling
    mg = _copy(megatron["mixed"], tmp_path / "unsafe")
    torch.save({"args": _Opaque(), "iteration": 0}, mg / "release" / "common.pt")
    _fails(cli, tmp_path, "convert", "megatron-to-hf", mg, dst, "--reference", ref, match="unsafe")
    # .metadata that would need an arbitrary global
    mg = _copy(megatron["mixed"], tmp_path / "evil")
    (mg / "release" / ".metadata").write_bytes(pickle.dumps(_Opaque()))
    _fails(cli, tmp_path, "convert", "megatron-to-hf", mg, dst, "--reference", ref, match="refusing")
    # truncated data file
    mg = _copy(megatron["mixed"], tmp_path / "cut")
    f = mg / "release" / "__3_0.distcp"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    _fails(cli, tmp_path, "convert", "megatron-to-hf", mg, dst, "--reference", ref, match="__3_0.distcp")
    # a reference of another model: its config differs from the one the folder keeps (named fields)
    two = _reference(tmp_path, "two", layers=2)
    _fails(cli, tmp_path, "convert", "megatron-to-hf", megatron["mixed"], dst, "--reference", two,
           match="describes another model than this checkpoint: reference: 2 layers; checkpoint: 4 layers")
    e4 = _reference(tmp_path, "e4", experts=4)
    _fails(cli, tmp_path, "convert", "megatron-to-hf", megatron["mixed"], dst, "--reference", e4,
           match="reference: 4 experts; checkpoint: 8 experts")
    # a folder that keeps no config: the tensors themselves are checked against the reference
    bare = _copy(megatron["mixed"], tmp_path / "bare")
    common = torch.load(bare / "release" / "common.pt", weights_only=True)
    common.pop("inkling", None)
    torch.save(common, bare / "release" / "common.pt")
    for p in (bare / "release").glob("*.sha256"):
        p.unlink()  # (a foreign folder has no sidecars either)
    _fails(cli, tmp_path, "convert", "megatron-to-hf", bare, dst, "--reference", two,
           match="reference: 2 layers; checkpoint: 4 layers")
    _fails(cli, tmp_path, "convert", "megatron-to-hf", bare, dst, "--reference", e4,
           match="reference: 4 experts; checkpoint: 8 experts")


class _Opaque:
    """Any class outside the weights-only allow-list."""


def _mount_tmpfs(path: Path, options: str) -> bool:
    import subprocess

    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


@pytest.mark.parametrize("options,match", [("size=1m", "No space left"), ("ro", "not writable")])
def test_full_or_read_only_destination(cli, tmp_path, options, match):
    mnt = tmp_path / "mnt"
    if not _mount_tmpfs(mnt, options):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        code, out, err = cli("convert", "hf-to-megatron", TINY["mixed"], mnt / "dst", "-q")
        assert code != 0
        lines = err.strip().splitlines()
        assert len(lines) == 1 and match in lines[0], err
        assert list(mnt.iterdir()) == []  # nothing published, staging removed
    finally:
        import subprocess

        subprocess.run(["umount", str(mnt)], check=False)


def test_dry_run_validates_and_writes_nothing(cli, tmp_path, megatron):
    code, out, err = cli("convert", "hf-to-megatron", TINY["mixed"], tmp_path / "mg", "--dry-run", "--json")
    assert code == 0, err
    info = json.loads(out)
    assert info["schema"] == "inkling-ckpt/hf-to-megatron-dry-run/1" and info["status"] == "dry-run"
    m = MegatronMapping(HFCheckpoint.open(TINY["mixed"]).cfg)
    assert info["tensors"] == len(m.keys()) and info["extra_state_objects"] == len(m.extra_state())
    assert info["chunks"] == sum(len(e.chunks()) for e in m.entries()) and info["preset"] == "miles"
    assert info["vision_tensors_left_out"] > 0
    assert not (tmp_path / "mg").exists() and list(tmp_path.iterdir()) == []
    code, out, err = cli("convert", "megatron-to-hf", megatron["mixed"], tmp_path / "hf", "--reference", TINY["mixed"],
                         "--dry-run", "--json")
    assert code == 0, err
    assert json.loads(out)["output_tensors"] == len(HFCheckpoint.open(TINY["mixed"]).tensors)
    code, out, err = cli("convert", "hf-to-megatron", TINY["mixed"], tmp_path / "mg", "--dry-run", "--preset", "bridge",
                         "--json")
    assert code == 0 and json.loads(out)["preset"] == "bridge", err
    code, _, err = cli("convert", "hf-to-megatron", TINY["mixed"], tmp_path / "mg", "--preset", "nemo")
    assert code == 2 and "'nemo' is not one of 'miles', 'bridge'" in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_megatron_to_hf_reads_stacked_layers(tmp_path, megatron):
    """A training run that treats layers as homogeneous saves ``decoder.layers.<name>`` with a
    leading layer axis (tensors that exist on every layer); megatron-to-hf reads it as per-layer
    keys and gives the fixture back byte for byte."""
    from inkling_ckpt.convert.megatron import megatron_to_hf
    from inkling_ckpt.layouts.megatron import ChunkItem, ObjectItem, common_state, finish_iteration_dir
    from inkling_ckpt.layouts.megatron_writer import write_dcp

    ours = TorchDistCheckpoint.open(megatron["mixed"])
    L = HFCheckpoint.open(TINY["mixed"]).cfg.num_hidden_layers
    groups: dict[str, list[str]] = {}
    for key in ours.keys:
        m = re.match(r"decoder\.layers\.(\d+)\.(.+)", key)
        name = f"decoder.layers.{m.group(2)}" if m else key
        groups.setdefault(name, []).append(key)
    chunks, source = [], {}
    for unit, (name, keys) in enumerate(groups.items()):
        if len(keys) == L and len({ours.keys[k].shape for k in keys}) == 1:  # stack: offsets with a layer index
            shape = (L, *ours.keys[keys[0]].shape)
            for i, k in enumerate(sorted(keys, key=lambda k: int(k.split(".")[2]))):
                for off, size in ours.keys[k].chunks:
                    chunks.append(ChunkItem(name, (i, *off), (1, *size), shape, ours.keys[k].dtype, unit))
                    source[(name, (i, *off))] = (k, off)
        else:
            for k in keys:
                for off, size in ours.keys[k].chunks:
                    chunks.append(ChunkItem(k, off, size, ours.keys[k].shape, ours.keys[k].dtype, unit))
                    source[(k, off)] = (k, off)

    def produce(c: ChunkItem):
        k, off = source[(c.key, c.offsets)]
        t = ours.read_chunk(k, off)
        return t.unsqueeze(0) if len(c.sizes) == t.dim() + 1 else t

    out = tmp_path / "stacked"
    write_dcp(out, chunks, [ObjectItem("x._extra_state/shard_0_1", 0, b"")], produce)
    finish_iteration_dir(out, common_state({}))
    assert "decoder.layers.mlp.experts.experts.linear_fc1.weight" in TorchDistCheckpoint.open(out).keys
    megatron_to_hf(out, tmp_path / "back", HFCheckpoint.open(TINY["mixed"]), scales="keep", progress=False)
    assert _differing(TINY["mixed"], tmp_path / "back") == []


def test_megatron_experts_must_be_bf16(tmp_path, megatron):
    """Experts stored in another dtype are refused by name (no implicit casts)."""
    from inkling_ckpt.convert.megatron import megatron_to_hf
    from inkling_ckpt.errors import CheckpointError
    from inkling_ckpt.layouts.megatron import ChunkItem, common_state, finish_iteration_dir
    from inkling_ckpt.layouts.megatron_writer import write_dcp

    ours = TorchDistCheckpoint.open(megatron["bf16"])
    bad = "decoder.layers.1.mlp.experts.experts.linear_fc2.weight"
    chunks = [ChunkItem(k, off, size, st.shape, torch.float32 if k == bad else st.dtype, 0)
              for k, st in ours.keys.items() for off, size in st.chunks]

    def produce(c: ChunkItem):
        t = ours.read_chunk(c.key, c.offsets)
        return t.float() if c.key == bad else t

    write_dcp(tmp_path / "f32", chunks, [], produce)
    finish_iteration_dir(tmp_path / "f32", common_state())
    with pytest.raises(CheckpointError, match=f"{re.escape(bad)} is F32; routed experts must be BF16"):
        megatron_to_hf(tmp_path / "f32", tmp_path / "back", HFCheckpoint.open(TINY["bf16"]), progress=False)
    assert not (tmp_path / "back").exists()


def test_big_dense_tensors_move_in_row_slices(tmp_path, monkeypatch):
    """A global tensor bigger than DENSE_CHUNK_BYTES (the real embeddings: 1.85 GB) is stored as row
    ranges (layer tensors stay one chunk, as the spec says): hf-to-megatron reads only each range's
    rows, megatron-to-hf reads row slices of the slice budget by position (here straddling the
    stored ranges, and cutting the bigger layer tensors' single chunks), never a big tensor whole,
    and the round trip gives the source back byte for byte."""
    from inkling_ckpt.convert.megatron import hf_to_megatron, megatron_to_hf
    from inkling_ckpt.model import mapping
    from inkling_ckpt.model.inventory import is_vision
    from inkling_ckpt.pipeline import Options

    limit = 48 * 1024
    monkeypatch.setattr(mapping, "DENSE_CHUNK_BYTES", limit)
    src = HFCheckpoint.open(TINY["mixed"])
    big = {n for n, t in src.tensors.items()
           if t.nbytes > limit and ".mlp.experts." not in n and not is_vision(n) and len(t.shape) >= 2}
    assert {"model.llm.embed.weight", "model.llm.unembed.weight"} <= big
    hf_reads: list[tuple[str, int]] = []
    rows_of = HFCheckpoint.read_rows

    def recording(self, name, start, stop, **kw):  # type: ignore[no-untyped-def]
        t = self.tensors[name]
        hf_reads.append((name, (stop - start) * t.nbytes // t.shape[0] if t.shape else t.nbytes))
        return rows_of(self, name, start, stop, **kw)

    monkeypatch.setattr(HFCheckpoint, "read_rows", recording)
    hf_to_megatron(src, tmp_path / "mg", options=Options(device="cpu", progress=False))
    glob = {"model.llm.embed.weight", "model.llm.unembed.weight"}
    assert max(n for name, n in hf_reads if name in glob) <= limit
    mg = TorchDistCheckpoint.open(tmp_path / "mg")
    m = MegatronMapping(src.cfg)
    for name in big:
        st = mg.keys[m.entry_for_hf(name).key]
        if name in glob:
            assert len(st.chunks) > 1 and all(size[0] * st.shape[1] * st.dtype.itemsize <= limit for _, size in st.chunks)
        else:
            assert len(st.chunks) == 1, name
    assert big - glob  # some layer tensors over the limit too

    regions: dict[str, int] = {}  # the largest region read of each key
    positioned: list[str] = []
    read, region = TorchDistCheckpoint.read, TorchDistCheckpoint._chunk_region

    def read_recording(self, key, offsets=None, sizes=None, **kw):  # type: ignore[no-untyped-def]
        t = read(self, key, offsets, sizes, **kw)
        regions[key] = max(regions.get(key, 0), t.nbytes)
        return t

    def region_recording(self, key, *args):  # type: ignore[no-untyped-def]
        t = region(self, key, *args)
        if t is not None:
            positioned.append(key)
        return t

    monkeypatch.setattr(TorchDistCheckpoint, "read", read_recording)
    monkeypatch.setattr(TorchDistCheckpoint, "_chunk_region", region_recording)
    megatron_to_hf(tmp_path / "mg", tmp_path / "back", src, scales="keep",
                   options=Options(device="cpu", slice_bytes=40 * 1024, workers=2, progress=False))
    keys = {m.entry_for_hf(n).key for n in big}
    assert max(regions[k] for k in keys) <= 40 * 1024
    assert "embedding.word_embeddings.weight" in positioned and "output_layer.weight" in positioned
    assert set(positioned) - {"embedding.word_embeddings.weight", "output_layer.weight"}  # parts of layer tensors
    assert _differing(TINY["mixed"], tmp_path / "back") == []


def test_the_memory_budget_counts_what_torch_dist_units_read():
    """hf-to-megatron's expert chunks cost their BF16 tensor plus the stored parts read to build it
    (NVFP4: a quarter more, MXFP8: a half) on the CPU, 1 byte on a GPU; megatron-to-hf's expert slices cost what they read and
    write, the stored slice twice on the CPU, and the reference's slice too with --scales keep."""
    from inkling_ckpt.convert.megatron import _blob_costs, _plan_to_hf, plan_megatron, source_mapping
    from inkling_ckpt.layouts.megatron import ObjectItem
    from inkling_ckpt.model.inventory import expert_stacks, inventory
    from inkling_ckpt.pipeline.units import expert_slice

    src = HFCheckpoint.open(TINY["mixed"])
    m = source_mapping(src)
    chunks, objects, _ = plan_megatron(m)
    cost, done = _blob_costs(src, m, "cpu")
    stacks = {st.name: st for st in expert_stacks(src.cfg, src.plan)}
    stacked = {e.key: stacks[e.hf] for e in m.entries() if e.stacked}
    seen = set()
    for c in chunks:
        st = stacked.get(c.key)
        if st is None:
            assert cost(c) == c.nbytes == done(c)
            continue
        stored = sum(p.nbytes for p in st.parts()) * c.sizes[0] // st.shape[0]
        assert cost(c) == c.nbytes + stored and stored > 0
        assert done(c) == c.nbytes  # once built, waiting for the writer: the serialized tensor alone
        seen.add(st.fmt)
    assert seen == {"nvfp4", "mxfp8"}
    assert all(cost(o) == 0 == done(o) for o in objects) and isinstance(objects[0], ObjectItem)
    # On a GPU the stored parts are read straight onto it and the chunk is written from there: an
    # expert chunk holds nothing on the host (1 byte); a dense one its tensor, read on the host.
    on_gpu, gpu_done = _blob_costs(src, m, "cuda")
    for c in chunks:
        want = 1 if c.key in stacked else c.nbytes
        assert on_gpu(c) == want == gpu_done(c)
    assert on_gpu(objects[0]) == 0 == gpu_done(objects[0])

    specs = inventory(src.cfg, src.plan, dtypes=src.dtypes())
    for host, keep in ((True, True), (True, False), (False, True), (False, False)):
        units = _plan_to_hf(m, specs, src.plan, 1 << 20, device_type="cpu" if host else "cuda", reference_read=keep)
        experts = [u for u in units if expert_slice(u) is not None]
        assert experts
        for u in experts:
            # on a GPU the stored slice and the reference's go straight onto it, and its result is
            # written from there: nothing stays on the host (1 byte)
            want = 2 * u.read_bytes + (2 if keep else 1) * u.write_bytes if host else 1
            assert u.memory == want and u.write_bytes > 0


@pytest.mark.parametrize("slice_bytes", [1, 1 << 20])
def test_megatron_to_hf_units_name_the_bytes_they_read(megatron, file_reads, slice_bytes):
    """What the executor reads ahead for a megatron-to-hf unit (its extents) covers every byte the
    unit then reads, of the torch_dist blobs and of the reference, and an expert slice's extents are
    exactly its blobs (a first read checks a whole blob against its sha256) and kept reference parts."""
    from inkling_ckpt.convert import megatron as conv
    from inkling_ckpt.convert.experts import ExpertEncoder
    from inkling_ckpt.pipeline import expert_slice

    ref = HFCheckpoint.open(TINY["mixed"])
    reader, plan, m, specs = conv._open_megatron(megatron["mixed"], ref, None, None)
    encoder = ExpertEncoder(plan, scales="keep", reference=ref)
    units = conv._plan_to_hf(m, specs, plan, slice_bytes)
    ex = conv.Executor(conv.Options(device="cpu", progress=False))
    run, extents = conv._to_hf_transform(reader, m, ref, encoder, ex), conv._to_hf_reads(reader, m, ref, encoder)
    experts = kept = 0
    for u in units:
        file_reads.clear()
        run(u)  # an expert slice encodes too, keeping the reference's scales and unchanged bytes
        want, got = byte_ranges(extents(u)), byte_ranges(file_reads)
        assert within(got, want), u.key
        if expert_slice(u) is not None:
            assert got == want, u.key
            experts += 1
            kept += any(Path(p).resolve().parent == TINY["mixed"].resolve() for p, _, _ in extents(u))
    assert experts > 0 and kept > 0


@pytest.mark.parametrize("variant", ["mixed", "bf16"])
def test_hf_to_megatron_chunks_name_the_bytes_they_read(file_reads, variant):
    """What the executor reads ahead for each torch_dist chunk hf-to-megatron builds is exactly what
    building it reads of the source."""
    from inkling_ckpt.convert import megatron as conv

    src = HFCheckpoint.open(TINY[variant])
    m, chunks, _, _, _ = conv._validated_plan(src, "miles")
    produce, reads = conv.chunk_producer(src, m), conv.chunk_reads(src, m)
    for item in chunks:
        file_reads.clear()
        produce(item)
        assert byte_ranges(file_reads) == byte_ranges(reads(item)), (item.key, item.offsets)
    assert any(m.entry(c.key).stacked for c in chunks) and len(chunks) > 20


@pytest.mark.parametrize("variant, plan, reference", [("bf16", "0-3:nvfp4", None), ("mixed", "0-3:bf16", None),
                                                       ("mixed", "0-3:mxfp8", "mixed"), ("bf16", None, "mixed")])
def test_requantize_units_name_the_bytes_they_read(file_reads, variant, plan, reference):
    """What the executor reads ahead for a quantize / dequantize / hf-to-hf unit is exactly what the
    unit then reads of the source and of a reference whose scales it keeps (BF16 quantized to the
    reference's plan with ``--scales keep``: every NVFP4 expert takes the reference's amax)."""
    from inkling_ckpt.convert import requantize as rq
    from inkling_ckpt.convert.experts import ExpertEncoder
    from inkling_ckpt.model.inventory import inventory
    from inkling_ckpt.model.precision import PrecisionPlan, dense_as
    from inkling_ckpt.pipeline import Executor, Options

    src = HFCheckpoint.open(TINY[variant])
    ref = HFCheckpoint.open(TINY[reference]) if reference is not None else None
    p = dense_as(PrecisionPlan.parse(plan, src.cfg.num_hidden_layers) if plan else ref.plan, src.plan, None)
    encoder = ExpertEncoder(p, scales="keep" if ref is not None else "fresh", reference=ref)
    specs = inventory(src.cfg, p, dtypes=src.dtypes(), vision=src.vision_specs())
    ex = Executor(Options(device="cpu", progress=False))
    run, reads = rq.transform(src, p, encoder, ex), rq.reads(src, p, encoder)
    units = rq.plan_units(src, specs, p, 1)
    kept = 0
    for u in units:
        file_reads.clear()
        run(u)
        assert byte_ranges(file_reads) == byte_ranges(reads(u)), u.key
        kept += reference not in (None, variant) and any(Path(f).parent == TINY[reference].resolve() for f, _, _ in reads(u))
    assert len(units) > 20 and (kept > 0) == (plan is None)


def test_dtype_rounds_but_never_overflows(cli, tmp_path):
    """--dtype f16 is the permission to round experts, not to overflow them: an expert value beyond
    F16's range is refused in one line naming the tensor and the value, with nothing published, on
    each path that narrows (a BF16 or MXFP8 source decoded to F16; torch_dist BF16 re-encoded as F16),
    where the encoder used to report the infinity the cast made as the source's own "NaN or Inf
    values" and offer --allow-nonfinite, which would have written it. A wider --dtype passes."""
    from safetensors.torch import load_file, save_file

    big = _copy(TINY["bf16"], tmp_path / "big")
    name = "model.llm.layers.0.mlp.experts.w2_weight"
    for f in big.glob("model-*.safetensors"):
        tensors = load_file(f)
        if name in tensors:
            tensors[name][0, 0, 0] = 1e6
            save_file(tensors, str(f), metadata={"format": "pt"})
    assert cli("quantize", big, tmp_path / "bigq", "--plan", "mxfp8", "-q")[0] == 0
    assert cli("convert", "hf-to-megatron", big, tmp_path / "bigmg", "-q")[0] == 0
    want = f"{name}: value 999424 at (0, 0, 0) is beyond float16's range (max 65504)"
    _fails(cli, tmp_path, "convert", "hf-to-hf", big, tmp_path / "dst", "--plan", "bf16", "--dtype", "f16", "-q",
           match=want)
    _fails(cli, tmp_path, "convert", "hf-to-hf", big, tmp_path / "dst", "--plan", "bf16", "--dtype", "f16",
           "--allow-nonfinite", "-q", match=want)
    _fails(cli, tmp_path, "dequantize", tmp_path / "bigq", tmp_path / "dst", "--dtype", "f16", "-q",
           match=f"{name}: value 983040 at (0, 0, 0) is beyond float16's range")
    _fails(cli, tmp_path, "convert", "megatron-to-hf", tmp_path / "bigmg", tmp_path / "dst", "--reference", big,
           "--dtype", "f16", "-q", match=want)
    assert cli("convert", "hf-to-hf", big, tmp_path / "dst", "--plan", "bf16", "--dtype", "f32", "-q")[0] == 0
