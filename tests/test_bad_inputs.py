"""The bad-input corpus (issues 11 and 12): untrusted checkpoints and careless commands.

Every case builds one bad input from the bundled fixtures used as opaque folders (no tensor
names, no layout knowledge: "the first tensor of the first shard", "the first key stored in
several chunks"), runs the CLI in-process and asserts the same contract:

* exit status non-zero, and exactly one line on stderr naming the file and the problem;
* no traceback;
* nothing published (DST absent, or byte-identical when it existed), no staging folder left;
* every input untouched (a hash of its whole tree before and after);
* for code-execution payloads, the marker file the payload would create does not exist.

Cases register themselves with ``@case`` and run through one parametrized test, so the whole
list reads in one place. Class numbers refer to issue 11; classes 11-17 to issue 15 (round two:
every input counts against DST, --force replaces only our own outputs, no write follows a link,
no read leaves its folder or blocks, the unpickler builds instances only, no silent wrong output,
the library refuses what the CLI refuses).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import pickle
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from conftest import FIXTURES

BF16 = FIXTURES / "tiny-bf16"
MIXED = FIXTURES / "tiny-mixed"


# ---- helpers --------------------------------------------------------------------------------------

def tree_hash(root: Path) -> str:
    """sha256 over every path, symlink target and file byte under ``root`` (or of ``root`` itself)."""
    h = hashlib.sha256()
    if not root.exists() and not root.is_symlink():
        return "absent"
    paths = [root] if not root.is_dir() else sorted(root.rglob("*"))
    for p in paths:
        h.update(str(p.relative_to(root) if p != root else ".").encode() + b"\0")
        if p.is_symlink():
            h.update(b"L" + os.readlink(p).encode())
        elif p.is_file():
            h.update(b"F" + p.read_bytes())
        else:
            h.update(b"D")
    return h.hexdigest()


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def index_of(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "model.safetensors.index.json").read_text())


def write_index(folder: Path, index: dict[str, Any]) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def shards_of(folder: Path) -> list[str]:
    return sorted(set(index_of(folder)["weight_map"].values()))


def read_st_header(path: Path) -> tuple[int, dict[str, Any]]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n))


def rewrite_st_header(path: Path, header: dict[str, Any]) -> None:
    """Replace a safetensors header in place, padded to its original length (data stays put)."""
    n, _ = read_st_header(path)
    blob = json.dumps(header, separators=(",", ":")).encode()
    assert len(blob) <= n, "rewritten header must fit"
    data = path.read_bytes()
    path.write_bytes(data[:8] + blob + b" " * (n - len(blob)) + data[8 + n:])


def config_of(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg.get("text_config", cfg)


@dataclass
class Bad:
    """One bad input: the command, what the error line must mention, what must stay untouched."""

    args: list[Any]
    needle: str  # the problem, as the message words it (case-insensitive)
    names: str  # the file (or folder) the message must name
    inputs: list[Path] = field(default_factory=list)
    dst: Path | None = None
    marker: Path | None = None
    patch: Callable[[pytest.MonkeyPatch], None] | None = None
    intact: Callable[[], str | None] | None = None  # after the run: a description of damage, or None


CASES: dict[str, Callable[[Path, dict[str, Path]], Bad]] = {}


def case(fn: Callable[[Path, dict[str, Path]], Bad]) -> Callable[[Path, dict[str, Path]], Bad]:
    CASES[fn.__name__] = fn
    return fn


class _Built(dict):
    """Outputs of our own writers, each made once on first use: a torch_dist and a sharded folder."""

    RECIPES = {
        "megatron": lambda out: ["convert", "hf-to-megatron", BF16, out, "-q"],
        "sharded": lambda out: ["shard", BF16, out, "--tp", "1", "-q"],
        "adapter": lambda out: ["lora", "export", _Built.dump_of(out), out, "--config", BF16, "-q"],
    }

    @staticmethod
    def dump_of(out: Path) -> Path:
        """A trainer-side LoRA dump (Megatron-Bridge names) for the BF16 fixture, beside ``out``."""
        from safetensors.torch import save_file

        from inkling_ckpt.lora import ModelDims
        from test_lora import ALPHA, trainer_adapter

        p = out.parent / "trainer-dump.safetensors"
        if not p.exists():
            dims = ModelDims.from_config(json.loads((BF16 / "config.json").read_text()))
            save_file(trainer_adapter(dims, seed=3), str(p), metadata={"lora_alpha": str(ALPHA)})
        return p

    def __init__(self, base: Path):
        super().__init__()
        self.base = base

    def __missing__(self, kind: str) -> Path:
        from inkling_ckpt.cli.app import main

        out = self.base / kind
        try:
            main([str(a) for a in self.RECIPES[kind](out)])
        except SystemExit as e:
            assert not e.code, f"building the {kind} input failed"
        self[kind] = out
        return out


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    return _Built(tmp_path_factory.mktemp("built"))


def release(m: Path) -> Path:
    return m / "release"


def load_metadata(folder: Path):
    """The ``.metadata`` of a folder this suite built, as DCP's own classes (a trusted file: plain
    pickle), so a case can alter it and pickle it back under DCP's names."""
    return pickle.loads((release(folder) / ".metadata").read_bytes())


# ---- 1. code execution from .metadata ---------------------------------------------------------------

def _global_call_pickle(module: str, name: str, arg: str) -> bytes:
    """A protocol-4 pickle calling ``module``'s global ``name`` (dotted: traversed) with ``arg``."""
    def s(x: str) -> bytes:
        b = x.encode()
        return b"\x8c" + bytes([len(b)]) + b
    return b"\x80\x04" + s(module) + s(name) + b"\x93" + s(arg) + b"\x85R."


@case
def metadata_dotted_global_in_allowed_module(tmp, built):
    m = copy(built["megatron"], tmp / "m")
    marker = tmp / "pwned"
    (release(m) / ".metadata").write_bytes(
        _global_call_pickle("torch.distributed.checkpoint.filesystem", "os.system", f"touch {marker}"))
    return Bad(["convert", "megatron-to-hf", m, tmp / "out", "--reference", BF16, "--dry-run"],
               "refusing to unpickle", ".metadata", inputs=[m], dst=tmp / "out", marker=marker)


@case
def metadata_dotted_global_runs_on_convert(tmp, built):
    m = copy(built["megatron"], tmp / "m")
    marker = tmp / "pwned"
    (release(m) / ".metadata").write_bytes(
        _global_call_pickle("torch.distributed.checkpoint.metadata", "os.system", f"touch {marker}"))
    return Bad(["convert", "megatron-to-hf", m, tmp / "out", "--reference", BF16, "-q"],
               "refusing to unpickle", ".metadata", inputs=[m], dst=tmp / "out", marker=marker)


@case
def metadata_megatron_stand_in_with_dotted_name(tmp, built):
    m = copy(built["megatron"], tmp / "m")
    marker = tmp / "pwned"
    (release(m) / ".metadata").write_bytes(
        _global_call_pickle("megatron.core.dist_checkpointing", "os.system", f"touch {marker}"))
    return Bad(["convert", "megatron-to-hf", m, tmp / "out", "--reference", BF16, "--dry-run"],
               "refusing to unpickle", ".metadata", inputs=[m], dst=tmp / "out", marker=marker)


# ---- 2. shard --merge writes outside DST -------------------------------------------------------------

def _manifest(s: Path) -> dict[str, Any]:
    return json.loads((s / "inkling-shard.json").read_text())


def _write_manifest(s: Path, man: dict[str, Any]) -> None:
    (s / "inkling-shard.json").write_text(json.dumps(man))


@case
def merge_source_name_leaves_dst(tmp, built):
    s = copy(built["sharded"], tmp / "s")
    man = _manifest(s)
    plain = next(k for k, v in man["source"].items() if "header" not in v)
    man["source"]["../../escaped.json"] = man["source"].pop(plain)
    _write_manifest(s, man)
    shutil.copyfile(s / "source" / plain, tmp / "escaped.json")  # what source/../../escaped.json reads
    out = tmp / "a" / "b" / "out"
    return Bad(["shard", "--merge", s, out, "-q"], "leaves its folder", "inkling-shard.json",
               inputs=[s, tmp / "escaped.json"], dst=out, marker=tmp / "a" / "escaped.json")


