"""The torch_dist layout on its own: chunks of any shape, the reader's safety rules."""

from __future__ import annotations

import contextlib
import pickle
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from inkling_ckpt.errors import CheckpointError, IntegrityError
from inkling_ckpt.layouts import megatron as megatron_layout
from inkling_ckpt.layouts.megatron import (
    ChunkItem, ObjectItem, StoredKey, TorchDistCheckpoint, _check_tiling, _overlapping, common_state, empty_extra_state,
    finish_iteration_dir,
)
from inkling_ckpt.layouts.megatron_writer import write_dcp


def _write(folder: Path, tensors: dict[str, torch.Tensor], splits: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]) -> None:
    chunks = []
    for unit, (key, t) in enumerate(tensors.items()):
        for off, size in splits.get(key, [((0,) * t.dim(), tuple(t.shape))]):
            chunks.append(ChunkItem(key, off, size, tuple(t.shape), t.dtype, unit))
    objects = [ObjectItem("a.linear_qkv._extra_state/shard_0_1", 0, empty_extra_state())]

    def produce(c: ChunkItem) -> torch.Tensor:
        region = tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))
        return tensors[c.key][region].clone()

    write_dcp(folder, chunks, objects, produce)
    finish_iteration_dir(folder, common_state())


@contextlib.contextmanager
def _module_named(name: str) -> Iterator[types.ModuleType]:
    """An empty module registered as ``name`` so pickle can name classes in it, Megatron installed or not.

    Pickle imports a class's module by name, parents first: stand-in parents are registered too
    where none is loaded. Everything is put back afterwards, a real module imported earlier included.
    """
    parts = name.split(".")
    added = [p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p not in sys.modules]
    for p in added:
        sys.modules[p] = types.ModuleType(p)
    real = sys.modules.get(name)
    mod = sys.modules[name] = types.ModuleType(name)
    try:
        yield mod
    finally:
        if real is None:
            del sys.modules[name]
        else:
            sys.modules[name] = real
        for p in reversed(added):
            del sys.modules[p]


