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

Safety: a destination equal to, containing or inside an input is refused (``--force`` or not);
the staging folder is held under an exclusive ``flock`` for the whole job (a second run on the
same destination refuses; a staging folder replaced under us is never published); every failure
but an interruption removes the staging folder; a ``--force`` publish moves the old output aside
and puts it back if the rename fails, and a run finding DST missing beside such an ``-old-``
copy (a publish killed half-way) restores it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterable, Literal

from .. import __version__
from ..errors import InklingError, OutputError
from .paths import check_dst, check_name, roots_in

JOB_FILE = ".inkling-job.json"  # inside the staging folder; removed before publishing
DONE_FILE = ".inkling-done.json"  # name of the in-folder marker of earlier versions (readers still skip it)


def fingerprint(job: dict[str, Any]) -> str:
    """A stable digest of a job description (plain JSON types)."""
    blob = json.dumps({"version": __version__, **job}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


class Staging:
    """A staging folder for one job's output; use as ``with Staging(dst, job, force) as st:``.

    ``st.done`` is True when the destination already holds this job's finished output (nothing
    to do). Inside the block write into ``st.path``; a normal exit publishes. Any failure removes
    the staging folder (bad input, a full disk, a failing write) except an interruption
    (Ctrl-C, SIGTERM, a kill), which keeps it for a resume.

    The destination is refused when it is, contains or lies inside an input (``inputs`` and every
    ``"root"`` in ``job``), with or without ``force``. The staging folder is held under an
    exclusive ``flock`` for the whole job: a second run on the same destination refuses at once,
    and a staging folder that another process replaced is never published.
    """

    def __init__(self, dst: str | Path, job: dict[str, Any], force: bool = False,
                 inputs: Iterable[str | Path | None] = ()):
        self.dst = Path(dst)
        self.fp = fingerprint(job)
        self.job_command = str(job.get("command", ""))
        self.force = force
        self.inputs = [*inputs, *roots_in(job)]
        self.path = staging_path(self.dst)
        self.marker = done_marker(self.dst)
        self.done = False
        self.resumed = False
        self._fd: int | None = None
        self._ino: tuple[int, int] | None = None

    def _record(self) -> dict[str, Any]:
        # No paths, no options: only digests and what kind of job it was.
        return {"fingerprint": self.fp, "command": self.job_command, "inkling_ckpt": __version__}

    def __enter__(self) -> "Staging":
        check_dst(self.dst, self.inputs)
        parent = self.dst.parent
        if not parent.exists():
            try:
                parent.mkdir(parents=True)
            except OSError as e:
                raise OutputError(f"cannot create {parent}: {e.strerror}") from None
        if not os.access(parent, os.W_OK):
            raise OutputError(f"{parent} is not writable")
        created = self._lock()
        try:
            _recover_publish(self.dst)
            if self.dst.exists() and not self.force:
                record = _read_json(self.marker)
                if record.get("fingerprint") != self.fp:
                    raise OutputError(f"{self.dst} already exists (from another job); pass --force to replace it")
                if record.get("output") != output_digest(self.dst):
                    raise OutputError(f"{self.dst} was changed after this job finished; pass --force to write it again")
                self.done = True
                self._release(remove=created)
                return self
            job_file = self.path / JOB_FILE
            if job_file.is_file() and _read_fp(job_file) == self.fp:
                self.resumed = True
            else:
                _clear(self.path)  # keep the folder itself: it is what we hold the lock on
                _write_json(job_file, self._record())
        except OSError as e:
            self._release(remove=created)
            raise OutputError(f"cannot write {self.path}: {e.strerror}") from None
        except BaseException:
            self._release(remove=created)
            raise
        return self

    def _lock(self) -> bool:
        """Create (if needed) and exclusively lock the staging folder; True when it was created here."""
        for _ in range(5):
            created = False
            if self.path.is_symlink() or (self.path.exists() and not self.path.is_dir()):
                raise OutputError(f"{self.path}: exists and is not a staging folder; remove it")
            try:
                self.path.mkdir()
                created = True
            except FileExistsError:
                pass
            except OSError as e:
                raise OutputError(f"cannot create {self.path}: {e.strerror}") from None
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            except FileNotFoundError:
                continue  # removed by another process between mkdir and open: try again
            except OSError as e:
                raise OutputError(f"cannot open {self.path}: {e.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise OutputError(f"{self.dst}: another inkling-ckpt run is writing it now (its staging folder "
                                  f"{self.path.name} is locked); wait for it to finish") from None
            st = os.fstat(fd)
            try:
                now = os.stat(self.path, follow_symlinks=False)
            except FileNotFoundError:
                now = None
            if now is not None and (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                self._fd, self._ino = fd, (st.st_dev, st.st_ino)
                return created
            os.close(fd)  # locked a folder that was replaced meanwhile: take the new one
        raise OutputError(f"{self.path}: keeps being replaced by another process; refusing to write")

    def _release(self, remove: bool = False) -> None:
        if remove:
            shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _owned(self) -> bool:
        """Whether the staging folder is still the one this job locked and set up."""
        try:
            now = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return False
        return (now.st_dev, now.st_ino) == self._ino and _read_fp(self.path / JOB_FILE) == self.fp

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        if self.done:
            return False
        try:
            if exc_type is None:
                self._publish()
                return False
            if not issubclass(exc_type, Exception):
                return False  # KeyboardInterrupt, SystemExit: keep the staging folder for a resume
            if self._owned():
                shutil.rmtree(self.path, ignore_errors=True)
            if issubclass(exc_type, InklingError):
                return False
            if issubclass(exc_type, OSError):
                raise OutputError(f"cannot write {self.dst}: {exc.strerror or exc}") from None
            if issubclass(exc_type, RuntimeError) and _is_write_failure(exc):
                raise OutputError(f"cannot write {self.dst}: {_first_line(exc)} (disk full?)") from None
            return False
        finally:
            self._release()

    def is_finished(self, relpath: str) -> bool:
        """Whether a file of the output is already complete in staging (written via :meth:`finish`)."""
        return self.resumed and (self.path / _rel(relpath)).is_file()

    def partial(self, relpath: str) -> Path:
        """Where to write a file before :meth:`finish` makes it count as complete."""
        p = self.path / (_rel(relpath) + ".partial")
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def finish(self, relpath: str) -> None:
        """Mark a file written through :meth:`partial` as complete (an atomic rename)."""
        src = self.path / (_rel(relpath) + ".partial")
        _fsync(src)
        os.replace(src, self.path / relpath)

    def _publish(self) -> None:
        if not self._owned():
            raise OutputError(f"{self.path}: the staging folder was replaced by another run; not publishing it")
        (self.path / JOB_FILE).unlink()
        self.marker.unlink(missing_ok=True)  # a crash before the new one is written leaves no stale claim
        trash = None
        if self.dst.exists():
            trash = self.dst.parent / f".{self.dst.name}{OLD_INFIX}{uuid.uuid4().hex[:8]}"
            os.replace(self.dst, trash)
        try:
            os.replace(self.path, self.dst)
        except BaseException as e:
            if trash is not None:  # put the previous output back: DST is never left missing
                os.replace(trash, self.dst)
            shutil.rmtree(self.path, ignore_errors=True)
            if isinstance(e, OSError):
                raise OutputError(f"cannot publish {self.dst}: {e.strerror or e}; the previous output is kept") from None
            raise
        _write_json(self.marker, {**self._record(), "output": output_digest(self.dst)})
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)


OLD_INFIX = ".inkling-old-"


def staging_path(dst: str | Path) -> Path:
    """The staging folder of a destination (beside it, hidden)."""
    d = Path(dst)
    return d.parent / f".{d.name}.inkling-partial"


def _recover_publish(dst: Path) -> None:
    """Finish what a publish cut short: restore a previous output left aside as ``-old-`` when
    DST is missing, and delete such copies once DST is back."""
    prefix = f".{dst.name}{OLD_INFIX}"  # not a glob: names may hold '[' or '*'
    olds = sorted((p for p in dst.parent.iterdir() if p.name.startswith(prefix)), key=lambda p: p.stat().st_mtime)
    if not olds:
        return
    if not dst.exists():
        os.replace(olds.pop(), dst)
    for p in olds:
        shutil.rmtree(p, ignore_errors=True)


def _clear(folder: Path) -> None:
    for p in list(folder.iterdir()):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def _rel(relpath: str) -> str:
    """Names inside the staging folder come from our own plans, but never let one leave it."""
    check_name(relpath, "staging", "output file")
    return relpath


def _is_write_failure(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(s in text for s in ("file write failed", "failed writing", "no space left", "unexpected pos",
                                   "disk quota"))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


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
