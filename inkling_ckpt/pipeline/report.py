"""What a finished job did, as data (``--json``) and as the one line that stays in the log."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ..units import fmt_bytes, ranks_phrase
from .executor import RankStats


@dataclass
class Result:
    """What a writing command did: output, bytes moved, time, what a resume reused, each rank's share."""

    dst: Path
    skipped: bool = False
    resumed: bool = False  # True only when an interrupted run's work was reused (bytes_reused > 0)
    tensors: int = 0
    bytes: int = 0  # the output's tensor bytes
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0
    bytes_reused: int = 0
    ranks: list[dict[str, Any]] = field(default_factory=list)

    def add_ranks(self, stats: Sequence[RankStats], seconds: float | None = None) -> None:
        """Fill in the totals from every rank's stats (elapsed: the slowest rank, unless given)."""
        self.ranks = [s.as_dict() for s in stats]
        self.bytes_read = sum(s.bytes_read for s in stats)
        self.bytes_written = sum(s.bytes_written for s in stats)
        self.bytes_reused = sum(s.bytes_reused for s in stats)
        self.seconds = seconds if seconds is not None else max((s.seconds for s in stats), default=0.0)
        self.resumed = self.bytes_reused > 0

    def as_dict(self) -> dict[str, Any]:
        return {"dst": str(self.dst), "skipped": self.skipped, "resumed": self.resumed, "tensors": self.tensors,
                "bytes": self.bytes, "seconds": round(self.seconds, 3), "bytes_read": self.bytes_read,
                "bytes_written": self.bytes_written, "bytes_reused": self.bytes_reused,
                "ranks": {"count": len(self.ranks), "each": self.ranks}, "notes": list(self.notes)}

    def summary(self, what: str = "output") -> str:
        """One line: what was written, how long it took, at what rate, what a resume reused, on how many ranks."""
        if self.skipped:
            return f"{self.dst}: already holds this {what}; nothing to do (--force to redo)"
        how = "resumed and finished" if self.resumed else "wrote"
        rate = (self.bytes_read + self.bytes_written) / self.seconds / 1e6 if self.seconds > 0 else 0.0
        line = (f"{how} {self.dst}: {self.tensors} tensors, {gb(self.bytes)} in {self.seconds:.1f} s "
                f"(read {gb(self.bytes_read)}, wrote {gb(self.bytes_written)}, {rate:.0f} MB/s")
        if self.resumed:
            line += f"; the resume reused {gb(self.bytes_reused)}"
        return line + ranks_phrase(self.ranks) + ")"


#: Sizes in the closing line: the toolkit's one convention (decimal units), under the pipeline's short name.
gb = fmt_bytes


__all__ = ["Result", "gb"]
