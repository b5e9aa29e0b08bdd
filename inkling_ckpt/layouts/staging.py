"""Atomic, resumable output folders.

Every command writes into a staging folder beside the destination
(``.DST.inkling-partial``) and publishes it with one rename at the end, so a destination
folder that exists is always complete. The staging folder records a fingerprint of the job
(inputs, options, version); a rerun of the same job resumes there and skips files already
finished, a different job starts afresh. The published folder keeps the fingerprint in
``.inkling-done.json`` so a rerun of a finished job is skipped unless forced.
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

JOB_FILE = ".inkling-job.json"
DONE_FILE = ".inkling-done.json"


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
        self.job = job
        self.force = force
        self.path = self.dst.parent / f".{self.dst.name}.inkling-partial"
        self.done = False
        self.resumed = False

    def __enter__(self) -> "Staging":
        if self.dst.exists():
            marker = self.dst / DONE_FILE
            same = marker.is_file() and _read_fp(marker) == self.fp
            if same and not self.force:
                self.done = True
                return self
            if not self.force:
                raise OutputError(f"{self.dst} already exists (from another job); pass --force to replace it")
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
                _write_json(job_file, {"fingerprint": self.fp, "job": self.job})
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
        _write_json(self.path / DONE_FILE, {"fingerprint": self.fp, "job": self.job})
        trash = None
        if self.dst.exists():
            trash = self.dst.parent / f".{self.dst.name}.inkling-old-{uuid.uuid4().hex[:8]}"
            os.replace(self.dst, trash)
        os.replace(self.path, self.dst)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)


def _read_fp(path: Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        return None


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
