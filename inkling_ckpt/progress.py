"""Progress bars for long work: bytes, rate and ETA on stderr (quiet when asked or not a TTY)."""

from __future__ import annotations

import sys

from tqdm import tqdm

from .units import UNIT_DIVISOR


class ByteProgress:
    """A byte-counting progress bar; ``advance(n)`` after each tensor written."""

    def __init__(self, total: int, *, desc: str, enabled: bool = True, initial: int = 0):
        self._bar = tqdm(total=total, initial=initial, desc=desc, unit="B", unit_scale=True, unit_divisor=UNIT_DIVISOR,
                         disable=not enabled or not sys.stderr.isatty(), dynamic_ncols=True, leave=False)

    def advance(self, n: int) -> None:
        self._bar.update(n)

    def __enter__(self) -> "ByteProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        self._bar.close()
