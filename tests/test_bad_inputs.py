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
list reads in one place. Class numbers refer to issue 11.
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


CASES: dict[str, Callable[[Path, dict[str, Path]], Bad]] = {}


def case(fn: Callable[[Path, dict[str, Path]], Bad]) -> Callable[[Path, dict[str, Path]], Bad]:
    CASES[fn.__name__] = fn
    return fn


class _Built(dict):
    """Outputs of our own writers, each made once on first use: a torch_dist and a sharded folder."""

    RECIPES = {
        "megatron": lambda out: ["convert", "hf-to-megatron", BF16, out, "-q"],
        "sharded": lambda out: ["shard", BF16, out, "--tp", "1", "-q"],
    }

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
    from inkling_ckpt.layouts.megatron import read_dcp_metadata

    return read_dcp_metadata(release(folder) / ".metadata")


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
        real = os.replace

        def replace(a, b, *args, **kw):
            if Path(a).name.endswith(".inkling-partial") and Path(b) == dst:
                raise OSError(errno.EIO, "Input/output error")
            return real(a, b, *args, **kw)

        mp.setattr(os, "replace", replace)
    return patch


@case
def crash_inside_force_publish_keeps_dst(tmp, built):
    src = copy(BF16, tmp / "src")
    dst = tmp / "out"
    dst.mkdir()
    (dst / "previous-output.txt").write_text("the user's earlier result")
    return Bad(["shard", src, dst, "--tp", "1", "--force", "-q"], "cannot publish", "out", inputs=[src], dst=dst,
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


def test_interrupted_force_publish_is_recovered(tmp_path, cli):
    """A publish killed between its two renames (DST moved aside, new output not yet in place)
    is repaired by the next run: the previous output comes back, the -old- copy goes."""
    from inkling_ckpt.layouts.staging import OLD_INFIX

    src = copy(BF16, tmp_path / "src")
    dst = tmp_path / "out"
    code, _, err = cli("shard", src, dst, "--tp", "1", "-q")
    assert code == 0, err
    before = tree_hash(dst)
    os.replace(dst, tmp_path / f".out{OLD_INFIX}deadbeef")  # the state a kill leaves behind
    code, out, err = cli("shard", src, dst, "--tp", "1", "-q")
    assert code == 0, err
    assert "nothing to do" in out  # the restored output is this job's finished output
    assert tree_hash(dst) == before
    assert not list(tmp_path.glob(f".out{OLD_INFIX}*"))


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
