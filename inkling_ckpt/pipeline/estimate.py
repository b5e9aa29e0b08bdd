"""Time estimates for ``--dry-run``: the job's bytes at the rates this machine measured.

``bench/pipeline.py --save-rates`` records, per command and device, the MB/s (bytes read +
written per second) it measured, in ``$XDG_CACHE_HOME/inkling-ckpt/rates.json`` (default
``~/.cache``). A dry run divides the job's bytes by that rate; without a file it says so.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .report import gb

RATES_FILE = "rates.json"


def rates_path() -> Path:
    """Where the measured rates live on this machine."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "inkling-ckpt" / RATES_FILE


def load_rates() -> dict[str, Any]:
    """The recorded rates (``{"commands": {command: {device: {"mb_s": ...}}}, "plain_mb_s": ...}``), or ``{}``."""
    try:
        data = json.loads(rates_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save_rates(measured: dict[str, dict[str, float]], plain_mb_s: float, machine: str) -> Path:
    """Merge ``{command: {rate_key: MB/s}}`` into this machine's rates file; returns its path."""
    path = rates_path()
    data = load_rates()
    cmds = data.setdefault("commands", {})
    for command, by_device in measured.items():
        for device, rate in by_device.items():
            cmds.setdefault(command, {})[device] = {"mb_s": round(rate, 1)}
    data["plain_mb_s"] = round(plain_mb_s, 1)
    data["machine"] = machine
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def rate_key(device: str, ranks: int = 1) -> str:
    """How a rate is filed: ``cpu``, ``cuda``, or ``cpu x2`` for two ranks."""
    return device if ranks <= 1 else f"{device} x{ranks}"


def estimate(command: str, bytes_read: int, bytes_written: int, device: str = "cpu", ranks: int = 1) -> dict[str, Any]:
    """The job's bytes and, when this machine has a measured rate for ``command`` on ``device``, its time.

    With several ranks and no rate measured for that many, the one-rank rate gives an upper bound.
    """
    out: dict[str, Any] = {"bytes_read": bytes_read, "bytes_written": bytes_written}
    by_device = load_rates().get("commands", {}).get(command, {})
    rate = (by_device.get(rate_key(device, ranks)) or {}).get("mb_s")
    bound = False
    if not rate and ranks > 1:
        rate, bound = (by_device.get(device) or {}).get("mb_s"), True
    if not rate:
        out["seconds"] = None
        out["estimate"] = (f"reads {gb(bytes_read)}, writes {gb(bytes_written)}; no measured rate for {command} on "
                           f"{device} here (bench/pipeline.py --save-rates records them)")
        return out
    seconds = (bytes_read + bytes_written) / (float(rate) * 1e6)
    out["seconds"] = round(seconds, 1)
    out["estimate"] = (f"reads {gb(bytes_read)}, writes {gb(bytes_written)}: about {_duration(seconds)} at the "
                       f"{rate:.0f} MB/s measured here for {command} on {rate_key(device, 1 if bound else ranks)}"
                       + (f" (one rank's rate: {ranks} ranks should take less)" if bound else ""))
    return out


def _duration(s: float) -> str:
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


__all__ = ["estimate", "load_rates", "save_rates", "rates_path", "rate_key"]
