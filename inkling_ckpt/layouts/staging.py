"""Atomic, resumable output folders.

Every command writes into a staging folder beside the destination (``.DST.inkling-partial``,
created private to this user, mode 0700) and publishes it with one rename at the end, so a
destination folder that exists is always complete. The staging folder records a fingerprint
of the job (inputs, options, version); a rerun of the same job resumes there and skips files
already finished, a different job starts afresh.

The job's done record travels *inside* the published folder, at
``DST/.cache/huggingface/inkling-ckpt.json``: nothing piles up beside outputs, and
``huggingface_hub.upload_folder`` (which uploads hidden files but always skips ``.git/`` and
``.cache/huggingface/``, where its own ``hf download --local-dir`` bookkeeping lives) never
uploads it. It holds the job's fingerprint and a digest of the published files (names, sizes,
modification times; the record folder excluded), so a rerun of the same job over the untouched
folder does nothing unless forced. Digests only: source paths and options are hashed into the
fingerprint, never written out.

Safety:

* a destination equal to, containing or inside an input is refused (``--force`` or not);
* an existing destination is replaced (``--force``) only when its done record proves that
  inkling-ckpt published it (an empty folder is taken as free); anything else is refused;
* the staging folder is held under an exclusive ``flock`` for the whole job (a second run on
  the same destination refuses; a staging folder replaced under us is never published); every
  failure but an interruption or a lost rank (:class:`~inkling_ckpt.errors.RankLostError`) removes it;
* nothing is written through a link: files beside DST are created exclusively
  (``O_EXCL | O_NOFOLLOW``) or inside a fresh private folder, and moved with ``rename``;
* a ``--force`` publish moves the old output into a fresh private ``.DST.inkling-old-*`` folder
  that holds this job's marker, and puts it back if the rename fails; a later run of the same
  job that finds DST missing beside such a folder (a publish killed half-way) restores it.
  Folders without this job's marker are never touched.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import stat
import tempfile
import uuid
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Literal

from .. import __version__
from ..errors import InklingError, OutputError
from .paths import check_dst, check_name, roots_in

JOB_FILE = ".inkling-job.json"  # inside the staging folder; removed before publishing
DONE_FILE = ".inkling-done.json"  # name of the in-folder marker of earlier versions (readers still skip it)
RECORD_DIR = (".cache", "huggingface")  # inside DST: upload_folder's always-ignored bookkeeping folder
RECORD_NAME = "inkling-ckpt.json"
ASIDE_FILE = "inkling-aside.json"  # inside a .DST.inkling-old-* folder: whose publish made it
OLD_INFIX = ".inkling-old-"
_MAX_RECORD = 1 << 16


def fingerprint(job: dict[str, Any]) -> str:
    """A stable digest of a job description (plain JSON types)."""
    blob = json.dumps({"version": __version__, **job}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


class Staging:
    """A staging folder for one job's output; use as ``with Staging(dst, job, force) as st:``.

    ``st.done`` is True when the destination already holds this job's finished output (nothing
    to do). Inside the block write into ``st.path``; a normal exit publishes. Any failure removes
    the staging folder (bad input, a full disk, a failing write) except an interruption
    (Ctrl-C, SIGTERM, a kill) or a rank lost under torchrun, which keep it for a resume.

    The destination is refused when it is, contains or lies inside an input (``inputs`` and every
    ``"root"`` in ``job``), with or without ``force``, and when it exists without a done record
    of inkling-ckpt (``force`` replaces only our own outputs).
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
            _recover_publish(self.dst, self.fp)
            if os.path.lexists(self.dst):
                record = published_record(self.dst)
                if not self.force and record:
                    if record.get("fingerprint") != self.fp:
                        raise OutputError(f"{self.dst} already exists (from another job); pass --force to replace it")
                    if record.get("output") != output_digest(self.dst):
                        raise OutputError(f"{self.dst} was changed after this job finished; pass --force to write it again")
                    self.done = True
                    self._release(remove=created)
                    return self
                if not record and not _empty_dir(self.dst):
                    raise OutputError(_not_ours(self.dst))
            job_file = self.path / JOB_FILE
            if _read_fp(job_file) == self.fp:
                self.resumed = True
            else:
                _clear(self.path)  # keep the folder itself: it is what we hold the lock on
                write_new(job_file, _json(self._record()))
        except OSError as e:
            self._release(remove=created)
            raise OutputError(f"cannot write {self.path}: {e.strerror}") from None
        except BaseException:
            self._release(remove=created)
            raise
        return self

    def _lock(self) -> bool:
        """Create (if needed, private to this user) and exclusively lock the staging folder; True when
        it was created here."""
        for _ in range(5):
            created = False
            if self.path.is_symlink() or (self.path.exists() and not self.path.is_dir()):
                raise OutputError(f"{self.path}: exists and is not a staging folder; remove it")
            try:
                self.path.mkdir(mode=0o700)
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
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise OutputError(f"{self.dst}: another inkling-ckpt run is writing it now (its staging folder "
                                      f"{self.path.name} is locked); wait for it to finish") from None
                if created:  # ours and still empty: nothing of a run to keep
                    with contextlib.suppress(OSError):
                        self.path.rmdir()
                raise OutputError(f"{self.path}: cannot lock the staging folder ({e.strerror}); this filesystem "
                                  "may not support flock: write DST on a local disk") from None
            st = os.fstat(fd)
            if st.st_uid != os.getuid():
                os.close(fd)
                raise OutputError(f"{self.path}: a staging folder owned by another user; refusing to write into it")
            os.fchmod(fd, 0o700)  # nobody else may plant links in it while we write
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
            if not issubclass(exc_type, Exception) or getattr(exc, "keeps_staging", False):
                return False  # KeyboardInterrupt, SystemExit, a rank lost: keep the staging folder for a resume
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
        """Where to write a file before :meth:`finish` makes it count as complete (a fresh name:
        whatever was there, a link included, is removed first, so the writer creates a new file)."""
        p = self.path / (_rel(relpath) + ".partial")
        p.parent.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(p):
            p.unlink()
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
        record_dir = self.path.joinpath(*RECORD_DIR)
        for i in range(1, len(RECORD_DIR) + 1):  # created here, in our private folder; never through a link
            d = self.path.joinpath(*RECORD_DIR[:i])
            if d.is_symlink() or (d.exists() and not d.is_dir()):
                raise OutputError(f"{d}: not a folder; not publishing")
            d.mkdir(exist_ok=True)
        write_new(record_dir / RECORD_NAME, _json({**self._record(), "output": output_digest(self.path)}),
                  replace=True)
        os.chmod(self.path, 0o777 & ~_umask())  # private while written; the usual mode once published
        aside = _set_aside(self.dst, self.fp) if os.path.lexists(self.dst) else None
        try:
            os.rename(self.path, self.dst)
        except BaseException as e:
            if aside is not None:  # put the previous output back: DST is never left missing
                os.rename(aside / "old", self.dst)
                shutil.rmtree(aside, ignore_errors=True)
            shutil.rmtree(self.path, ignore_errors=True)
            if isinstance(e, OSError):
                raise OutputError(f"cannot publish {self.dst}: {e.strerror or e}; the previous output is kept") from None
            raise
        legacy = legacy_marker(self.dst)
        if _is_regular(legacy):  # an earlier version's record beside DST: stale now
            legacy.unlink()
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)


