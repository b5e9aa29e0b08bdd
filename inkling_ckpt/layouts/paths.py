"""Paths read from files, and output folders checked against inputs.

Every file name a checkpoint names (an index's shard, a manifest's source file, a ``.metadata``
data file) is untrusted: it must be a plain relative name that stays inside its folder once
symlinks are resolved. The one sanctioned exception is a Hugging Face hub cache, whose snapshot
files are symlinks into the same repository cache's ``blobs/``.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath
from typing import Any, Iterable

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
    return p


def check_file_inside(root: Path, p: Path, where: str) -> None:
    """A file found by listing ``root`` (e.g. a pass-through file) must not be a link out of it."""
    try:
        real = p.resolve()
    except (OSError, RuntimeError) as e:
        raise CheckpointError(f"{where}: {p.name} cannot be resolved ({e})") from None
    if not _within(real, link_roots(root)):
        raise CheckpointError(f"{where}: {p.name} is a symlink to {real}, outside the checkpoint folder; refusing to copy it")


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


__all__ = ["check_name", "inside", "check_file_inside", "check_dst", "link_roots", "roots_in"]
