"""The torch_dist reader never imports ``torch.distributed.checkpoint`` (DCP) and reads ``.metadata``
as DCP itself does.

Importing DCP pulls in DTensor, sympy and symbolic shapes (1.3 s on the 2-core box, 2.6-2.8 s on a
GPU node) and reading needs none of it: the reader's unpickler resolves DCP's names to the
toolkit's own records (``layouts.dcp_records``). Only writing (``layouts.megatron_dcp``, for
``.metadata``) imports DCP. Differential: what ``read_dcp_metadata`` makes of a ``.metadata`` is compared with DCP's own
``FileSystemReader.read_metadata`` on a stock ``dcp.save`` and on our hf-to-megatron output.
"""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import FIXTURES, subprocess_env
from inkling_ckpt.errors import CheckpointError
from inkling_ckpt.layouts import dcp_records
from inkling_ckpt.layouts.megatron import TorchDistCheckpoint, _dcp_allowed, read_dcp_metadata

MIXED = FIXTURES / "tiny-mixed"


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> Path:
    """The mixed fixture through hf-to-megatron (experts stored one chunk each)."""
    from inkling_ckpt.convert.megatron import hf_to_megatron
    from inkling_ckpt.layouts.hf import HFCheckpoint

    out = tmp_path_factory.mktemp("ours") / "mg"
    hf_to_megatron(HFCheckpoint.open(MIXED), out, progress=False)
    return out / "release"