def test_reader_assembles_any_chunking(tmp_path):
    """Megatron saves with TP/EP split tensors into many chunks; reads must assemble any region."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(6, 8, generator=g).to(torch.bfloat16)
    e = torch.randn(4, 6, 5, generator=g).to(torch.bfloat16)
    splits = {
        "a": [((0, 0), (3, 4)), ((0, 4), (3, 4)), ((3, 0), (3, 8))],  # TP-like rectangles
        "e": [((i, r, 0), (1, 3, 5)) for i in range(4) for r in (0, 3)],  # per expert, gate/up halves
    }
    _write(tmp_path, {"a": a, "e": e}, splits)
    ckpt = TorchDistCheckpoint.open(tmp_path)
    assert torch.equal(ckpt.read("a"), a)
    assert torch.equal(ckpt.read("a", (2, 3), (3, 4)), a[2:5, 3:7])
    assert torch.equal(ckpt.read("e", (2, 0, 0), (1, 6, 5)), e[2:3])
    assert torch.equal(ckpt.read("e"), e)
    assert ckpt.read_object("a.linear_qkv._extra_state/shard_0_1")[0].numel() == 0
    assert ckpt.common["content_metadata"] == {"non_homogeneous_layers": True}
    with pytest.raises(CheckpointError, match="outside"):
        ckpt.read("a", (4, 0), (3, 8))


def _guillotine(data, off: tuple[int, ...], size: tuple[int, ...], depth: int) -> list:
    """A random tiling of the box ``off`` + ``size``: cut along a drawn dimension, recursively."""
    cuttable = [d for d, z in enumerate(size) if z > 1]
    if depth == 0 or not cuttable or not data.draw(st.booleans()):
        return [(off, size)]
    d = data.draw(st.sampled_from(cuttable))
    at = data.draw(st.integers(1, size[d] - 1))
    left = (off, size[:d] + (at,) + size[d + 1:])
    right = (off[:d] + (off[d] + at,) + off[d + 1:], size[:d] + (size[d] - at,) + size[d + 1:])
    return _guillotine(data, *left, depth - 1) + _guillotine(data, *right, depth - 1)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_the_chunk_index_finds_exactly_the_chunks_a_region_meets(data):
    """The bisecting index (one read of a stacked key looks at a few chunks, not all of them) against
    a plain scan of every chunk, on random tilings: the same chunks, in offset order."""
    shape = tuple(data.draw(st.lists(st.integers(1, 7), min_size=1, max_size=4)))
    chunks = _guillotine(data, (0,) * len(shape), shape, 6)
    key = StoredKey("k", shape, torch.bfloat16, tuple(data.draw(st.permutations(chunks))))
    for _ in range(5):
        off = tuple(data.draw(st.integers(0, z - 1)) for z in shape)
        size = tuple(data.draw(st.integers(1, z - o)) for o, z in zip(off, shape, strict=True))
        want = sorted(c for c in chunks
                      if all(a < b + y and b < a + x for a, x, b, y in zip(off, size, c[0], c[1], strict=True)))
        got = [(c_off, c_size) for c_off, c_size, _, _ in _overlapping(key, off, size)]
        assert got == want


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_a_tiling_passes_and_an_overlap_with_the_same_volume_is_named(data):
    """Random tilings pass the tiling check; moving one chunk onto another's place (the volumes
    still add up) or storing one twice in place of another of its size fails, naming both."""
    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=4)))
    chunks = _guillotine(data, (0,) * len(shape), shape, 6)
    _check_tiling(Path("f"), StoredKey("k", shape, torch.bfloat16, tuple(data.draw(st.permutations(chunks)))))
    same = [(i, j) for i in range(len(chunks)) for j in range(len(chunks)) if i != j and chunks[i][1] == chunks[j][1]]
    if not same:
        return
    i, j = data.draw(st.sampled_from(same))
    bad = list(chunks)
    bad[i] = chunks[j]  # j stored twice, i's place left empty
    with pytest.raises(CheckpointError, match=r"chunks of k at .* overlap"):
        _check_tiling(Path("f"), StoredKey("k", shape, torch.bfloat16, tuple(bad)))


@pytest.mark.parametrize("one_read", [True, False], ids=["one-read", "streamed"])
def test_reader_checks_every_blob_on_either_read_path(tmp_path, monkeypatch, one_read):
    """Chunks up to ONE_READ_BYTES are read once for checksum and load, bigger ones streamed twice:
    both give the stored tensor, and both refuse a blob whose bytes changed (same length)."""
    if not one_read:
        monkeypatch.setattr(megatron_layout, "ONE_READ_BYTES", 0)
    g = torch.Generator().manual_seed(1)
    a = torch.randn(64, 32, generator=g).to(torch.bfloat16)
    _write(tmp_path, {"a": a}, {"a": [((0, 0), (32, 32)), ((32, 0), (32, 32))]})
    assert torch.equal(TorchDistCheckpoint.open(tmp_path).read("a"), a)
    data = next(tmp_path.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[-200] ^= 0x01  # inside the last blob's tensor bytes
    data.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="sha256"):
        TorchDistCheckpoint.open(tmp_path).read("a")


def test_reader_reads_a_part_of_a_chunk_by_position(tmp_path, monkeypatch):
    """A region covering a stored chunk in part reads only its bytes (rows of the embeddings, experts
    of a stacked weight), never loading the chunk: the same values as slicing the whole tensor."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(40, 8, generator=g).to(torch.bfloat16)
    e = torch.randn(6, 4, 5, generator=g)
    _write(tmp_path, {"a": a, "e": e}, {"a": [((0, 0), (24, 8)), ((24, 0), (16, 8))]})
    ckpt = TorchDistCheckpoint.open(tmp_path)

    def no_load(*args):  # type: ignore[no-untyped-def]
        raise AssertionError("a chunk was loaded whole for a part of it")

    monkeypatch.setattr(TorchDistCheckpoint, "read_chunk", no_load)
    for off, size in [((0, 0), (5, 8)), ((20, 0), (10, 8)), ((3, 2), (30, 5)), ((39, 7), (1, 1))]:
        want = a[off[0]:off[0] + size[0], off[1]:off[1] + size[1]]
        assert torch.equal(ckpt.read("a", off, size), want), (off, size)
    assert torch.equal(ckpt.read("e", (2, 0, 0), (3, 4, 5)), e[2:5])
    assert torch.equal(ckpt.read("e", (5, 1, 1), (1, 2, 3)), e[5:, 1:3, 1:4])


