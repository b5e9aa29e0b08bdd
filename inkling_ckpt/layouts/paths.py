"""Paths read from files, and output folders checked against inputs.

Every file name a checkpoint names (an index's shard, a manifest's source file, a ``.metadata``
data file) is untrusted: it must be a plain relative name that stays inside its folder once
symlinks are resolved. The one sanctioned exception is a Hugging Face hub cache, whose snapshot
files are symlinks into the same repository cache's ``blobs/``.

Every file a command opens must be a regular file inside its folder: checked before opening
(:func:`inside`, :func:`check_regular`) and opened without blocking (:func:`open_regular`:
``O_NONBLOCK``, then ``fstat`` says ``S_ISREG``), so a FIFO, a device or a link out of the folder is
refused in one line instead of hanging or filling the disk. Pass-through files (tokenizer,
generation config, a merge's extra folders) follow one rule, :func:`pass_through`, and are copied
by one function, :func:`copy_new`, which creates each target exclusively.

Outputs are checked against every input by :func:`check_dst` (folders) and
:func:`check_outputs` (every path a command writes, against every path it reads).
"""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterable

from ..errors import CheckpointError, OutputError

NAME_MAX = 255  # bytes per path component (Linux)
PATH_MAX = 4096


def check_name(rel: Any, where: str, what: str = "file name") -> str:
    """``rel`` if it is a plain relative path (no NUL, no ``..``, not absolute, sane length)."""
    if not isinstance(rel, str) or not rel:
        raise CheckpointError(f"{where}: {what} {rel!r} is not a file name")
    shown = repr(rel[:60] + ("…" if len(rel) > 60 else ""))
    if "\x00" in rel:
        raise CheckpointError(f"{where}: {what} {shown} holds a NUL byte")
    if len(rel.encode("utf-8", "surrogateescape")) > PATH_MAX:
        raise CheckpointError(f"{where}: {what} {shown} is longer than {PATH_MAX} bytes")
    p = PurePosixPath(rel)
    if p.is_absolute():
        raise CheckpointError(f"{where}: {what} {shown} is an absolute path; only names inside the folder are allowed")
    for part in p.parts:
        if part in ("..", "."):
            raise CheckpointError(f"{where}: {what} {shown} leaves its folder ('..')")
        if len(part.encode("utf-8", "surrogateescape")) > NAME_MAX:
            raise CheckpointError(f"{where}: {what} {shown} has a component longer than {NAME_MAX} bytes")
    return rel


def link_roots(root: Path) -> list[Path]:
    """Folders that files under ``root`` may resolve into: ``root`` itself, and for a hub-cache
    snapshot (``…/models--org--name/snapshots/<rev>``) that repository cache's ``blobs/``."""
    real = root.resolve()
    roots = [real]
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith(("models--", "datasets--", "spaces--")):
        blobs = real.parent.parent / "blobs"
        if blobs.is_dir():
            roots.append(blobs.resolve())
    return roots


def _within(p: Path, roots: Iterable[Path]) -> bool:
    return any(p == r or r in p.parents for r in roots)


def inside(root: Path, rel: Any, where: str, what: str = "file name") -> Path:
    """``root / rel``, refusing names that leave ``root`` (directly or through symlinks)."""
    check_name(rel, where, what)
    p = root / rel
    try:
        real = p.resolve()
    except (OSError, RuntimeError) as e:  # symlink loops
        raise CheckpointError(f"{where}: {what} {rel!r} cannot be resolved ({e})") from None
    if not _within(real, link_roots(root)):
        raise CheckpointError(f"{where}: {what} {rel!r} points outside the checkpoint folder (to {real})")
    kind = _special(real)
    if kind:
        raise CheckpointError(f"{where}: {what} {rel!r} is {kind}, not a regular file")
    return p


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def _special(p: Path) -> str | None:
    """What ``p`` is when it exists and is neither a regular file nor a folder (following links)."""
    try:
        mode = os.stat(p).st_mode
    except OSError:
        return None
    return next((name for test, name in _KINDS if test(mode)), None)


