"""Shared test helpers: paths of the bundled fixtures and a CLI runner."""

from __future__ import annotations

import filecmp
import os
import socket
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
TINY = {v: FIXTURES / f"tiny-{v}" for v in ("bf16", "mixed", "mxfp8")}
TINY_PLAN = "0-1:nvfp4,2-3:mxfp8"


def oracle(module: str, package: str, minversion: str | None = None) -> ModuleType:
    """Import a test-only package (an oracle the README's test command installs via the ``test`` extra).

    Missing, the test skips and says which package to install. Under CI (``CI=true``) the test
    command has installed every oracle, so a missing one fails there instead of skipping quietly.
    """
    __tracebackhide__ = True  # pytest reports the skip at the calling test, not here
    reason = f"{package} is not installed (test-only: pip install -e '.[test]')"
    if os.environ.get("CI", "").lower() not in ("1", "true"):
        return pytest.importorskip(module, minversion=minversion, reason=reason)
    try:
        return pytest.importorskip(module, minversion=minversion, reason=reason)
    except pytest.skip.Exception:
        pass
    pytest.fail(f"{reason}; CI installs every test-only package", pytrace=False)


@pytest.fixture
def cli(capsys):
    """Run the CLI in-process; returns (exit code, stdout, stderr)."""
    from inkling_ckpt.cli.app import main

    def run(*args: str) -> tuple[int, str, str]:
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def same_files(a: Path, b: Path, ignore_hidden: bool = True) -> list[str]:
    """Names of files that differ (or exist on one side only) between two folders, byte for byte."""
    names = {p.name for p in a.iterdir()} | {p.name for p in b.iterdir()}
    if ignore_hidden:
        names = {n for n in names if not n.startswith(".")}
    return sorted(n for n in names
                  if not (a / n).is_file() or not (b / n).is_file() or not filecmp.cmp(a / n, b / n, shallow=False))


def free_port() -> str:
    """A TCP port on loopback that nothing listens on now (for torchrun / gloo rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def subprocess_env() -> dict[str, str]:
    """The environment for a child process running this checkout, one thread per process."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def executor_gpu_workers(monkeypatch: pytest.MonkeyPatch, module: ModuleType) -> list[int]:
    """The ``gpu_workers`` each Executor that ``module`` creates asks for (the GPU default when it
    names none), recorded as the command runs."""
    from inkling_ckpt.pipeline import executor as executor_mod

    seen: list[int] = []
    real = executor_mod.Executor

    def spy(*args, **kw):  # type: ignore[no-untyped-def]
        seen.append(kw.get("gpu_workers", executor_mod.MAX_DEFAULT_GPU_WORKERS))
        return real(*args, **kw)

    monkeypatch.setattr(module, "Executor", spy)
    return seen


def byte_ranges(ranges) -> dict[str, list[tuple[int, int]]]:
    """``(file, offset, length)`` ranges as each file's sorted, merged ``[start, stop)`` intervals (files
    resolved), so two lists of reads compare by the bytes they cover."""
    per: dict[str, list[tuple[int, int]]] = {}
    for p, a, n in ranges:
        if n > 0:
            per.setdefault(str(Path(p).resolve()), []).append((a, a + n))
    out = {}
    for f, spans in per.items():
        merged: list[tuple[int, int]] = []
        for a, b in sorted(spans):
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        out[f] = merged
    return out


def within(inner: dict[str, list[tuple[int, int]]], outer: dict[str, list[tuple[int, int]]]) -> bool:
    """Every byte of ``inner`` lies in ``outer`` (both as :func:`byte_ranges` gives them)."""
    for f, spans in inner.items():
        big = outer.get(f, [])
        for a, b in spans:
            if not any(x <= a and b <= y for x, y in big):
                return False
    return True


@pytest.fixture
def file_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Every positioned read the package makes from here on (``layouts.pread``'s and ``os.pread``), as
    ``(file, offset, length)``: what a test compares with the extents a command names for read-ahead."""
    from inkling_ckpt.layouts import pread

    reads: list[tuple[str, int, int]] = []
    real_into, real_pread = pread._pread_into, os.pread

    def into(fd: int, view: memoryview, offset: int, truncated: str) -> None:
        reads.append((os.readlink(f"/proc/self/fd/{fd}"), offset, len(view)))
        real_into(fd, view, offset, truncated)

    def plain(fd: int, n: int, offset: int) -> bytes:
        got = real_pread(fd, n, offset)
        reads.append((os.readlink(f"/proc/self/fd/{fd}"), offset, len(got)))
        return got

    monkeypatch.setattr(pread, "_pread_into", into)
    monkeypatch.setattr(os, "pread", plain)
    return reads
