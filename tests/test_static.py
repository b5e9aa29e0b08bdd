"""Static checks, part of the suite so the README's test command (and CI) enforces them.

ruff (pyflakes, pycodestyle, bugbear) over the whole repository and mypy over ``inkling_ckpt/``,
both configured in ``pyproject.toml`` and pinned in the ``test`` extra. To run one alone, from
the repository root: ``python -m ruff check .`` or ``python -m mypy``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT, oracle


def _run(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True)


def test_ruff_finds_nothing():
    oracle("ruff", "ruff")
    r = _run("ruff", "check", "--no-cache", "--output-format", "concise", ".")
    if r.returncode:
        pytest.fail(f"ruff findings (fix the code; a rule turned off needs a reason in pyproject.toml):\n{r.stdout}{r.stderr}",
                    pytrace=False)


def test_mypy_finds_nothing():
    # Its cache (.mypy_cache, git-ignored) makes a rerun take seconds; a cold run reads torch's stubs (a minute or two).
    oracle("mypy", "mypy")
    r = _run("mypy")
    if r.returncode:
        pytest.fail(f"mypy errors in inkling_ckpt/ (a narrow `# type: ignore[code]` only where a stub is wrong, with a "
                    f"reason):\n{r.stdout}{r.stderr}", pytrace=False)
