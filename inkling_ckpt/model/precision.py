"""Precision plans: which format each decoder layer's routed experts are stored in.

Written compactly as ``0-39:nvfp4,40-47:mxfp8``; a bare format name (``mxfp8``) covers every
layer. Layers no rule names stay BF16.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from ..errors import PlanError
from ..formats.stacked import STACKED_FORMATS as FORMAT_NAMES

_RULE = re.compile(r"^\s*(?:(\d+)(?:\s*-\s*(\d+))?\s*:)?\s*([A-Za-z0-9_]+)\s*$")


@dataclass(frozen=True)
class PrecisionPlan:
    """Per-layer expert formats for a model with ``num_layers`` decoder layers."""

    formats: tuple[str, ...]

    @classmethod
    def parse(cls, text: str, num_layers: int) -> "PrecisionPlan":
        """Parse ``0-1:nvfp4,2-3:mxfp8`` (or ``mxfp8``) for a model with ``num_layers`` layers; a layer
        no rule names is ``bf16`` (unquantized; ``dense_as`` picks its dtype)."""
        if not text or not text.strip():
            raise PlanError("the precision plan is empty")
        layers: list[str | None] = [None] * num_layers
        for raw in text.split(","):
            m = _RULE.match(raw)
            if not m:
                raise PlanError(f"precision plan rule {raw.strip()!r} is not FIRST-LAST:FORMAT")
            first, last, fmt = m.group(1), m.group(2), m.group(3).lower()
            if fmt not in FORMAT_NAMES:
                raise PlanError(
                    f"precision plan names format {fmt!r}; known formats: {', '.join(FORMAT_NAMES)}"
                )
            if first is None:
                lo, hi = 0, num_layers - 1
            else:
                lo = int(first)
                hi = int(last) if last is not None else lo
            if lo > hi:
                raise PlanError(f"precision plan rule {raw.strip()!r}: range runs backwards")
            if hi >= num_layers:
                raise PlanError(
                    f"precision plan rule {raw.strip()!r} names layer {hi}, but the model has "
                    f"layers 0-{num_layers - 1}"
                )
            for i in range(lo, hi + 1):
                if layers[i] is not None:
                    raise PlanError(f"precision plan names layer {i} twice")
                layers[i] = fmt
        return cls(tuple(f or "bf16" for f in layers))

    @classmethod
    def uniform(cls, fmt: str, num_layers: int) -> "PrecisionPlan":
        return cls.parse(fmt, num_layers)

    def __len__(self) -> int:
        return len(self.formats)

    def format_of(self, layer: int) -> str:
        return self.formats[layer]

    def used_formats(self) -> list[str]:
        return sorted(set(self.formats))

    def ranges(self) -> list[tuple[int, int, str]]:
        """Maximal runs of equal format: [(first, last, fmt), ...]."""
        out: list[tuple[int, int, str]] = []
        for i, f in enumerate(self.formats):
            if out and out[-1][2] == f and out[-1][1] == i - 1:
                out[-1] = (out[-1][0], i, f)
            else:
                out.append((i, i, f))
        return out

    @property
    def variant(self) -> str:
        """``bf16``, ``nvfp4``, ``mxfp8`` when uniform, else ``mixed``."""
        used = self.used_formats()
        return used[0] if len(used) == 1 else "mixed"

    def __str__(self) -> str:
        return ",".join(f"{a}-{b}:{f}" if a != b else f"{a}:{f}" for a, b, f in self.ranges())

    @classmethod
    def from_layer_formats(cls, formats: Sequence[str] | Iterable[str]) -> "PrecisionPlan":
        return cls(tuple(formats))


#: Casts between unquantized expert dtypes that keep every value: (stored format, written format).
EXACT_CASTS = frozenset({("bf16", "f32"), ("f16", "f32")})


def dense_as(plan: PrecisionPlan, source: PrecisionPlan, dtype: str | None = None) -> PrecisionPlan:
    """``plan`` with its unquantized layers written in ``dtype`` (``bf16``, ``f16``, ``f32``).

    Without ``dtype`` a layer keeps the plan's format; where the source stores that layer's
    experts unquantized in another dtype and the cast would round them (F32 → BF16, F16 ↔ BF16),
    PlanError names ``--dtype``: no command narrows a dtype silently.
    """
    from ..formats.stacked import UNQUANTIZED

    if dtype is not None and dtype not in UNQUANTIZED:
        raise PlanError(f"--dtype {dtype!r}: choose one of {', '.join(UNQUANTIZED)}")
    out = []
    for i, fmt in enumerate(plan.formats):
        if fmt in UNQUANTIZED:
            stored = source.format_of(i)
            if dtype is not None:
                fmt = dtype
            elif stored in UNQUANTIZED and stored != fmt and (stored, fmt) not in EXACT_CASTS:
                raise PlanError(f"layer {i}'s routed experts are {stored.upper()}; writing them as {fmt.upper()} would "
                                f"round them (no silent casts): pass --dtype {fmt} to round them, or --dtype {stored} "
                                "to keep them")
        out.append(fmt)
    return PrecisionPlan(tuple(out))