def test_a_part_of_a_corrupted_chunk_is_an_integrity_error(tmp_path):
    from inkling_ckpt.errors import IntegrityError

    a = torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8)
    _write(tmp_path, {"a": a}, {})
    data = next(tmp_path.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    at = raw.rfind(a[60].numpy().tobytes())  # a byte of row 60, far from the rows read below
    raw[at] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="sha256"):
        TorchDistCheckpoint.open(tmp_path).read("a", (0, 0), (4, 8))


def test_blob_layouts_of_foreign_saves(tmp_path):
    """Blobs written by others: views save their whole storage (strides and an offset to honour);
    anything not a plain uncompressed record is loaded whole instead (no layout)."""
    import io
    import zipfile

    from inkling_ckpt.layouts.megatron import _blob_layout

    base = torch.arange(12 * 10, dtype=torch.float32).reshape(12, 10)
    cases = {"transposed": base.t(), "sliced": base[3:7, 2:]}
    for name, t in cases.items():
        buf = io.BytesIO()
        torch.save(t, buf)
        path = tmp_path / name
        path.write_bytes(b"x" * 100 + buf.getvalue())
        with open(path, "rb") as f:
            lay = _blob_layout(f, path, 100, len(buf.getvalue()), tuple(t.shape), t.dtype, name)
            assert lay is not None and lay.strides == t.stride() and lay.storage_offset == t.storage_offset()
            f.seek(lay.start)
            storage = torch.frombuffer(bytearray(f.read(base.numel() * 4)), dtype=torch.float32)
        assert torch.equal(storage.as_strided(t.shape, lay.strides, lay.storage_offset), t)
    # A deflated record (a re-zipped save): no positioned reads.
    buf = io.BytesIO()
    torch.save(base, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for info in src.infolist():
            z.writestr(info.filename, src.read(info.filename))
    path = tmp_path / "deflated"
    path.write_bytes(out.getvalue())
    with open(path, "rb") as f:
        assert _blob_layout(f, path, 0, len(out.getvalue()), (12, 10), torch.float32, "deflated") is None


@pytest.mark.parametrize("off,size", [((0, 0), (6,)), ((0, 0), (2,)), ((0, 0), (3, 4, 1)), ((0,), (6, 8))])
def test_reader_refuses_a_region_of_another_rank(tmp_path, off, size):
    """Offsets and sizes must name every dim: the bounds check once zipped sizes against the shape,
    so a short or long ``sizes`` passed it and torch failed later (or filled a wrong-rank tensor)."""
    a = torch.arange(48, dtype=torch.float32).reshape(6, 8).to(torch.bfloat16)
    _write(tmp_path, {"a": a}, {"a": [((0, 0), (3, 4)), ((0, 4), (3, 4)), ((3, 0), (3, 8))]})
    with pytest.raises(CheckpointError, match="outside"):
        TorchDistCheckpoint.open(tmp_path).read("a", off, size)


def test_metadata_with_legacy_megatron_classes_loads_without_megatron(tmp_path):
    """Old mcore pickled its own Metadata subclass into .metadata; those become stand-ins."""
    from torch.distributed.checkpoint.metadata import Metadata

    _write(tmp_path, {"a": torch.zeros(2, 2, dtype=torch.bfloat16)}, {})
    md = pickle.loads((tmp_path / ".metadata").read_bytes())  # our own writer's: DCP's classes, trusted
    with _module_named("megatron.core.dist_checkpointing.strategies.torch") as mod:

        class MCoreMetadata(Metadata):
            pass

        class MCoreSavePlan:
            pass

        for cls in (MCoreMetadata, MCoreSavePlan):
            cls.__module__, cls.__qualname__ = mod.__name__, cls.__name__
        mod.MCoreMetadata, mod.MCoreSavePlan = MCoreMetadata, MCoreSavePlan
        legacy = MCoreMetadata(state_dict_metadata=md.state_dict_metadata, storage_data=md.storage_data)
        legacy.mcore_data = {"x": MCoreSavePlan()}
        blob = pickle.dumps(legacy)
    assert b"megatron.core.dist_checkpointing" in blob
    (tmp_path / ".metadata").write_bytes(blob)
    ckpt = TorchDistCheckpoint.open(tmp_path)
    assert torch.equal(ckpt.read("a"), torch.zeros(2, 2, dtype=torch.bfloat16))


def test_metadata_chunks_must_tile_the_tensor(tmp_path):
    _write(tmp_path, {"a": torch.zeros(4, 2, dtype=torch.bfloat16)}, {"a": [((0, 0), (2, 2)), ((2, 0), (2, 2))]})
    md = pickle.loads((tmp_path / ".metadata").read_bytes())  # our own writer's: DCP's classes, trusted
    md.state_dict_metadata["a"].chunks.pop()
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match="do not cover"):
        TorchDistCheckpoint.open(tmp_path)