@pytest.fixture(scope="module")
def stock(tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    """A folder written by torch's own ``dcp.save`` (FileSystemWriter, one process): several dtypes,
    a scalar, a bytes entry and a pickled object."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    folder = tmp_path_factory.mktemp("stock")
    g = torch.Generator().manual_seed(0)
    state: dict[str, Any] = {
        "w": torch.randn(6, 4, generator=g).to(torch.bfloat16),
        "b": torch.randn(5, generator=g),
        "step": torch.tensor(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "fp8": torch.randn(2, 8, generator=g).to(torch.float8_e4m3fn),
        "blob": io.BytesIO(b"opaque bytes"),
        "lr": 0.5,
    }
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.save(state, storage_writer=FileSystemWriter(folder), no_dist=True)
    return folder, state


def _summary(md: Any) -> tuple[dict[str, Any], dict[Any, tuple[str, int, int]]]:
    """What a reader relies on in a Metadata, the same for DCP's classes and ours: every entry
    (kind, size, dtype and the other tensor properties, chunk offsets and sizes) and every storage
    record (relative path, offset, length) under its (key, offsets)."""
    entries: dict[str, Any] = {}
    for key, v in md.state_dict_metadata.items():
        if type(v).__name__ == "TensorStorageMetadata":
            p = v.properties
            entries[key] = ("tensor", tuple(v.size), p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory,
                            [(tuple(c.offsets), tuple(c.sizes)) for c in v.chunks])
        else:
            entries[key] = (type(v).__name__,)
    storage = {(i.fqn, None if i.offset is None else tuple(i.offset)): (s.relative_path, s.offset, s.length)
               for i, s in md.storage_data.items()}
    return entries, storage


def _same_as_dcp(folder: Path) -> Any:
    """Read ``folder/.metadata`` both ways and compare; returns ours."""
    from torch.distributed.checkpoint import FileSystemReader

    theirs = FileSystemReader(folder).read_metadata()
    mine = read_dcp_metadata(folder / ".metadata")
    assert _summary(mine) == _summary(theirs)
    assert mine.version == theirs.version and mine.planner_data == theirs.planner_data
    assert (mine.storage_meta is None) == (theirs.storage_meta is None)
    if mine.storage_meta is not None:
        assert mine.storage_meta.save_id == theirs.storage_meta.save_id
    # Our records under DCP's names; none of DCP's classes.
    for key, v in mine.state_dict_metadata.items():
        assert type(v).__module__ == dcp_records.__name__
        assert type(v).__name__ == type(theirs.state_dict_metadata[key]).__name__
    for idx, info in theirs.storage_data.items():  # every storage record found by key and offsets, hint or not
        offset = None if idx.offset is None else torch.Size(idx.offset)
        found = mine.storage_data[dcp_records.MetadataIndex(idx.fqn, offset, index=12345)]
        assert (found.relative_path, found.offset, found.length) == (info.relative_path, info.offset, info.length)
    return mine


def test_stock_dcp_save_reads_as_dcp_reads_it(stock):
    folder, state = stock
    mine = _same_as_dcp(folder)
    kinds = {k: type(v).__name__ for k, v in mine.state_dict_metadata.items()}
    assert kinds == {k: "TensorStorageMetadata" if isinstance(v, torch.Tensor) else "BytesStorageMetadata"
                     for k, v in state.items()}
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    ckpt = TorchDistCheckpoint.open(folder)
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            got = ckpt.read(k)
            assert got.dtype == v.dtype and got.shape == v.shape \
                and torch.equal(got.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k
    assert ckpt.read_object("lr") == 0.5  # a non-tensor object, torch.save'd by DCP


def test_stock_dcp_save_of_an_empty_tensor_reads_as_dcp_reads_it(tmp_path):
    """An empty tensor is one chunk of its whole (empty) shape: the metadata reads as DCP reads it,
    and the folder opens and reads (the tiling check once refused any chunk with a zero size)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.save({"empty": torch.empty(0, 3, dtype=torch.float16), "w": torch.ones(2, 3)},
                 storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    _same_as_dcp(tmp_path)
    (tmp_path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    ckpt = TorchDistCheckpoint.open(tmp_path)
    got = ckpt.read("empty")
    assert got.shape == (0, 3) and got.dtype == torch.float16
    assert torch.equal(ckpt.read("w"), torch.ones(2, 3))


def test_our_hf_to_megatron_output_reads_as_dcp_reads_it(ours):
    mine = _same_as_dcp(ours)
    chunked = [k for k, v in mine.state_dict_metadata.items() if getattr(v, "chunks", ()) and len(v.chunks) > 1]
    assert chunked, "the fixture has no tensor stored in several chunks"
    # The values too: a tensor of several chunks read by DCP's own loader and by ours.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    key = chunked[0]
    st = mine.state_dict_metadata[key]
    into = {key: torch.empty(tuple(st.size), dtype=st.properties.dtype)}
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.load(into, storage_reader=FileSystemReader(ours), no_dist=True)
    assert torch.equal(TorchDistCheckpoint.open(ours.parent).read(key), into[key])


def test_records_match_dcp_fields_and_values():
    """Each record has the fields of the DCP class of its name (in order) and each enum its members'
    values: what a pickle of DCP's classes holds lands where the reader looks."""
    import importlib

    for module, records in dcp_records.DCP_NAMES.items():
        for ours_cls in records:
            theirs = getattr(importlib.import_module(module), ours_cls.__name__)
            assert ours_cls is not theirs
            if dataclasses.is_dataclass(theirs):
                assert [f.name for f in dataclasses.fields(ours_cls)] == [f.name for f in dataclasses.fields(theirs)]
            else:
                assert {m.name: m.value for m in ours_cls} == {m.name: m.value for m in theirs}
    a = dcp_records.MetadataIndex("k", (1, 2), index=3)
    b = dcp_records.MetadataIndex("k", torch.Size([1, 2]))
    assert a == b and hash(a) == hash(b) and type(a.offset) is torch.Size
    assert dcp_records.MetadataIndex("k") != dcp_records.MetadataIndex("k", (0,))


def test_allow_list_never_resolves_to_a_dcp_class():
    """Every name the .metadata unpickler allows resolves to a toolkit record or a plain torch/stdlib
    object: an entry pointing at DCP would import it for every reader again."""
    table = _dcp_allowed()
    for (module, name), obj in table.items():
        where = getattr(obj, "__module__", None) or type(obj).__module__
        assert not str(where).startswith("torch.distributed"), (module, name, where)
        if module.startswith("torch.distributed.checkpoint"):
            assert obj is getattr(dcp_records, name) and where == dcp_records.__name__, (module, name)
    wanted = {("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "StorageMeta", "_MEM_FORMAT_ENCODING")}
    wanted |= {("torch.distributed.checkpoint.filesystem", "_StorageInfo")}
    wanted |= {("torch.distributed.checkpoint.planner", n) for n in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan", "ReadItem", "LoadItemType")}
    assert {k for k in table if k[0].startswith("torch.distributed")} == wanted


_READ_IN_A_FRESH_PROCESS = """
import sys
from inkling_ckpt.layouts.megatron import TorchDistCheckpoint
ckpt = TorchDistCheckpoint.open(sys.argv[1])
key = next(iter(ckpt.keys))
ckpt.read(key)
from inkling_ckpt.cli.app import main
try:
    main(["convert", "megatron-to-hf", sys.argv[1], sys.argv[2], "--reference", sys.argv[3], "-q"])
except SystemExit as e:
    assert not e.code, e.code
loaded = sorted(m for m in sys.modules if m.startswith("torch.distributed.checkpoint") or m == "sympy")
print("loaded:", loaded)
"""


def test_reading_and_megatron_to_hf_never_import_dcp(ours, tmp_path):
    r = subprocess.run([sys.executable, "-c", _READ_IN_A_FRESH_PROCESS, str(ours.parent), str(tmp_path / "hf"), str(MIXED)],
                       env=subprocess_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "loaded: []" in r.stdout, r.stdout
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()


def test_importing_the_torch_dist_writer_does_not_import_dcp():
    """Only a run of hf-to-megatron pays DCP's import, not every command importing its module."""
    code = ("import sys; import inkling_ckpt.layouts.megatron_writer, inkling_ckpt.convert.megatron; "
            "print('loaded:', sorted(m for m in sys.modules if m.startswith('torch.distributed.checkpoint')))")
    r = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True)
    assert r.returncode == 0 and "loaded: []" in r.stdout, r.stdout + r.stderr


def test_unknown_memory_format_code_is_refused(tmp_path):
    """TensorProperties' own state setter accepts only DCP's three memory-format codes."""
    from torch.distributed.checkpoint.metadata import TensorProperties

    tp = TensorProperties(dtype=torch.float32)
    tp.__getstate__ = lambda: (torch.float32, torch.strided, False, 7, False)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(tp))
    with pytest.raises(CheckpointError, match="cannot read DCP metadata"):
        read_dcp_metadata(tmp_path / ".metadata")