def check_regular(p: Path, where: str | None = None) -> Path:
    """``p`` if it is a regular file (links followed); else a one-line CheckpointError. For files
    that third-party readers open by path (``safe_open``): checked just before they open it."""
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        raise  # callers word "missing" in their own terms
    except OSError as e:
        raise CheckpointError(f"{p}: cannot read ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "a folder" if stat.S_ISDIR(mode) else "special")
        raise CheckpointError(f"{p}: is {kind}, not a regular file; refusing to read it")
    return p


def open_regular(p: Path, limit: int | None = None, buffering: int = -1) -> io.BufferedReader | io.FileIO:
    """Open a file for reading that must be a regular file: checked first, opened with
    ``O_NONBLOCK`` (a FIFO swapped in meanwhile cannot block), then ``fstat``-checked. ``limit``:
    refuse files larger than this many bytes (configs, manifests)."""
    check_regular(p)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise CheckpointError(f"{p}: cannot read ({e.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointError(f"{p}: is not a regular file; refusing to read it")
    if limit is not None and st.st_size > limit:
        os.close(fd)
        raise CheckpointError(f"{p}: {st.st_size} bytes, more than the {limit} such a file may hold")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb", buffering=buffering)  # type: ignore[return-value]  # "rb": FileIO or BufferedReader


def check_file_inside(root: Path, p: Path, where: str) -> None:
    """A file found by listing ``root`` (e.g. a pass-through file) must not be a link out of it,
    nor a special file."""
    try:
        real = p.resolve()
    except (OSError, RuntimeError) as e:
        raise CheckpointError(f"{where}: {p.name} cannot be resolved ({e})") from None
    if not _within(real, link_roots(root)):
        raise CheckpointError(f"{where}: {p.name} is a symlink to {real}, outside the checkpoint folder; refusing to copy it")
    kind = _special(real)
    if kind:
        raise CheckpointError(f"{where}: {p.name} is {kind}, not a regular file; refusing to copy it")


def pass_through(root: Path, *, skip: Callable[[str], bool] = lambda rel: False,
                 subfolders: bool = False) -> dict[str, Path]:
    """The files of ``root`` a writer carries over verbatim, by relative name: hidden names
    (``.git``, ``.cache``, our bookkeeping) and names ``skip`` selects left out, links that
    leave the folder and special files refused; with ``subfolders``, real subfolders are walked
    (a link to a folder is refused: it is not a file of this checkpoint)."""
    out: dict[str, Path] = {}

    def walk(folder: Path, prefix: str) -> None:
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            rel = prefix + entry.name
            if entry.name.startswith(".") or skip(rel):
                continue
            p = Path(entry.path)
            if entry.is_dir(follow_symlinks=False):
                if subfolders:
                    walk(p, rel + "/")
                continue
            check_file_inside(root, p, str(root))
            if p.is_dir():
                if subfolders:
                    raise CheckpointError(f"{root}: {rel} is a link to a folder; refusing to copy it")
                continue
            out[rel] = p

    walk(root, "")
    return out


def copy_new(src: Path, dst: Path, chunk: int = 16 << 20) -> int:
    """Stream ``src`` (a regular file, opened without blocking) into a new file ``dst`` (created
    exclusively, never through a link: a stale entry at the name is removed first). Returns bytes."""
    if os.path.lexists(dst):
        dst.unlink()
    dst.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open_regular(src) as fin:
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "wb") as fout:
            while True:
                piece = fin.read(chunk)
                if not piece:
                    break
                fout.write(piece)
                n += len(piece)
    return n


def roots_in(job: Any) -> list[str]:
    """Every ``"root"`` value in a job description (the inputs' ``describe()`` outputs)."""
    found: list[str] = []
    if isinstance(job, dict):
        for k, v in job.items():
            if k == "root" and isinstance(v, str):
                found.append(v)
            else:
                found.extend(roots_in(v))
    elif isinstance(job, (list, tuple)):
        for v in job:
            found.extend(roots_in(v))
    return found


def check_dst(dst: str | Path, inputs: Iterable[str | Path | None]) -> None:
    """Refuse a destination equal to, containing or inside any input folder (``--force`` or not)."""
    d = Path(os.path.abspath(dst)).resolve()
    for inp in inputs:
        if inp is None:
            continue
        ip = Path(inp)
        if not ip.exists():
            continue  # a hub repo id: its resolved snapshot folder is checked through the job
        i = ip.resolve()
        if d == i:
            raise OutputError(f"{dst}: is the input {inp}; write the output somewhere else")
        if d in i.parents:
            raise OutputError(f"{dst}: contains the input {inp}; replacing it would delete the input")
        if i in d.parents:
            raise OutputError(f"{dst}: lies inside the input {inp}; outputs never go into an input folder")


def check_outputs(outputs: Iterable[str | Path | None], inputs: Iterable[str | Path | None]) -> None:
    """Every path a command writes (a destination folder, a report or plot file) against every
    path it reads (sources, ``--config``, ``--reference``, ``--tokens``, adapters): none may be,
    contain or lie inside another. Paths that do not exist locally (hub ids) are skipped."""
    ins = [i for i in inputs if i is not None and str(i) != ""]
    for out in outputs:
        if out is not None and str(out) != "":
            check_dst(out, ins)


__all__ = ["check_name", "inside", "check_file_inside", "check_dst", "check_outputs", "link_roots", "roots_in",
           "check_regular", "open_regular", "pass_through", "copy_new"]
