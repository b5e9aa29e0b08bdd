"""Bookkeeping for resumable jobs: nothing private, nothing of it in a published folder."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import TINY, TINY_PLAN
from inkling_ckpt.layouts.staging import JOB_FILE, Staging, done_marker


def _files(folder: Path, bookkeeping: bool = False) -> dict[str, bytes]:
    """Every file under ``folder``; the done record under .cache/huggingface only with ``bookkeeping``."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
            and (bookkeeping or not p.relative_to(folder).as_posix().startswith(".cache/huggingface/"))}


@pytest.fixture
def src(tmp_path) -> Path:
    """A copy of the tiny BF16 checkpoint under a path no output may mention."""
    dst = tmp_path / "private-user-folder" / "src"
    shutil.copytree(TINY["bf16"], dst)
    return dst


def test_outputs_hold_no_bookkeeping_and_no_absolute_path(cli, tmp_path, src):
    out = tmp_path / "out"
    jobs = {
        "q": ("quantize", src, out / "q", "--plan", TINY_PLAN),
        "sh": ("shard", src, out / "sh", "--tp", "2", "--ep", "2"),
        "meg": ("convert", "hf-to-megatron", src, out / "meg"),
    }
    for args in jobs.values():
        code, _, err = cli(*args, "-q")
        assert code == 0, err
    private = [str(p).encode() for p in {src, src.resolve(), tmp_path, tmp_path.resolve()}]
    for name in jobs:
        files = _files(out / name)
        assert files, name
        assert not [f for f in files if ".inkling-" in f or f.endswith(".partial")], f"bookkeeping in {name}"
        leaks = [f for f, data in files.items() if any(p in data for p in private)]
        assert leaks == [], f"{name}: absolute path in {leaks}"
        record = json.loads(done_marker(out / name).read_text())
        assert set(record) == {"command", "fingerprint", "inkling_ckpt", "output"}
        assert not any(p in json.dumps(record).encode() for p in private)
        assert [f for f in _files(out / name, bookkeeping=True) if f.startswith(".")] == \
            [".cache/huggingface/inkling-ckpt.json"]
    assert sorted(p.name for p in out.iterdir()) == ["meg", "q", "sh"]  # nothing piles up beside outputs


def test_upload_folder_would_publish_only_the_checkpoint(cli, tmp_path, src):
    """huggingface_hub uploads hidden files too (it ignores only .git and .cache/huggingface): the
    published folder must hold nothing but the checkpoint. Uses upload_folder's own file selection."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS

    dst = tmp_path / "q"
    assert cli("quantize", src, dst, "--plan", TINY_PLAN, "-q")[0] == 0
    ops = HfApi()._prepare_upload_folder_additions(dst, "", ignore_patterns=list(DEFAULT_IGNORE_PATTERNS))
    uploaded = sorted(op.path_in_repo for op in ops)
    assert done_marker(dst).is_file()  # the record is in the folder, and upload_folder skips it
    assert uploaded == sorted(_files(dst))
    assert uploaded and not [f for f in uploaded if f.startswith(".") or "/." in f]


def test_rerun_over_an_edited_output_is_refused_not_skipped(cli, tmp_path, src):
    dst = tmp_path / "q"
    args = ("quantize", src, dst, "--plan", "mxfp8", "-q")
    assert cli(*args)[0] == 0
    code, out, _ = cli(*args)
    assert code == 0 and "nothing to do" in out
    config = dst / "config.json"
    st = config.stat()
    os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # edited by hand, say
    code, _, err = cli(*args)
    assert code != 0 and "changed after this job finished" in err and "--force" in err
    assert len(err.strip().splitlines()) == 1
    assert cli(*args, "--force")[0] == 0
    assert "nothing to do" in cli(*args)[1]
    done_marker(dst).unlink()  # a folder with no record of this job is not taken for it
    code, _, err = cli(*args)
    assert code != 0 and "already exists" in err


def test_staging_records_digests_only(tmp_path):
    job = {"command": "demo", "source": {"root": "/home/someone/secret-model"}, "plan": "mxfp8"}
    dst = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt), Staging(dst, job) as st:
        (st.path / "a.bin").write_bytes(b"x")
        raise KeyboardInterrupt  # interrupted: staging kept for a resume
    text = (tmp_path / ".out.inkling-partial" / JOB_FILE).read_text()
    assert "secret" not in text and json.loads(text)["command"] == "demo"
    with Staging(dst, job) as st:
        assert st.resumed
    assert _files(dst) == {"a.bin": b"x"}
    assert "secret" not in done_marker(dst).read_text()
    with Staging(dst, job) as st:
        assert st.done
    other = {**job, "source": {"root": "/home/someone/other-model"}}  # paths still tell jobs apart
    with pytest.raises(Exception, match="already exists"), Staging(dst, other):
        pass