@case
def merge_source_name_absolute(tmp, built):
    s = copy(built["sharded"], tmp / "s")
    man = _manifest(s)
    plain = next(k for k, v in man["source"].items() if "header" not in v)
    man["source"][str(tmp / "abs-escaped.json")] = man["source"].pop(plain)
    _write_manifest(s, man)
    return Bad(["shard", "--merge", s, tmp / "out", "-q"], "absolute path", "inkling-shard.json",
               inputs=[s], dst=tmp / "out", marker=tmp / "abs-escaped.json")


@case
def merge_header_copy_outside_folder(tmp, built):
    s = copy(built["sharded"], tmp / "s")
    man = _manifest(s)
    outside = tmp / "outside.header"
    with_header = next(k for k, v in man["source"].items() if "header" in v)
    shutil.copyfile(s / man["source"][with_header]["header"], outside)
    man["source"][with_header]["header"] = "../outside.header"
    _write_manifest(s, man)
    return Bad(["shard", "--merge", s, tmp / "out", "-q"], "leaves its folder", "inkling-shard.json",
               inputs=[s, outside], dst=tmp / "out")


@case
def metadata_data_file_is_a_link_out_of_the_folder(tmp, built):
    m = copy(built["megatron"], tmp / "m")
    md = load_metadata(m)
    idx, info = next(iter(md.storage_data.items()))
    outside = tmp / "elsewhere.distcp"
    shutil.copyfile(release(m) / info.relative_path, outside)
    (release(m) / "link.distcp").symlink_to(outside)
    for v in md.storage_data.values():
        if v.relative_path == info.relative_path:
            v.relative_path = "link.distcp"
    with open(release(m) / ".metadata", "wb") as f:
        pickle.dump(md, f)
    return Bad(["convert", "megatron-to-hf", m, tmp / "out", "--reference", BF16, "-q"], "outside the checkpoint",
               ".metadata", inputs=[m, outside], dst=tmp / "out")


@case
def metadata_with_wrong_field_types(tmp, built):
    m = copy(built["megatron"], tmp / "m")
    md = load_metadata(m)
    key, v = _multi_chunk_key(md)
    v.chunks = "not a list"
    with open(release(m) / ".metadata", "wb") as f:
        pickle.dump(md, f)
    return Bad(["convert", "megatron-to-hf", m, tmp / "out", "--reference", BF16, "-q"], "damaged", ".metadata",
               inputs=[m], dst=tmp / "out")


# ---- 3. --force must never delete an input ------------------------------------------------------------

@case
def force_dst_is_src(tmp, built):
    src = copy(BF16, tmp / "src")
    return Bad(["convert", "hf-to-hf", src, src, "--plan", "bf16", "--force", "-q"], "is the input", "src",
               inputs=[src])


@case
def force_dst_contains_src(tmp, built):
    src = copy(BF16, tmp / "p" / "src")
    return Bad(["convert", "hf-to-hf", src, tmp / "p", "--plan", "bf16", "--force", "-q"], "contains the input",
               str(tmp / "p"), inputs=[tmp / "p"])


@case
def force_dst_inside_src(tmp, built):
    src = copy(BF16, tmp / "src")
    return Bad(["convert", "hf-to-hf", src, src / "out", "--plan", "bf16", "--force", "-q"], "inside the input",
               "src", inputs=[src], dst=src / "out")


@case
def force_dst_is_reference(tmp, built):
    m = built["megatron"]
    ref = copy(BF16, tmp / "ref")
    return Bad(["convert", "megatron-to-hf", m, ref, "--reference", ref, "--force", "-q"], "is the input", "ref",
               inputs=[ref, m])


@case
def force_dst_is_merge_input(tmp, built):
    s = copy(built["sharded"], tmp / "s")
    return Bad(["shard", "--merge", s, s, "--force", "-q"], "is the input", "s", inputs=[s])


@case
def force_dst_is_megatron_source_parent(tmp, built):
    m = copy(built["megatron"], tmp / "m")
    return Bad(["convert", "megatron-to-hf", release(m), m, "--reference", BF16, "--force", "-q"],
               "contains the input", "m", inputs=[m])


# ---- 4. concurrent runs on one DST -------------------------------------------------------------------