def test_common_pt_as_megatron_writes_it_loads_without_megatron(tmp_path):
    """MLM's common.pt holds argparse.Namespace args and Megatron enums: readable, no Megatron code run."""
    import argparse
    import enum

    _write(tmp_path, {"a": torch.zeros(2, 2, dtype=torch.bfloat16)}, {})
    with _module_named("megatron.core.enums") as mod:

        class ModelType(enum.Enum):
            encoder_or_decoder = 1

        ModelType.__module__, ModelType.__qualname__ = mod.__name__, "ModelType"
        mod.ModelType = ModelType
        args = argparse.Namespace(tensor_model_parallel_size=2, params_dtype=torch.bfloat16, model_type=ModelType.encoder_or_decoder)
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 10}, tmp_path / "common.pt")
    ckpt = TorchDistCheckpoint.open(tmp_path)
    assert ckpt.common["iteration"] == 10
    assert ckpt.common["args"].tensor_model_parallel_size == 2
    # An inert stand-in, or (where a test already imported megatron-core, whose enum torch's weights-only
    # loader then resolves itself) the plain Enum member: either way no Megatron code runs.
    assert type(ckpt.common["args"].model_type).__name__ in ("_MegatronValue", "ModelType")


@pytest.mark.parametrize("name", ["bf16", "strided", "offset", "transposed", "float8", "scalar", "empty"])
def test_a_chunk_read_at_once_keeps_its_values_where_they_were_read(name):
    """The one-read path loads a blob's tensor in place (no second copy of a checkpoint's bytes):
    the same tensor as ``torch.load`` (values, strides, storage offset), its values inside the
    buffer read; a blob of anything else loads the usual way."""
    import io

    from inkling_ckpt.layouts.megatron import _load_in_place

    g = torch.Generator().manual_seed(3)
    x = {"bf16": torch.randn(5, 7, generator=g).bfloat16(), "strided": torch.randn(64, 3, generator=g)[::2],
         "offset": torch.arange(100.0)[10:30].view(4, 5), "transposed": torch.randn(3, 4, generator=g).t(),
         "float8": torch.randn(8, 16, generator=g).to(torch.float8_e4m3fn), "scalar": torch.tensor(3.5),
         "empty": torch.empty(0, 5)}[name]
    saved = io.BytesIO()
    torch.save(x, saved)
    buf = torch.frombuffer(bytearray(saved.getvalue()), dtype=torch.uint8)
    y = _load_in_place(buf, tuple(x.shape), x.dtype, name)
    ref = torch.load(io.BytesIO(saved.getvalue()), weights_only=True)
    assert (y.dtype, y.shape, y.stride()) == (ref.dtype, ref.shape, ref.stride())
    assert torch.equal(y.view(torch.uint8), ref.view(torch.uint8)) if x.dtype.itemsize == 1 else torch.equal(y, ref)
    if x.numel():
        assert buf.data_ptr() <= y.data_ptr() < buf.data_ptr() + buf.numel()
    # What the metadata does not describe (another shape) or a blob of another object: a plain load.
    assert _load_in_place(buf, (1, 2, 3), x.dtype, name).shape == x.shape
    saved = io.BytesIO()
    torch.save({"a": 1}, saved)
    assert _load_in_place(torch.frombuffer(bytearray(saved.getvalue()), dtype=torch.uint8), (1,), x.dtype, name) == {"a": 1}


