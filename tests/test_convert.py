"""convert hf-to-megatron / megatron-to-hf / hf-to-hf on the bundled tiny fixtures."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from conftest import TINY, same_files
from inkling_ckpt.convert.megatron import logical_getter
from inkling_ckpt.layouts.hf import HFCheckpoint
from inkling_ckpt.layouts.megatron import BACKEND, TorchDistCheckpoint
from inkling_ckpt.model.mapping import InklingMapping


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _differing(a: Path, b: Path) -> list[str]:
    x, y = HFCheckpoint.open(a), HFCheckpoint.open(b)
    assert set(x.tensors) == set(y.tensors)
    return [n for n in x.tensors if not torch.equal(_bits(x.get(n)), _bits(y.get(n)))]


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


@pytest.mark.parametrize("variant", ["bf16", "mixed", "mxfp8"])
def test_round_trip_with_kept_scales_is_byte_identical(cli, tmp_path, megatron, variant):
    code, out, err = cli("convert", "megatron-to-hf", megatron[variant], tmp_path / "back",
                         "--reference", TINY[variant], "--scales", "keep", "-q")
    assert code == 0, err
    assert _differing(TINY[variant], tmp_path / "back") == []
    # Configs and pass-through files too (shard boundaries may differ: compare tensors, not shards).
    for name in ("config.json", "generation_config.json", "hf_quant_config.json"):
        if (TINY[variant] / name).exists():
            assert json.loads((TINY[variant] / name).read_text()) == json.loads((tmp_path / "back" / name).read_text())


def test_fresh_scales_change_bytes_not_values(tmp_path, megatron):
    """--scales fresh: which tensors differ, and why.

    Every difference is an equal value written with other bytes: NVFP4 elements that rounded to
    -0 decode to -0.0 and re-encode as +0 (nibble 0x0, the ModelOpt convention), and MXFP8
    blocks whose largest element rounded down to 224·2^s re-encode one scale lower. Nothing
    outside the routed experts changes.
    """
    from inkling_ckpt.convert.megatron import megatron_to_hf

    ref = HFCheckpoint.open(TINY["mixed"])
    megatron_to_hf(megatron["mixed"], tmp_path / "fresh", ref, scales="fresh", progress=False)
    differ = _differing(TINY["mixed"], tmp_path / "fresh")
    modules = sorted({n.rsplit(".", 1)[0] for n in differ})
    assert all(".mlp.experts." in n for n in differ)
    a, b = logical_getter(ref), logical_getter(HFCheckpoint.open(tmp_path / "fresh"))
    assert all(torch.equal(a(m + ".weight"), b(m + ".weight")) for m in modules)  # == treats -0.0 as 0.0
    print(f"--scales fresh: {len(differ)} of {len(ref.tensors)} tensors differ in bytes "
          f"({len(modules)} expert linears), 0 in decoded values")


def test_torch_dist_folder_matches_the_spec(megatron):
    root = megatron["mixed"]
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "release"
    rel = root / "release"
    assert json.loads((rel / "metadata.json").read_text()) == BACKEND
    common = torch.load(rel / "common.pt", weights_only=True)
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == 0
    assert common["content_metadata"] == {"non_homogeneous_layers": True}
    ckpt = TorchDistCheckpoint.open(root)
    m = InklingMapping(ckpt_cfg := HFCheckpoint.open(TINY["mixed"]).cfg)
    assert set(ckpt.keys) == set(m.megatron_keys())
    assert set(ckpt.objects) == set(m.extra_state_keys())
    for key in m.megatron_keys():
        st = ckpt.keys[key]
        assert st.shape == m.megatron_shape(key) and st.dtype == m.megatron_dtype(key)
        assert len(st.chunks) == len(m.chunks(key))  # one chunk per expert for stacked experts
    E = ckpt_cfg.n_routed_experts
    fc1 = ckpt.keys["decoder.layers.0.mlp.experts.experts.linear_fc1.weight"]
    assert fc1.chunks[3] == ((3, 0, 0), (1, 2 * ckpt_cfg.moe_intermediate_size, ckpt_cfg.hidden_size)) and len(fc1.chunks) == E
    assert ckpt.read_object(m.extra_state_keys()[0])[0].numel() == 0
    # Values: every tensor equals the mapping applied to the (decoded) HF source.
    src = HFCheckpoint.open(TINY["mixed"])
    get = logical_getter(src)
    for key in m.megatron_keys():
        assert torch.equal(ckpt.read(key), m.to_megatron(key, get)), key


def test_pad_vocab_round_trips(cli, tmp_path):
    code, _, err = cli("convert", "hf-to-megatron", TINY["bf16"], tmp_path / "mg", "--pad-vocab-to-multiple", "384", "-q")
    assert code == 0, err
    ckpt = TorchDistCheckpoint.open(tmp_path / "mg")
    emb = ckpt.read("embedding.word_embeddings.weight")
    assert emb.shape[0] == 768 and not emb[512:].any()
    code, _, err = cli("convert", "megatron-to-hf", tmp_path / "mg", tmp_path / "back", "--reference", TINY["bf16"], "-q")
    assert code == 0, err
    assert _differing(TINY["bf16"], tmp_path / "back") == []


def test_hf_to_hf_reproduces_the_bundled_variants(cli, tmp_path):
    code, _, err = cli("convert", "hf-to-hf", TINY["bf16"], tmp_path / "mx", "--plan", "mxfp8", "--max-shard-size", "2MB", "-q")
    assert code == 0, err
    assert same_files(TINY["mxfp8"], tmp_path / "mx") == []
    code, _, err = cli("convert", "hf-to-hf", TINY["mixed"], tmp_path / "bf", "--plan", "bf16", "-q")
    assert code == 0, err
    back = HFCheckpoint.open(tmp_path / "bf")
    assert back.plan.variant == "bf16"


def test_plan_change_on_the_way_back(tmp_path, megatron):
    """megatron-to-hf --plan mxfp8 from a mixed reference equals hf-to-hf of the decoded weights."""
    from inkling_ckpt.convert.megatron import megatron_to_hf
    from inkling_ckpt.model.precision import PrecisionPlan

    ref = HFCheckpoint.open(TINY["mixed"])
    megatron_to_hf(megatron["mixed"], tmp_path / "mx", ref, plan=PrecisionPlan.uniform("mxfp8", 4), scales="fresh",
                   progress=False)
    out = HFCheckpoint.open(tmp_path / "mx")
    assert out.plan.variant == "mxfp8"
    # Layers 2-3 were MXFP8 already: same values as the reference.
    a, b = logical_getter(ref), logical_getter(out)
    name = "model.language_model.layers.3.mlp.experts.1.down_proj.weight"
    assert torch.equal(a(name), b(name))


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

    calls = {"n": 0}
    real = InklingMapping.build_chunk

    def dying(self, key, offsets, sizes, get_hf):
        calls["n"] += 1
        if key.startswith("decoder.layers.2."):
            raise KeyboardInterrupt  # not an InklingError: staging is kept for a resume
        return real(self, key, offsets, sizes, get_hf)

    monkeypatch.setattr(InklingMapping, "build_chunk", dying)
    with pytest.raises(KeyboardInterrupt):
        conv.hf_to_megatron(src, tmp_path / "out", progress=False)
    staging = tmp_path / ".out.inkling-partial"
    assert not (tmp_path / "out").exists() and staging.is_dir()
    assert not (staging / "release" / "metadata.json").exists()
    with pytest.raises(Exception, match="metadata.json"):
        TorchDistCheckpoint.open(staging)
    finished = sorted(p.name for p in (staging / "release" / layout.UNITS_DIR).glob("*.json"))
    assert finished == ["0.json", "1.json", "2.json"]  # globals, layers 0 and 1

    monkeypatch.setattr(InklingMapping, "build_chunk", real)
    built: list[str] = []

    def counting(self, key, offsets, sizes, get_hf):
        built.append(key)
        return real(self, key, offsets, sizes, get_hf)

    monkeypatch.setattr(InklingMapping, "build_chunk", counting)
    result = conv.hf_to_megatron(src, tmp_path / "out", progress=False)
    assert result.resumed
    assert not any(k.startswith(("decoder.layers.0.", "decoder.layers.1.", "embedding.")) for k in built)
    assert same_files(tmp_path / "ref" / "release", tmp_path / "out" / "release", ignore_hidden=False) == []


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
    gone = _shard(src, 2)
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
    # a reference of another model: the checkpoint holds layers the reference does not have
    assert cli("make-fixture", tmp_path / "two", "--layers", "2", "-q")[0] == 0
    _fails(cli, tmp_path, "convert", "megatron-to-hf", megatron["mixed"], dst, "--reference", tmp_path / "two",
           match="no rule consumes tensor decoder.layers.2.")
    # a tensor of the wrong global shape
    assert cli("make-fixture", tmp_path / "e4", "--experts", "4", "-q")[0] == 0
    _fails(cli, tmp_path, "convert", "megatron-to-hf", megatron["mixed"], dst, "--reference", tmp_path / "e4",
           match="mlp.router.weight is [8, 256]")


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
    code, out, err = cli("convert", "hf-to-megatron", TINY["mixed"], tmp_path / "mg", "--dry-run")
    assert code == 0, err
    info = json.loads(out)
    m = InklingMapping(HFCheckpoint.open(TINY["mixed"]).cfg)
    assert info["tensors"] == len(m.megatron_keys()) and info["extra_state_objects"] == len(m.extra_state_keys())
    assert info["chunks"] == sum(len(m.chunks(k)) for k in m.megatron_keys())
    assert not (tmp_path / "mg").exists() and list(tmp_path.iterdir()) == []
    code, out, err = cli("convert", "megatron-to-hf", megatron["mixed"], tmp_path / "hf", "--reference", TINY["mixed"],
                         "--dry-run")
    assert code == 0, err
    assert json.loads(out)["output_tensors"] == len(HFCheckpoint.open(TINY["mixed"]).tensors)
    assert list(tmp_path.iterdir()) == []


def test_megatron_to_hf_reads_stacked_layers(tmp_path, megatron):
    """A training run that treats layers as homogeneous saves ``decoder.layers.<name>`` with a
    leading layer axis (only the K/V convolutions of the full-attention layer stay per layer
    here); megatron-to-hf reads it as per-layer keys and gives the fixture back byte for byte."""
    import re

    from inkling_ckpt.convert.megatron import megatron_to_hf
    from inkling_ckpt.layouts.megatron import ChunkItem, ObjectItem, common_state, finish_iteration_dir, write_dcp

    ours = TorchDistCheckpoint.open(megatron["mixed"])
    L = HFCheckpoint.open(TINY["mixed"]).cfg.num_hidden_layers
    groups: dict[str, list[str]] = {}
    for key in ours.keys:
        m = re.match(r"decoder\.layers\.(\d+)\.(.+)", key)
        name = f"decoder.layers.{m.group(2)}" if m else key
        groups.setdefault(name, []).append(key)
    chunks, source = [], {}
    for unit, (name, keys) in enumerate(groups.items()):
        if len(keys) == L:  # stack: chunk per layer (and per expert), offsets with a layer index
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