def staging_path(dst: str | Path) -> Path:
    """The staging folder of a destination (beside it, hidden)."""
    d = Path(dst)
    return d.parent / f".{d.name}.inkling-partial"


def done_marker(dst: str | Path) -> Path:
    """Where a finished job's record lives: inside the published folder, under ``.cache/huggingface/``
    (which ``huggingface_hub.upload_folder`` never uploads)."""
    return Path(dst).joinpath(*RECORD_DIR, RECORD_NAME)


def legacy_marker(dst: str | Path) -> Path:
    """Where versions up to 0.x kept the record: beside the folder (read, never written)."""
    d = Path(dst)
    return d.parent / f".{d.name}{DONE_FILE}"


def published_record(dst: Path) -> dict[str, Any]:
    """The done record proving inkling-ckpt published ``dst`` ({} when there is none). Read without
    following links (a link planted at any step is no record) and never blocking."""
    if dst.is_symlink() or not dst.is_dir():
        return {}
    record = _read_json_at(dst, (*RECORD_DIR, RECORD_NAME))
    if not record and _is_regular(legacy_marker(dst)):
        record = _read_json_at(dst.parent, (legacy_marker(dst).name,))
    return record if isinstance(record.get("fingerprint"), str) and "inkling_ckpt" in record else {}