@case
def second_run_while_staging_is_locked(tmp, built):
    from inkling_ckpt.layouts.staging import staging_path

    src = copy(BF16, tmp / "src")
    dst = tmp / "out"
    st = staging_path(dst)
    st.mkdir()
    fd = os.open(st, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # what a running conversion holds
    (st / "other-run.txt").write_text("another process's work")
    _HELD.append(fd)
    return Bad(["shard", src, dst, "--tp", "1", "-q"], "another inkling-ckpt run", "out",
               inputs=[src, st], dst=dst)


_HELD: list[int] = []


# ---- 5. silently wrong conversions ---------------------------------------------------------------------

@case
def overlapping_data_offsets(tmp, built):
    src = copy(BF16, tmp / "src")
    shard = src / shards_of(src)[0]
    _, header = read_st_header(shard)
    names = [k for k in header if k != "__metadata__"]
    size = {k: header[k]["data_offsets"][1] - header[k]["data_offsets"][0] for k in names}
    a, b = next((x, y) for i, x in enumerate(names) for y in names[i + 1:] if size[x] == size[y])
    header[b]["data_offsets"] = list(header[a]["data_offsets"])
    rewrite_st_header(shard, header)
    return Bad(["convert", "hf-to-hf", src, tmp / "out", "--plan", "bf16", "-q"], "overlap", shard.name,
               inputs=[src], dst=tmp / "out")


@case
def same_tensor_in_two_shards(tmp, built):
    from safetensors.torch import load_file, save_file

    src = copy(BF16, tmp / "src")
    wm = index_of(src)["weight_map"]
    first, second = shards_of(src)[:2]
    name = next(n for n, f in sorted(wm.items()) if f == first)
    extra = load_file(src / first)[name]
    tensors = load_file(src / second)
    tensors[name] = extra.clone()
    save_file(tensors, src / second, metadata={"format": "pt"})
    return Bad(["shard", src, tmp / "out", "--tp", "1", "-q"], "duplicate", second, inputs=[src], dst=tmp / "out")


def _multi_chunk_key(md) -> tuple[str, Any]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    for key, v in md.state_dict_metadata.items():
        if isinstance(v, TensorStorageMetadata) and len(v.chunks) >= 2:
            return key, v
    raise AssertionError("no tensor stored in several chunks")


@case
def torch_dist_chunks_overlap_but_volumes_add_up(tmp, built):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    m = copy(built["megatron"], tmp / "m")
    md = load_metadata(m)
    key, v = _multi_chunk_key(md)
    c0, c1 = v.chunks[0], v.chunks[1]
    v.chunks[1] = ChunkStorageMetadata(offsets=c0.offsets, sizes=c1.sizes)  # same volume, lands on chunk 0
    info = md.storage_data.pop(MetadataIndex(key, c1.offsets))
    md.storage_data[MetadataIndex(key, c0.offsets)] = info
    with open(release(m) / ".metadata", "wb") as f:
        pickle.dump(md, f)
    return Bad(["convert", "megatron-to-hf", m, tmp / "out", "--reference", BF16, "-q"], "overlap", ".metadata",
               inputs=[m], dst=tmp / "out")


@case
def torch_dist_empty_tensor_with_chunks(tmp, built):
    """A tensor declared empty (a zero in its size) may only be one whole chunk: an empty tensor is
    read without data, so any chunk of it that points at bytes is a damaged or crafted entry."""
    m = copy(built["megatron"], tmp / "m")
    md = load_metadata(m)
    key, v = _multi_chunk_key(md)
    v.size = torch.Size([0, *v.size[1:]])
    with open(release(m) / ".metadata", "wb") as f:
        pickle.dump(md, f)
    return Bad(["convert", "megatron-to-hf", m, tmp / "out", "--reference", BF16, "-q"], "one whole chunk", ".metadata",
               inputs=[m], dst=tmp / "out")


@case
def distcp_bit_flip(tmp, built):
    m = copy(built["megatron"], tmp / "m")
    data = max(release(m).glob("*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    return Bad(["convert", "megatron-to-hf", m, tmp / "out", "--reference", BF16, "-q"], "sha256", data.name,
               inputs=[m], dst=tmp / "out")


# ---- 6. writes into SRC ---------------------------------------------------------------------------------

@case
def index_entry_absolute_path_inside_src(tmp, built):
    src = copy(BF16, tmp / "src")
    index = index_of(src)
    index["weight_map"] = {n: str(src / f) for n, f in index["weight_map"].items()}
    write_index(src, index)
    return Bad(["shard", src, tmp / "out", "--tp", "1", "-q"], "absolute path", "model.safetensors.index.json",
               inputs=[src], dst=tmp / "out")


# ---- 7. symlinks: hub-cache snapshots are fine, links leaving the checkpoint are not --------------------

def fake_hub_cache(tmp: Path, src: Path) -> Path:
    """A huggingface_hub cache holding ``src``: snapshot files are relative links into blobs/."""
    repo = tmp / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    for p in sorted(src.iterdir()):
        digest = hashlib.sha256(p.read_bytes()).hexdigest()
        shutil.copyfile(p, repo / "blobs" / digest)
        (snap / p.name).symlink_to(Path("..") / ".." / "blobs" / digest)
    return snap


@case
def hub_snapshot_link_leaving_the_repo_cache(tmp, built):
    snap = fake_hub_cache(tmp, BF16)
    victim = snap / shards_of(snap)[0]
    outside = tmp / "elsewhere.safetensors"
    shutil.copyfile(victim, outside)
    victim.unlink()
    victim.symlink_to(outside)
    return Bad(["shard", snap, tmp / "out", "--tp", "1", "-q"], "outside the checkpoint folder", victim.name,
               inputs=[tmp / "hub", outside], dst=tmp / "out")


@case
def pass_through_file_links_out_of_src(tmp, built):
    src = copy(BF16, tmp / "src")
    secret = tmp / "secret.txt"
    secret.write_text("private key material")
    (src / "tokenizer.json").symlink_to(secret)
    return Bad(["convert", "hf-to-hf", src, tmp / "out", "--plan", "bf16", "-q"], "outside the checkpoint folder",
               "tokenizer.json", inputs=[src, secret], dst=tmp / "out")


@case
def pass_through_file_links_out_of_src_on_shard(tmp, built):
    src = copy(BF16, tmp / "src")
    secret = tmp / "secret.txt"
    secret.write_text("private key material")
    (src / "notes.txt").symlink_to(secret)
    return Bad(["shard", src, tmp / "out", "--tp", "1", "-q"], "outside the checkpoint folder", "notes.txt",
               inputs=[src, secret], dst=tmp / "out")


# ---- 8. resource exhaustion ------------------------------------------------------------------------------

def _set_count(src: Path, keys: tuple[str, ...], value: int) -> None:
    cfg = config_of(src)
    tc = text_config(cfg)
    hit = [k for k in keys if k in tc] or [keys[0]]
    for k in hit:
        tc[k] = value
    (src / "config.json").write_text(json.dumps(cfg))


@case
def config_with_absurd_expert_count(tmp, built):
    src = copy(BF16, tmp / "src")
    _set_count(src, ("n_routed_experts", "num_local_experts", "num_experts"), 10**12)
    return Bad(["inspect", src], "limit", "config.json", inputs=[src])


@case
def config_with_absurd_layer_count(tmp, built):
    src = copy(BF16, tmp / "src")
    _set_count(src, ("num_hidden_layers",), 10**12)
    return Bad(["shard", src, tmp / "out", "--tp", "1", "-q"], "limit", "config.json", inputs=[src], dst=tmp / "out")


@case
def bare_config_with_absurd_layer_count(tmp, built):
    cfg = config_of(BF16)
    tc = text_config(cfg)
    tc["num_hidden_layers"] = 10**12
    path = tmp / "config.json"
    path.write_text(json.dumps(cfg))
    return Bad(["memory", path, "--tp", "1", "--variant", "bf16"], "limit", "config.json", inputs=[path])


@case
def make_fixture_absurd_layers(tmp, built):
    return Bad(["make-fixture", tmp / "out", "--layers", str(10**12), "-q"], "--layers", "--layers", dst=tmp / "out")


@case
def make_fixture_absurd_experts(tmp, built):
    return Bad(["make-fixture", tmp / "out", "--experts", str(10**12), "-q"], "--experts", "--experts",
               dst=tmp / "out")


@case
def shard_absurd_tp(tmp, built):
    src = copy(BF16, tmp / "src")
    return Bad(["shard", src, tmp / "out", "--tp", str(10**12), "--ep", "1", "-q"],
               "between", "--tp", inputs=[src], dst=tmp / "out")


# ---- 9. failure paths -------------------------------------------------------------------------------------

def _disk_full(mp: pytest.MonkeyPatch) -> None:
    real = torch.save
    calls = {"n": 0}

    def save(obj, f, *a, **kw):
        calls["n"] += 1
        if calls["n"] > 3:  # a few blobs in: the staging folder holds data by now
            raise RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing "
                               "file data/0: file write failed")
        return real(obj, f, *a, **kw)

    mp.setattr(torch, "save", save)


@case
def disk_full_during_hf_to_megatron(tmp, built):
    src = copy(BF16, tmp / "src")
    return Bad(["convert", "hf-to-megatron", src, tmp / "out", "-q"], "cannot write", "out", inputs=[src],
               dst=tmp / "out", patch=_disk_full)


def _publish_fails(dst: Path) -> Callable[[pytest.MonkeyPatch], None]:
    def patch(mp: pytest.MonkeyPatch) -> None:
        real = os.rename

        def rename(a, b, *args, **kw):
            if Path(a).name.endswith(".inkling-partial") and Path(b) == dst:
                raise OSError(errno.EIO, "Input/output error")
            return real(a, b, *args, **kw)

        mp.setattr(os, "rename", rename)
    return patch


@case
def crash_inside_force_publish_keeps_dst(tmp, built):
    src = copy(BF16, tmp / "src")
    dst = copy(built["sharded"], tmp / "out")  # an earlier output of ours: --force may replace it
    return Bad(["shard", src, dst, "--tp", "2", "--force", "-q"], "cannot publish", "out", inputs=[src], dst=dst,
               patch=_publish_fails(dst))


# ---- 10. one line, never a traceback ------------------------------------------------------------------------

@case
def tracker_not_utf8(tmp, built):
    m = copy(built["megatron"], tmp / "m")
    (m / "latest_checkpointed_iteration.txt").write_bytes(b"\xff\xfe\x00release")
    return Bad(["convert", "megatron-to-hf", m, tmp / "out", "--reference", BF16, "-q"], "not text",
               "latest_checkpointed_iteration.txt", inputs=[m], dst=tmp / "out")


@case
def common_pt_not_a_dict(tmp, built):
    m = copy(built["megatron"], tmp / "m")
    torch.save([1, 2, 3], release(m) / "common.pt")
    return Bad(["convert", "megatron-to-hf", m, tmp / "out", "--reference", BF16, "-q"], "expected a dict",
               "common.pt", inputs=[m], dst=tmp / "out")


@case
def index_file_name_with_nul(tmp, built):
    src = copy(BF16, tmp / "src")
    index = index_of(src)
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "model\x00.safetensors"
    write_index(src, index)
    return Bad(["inspect", src], "NUL", "model.safetensors.index.json", inputs=[src])


@case
def index_tensor_name_with_nul(tmp, built):
    src = copy(BF16, tmp / "src")
    index = index_of(src)
    first = next(iter(index["weight_map"]))
    index["weight_map"][first + "\x00x"] = index["weight_map"][first]
    write_index(src, index)
    return Bad(["inspect", src], "NUL", "model.safetensors.index.json", inputs=[src])


@case
def index_file_name_too_long(tmp, built):
    src = copy(BF16, tmp / "src")
    index = index_of(src)
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "m" * 300 + ".safetensors"
    write_index(src, index)
    return Bad(["inspect", src], "longer than", "model.safetensors.index.json", inputs=[src])


@case
def config_layer_types_wrong_type(tmp, built):
    src = copy(BF16, tmp / "src")
    cfg = config_of(src)
    text_config(cfg)["layer_types"] = 5
    (src / "config.json").write_text(json.dumps(cfg))
    return Bad(["inspect", src], "layer_types must be a list", "config.json", inputs=[src])


@case
def config_number_as_string(tmp, built):
    src = copy(BF16, tmp / "src")
    cfg = config_of(src)
    text_config(cfg)["hidden_size"] = str(text_config(cfg)["hidden_size"])
    (src / "config.json").write_text(json.dumps(cfg))
    return Bad(["inspect", src], "hidden_size", "config.json", inputs=[src])


@case
def config_count_as_float(tmp, built):
    src = copy(BF16, tmp / "src")
    cfg = config_of(src)
    text_config(cfg)["num_hidden_layers"] = float(text_config(cfg)["num_hidden_layers"])
    (src / "config.json").write_text(json.dumps(cfg))
    return Bad(["inspect", src], "num_hidden_layers", "config.json", inputs=[src])


@case
def config_nested_too_deeply(tmp, built):
    src = copy(BF16, tmp / "src")
    (src / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    return Bad(["inspect", src], "nested too deeply", "config.json", inputs=[src])


@case
def manifest_field_of_wrong_type(tmp, built):
    s = copy(built["sharded"], tmp / "s")
    man = _manifest(s)
    man["ranks"][0]["dir"] = 5
    _write_manifest(s, man)
    return Bad(["shard", "--merge", s, tmp / "out", "-q"], "rank folder", "inkling-shard.json", inputs=[s],
               dst=tmp / "out")


@case
def verify_min_sqnr_nan(tmp, built):
    return Bad(["verify", BF16, BF16, "--min-sqnr", "nan", "-q"], "finite", "--min-sqnr", inputs=[BF16])


# ---- 11. every input path counts against DST (issue 15.1) ------------------------------------------

@case
def lora_export_out_is_the_config_base(tmp, built):
    base = copy(BF16, tmp / "base")
    dump = _Built.dump_of(tmp / "x")
    return Bad(["lora", "export", dump, base, "--config", base, "--force", "-q"], "is the input", "base",
               inputs=[base, dump])


@case
def lora_export_out_contains_the_config_file(tmp, built):
    base = copy(BF16, tmp / "p" / "base")
    dump = _Built.dump_of(tmp / "x")
    return Bad(["lora", "export", dump, tmp / "p", "--config", base / "config.json", "--force", "-q"],
               "contains the input", str(tmp / "p"), inputs=[tmp / "p", dump])


@case
def lora_export_out_inside_the_config_base(tmp, built):
    base = copy(BF16, tmp / "base")
    dump = _Built.dump_of(tmp / "x")
    return Bad(["lora", "export", dump, base / "adapter", "--config", base, "-q"], "inside the input", "base",
               inputs=[base, dump], dst=base / "adapter")


@case
def lora_merge_out_is_the_adapter(tmp, built):
    ad = copy(built["adapter"], tmp / "ad")
    return Bad(["lora", "merge", BF16, ad, ad, "--force", "-q"], "is the input", "ad", inputs=[ad, BF16])


@case
def quantize_dst_contains_the_reference(tmp, built):
    ref = copy(MIXED, tmp / "p" / "ref")
    return Bad(["quantize", BF16, tmp / "p", "--plan", "mxfp8", "--scales", "keep", "--reference", ref, "--force",
                "-q"], "contains the input", str(tmp / "p"), inputs=[tmp / "p", BF16])


@case
def verify_plot_is_an_input_folder(tmp, built):
    b = copy(MIXED, tmp / "b.png")  # a checkpoint folder whose name looks like a plot
    return Bad(["verify", BF16, b, "--plot", b, "-q"], "is the input", "b.png", inputs=[b, BF16])


@case
def verify_plot_inside_an_input(tmp, built):
    a = copy(BF16, tmp / "a")
    return Bad(["verify", a, BF16, "--plot", a / "sqnr.png", "-q"], "inside the input", "sqnr.png", inputs=[a, BF16],
               dst=a / "sqnr.png")


@case
def verify_plot_is_the_config_file(tmp, built):
    cfg = tmp / "config.json"
    shutil.copyfile(BF16 / "config.json", cfg)
    return Bad(["verify", built["megatron"], BF16, "--config", cfg, "--plot", cfg, "-q"], "is the input",
               "config.json", inputs=[cfg, built["megatron"]])


# ---- 12. --force replaces only what inkling-ckpt published (issue 15.2) -------------------------------

@case
def force_over_a_users_folder(tmp, built):
    src = copy(BF16, tmp / "src")
    dst = tmp / "out"
    dst.mkdir()
    (dst / "thesis.tex").write_text("three years of work")
    return Bad(["convert", "hf-to-hf", src, dst, "--plan", "bf16", "--force", "-q"], "did not publish", "out",
               inputs=[src], dst=dst)


@case
def force_over_a_users_file(tmp, built):
    src = copy(BF16, tmp / "src")
    dst = tmp / "out"
    dst.write_text("a file, not a checkpoint")
    return Bad(["shard", src, dst, "--tp", "1", "--force", "-q"], "did not publish", "out", inputs=[src], dst=dst)


@case
def force_over_a_link_to_our_output(tmp, built):
    src = copy(BF16, tmp / "src")
    ours = copy(built["sharded"], tmp / "ours")
    dst = tmp / "out"
    dst.symlink_to(ours)  # replacing "out" would delete ours/ through a name that is not it
    return Bad(["shard", src, dst, "--tp", "1", "--force", "-q"], "did not publish", "out", inputs=[src, ours],
               dst=dst)


@case
def force_over_a_folder_with_a_forged_link_record(tmp, built):
    src = copy(BF16, tmp / "src")
    ours = copy(built["sharded"], tmp / "ours")
    dst = tmp / "out"
    dst.mkdir()
    (dst / "data.bin").write_bytes(b"user data")
    (dst / ".cache").symlink_to(ours / ".cache")  # a record reached through a link proves nothing
    return Bad(["shard", src, dst, "--tp", "1", "--force", "-q"], "did not publish", "out", inputs=[src, ours],
               dst=dst)


@case
def no_force_over_a_users_folder_says_force_would_not_help(tmp, built):
    src = copy(BF16, tmp / "src")
    dst = tmp / "out"
    dst.mkdir()
    (dst / "notes.md").write_text("mine")
    return Bad(["quantize", src, dst, "--plan", "mxfp8", "-q"], "--force replaces only", "out", inputs=[src],
               dst=dst)


# ---- 13. no write follows a link (issue 15.3) -----------------------------------------------------------

@case
def staging_folder_is_a_planted_link(tmp, built):
    from inkling_ckpt.layouts.staging import staging_path

    src = copy(BF16, tmp / "src")
    victim = tmp / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("precious")
    dst = tmp / "out"
    staging_path(dst).symlink_to(victim)
    return Bad(["convert", "hf-to-hf", src, dst, "--plan", "bf16", "-q"], "not a staging folder", "inkling-partial",
               inputs=[src, victim, staging_path(dst)], dst=dst)


# ---- 14. no read leaves its folder through a link, none blocks on a special file (issue 15.4) -----------

@case
def lora_merge_extra_file_links_out_of_base(tmp, built):
    base = copy(BF16, tmp / "base")
    secret = tmp / "secret.txt"
    secret.write_text("private key material")
    (base / "tokenizer.json").symlink_to(secret)
    return Bad(["lora", "merge", base, built["adapter"], tmp / "out", "-q"], "outside the checkpoint folder",
               "tokenizer.json", inputs=[base, secret], dst=tmp / "out")


@case
def lora_merge_extra_subfolder_links_out_of_base(tmp, built):
    base = copy(BF16, tmp / "base")
    home = tmp / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_rsa").write_text("private key")
    (base / "original").symlink_to(home)
    return Bad(["lora", "merge", base, built["adapter"], tmp / "out", "-q"], "outside the checkpoint folder",
               "original", inputs=[base, home], dst=tmp / "out")


@case
def lora_merge_extra_file_links_to_dev_zero(tmp, built):
    base = copy(BF16, tmp / "base")
    (base / "vocab.bin").symlink_to("/dev/zero")
    return Bad(["lora", "merge", base, built["adapter"], tmp / "out", "-q"], "outside the checkpoint folder",
               "vocab.bin", inputs=[base], dst=tmp / "out")


@case
def lora_merge_file_in_subfolder_links_out(tmp, built):
    base = copy(BF16, tmp / "base")
    (base / "extra").mkdir()
    secret = tmp / "secret.txt"
    secret.write_text("private")
    (base / "extra" / "notes.txt").symlink_to(secret)
    return Bad(["lora", "merge", base, built["adapter"], tmp / "out", "-q"], "outside the checkpoint folder",
               "notes.txt", inputs=[base, secret], dst=tmp / "out")


@case
def merge_source_config_links_to_dev_zero(tmp, built):
    s = copy(built["sharded"], tmp / "s")
    cfg = s / "source" / "config.json"
    cfg.unlink()
    cfg.symlink_to("/dev/zero")
    return Bad(["shard", "--merge", s, tmp / "out", "-q"], "outside the checkpoint folder", "config.json",
               inputs=[s], dst=tmp / "out")


@case
def merge_source_config_not_listed_in_the_manifest(tmp, built):
    s = copy(built["sharded"], tmp / "s")
    man = _manifest(s)
    del man["source"]["config.json"]
    _write_manifest(s, man)
    return Bad(["shard", "--merge", s, tmp / "out", "-q"], "not listed", "inkling-shard.json", inputs=[s],
               dst=tmp / "out")


@case
def fifo_config_json_on_inspect(tmp, built):
    src = copy(BF16, tmp / "src")
    (src / "config.json").unlink()
    os.mkfifo(src / "config.json")
    return Bad(["inspect", src], "FIFO", "config.json", inputs=[src])


@case
def fifo_index_on_shard(tmp, built):
    src = copy(BF16, tmp / "src")
    (src / "model.safetensors.index.json").unlink()
    os.mkfifo(src / "model.safetensors.index.json")
    return Bad(["shard", src, tmp / "out", "--tp", "1", "-q"], "FIFO", "model.safetensors.index.json", inputs=[src],
               dst=tmp / "out")


@case
def fifo_metadata_on_inspect(tmp, built):
    m = copy(built["megatron"], tmp / "m")
    (release(m) / ".metadata").unlink()
    os.mkfifo(release(m) / ".metadata")
    return Bad(["inspect", m], "FIFO", ".metadata", inputs=[m])


@case
def fifo_pass_through_file_on_convert(tmp, built):
    src = copy(BF16, tmp / "src")
    os.mkfifo(src / "tokenizer.json")
    return Bad(["convert", "hf-to-hf", src, tmp / "out", "--plan", "bf16", "-q"], "FIFO", "tokenizer.json",
               inputs=[src], dst=tmp / "out")


@case
def fifo_sidecar_on_convert(tmp, built):
    m = copy(built["megatron"], tmp / "m")
    sums = next(release(m).glob("*.distcp.sha256"))
    sums.unlink()
    os.mkfifo(sums)
    return Bad(["convert", "megatron-to-hf", m, tmp / "out", "--reference", BF16, "-q"], "FIFO", sums.name,
               inputs=[m], dst=tmp / "out")


@case
def fifo_adapter_config_on_lora_inspect(tmp, built):
    ad = copy(built["adapter"], tmp / "ad")
    (ad / "adapter_config.json").unlink()
    os.mkfifo(ad / "adapter_config.json")
    return Bad(["lora", "inspect", ad], "FIFO", "adapter_config.json", inputs=[ad])


@case
def lora_adapter_weights_link_out_of_the_adapter(tmp, built):
    ad = copy(built["adapter"], tmp / "ad")
    outside = tmp / "elsewhere.safetensors"
    shutil.move(ad / "adapter_model.safetensors", outside)
    (ad / "adapter_model.safetensors").symlink_to(outside)
    return Bad(["lora", "merge", BF16, ad, tmp / "out", "-q"], "outside the checkpoint folder",
               "adapter_model.safetensors", inputs=[ad, outside], dst=tmp / "out")


@case
def lora_export_dump_folder_file_links_to_dev_zero(tmp, built):
    d = tmp / "dump"
    d.mkdir()
    shutil.copyfile(_Built.dump_of(tmp / "x"), d / "a.safetensors")
    (d / "b.safetensors").symlink_to("/dev/zero")
    return Bad(["lora", "export", d, tmp / "out", "--config", BF16, "-q"], "outside the checkpoint folder",
               "b.safetensors", inputs=[d], dst=tmp / "out")


# ---- 15. the .metadata unpickler builds instances only, every length bounded (issue 15.5) --------------

def _op_str(x: str) -> bytes:
    b = x.encode()
    return b"\x8c" + bytes([len(b)]) + b


def _build_on(module: str, name: str, attr: str) -> bytes:
    """A protocol-4 pickle: push the global ``module.name`` and BUILD (None, {attr: True}) onto it: the
    "slot state" form, which pickle applies with setattr (it works on a class object)."""
    return (b"\x80\x04" + _op_str(module) + _op_str(name) + b"\x93" + b"N}" + _op_str(attr) + b"\x88" + b"s"
            + b"\x86" + b"b" + b".")


def _class_untouched(module: str, name: str, attr: str) -> Callable[[], str | None]:
    from inkling_ckpt.layouts.megatron import _dcp_allowed

    obj = _dcp_allowed()[(module, name)]  # the class the name resolves to (the reader's own record)
    missing = object()
    before = vars(obj).get(attr, missing)

    def check() -> str | None:
        now = vars(obj).get(attr, missing)
        if now is before:
            return None
        if before is missing:  # undo, so one failure does not leak into other tests
            delattr(obj, attr)
        else:
            setattr(obj, attr, before)
        return f"{module}.{name}.{attr} was set to {now!r} by a crafted .metadata"
    return check


@case
def metadata_build_on_a_torch_class(tmp, built):
    m = copy(built["megatron"], tmp / "m")
    mod, name = "torch.distributed.checkpoint.metadata", "TensorStorageMetadata"
    (release(m) / ".metadata").write_bytes(_build_on(mod, name, "inkling_pwned"))
    return Bad(["inspect", m], "refusing to unpickle", ".metadata", inputs=[m],
               intact=_class_untouched(mod, name, "inkling_pwned"))


@case
def metadata_build_on_the_metadata_class(tmp, built):
    m = copy(built["megatron"], tmp / "m")
    mod, name = "torch.distributed.checkpoint.metadata", "Metadata"
    (release(m) / ".metadata").write_bytes(_build_on(mod, name, "planner_data"))
    return Bad(["convert", "megatron-to-hf", m, tmp / "out", "--reference", BF16, "-q"], "refusing to unpickle",
               ".metadata", inputs=[m], dst=tmp / "out", intact=_class_untouched(mod, name, "planner_data"))


@case
def metadata_build_on_an_enum_member(tmp, built):
    m = copy(built["megatron"], tmp / "m")
    # WriteItemType(1) is the shared enum member; BUILD would set an attribute on it for the process
    payload = (b"\x80\x04" + _op_str("torch.distributed.checkpoint.planner") + _op_str("WriteItemType") + b"\x93"
               + b"K\x01\x85R" + b"}" + _op_str("inkling_pwned") + b"\x88s" + b"b.")
    (release(m) / ".metadata").write_bytes(payload)

    def intact() -> str | None:
        from inkling_ckpt.layouts.dcp_records import WriteItemType  # what the reader resolves the name to

        member = WriteItemType(1)
        if "inkling_pwned" in vars(member):
            del member.inkling_pwned
            return "WriteItemType member gained an attribute"
        return None
    return Bad(["inspect", m], "refusing to unpickle", ".metadata", inputs=[m], intact=intact)


@case
def metadata_bytes_entry_declares_2_to_60_bytes(tmp, built):
    m = copy(built["megatron"], tmp / "m")
    (release(m) / ".metadata").write_bytes(b"\x80\x04\x8e" + struct.pack("<Q", 2**60) + b"x" * 16 + b".")
    return Bad(["inspect", m], "runs past the end", ".metadata", inputs=[m])


@case
def metadata_unicode_entry_declares_2_to_60_bytes(tmp, built):
    m = copy(built["megatron"], tmp / "m")
    (release(m) / ".metadata").write_bytes(b"\x80\x04\x8d" + struct.pack("<Q", 2**60) + b"x" * 16 + b".")
    return Bad(["convert", "megatron-to-hf", m, tmp / "out", "--reference", BF16, "-q"], "runs past the end",
               ".metadata", inputs=[m], dst=tmp / "out")


@case
def metadata_frame_declares_2_to_60_bytes(tmp, built):
    m = copy(built["megatron"], tmp / "m")
    (release(m) / ".metadata").write_bytes(b"\x80\x04\x95" + struct.pack("<Q", 2**60) + b"N.")
    return Bad(["inspect", m], "runs past the end", ".metadata", inputs=[m])


@case
def metadata_object_blob_declares_2_to_60_bytes(tmp, built):
    m = copy(built["megatron"], tmp / "m")
    md = load_metadata(m)
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    key = next(k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    for idx, info in md.storage_data.items():
        if idx.fqn == key:
            info.length = 2**60
    with open(release(m) / ".metadata", "wb") as f:
        pickle.dump(md, f)
    return Bad(["convert", "megatron-to-hf", m, tmp / "out", "--reference", BF16, "-q"], "runs past the end",
               ".metadata", inputs=[m], dst=tmp / "out")


@case
def metadata_tensor_blob_runs_past_its_file(tmp, built):
    m = copy(built["megatron"], tmp / "m")
    md = load_metadata(m)
    info = max(md.storage_data.values(), key=lambda i: i.offset)
    info.offset += 1 << 40
    with open(release(m) / ".metadata", "wb") as f:
        pickle.dump(md, f)
    return Bad(["inspect", m], "runs past the end", ".metadata", inputs=[m])


# ---- 16. no silent wrong output (issue 15.6) -------------------------------------------------------------

def _reference_with(tmp: Path, **changes: Any) -> Path:
    ref = copy(BF16, tmp / "ref")
    cfg = config_of(ref)
    text_config(cfg).update(changes)
    (ref / "config.json").write_text(json.dumps(cfg))
    return ref


@case
def reference_with_another_top_k(tmp, built):
    ref = _reference_with(tmp, num_experts_per_tok=text_config(config_of(BF16))["num_experts_per_tok"] + 1)
    return Bad(["convert", "megatron-to-hf", built["megatron"], tmp / "out", "--reference", ref, "-q"],
               "num_experts_per_tok", "megatron", inputs=[ref, built["megatron"]], dst=tmp / "out")


@case
def reference_with_another_rope_theta(tmp, built):
    ref = _reference_with(tmp, rope_theta=123456.0)
    return Bad(["convert", "megatron-to-hf", built["megatron"], tmp / "out", "--reference", ref, "-q"],
               "rope_theta", "megatron", inputs=[ref, built["megatron"]], dst=tmp / "out")


@case
def reference_with_another_route_scale_dry_run(tmp, built):
    ref = _reference_with(tmp, route_scale=1.0)
    return Bad(["convert", "megatron-to-hf", built["megatron"], tmp / "out", "--reference", ref, "--dry-run"],
               "route_scale", "megatron", inputs=[ref, built["megatron"]], dst=tmp / "out")


def _drop_sidecars(m: Path) -> list[Path]:
    gone = sorted(release(m).glob("*.distcp.sha256"))
    for p in gone:
        p.unlink()
    return gone


@case
def our_torch_dist_without_its_sidecars(tmp, built):
    m = copy(built["megatron"], tmp / "m")
    gone = _drop_sidecars(m)
    return Bad(["convert", "megatron-to-hf", m, tmp / "out", "--reference", BF16, "-q"], "missing",
               gone[0].name, inputs=[m], dst=tmp / "out")


@case
def our_torch_dist_without_sidecars_and_a_flipped_byte(tmp, built):
    m = copy(built["megatron"], tmp / "m")
    _drop_sidecars(m)
    data = max(release(m).glob("*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    return Bad(["convert", "megatron-to-hf", m, tmp / "out", "--reference", BF16, "-q"], "missing",
               ".distcp.sha256", inputs=[m], dst=tmp / "out")


@case
def verify_on_our_torch_dist_without_sidecars(tmp, built):
    m = copy(built["megatron"], tmp / "m")
    gone = _drop_sidecars(m)
    return Bad(["verify", BF16, m, "-q"], "missing", gone[0].name, inputs=[m])


@case
def our_torch_dist_with_one_sidecar_emptied(tmp, built):
    m = copy(built["megatron"], tmp / "m")
    sums = sorted(release(m).glob("*.distcp.sha256"))[0]
    sums.write_text("")
    return Bad(["inspect", m], "missing", sums.name, inputs=[m])


# ---- the one test over the corpus -------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input(name, tmp_path, built, cli, monkeypatch):
    bad = CASES[name](tmp_path, built)
    try:
        watched = [*bad.inputs] + ([bad.dst] if bad.dst is not None else [])
        before = {p: tree_hash(p) for p in watched}
        if bad.patch is not None:
            bad.patch(monkeypatch)
        try:
            code, out, err = cli(*bad.args)
        except Exception as e:  # escaped main(): the user would see a traceback
            pytest.fail(f"traceback: {type(e).__name__}: {e}")
        monkeypatch.undo()
    finally:
        while _HELD:
            os.close(_HELD.pop())
    if bad.marker is not None:  # first: code that ran (or a file written outside DST) is the worst outcome
        assert not bad.marker.exists(), f"the payload ran: {bad.marker} exists"
    if bad.intact is not None:  # so is a payload that changed this process's classes
        damage = bad.intact()
        assert damage is None, damage
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0, f"exit 0 on bad input; stderr: {err!r}"
    assert "Traceback" not in err, err
    assert len(lines) == 1, f"expected one line on stderr, got: {err!r}"
    assert bad.needle.lower() in lines[0].lower(), lines[0]
    assert bad.names in lines[0], lines[0]
    for p in watched:
        assert tree_hash(p) == before[p], f"{p} changed"
    if bad.dst is not None:
        leftovers = [p.name for p in bad.dst.parent.glob(f".{bad.dst.name}.inkling-*") if p not in bad.inputs]
        assert not leftovers, f"left behind: {leftovers}"


# ---- the good side of the same classes ----------------------------------------------------------------------

def test_hub_cache_snapshot_reads_and_converts(tmp_path, cli):
    """Snapshot files that link into the same repo cache's blobs/ are a normal checkpoint."""
    snap = fake_hub_cache(tmp_path, BF16)
    before = tree_hash(tmp_path / "hub")
    code, out, err = cli("inspect", snap)
    assert code == 0, err
    code, out, err = cli("shard", snap, tmp_path / "out", "--tp", "1", "-q")
    assert code == 0, err
    assert tree_hash(tmp_path / "hub") == before


def test_hub_repo_id_from_cache(tmp_path, cli, monkeypatch):
    """``inspect org/name`` works offline from a populated hub cache."""
    import huggingface_hub.constants as hc

    fake_hub_cache(tmp_path, BF16)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out, err = cli("inspect", "org/tiny")
    assert code == 0, err


def test_pass_through_files_are_streamed(tmp_path, cli, monkeypatch):
    """A large pass-through file is copied in pieces, never read whole into memory."""
    src = copy(BF16, tmp_path / "src")
    big = src / "big.bin"
    big.write_bytes(os.urandom(1 << 20))
    real = Path.read_bytes

    def read_bytes(self):
        if self.name == "big.bin":
            raise AssertionError("pass-through file read whole")
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    code, out, err = cli("convert", "hf-to-hf", src, tmp_path / "out", "--plan", "bf16", "-q")
    assert code == 0, err
    monkeypatch.undo()
    assert (tmp_path / "out" / "big.bin").read_bytes() == big.read_bytes()


def _kill_after_set_aside(dst: Path, job: dict[str, Any]) -> None:
    """The state a publish killed between its two renames leaves: DST moved aside, not replaced."""
    from inkling_ckpt.layouts.staging import Staging, _set_aside

    st = Staging(dst, job, force=True).__enter__()
    (st.path / "new.txt").write_text("2")
    _set_aside(dst, st.fp)
    st._release()  # the process dies: its lock goes, its staging folder stays


def test_interrupted_force_publish_is_recovered(tmp_path):
    """A publish killed between its two renames (DST moved aside, new output not yet in place)
    is repaired by the next run of the same job: the previous output comes back, the -old- copy goes."""
    from inkling_ckpt.layouts.staging import OLD_INFIX, Staging

    dst = tmp_path / "out"
    job = {"command": "demo"}
    with Staging(dst, job) as st:
        (st.path / "old.txt").write_text("1")
    before = tree_hash(dst)
    _kill_after_set_aside(dst, job)
    assert not dst.exists() and list(tmp_path.glob(f".out{OLD_INFIX}*"))
    with Staging(dst, job) as st:
        assert st.done  # the restored output is this job's finished output
    assert tree_hash(dst) == before
    assert not list(tmp_path.glob(f".out{OLD_INFIX}*"))


def test_recovery_never_touches_folders_without_this_jobs_marker(tmp_path, cli):
    """Folders named like publish backups but not made by this job (a user's, another job's) stay."""
    from inkling_ckpt.layouts.staging import OLD_INFIX, Staging

    src = copy(BF16, tmp_path / "src")
    users = tmp_path / f".out{OLD_INFIX}mine"
    users.mkdir()
    (users / "data.txt").write_text("a user's folder that happens to have this name")
    link = tmp_path / f".out{OLD_INFIX}link"
    link.symlink_to(users)
    other = tmp_path / "o"
    with Staging(other, {"command": "another job"}) as st:
        (st.path / "x").write_text("x")
    _kill_after_set_aside(other, {"command": "another job"})
    theirs = next(tmp_path.glob(f".o{OLD_INFIX}*"))
    before = {p: tree_hash(p) for p in (users, link, theirs)}
    code, _, err = cli("shard", src, tmp_path / "out", "--tp", "1", "-q")
    assert code == 0, err
    with Staging(tmp_path / "o", {"command": "a third job"}) as st:
        (st.path / "y").write_text("y")
    assert {p: tree_hash(p) for p in (users, link, theirs)} == before


def test_force_replaces_our_own_output_and_an_empty_folder(tmp_path, cli):
    src = copy(BF16, tmp_path / "src")
    dst = tmp_path / "out"
    dst.mkdir()  # made by the user beforehand, empty: nothing to lose
    assert cli("shard", src, dst, "--tp", "1", "-q")[0] == 0
    code, out, err = cli("shard", src, dst, "--tp", "2", "--force", "-q")
    assert code == 0, err
    assert json.loads((dst / "inkling-shard.json").read_text())["plan"]["tp"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # no record or backup beside DST


@pytest.mark.parametrize("planted", [".out.inkling-done.json.tmp", ".out.inkling-done.json",
                                     ".out.inkling-partial/.inkling-job.json"])
def test_no_write_follows_a_planted_link(tmp_path, cli, planted):
    """Links planted where the bookkeeping of earlier versions wrote (beside DST, or in a staging
    folder left behind) are never written through: their targets stay as they were."""
    src = copy(BF16, tmp_path / "src")
    victim = tmp_path / "victim.txt"
    victim.write_text("do not overwrite")
    link = tmp_path / planted
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(victim)
    for args in (["--tp", "1"], ["--tp", "2", "--force"]):
        code, _, err = cli("shard", src, tmp_path / "out", *args, "-q")
        assert code == 0, err
    assert victim.read_text() == "do not overwrite"
    assert (tmp_path / "out" / "inkling-shard.json").is_file()


def test_plot_over_a_link_replaces_the_link_not_its_target(tmp_path, cli):
    pytest.importorskip("matplotlib")
    victim = tmp_path / "victim.txt"
    victim.write_text("do not overwrite")
    plot = tmp_path / "sqnr.png"
    plot.symlink_to(victim)
    code, _, err = cli("verify", BF16, MIXED, "--plot", plot, "-q")
    assert code in (0, 1), err
    assert victim.read_text() == "do not overwrite"
    assert not plot.is_symlink() and plot.read_bytes().startswith(b"\x89PNG")


def test_stock_dcp_writer_folder_is_readable(tmp_path):
    """What torch's own FileSystemWriter puts in .metadata (its checkpoint_id as a pathlib path
    among it) reads back, tensors included; the path comes back as inert data."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from inkling_ckpt.layouts.megatron import TorchDistCheckpoint, read_dcp_metadata

    folder = tmp_path / "foreign"
    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):  # one process, as meant
        dcp.save(state, storage_writer=FileSystemWriter(folder), checkpoint_id=folder, no_dist=True)
    raw = (folder / ".metadata").read_bytes()
    assert b"pathlib" in raw  # the case at hand: a Path pickled into .metadata
    md = read_dcp_metadata(folder / ".metadata")
    assert set(md.state_dict_metadata) == {"w", "b"}
    (folder / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    ckpt = TorchDistCheckpoint.open(folder)  # a foreign folder: no sha256 sidecars needed
    assert torch.equal(ckpt.read("w"), state["w"]) and torch.equal(ckpt.read("b"), state["b"])


# ---- 17. the library refuses what the CLI refuses (issue 15.7) ------------------------------------------

@pytest.fixture(scope="module")
def sync_inputs(tmp_path_factory):
    """The mixed fixture as a trainer holds it: Megatron names, BF16 experts (torch_dist, read back)."""
    from inkling_ckpt.convert.megatron import hf_to_megatron
    from inkling_ckpt.layouts.hf import HFCheckpoint
    from inkling_ckpt.layouts.megatron import TorchDistCheckpoint

    served = HFCheckpoint.open(MIXED)
    out = tmp_path_factory.mktemp("sync") / "mg"
    hf_to_megatron(served, out, progress=False)
    reader = TorchDistCheckpoint.open(out)
    return served, [(k, reader.read(k)) for k in reader.keys if "_extra_state" not in k]


def _first_plain(pairs: list[tuple[str, torch.Tensor]]) -> int:
    return next(i for i, (k, t) in enumerate(pairs) if ".experts." not in k and t.is_floating_point() and t.numel() > 1)


def _first_experts(pairs: list[tuple[str, torch.Tensor]]) -> int:
    return next(i for i, (k, _) in enumerate(pairs) if ".experts.experts." in k)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_weight_sync_refuses_nonfinite_non_expert(sync_inputs, bad):
    from inkling_ckpt.errors import NonFiniteError
    from inkling_ckpt.sync import WeightSync

    served, pairs = sync_inputs
    i = _first_plain(pairs)
    name, t = pairs[i]
    t = t.clone()
    t.view(-1)[t.numel() // 2] = bad
    sync = WeightSync.from_checkpoint(served, scales="keep", select="non-experts")
    with pytest.raises(NonFiniteError, match="NaN or Inf") as e:
        list(sync.groups([(name, t)]))
    assert name in str(e.value)
    assert list(WeightSync.from_checkpoint(served, scales="keep", select="non-experts",
                                           allow_nonfinite=True).groups([(name, t)]))


def test_weight_sync_refuses_nonfinite_experts(sync_inputs):
    from inkling_ckpt.errors import NonFiniteError
    from inkling_ckpt.sync import WeightSync

    served, pairs = sync_inputs
    i = _first_experts(pairs)
    layer = pairs[i][0].split(".")[2]
    exp = [(k, t.clone()) for k, t in pairs if f"layers.{layer}.mlp.experts.experts." in k]
    exp[0][1].view(-1)[7] = float("nan")
    with pytest.raises(NonFiniteError):
        list(WeightSync.from_checkpoint(served, scales="keep", select="experts").groups(exp))


@pytest.mark.parametrize("which", ["plain", "experts"])
def test_weight_sync_refuses_meta_tensors_in_one_line(sync_inputs, which):
    from inkling_ckpt.errors import CheckpointError
    from inkling_ckpt.sync import WeightSync

    served, pairs = sync_inputs
    i = _first_plain(pairs) if which == "plain" else _first_experts(pairs)
    name, t = pairs[i]
    with pytest.raises(CheckpointError, match="meta device") as e:
        list(WeightSync.from_checkpoint(served, scales="keep").groups([(name, t.to("meta"))]))
    assert name in str(e.value) and "\n" not in str(e.value)


def test_weight_sync_keep_reproduces_served_bytes_from_float32_masters(sync_inputs):
    """Trainers hold float32 master weights: the same values in float32 give the served bytes."""
    from inkling_ckpt.sync import WeightSync, verify

    served, pairs = sync_inputs
    f32 = [(k, t.float() if ".experts.experts." in k else t) for k, t in pairs]
    sync = WeightSync.from_checkpoint(served, scales="keep", select="experts")
    rep = verify(sync.buckets(f32), served, expected=sync.expected_names())
    assert rep.ok, rep.summary()


def test_weight_sync_keep_refuses_float32_that_bf16_cannot_hold(sync_inputs):
    from inkling_ckpt.errors import CheckpointError
    from inkling_ckpt.sync import WeightSync

    served, pairs = sync_inputs
    i = _first_experts(pairs)
    layer = pairs[i][0].split(".")[2]
    exp = [(k, t.float()) for k, t in pairs if f"layers.{layer}.mlp.experts.experts." in k]
    exp[0][1].view(-1)[3] += 1e-6  # between two BF16 values
    with pytest.raises(CheckpointError, match="BF16 cannot represent"):
        list(WeightSync.from_checkpoint(served, scales="keep", select="experts").groups(exp))


def _lora_items() -> list[tuple[str, torch.Tensor]]:
    from inkling_ckpt.lora import ModelDims
    from test_lora import trainer_adapter

    dims = ModelDims.from_config(json.loads((BF16 / "config.json").read_text()))
    return list(trainer_adapter(dims, seed=7).items()), dims


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("which", ["linear", "expert"])
def test_lora_export_refuses_nonfinite_factors(bad, which):
    from inkling_ckpt.errors import NonFiniteError
    from inkling_ckpt.lora import LoraExport

    items, dims = _lora_items()
    j = next(i for i, (n, _) in enumerate(items) if ("experts" in n) == (which == "expert"))
    name, t = items[j]
    t = t.clone()
    t.view(-1)[1] = bad
    items[j] = (name, t)
    with pytest.raises(NonFiniteError) as e:
        list(LoraExport(alpha=8, dims=dims).groups(items))
    assert name in str(e.value)
    assert list(LoraExport(alpha=8, dims=dims, allow_nonfinite=True).groups(items))


def test_lora_export_refuses_meta_factors():
    from inkling_ckpt.errors import AdapterError
    from inkling_ckpt.lora import LoraExport

    items, dims = _lora_items()
    items[0] = (items[0][0], items[0][1].to("meta"))
    with pytest.raises(AdapterError, match="meta device"):
        list(LoraExport(alpha=8, dims=dims).groups(items))


def test_staging_replaced_by_another_process_is_not_published(tmp_path):
    """A run whose staging folder another process rebuilt refuses to publish it."""
    from inkling_ckpt.errors import OutputError
    from inkling_ckpt.layouts.staging import Staging

    dst = tmp_path / "out"
    with pytest.raises(OutputError, match="replaced by another run"):
        with Staging(dst, {"job": 1}) as st:
            (st.path / "mine.txt").write_text("1")
            shutil.rmtree(st.path)  # what a second run (that ignored the lock) would do
            st.path.mkdir()
            (st.path / "theirs.txt").write_text("2")
    assert not dst.exists()


def test_every_writing_command_declares_its_paths():
    """The DST-against-inputs check runs in one place: each command that writes declares what it
    reads and writes (cli.app.declares); a new writing command without it fails here."""
    import inspect

    from inkling_ckpt.cli.app import _register, app

    _register()
    commands = [(c.name, c.callback) for c in app.registered_commands]
    for g in app.registered_groups:
        commands += [(f"{g.typer_instance.info.name} {c.name}", c.callback) for c in g.typer_instance.registered_commands]
    writers = {name: cb for name, cb in commands
               if set(inspect.signature(cb).parameters) & {"dst", "out", "plot"}}
    assert len(writers) >= 9, sorted(writers)
    undeclared = sorted(name for name, cb in writers.items()
                        if not any(p in getattr(cb, "declared", ((), ()))[1] for p in ("dst", "out", "plot")))
    assert undeclared == []


# ---- one line, and the right one (issue 15, class 8) ------------------------------------------------------


@pytest.mark.parametrize("name", ["org/na\nme", "org/name\r", "\x1b[31morg/name", "org/\x07name", "org/na\u0085me"])
def test_control_characters_in_a_source_name_stay_on_one_line(tmp_path, cli, name):
    code, out, err = cli("inspect", name)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0 and "Traceback" not in err
    assert len(lines) == 1 and "\x1b" not in err and "\x07" not in err, repr(err)
    escaped = "".join(repr(c)[1:-1] if (ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0) else c for c in name)
    assert escaped in lines[0], lines[0]


@pytest.mark.parametrize("failure", ["ENOLCK", "ENOSYS", "EOPNOTSUPP"])
def test_unsupported_flock_says_so_not_another_run(tmp_path, cli, monkeypatch, failure):
    import errno

    from inkling_ckpt.layouts import staging

    real = staging.fcntl.flock

    def flock(fd, op):
        if op & staging.fcntl.LOCK_EX:
            raise OSError(getattr(errno, failure), os.strerror(getattr(errno, failure)))
        return real(fd, op)

    monkeypatch.setattr(staging.fcntl, "flock", flock)
    dst = tmp_path / "out"
    code, out, err = cli("quantize", BF16, dst, "--plan", "mxfp8", "-q")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0 and "Traceback" not in err and len(lines) == 1, err
    assert "may not support flock" in lines[0] and "another run" not in lines[0], lines[0]
    assert not dst.exists() and not list(tmp_path.glob(".out.inkling-*"))


def _poison_scale(src: Path, layer: int, byte: int) -> None:
    from safetensors.torch import load_file, save_file

    name = f"model.llm.layers.{layer}.mlp.experts.w13_weight_scale"
    shard = src / index_of(src)["weight_map"][name]
    with open(shard, "rb") as f:
        meta = json.loads(f.read(int.from_bytes(f.read(8), "little"))).get("__metadata__")
    tensors = load_file(str(shard))
    u8 = tensors[name].view(torch.uint8).clone()
    u8.view(-1)[3] = byte
    tensors[name] = u8.view(tensors[name].dtype)
    save_file(tensors, str(shard), metadata=meta)


@pytest.mark.parametrize("layer,byte", [(0, 0xF8), (0, 0x7F), (3, 0xFF)])  # NVFP4 negative / NaN, MXFP8 NaN
def test_verify_forward_on_a_bad_block_scale_names_no_option_verify_lacks(tmp_path, cli, layer, byte):
    pytest.importorskip("transformers")
    src = copy(FIXTURES / "tiny-mixed", tmp_path / "src")
    _poison_scale(src, layer, byte)
    code, out, err = cli("verify", src, src, "--forward", "--random", "4", "-q")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0 and "Traceback" not in err and len(lines) == 1, err
    assert "--allow-nonfinite" not in lines[0] and "without --forward" in lines[0], lines[0]
    assert f"layers.{layer}.mlp.experts.w13_weight_scale" in lines[0], lines[0]