def test_a_blob_serialized_by_a_worker_keeps_the_tensor_uncopied():
    """The writer's in-memory blob: the bytes and sha256 of ``torch.save`` exactly, with the tensor's
    storage held as a view of it rather than copied (small pieces, which torch reuses, are copied)."""
    import hashlib
    import io

    from inkling_ckpt.layouts.megatron_writer import _Blob, _address, _no_crc32

    x = torch.randn(300, 70).bfloat16()
    blob = _Blob(x)
    want = io.BytesIO()
    with _no_crc32():
        torch.save(x, blob)  # type: ignore[arg-type]
        torch.save(x, want)
    assert b"".join(bytes(p) for p in blob.parts) == want.getvalue()
    assert blob.hexdigest() == hashlib.sha256(want.getvalue()).hexdigest()
    views = [p for p in blob.parts if isinstance(p, memoryview)]
    assert len(views) == 1 and _address(views[0]) == x.data_ptr() and views[0].nbytes == x.nbytes
    assert blob.tensor_bytes == x.nbytes


def _stand_in_blob(x: torch.Tensor) -> tuple[bytes, str, bytes, str]:
    """(bytes written, sha256) of ``x``'s blob made through a host stand-in with ``x`` in its storage's
    place, beside those of ``torch.save(x.cpu())``. The stand-in is filled with other bytes: they must
    not leak into the blob (torch.save never reads a storage it hands to write() without CRC32s)."""
    import hashlib
    import io

    from inkling_ckpt.layouts.megatron_writer import _Blob, _no_crc32

    stand_in = torch.full(tuple(x.shape), 7, dtype=x.dtype)
    blob = _Blob(stand_in, on_device=x)
    want = io.BytesIO()
    got = io.BytesIO()
    with _no_crc32():
        torch.save(stand_in, blob)  # type: ignore[arg-type]
        torch.save(x.cpu(), want)
    blob.write_to(got)
    return got.getvalue(), blob.hexdigest(), want.getvalue(), hashlib.sha256(want.getvalue()).hexdigest()


def test_a_blob_with_its_tensor_in_place_of_a_stand_in_is_the_tensors_blob():
    """hf-to-megatron on a GPU: the blob is serialized from an untouched host stand-in and the chunk
    itself takes the storage's place, hashed and written from where it is (here the host path of the
    same code): bytes and sha256 are torch.save's of the chunk."""
    x = torch.randn(300, 70).bfloat16()
    got, digest, want, want_digest = _stand_in_blob(x)
    assert got == want and digest == want_digest
    assert want != _stand_in_blob(torch.zeros_like(x))[0]  # the bytes are x's


@pytest.fixture
def small_stages(monkeypatch):
    """layouts.pread with 4 KiB staging buffers (fresh ones, for this test only): GPU reads and writes
    go through it in many pieces. Returns the module."""
    import threading

    from inkling_ckpt.layouts import pread

    monkeypatch.setattr(pread, "STAGE_BYTES", 4096)
    monkeypatch.setattr(pread, "_stages", threading.local())
    return pread


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_chunks_blob_is_hashed_and_written_from_the_gpu(small_stages):
    """A GPU chunk in a blob: hashed through the worker's pinned buffers and written through the
    writer's, in many small pieces here: torch.save's bytes and sha256 of the host copy."""
    for x in (torch.randn(300, 70).bfloat16(), torch.randint(0, 256, (10001,), dtype=torch.uint8), torch.zeros(0, 4)):
        got, digest, want, want_digest = _stand_in_blob(x.cuda())
        assert got == want and digest == want_digest, tuple(x.shape)


