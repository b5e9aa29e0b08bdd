"""One convention for sizes people read: decimal units (1 GB = 10^9 bytes), as the release and GPUs are sized.

Every human-readable size the toolkit prints goes through :func:`fmt_bytes`; JSON output carries raw
byte counts. Sizes people type (``--max-shard-size 5GB``, ``2MiB``) are parsed by
``layouts.hf.parse_size``, which takes both decimal and binary suffixes.
"""

from __future__ import annotations

from typing import Any, Sequence

KB, MB, GB, TB = 10**3, 10**6, 10**9, 10**12
_UNITS = (("TB", TB), ("GB", GB), ("MB", MB), ("kB", KB))
UNIT_DIVISOR = 1000  # for progress bars (tqdm's unit_scale), so their "G" is a GB too


def fmt_bytes(n: float, unit: str | None = None, *, digits: int = 2) -> str:
    """``n`` bytes as e.g. ``"390.06 GB"``; ``unit`` ("GB", "MB", "kB", "B") fixes the unit, else the largest that fits."""
    if unit is None:
        unit = next((name for name, div in _UNITS if abs(n) >= div), "B")
    if unit == "B":
        return f"{n:.0f} B"
    div = dict(_UNITS).get(unit)
    if div is None:
        raise ValueError(f"unknown unit {unit!r}")
    return f"{n / div:.{digits}f} {unit}"


def ranks_phrase(each: Sequence[dict[str, Any]]) -> str:
    """The end of a job's closing line from its per-rank stats (``"ranks"`` of a report): how many
    ranks took part, the device, and the peak GPU memory of the busiest rank (``""`` for none)."""
    out = f"; {len(each)} ranks" if len(each) > 1 else ""
    if each:
        out += f"; {each[0]['device']}"
        gpu = max(r.get("peak_gpu_bytes", 0) for r in each)
        if gpu:
            out += f", peak GPU memory {fmt_bytes(gpu)}"
    return out
