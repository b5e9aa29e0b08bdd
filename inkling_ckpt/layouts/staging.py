"""Atomic, resumable output folders.

Every command writes into a staging folder beside the destination
(``.DST.inkling-partial``) and publishes it with one rename at the end, so a destination
folder that exists is always complete. The staging folder records a fingerprint of the job
(inputs, options, version); a rerun of the same job resumes there and skips files already
finished, a different job starts afresh.

Nothing of this bookkeeping is published: the destination holds only the checkpoint, so an
upload of it (``huggingface_hub.upload_folder`` uploads hidden files too) carries nothing
else. A finished job leaves ``.DST.inkling-done.json`` *beside* the destination: the job's
fingerprint and a digest of the published files (names, sizes, modification times), so a rerun
of the same job over the untouched folder does nothing unless forced. Both files hold digests
only: source paths and options are hashed into the fingerprint, never written out.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from .. import __version__
from ..errors import InklingError, OutputError

JOB_FILE = ".inkling-job.json"  # inside the staging folder; removed before publishing
DONE_FILE = ".inkling-done.json"  # name of the in-folder marker of earlier versions (readers still skip it)


def fingerprint(job: dict[str, Any]) -> str:
    """A stable digest of a job description (plain JSON types)."""
    blob = json.dumps({"version": __version__, **job}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


class Staging:
    """A staging folder for one job's output; use as ``with Staging(dst, job, force) as st:``.

    ``st.done`` is True when the destination already holds this job's finished output (nothing
    to do). Inside the block write into ``st.path``; a normal exit publishes, an
    :class:`InklingError` (bad input: resuming cannot help) removes the staging folder, and any
    other interruption keeps it for a resume.
    """

    def __init__(self, dst: str | Path, job: dict[str, Any], force: bool = False):
        self.dst = Path(dst)
        self.fp = fingerprint(job)
        self.job_command = str(job.get("command", ""))
        self.force = force
        self.path = self.dst.parent / f".{self.dst.name}.inkling-partial"
        self.marker = done_marker(self.dst)
        self.done = False
        self.resumed = False

    def _record(self) -> dict[str, Any]:
        # No paths, no options: only digests and what kind of job it was.
        return {"fingerprint": self.fp, "command": self.job_command, "inkling_ckpt": __version__}

    def __enter__(self) -> "Staging":
        if self.dst.exists() and not self.force:
            record = _read_json(self.marker)
            if record.get("fingerprint") != self.fp:
                raise OutputError(f"{self.dst} already exists (from another job); pass --force to replace it")
            if record.get("output") != output_digest(self.dst):
                raise OutputError(f"{self.dst} was changed after this job finished; pass --force to write it again")
            self.done = True
            return self
        parent = self.dst.parent
        if not parent.exists():
            try:
                parent.mkdir(parents=True)
            except OSError as e:
                raise OutputError(f"cannot create {parent}: {e.strerror}") from None
        if not os.access(parent, os.W_OK):
            raise OutputError(f"{parent} is not writable")
        job_file = self.path / JOB_FILE
        if self.path.exists() and job_file.is_file() and _read_fp(job_file) == self.fp:
            self.resumed = True
        else:
            if self.path.exists():
                shutil.rmtree(self.path)
            try:
                self.path.mkdir()
                _write_json(job_file, self._record())
            except OSError as e:
                raise OutputError(f"cannot write {self.path}: {e.strerror}") from None
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self.done:
            return False
        if exc_type is None:
            self._publish()
        elif issubclass(exc_type, InklingError):
            shutil.rmtree(self.path, ignore_errors=True)
        elif issubclass(exc_type, OSError) and getattr(exc, "errno", None) in (errno.ENOSPC, errno.EROFS, errno.EACCES):
            shutil.rmtree(self.path, ignore_errors=True)
            raise OutputError(f"cannot write {self.dst}: {exc.strerror}") from None  # type: ignore[union-attr]
        return False

    def is_finished(self, relpath: str) -> bool:
        """Whether a file of the output is already complete in staging (written via :meth:`finish`)."""
        return self.resumed and (self.path / relpath).is_file()

    def partial(self, relpath: str) -> Path:
        """Where to write a file before :meth:`finish` makes it count as complete."""
        p = self.path / (relpath + ".partial")
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def finish(self, relpath: str) -> None:
        """Mark a file written through :meth:`partial` as complete (an atomic rename)."""
        src = self.path / (relpath + ".partial")
        _fsync(src)
        os.replace(src, self.path / relpath)

    def _publish(self) -> None:
        (self.path / JOB_FILE).unlink()
        self.marker.unlink(missing_ok=True)  # a crash before the new one is written leaves no stale claim
        trash = None
        if self.dst.exists():
            trash = self.dst.parent / f".{self.dst.name}.inkling-old-{uuid.uuid4().hex[:8]}"
            os.replace(self.dst, trash)
        os.replace(self.path, self.dst)
        _write_json(self.marker, {**self._record(), "output": output_digest(self.dst)})
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)


def done_marker(dst: str | Path) -> Path:
    """Where a finished job's record lives: beside the published folder, never inside it."""
    dst = Path(dst)
    return dst.parent / f".{dst.name}.inkling-done.json"


def output_digest(folder: Path) -> str:
    """A digest of the files under ``folder``: relative names, sizes and modification times.

    Cheap (no file is read) and changes when any file is added, removed, rewritten or touched,
    so a rerun never takes an edited output for this job's finished one.
    """
    h = hashlib.sha256()
    for top, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            p = Path(top) / name
            st = p.lstat()
            h.update(f"{p.relative_to(folder).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _read_fp(path: Path) -> str | None:
    return _read_json(path).get("fingerprint")


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