def test_a_blob_read_whole_is_not_streamed_again_for_a_part(tmp_path, monkeypatch):
    """A blob that passed its sha256 once (read whole) is not hashed again, streamed from the file,
    when a part of it is read later; one read for a part first checks it once for every later part."""
    a = torch.arange(40 * 8, dtype=torch.float32).reshape(40, 8)
    _write(tmp_path, {"a": a}, {})
    ckpt = TorchDistCheckpoint.open(tmp_path)
    streamed = []
    verify = TorchDistCheckpoint._verify

    def counting(self, path, info, key, digest=None):  # type: ignore[no-untyped-def]
        if digest is None:
            streamed.append(key)
        return verify(self, path, info, key, digest)

    monkeypatch.setattr(TorchDistCheckpoint, "_verify", counting)
    assert torch.equal(ckpt.read("a"), a)
    assert torch.equal(ckpt.read("a", (3, 0), (5, 8)), a[3:8])
    assert streamed == []
    fresh = TorchDistCheckpoint.open(tmp_path)
    assert torch.equal(fresh.read("a", (3, 0), (5, 8)), a[3:8])
    assert torch.equal(fresh.read("a", (10, 0), (5, 8)), a[10:15])
    assert streamed == ["a"]


def test_positioned_reads_feed_a_hash_with_the_bytes_they_read(tmp_path):
    """``read_exact(..., hasher=)`` gives the bytes and their sha256 in one pass (the torch_dist reader
    checks a blob read straight onto a GPU that way)."""
    import hashlib
    import os

    from inkling_ckpt.layouts.pread import read_exact

    data = bytes(range(256)) * 97
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        h = hashlib.sha256()
        got = read_exact(fd, 5, len(data) - 9, "truncated", hasher=h)
        assert got.numpy().tobytes() == data[5:-4] and h.hexdigest() == hashlib.sha256(data[5:-4]).hexdigest()
        with pytest.raises(CheckpointError, match="truncated"):
            read_exact(fd, 5, len(data), "truncated")
    finally:
        os.close(fd)