def _not_ours(dst: Path) -> str:
    what = "a link" if dst.is_symlink() else "a folder" if dst.is_dir() else "a file"
    return (f"{dst} already exists and is {what} that inkling-ckpt did not publish (no done record); "
            "move it away or choose another destination (--force replaces only inkling-ckpt's own outputs)")


def _empty_dir(p: Path) -> bool:
    if p.is_symlink() or not p.is_dir():
        return False
    try:
        return not any(os.scandir(p))
    except OSError:
        return False


def _set_aside(dst: Path, fp: str) -> Path:
    """Move the previous output DST into a fresh private folder that holds this job's marker."""
    if not published_record(dst) and not _empty_dir(dst):
        raise OutputError(_not_ours(dst))
    aside = Path(tempfile.mkdtemp(prefix=f".{dst.name}{OLD_INFIX}", dir=dst.parent))
    write_new(aside / ASIDE_FILE, _json({"fingerprint": fp}))
    os.rename(dst, aside / "old")
    return aside


def _recover_publish(dst: Path, fp: str) -> None:
    """Finish what a publish of this job cut short: when DST is missing, restore the previous output
    it had set aside; delete its aside folders once DST is back. Other folders are left alone."""
    prefix = f".{dst.name}{OLD_INFIX}"  # not a glob: names may hold '[' or '*'
    mine = []
    for p in dst.parent.iterdir():
        if not p.name.startswith(prefix):
            continue
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and _read_json_at(p, (ASIDE_FILE,)).get("fingerprint") == fp:
            mine.append((st.st_mtime, p))
    for _, p in sorted(mine):
        old = p / "old"
        if not os.path.lexists(dst) and old.is_dir() and not old.is_symlink():
            os.rename(old, dst)
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


def output_digest(folder: Path) -> str:
    """A digest of the files under ``folder``: relative names, sizes and modification times (the
    record folder ``.cache/huggingface`` excluded).

    Cheap (no file is read) and changes when any file is added, removed, rewritten or touched,
    so a rerun never takes an edited output for this job's finished one.
    """
    h = hashlib.sha256()
    skip = folder.joinpath(*RECORD_DIR)
    for top, dirs, files in os.walk(folder):
        dirs.sort()
        if Path(top) == skip.parent:
            dirs[:] = [d for d in dirs if d != RECORD_DIR[-1]]
        for name in sorted(files):
            p = Path(top) / name
            st = p.lstat()
            h.update(f"{p.relative_to(folder).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _is_regular(p: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(p).st_mode)
    except OSError:
        return False


def _read_json_at(folder: Path, parts: tuple[str, ...]) -> dict[str, Any]:
    """A small JSON object at ``folder/parts...``, opened step by step without following a link
    (``O_NOFOLLOW``) nor blocking on a special file; {} when absent or not such a file."""
    fds: list[int] = []
    try:
        fds.append(os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC))
        for part in parts[:-1]:
            fds.append(os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fds[-1]))
        fds.append(os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fds[-1]))
        st = os.fstat(fds[-1])
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_RECORD:
            return {}
        data = json.loads(os.read(fds[-1], _MAX_RECORD + 1))
    except (OSError, ValueError, RecursionError):
        return {}
    finally:
        for fd in fds:
            os.close(fd)
    return data if isinstance(data, dict) else {}


def _read_fp(path: Path) -> str | None:
    fp = _read_json_at(path.parent, (path.name,)).get("fingerprint")
    return fp if isinstance(fp, str) else None


def _json(data: Any) -> bytes:
    return (json.dumps(data, indent=2, sort_keys=True, default=str) + "\n").encode()


def write_new(path: Path, data: bytes, *, replace: bool = False) -> None:
    """Write ``path`` as a new file: created exclusively (``O_EXCL | O_NOFOLLOW``, so a link planted
    at the name is never written through), or, with ``replace``, written under a fresh random
    name beside it and renamed over it."""
    target = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp") if replace else path
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        target.unlink(missing_ok=True)
        raise
    if replace:
        os.replace(target, path)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_file(path: str | Path, write: Callable[[BinaryIO], None]) -> None:
    """Write one output file (a report, a plot) atomically and never through a link: ``write``
    fills a fresh private temporary file beside ``path`` (created exclusively), which then
    replaces ``path`` by rename (a link at ``path`` is replaced, its target never written)."""
    p = Path(path)
    if p.is_dir() and not p.is_symlink():
        raise OutputError(f"{p}: is a folder; give a file name")
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".inkling-tmp", dir=p.parent if str(p.parent) else ".")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