def test_only_a_device_off_the_host_takes_the_gpu_read_path():
    """``off_host``: the readers' one test for "read through the pinned buffers" (None: read on the host)."""
    from inkling_ckpt.layouts.pread import off_host

    assert off_host(None) is None and off_host("cpu") is None and off_host(torch.device("cpu")) is None
    assert off_host("cuda") == torch.device("cuda") and off_host(torch.device("cuda", 1)) == torch.device("cuda", 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reads_onto_a_gpu_give_the_host_bytes_and_check_them(tmp_path, small_stages):
    """Chunks read straight onto a GPU (through small pinned buffers, many pieces here) hold the
    values read on the host, whole chunks and parts alike, and a changed byte still fails the sha256."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    e = torch.randn(5, 24, 40, generator=g)
    _write(tmp_path, {"a": a, "e": e}, {"e": [((i, 0, 0), (1, 24, 40)) for i in range(5)]})
    ckpt = TorchDistCheckpoint.open(tmp_path)
    for key, off, size in [("a", None, None), ("a", (7, 3), (50, 61)), ("e", (1, 0, 0), (3, 24, 40)),
                           ("e", (4, 0, 0), (1, 24, 40)), ("e", (0, 2, 1), (5, 3, 39))]:
        got = ckpt.read(key, off, size, device="cuda")
        want = TorchDistCheckpoint.open(tmp_path).read(key, off, size)
        assert got.device.type == "cuda" and torch.equal(got.cpu(), want), (key, off, size)
    expert = e[3].numpy().tobytes()
    data = next(p for p in tmp_path.glob("*.distcp") if expert in p.read_bytes())
    raw = bytearray(data.read_bytes())
    raw[raw.rfind(expert) + 100] ^= 1
    data.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError, match="sha256"):
        TorchDistCheckpoint.open(tmp_path).read("e", (2, 0, 0), (3, 24, 40), device="cuda")
    assert torch.equal(TorchDistCheckpoint.open(tmp_path).read("e", (0, 0, 0), (2, 24, 40), device="cuda").cpu(), e[:2])



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_tensors_written_through_small_buffers_are_their_host_bytes(tmp_path, small_stages):
    """The HF writer brings a GPU result down piece by piece through two pinned buffers (many pieces
    here, and a tensor made contiguous on the copy stream first): the file holds its host bytes,
    after what was written before it."""
    pread = small_stages
    g = torch.Generator().manual_seed(5)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    cases = {"pieces": w, "transposed": w.t(), "odd": torch.randint(0, 256, (10001,), dtype=torch.uint8, generator=g),
             "one piece": w[:3], "empty": w[:0], "scalar": torch.tensor(2.5)}
    for name, t in cases.items():
        path = tmp_path / "out.bin"
        with open(path, "wb") as fh:
            fh.write(b"head")
            n = pread.write_from(fh, t.cuda())
        want = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert n == len(want) and path.read_bytes() == b"head" + want, name


def test_blobs_serialized_at_once_on_several_workers_all_leave_out_the_crc32(tmp_path, monkeypatch):
    """torch.save's CRC32 switch is per process in torch up to 2.12 (per thread from 2.13): a worker
    turning it off and back on around its own save let another worker's save write CRCs, so a blob's
    bytes depended on the schedule (CPU and CUDA outputs differed on the H200 node, torch 2.11).
    Forced here with the switch made per process: worker B saves right after worker A has finished."""
    import io
    import threading
    import zipfile
    from concurrent.futures import ThreadPoolExecutor

    from inkling_ckpt.layouts.megatron_writer import SUMS_SUFFIX, write_units

    flag = {"crc": True}  # one process-wide setting, as torch <= 2.12 keeps it
    monkeypatch.setattr(torch.serialization, "get_crc32_options", lambda: flag["crc"])
    monkeypatch.setattr(torch.serialization, "set_crc32_options", lambda on: flag.__setitem__("crc", on))
    tensors = {k: torch.arange(64, dtype=torch.float32).reshape(8, 8) + i for i, k in enumerate("ab")}
    chunks = [ChunkItem(k, (0, 0), (8, 8), (8, 8), torch.float32, 0) for k in tensors]
    b_saving, a_done = threading.Event(), threading.Event()
    real_save = torch.save

    def save(obj, f, *args, **kwargs):  # type: ignore[no-untyped-def]
        if threading.current_thread().name.endswith("_1"):  # B: inside its save once A is inside its own
            b_saving.set()
            assert a_done.wait(10)  # ... and goes on only after A's build has returned
        else:
            assert b_saving.wait(10)
        return real_save(obj, f, *args, **kwargs)

    def map_items(items, build):  # type: ignore[no-untyped-def]
        def run(i):  # type: ignore[no-untyped-def]
            out = build(items[i])
            if i == 0:
                a_done.set()
            return out
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(run, i) for i in range(len(items))]
            for item, fut in zip(items, futures, strict=True):
                yield item, fut.result()

    monkeypatch.setattr(torch, "save", save)
    write_units(tmp_path, chunks, [], lambda c: tensors[c.key].clone(), map_items=map_items)
    data = (tmp_path / "__0_0.distcp").read_bytes()
    spans = [tuple(map(int, line.split()[:2]))
             for line in (tmp_path / ("__0_0.distcp" + SUMS_SUFFIX)).read_text().splitlines()]
    assert len(spans) == 2
    for start, length in spans:
        records = zipfile.ZipFile(io.BytesIO(data[start:start + length])).infolist()
        assert [r.CRC for r in records] == [0] * len(records)
    assert flag["crc"] is True  # the setting is back as it was once the writing is done
