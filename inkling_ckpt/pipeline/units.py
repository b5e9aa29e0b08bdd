"""Planning units from an output inventory: dense tensors in row chunks, expert stacks in slices.

Every HF-writing command plans the same way, from headers only: the output's tensors in
inventory order (so reads and writes run forward through the files), dense tensors batched or
cut by rows to about one slice, each layer's stacked experts a slice of experts at a time with
all of that slice's stored parts (the NVFP4 scalar denominator goes with the first slice).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

from ..model.inventory import ExpertStack, TensorSpec, is_vision
from .executor import Unit


def expert_slices(stack: ExpertStack, slice_bytes: int) -> list[tuple[int, int]]:
    """(first, last) expert ranges of a stacked weight, each about ``slice_bytes`` of BF16 (at least one expert)."""
    e, r, c = stack.shape
    step = max(1, slice_bytes // max(1, r * c * 2))
    return [(a, min(e, a + step)) for a in range(0, e, step)]


def where_of(spec: TensorSpec | ExpertStack, layers: int) -> str:
    """Where the job is, for progress: "layer 3 of 48", or the part of the model outside the layers."""
    layer = spec.layer
    if layer is not None:
        return f"layer {layer + 1} of {layers}"
    if is_vision(spec.name):
        return "vision tower"
    return "embeddings and head"


def dense_units(specs: Sequence[TensorSpec], slice_bytes: int, layers: int, *, row_reads: bool = True,
                read_bytes: Callable[[TensorSpec], int] | None = None) -> list[Unit]:
    """Units for non-expert tensors: small ones batched up to ``slice_bytes``, big ones cut by rows.

    ``data`` is the list of pieces again (each ``(name, first row, last row)``) and the unit
    reads what it writes unless ``read_bytes`` says otherwise (per whole tensor).
    """
    units: list[Unit] = []
    batch: list[tuple[str, int, int]] = []
    size = 0
    where = ""
    readb = read_bytes or (lambda s: s.nbytes)
    by_name = {s.name: s for s in specs}

    def flush() -> None:
        nonlocal batch, size
        if batch:
            rb = sum(readb(by_name[n]) * (b - a) // _rows(by_name[n]) for n, a, b in batch)
            units.append(Unit(f"{batch[0][0]}[{batch[0][1]}:{batch[0][2]}]+{len(batch)}", where, rb, size,
                              tuple(batch), tuple(batch)))
        batch, size = [], 0

    for s in specs:
        w = where_of(s, layers)
        if w != where:
            flush()
            where = w
        rows = _rows(s)
        if s.nbytes > slice_bytes and rows > 1 and row_reads:
            flush()
            step = max(1, slice_bytes * rows // s.nbytes)
            for a in range(0, rows, step):
                b = min(rows, a + step)
                batch, size = [(s.name, a, b)], s.nbytes * (b - a) // rows
                flush()
            continue
        if size + s.nbytes > slice_bytes:
            flush()
        batch.append((s.name, 0, rows))
        size += s.nbytes
    flush()
    return units


def _rows(s: TensorSpec) -> int:
    return s.shape[0] if s.shape else 1


def stack_units(stack: ExpertStack, slice_bytes: int, layers: int, *, read_bytes: int | None = None) -> list[Unit]:
    """One unit per slice of experts of ``stack``; ``data`` is ``(stack, first, last)``.

    ``read_bytes`` is what reading the whole stack costs (default: the output's bytes).
    """
    parts = stack.parts()
    total_out = sum(p.nbytes for p in parts)
    total_in = total_out if read_bytes is None else read_bytes
    e = stack.shape[0]
    where = where_of(stack, layers)
    out = []
    for first, last in expert_slices(stack, slice_bytes):
        pieces = tuple((p.name, first, last) if p.shape != () else (p.name, 0, 1)
                       for p in parts if p.shape != () or first == 0)
        out.append(Unit(f"{stack.name}[{first}:{last}]", where, total_in * (last - first) // e,
                        total_out * (last - first) // e, pieces, (stack, first, last)))
    return out



def expert_slice(unit: Unit) -> tuple[ExpertStack, int, int] | None:
    """``(stack, first, last)`` of a unit :func:`stack_units` made (a slice of a layer's experts), else None."""
    d = unit.data
    if isinstance(d, tuple) and len(d) == 3 and isinstance(d[0], ExpertStack):
        return d
    return None


def read_on_device(units: Sequence[Unit], device_type: str, sources: Sequence[Any]) -> list[Unit]:
    """``units`` charged for a run whose expert slices read their stored parts straight onto a GPU
    (``read_parts(..., device=)``) and leave their results there for the HF writer (which brings
    them down through small pinned buffers, ``layouts.pread.write_from``): such a slice holds
    nothing on the host beyond those buffers, which count in the process's size, so its
    ``hold_bytes`` is 1. Only where every one of ``sources`` (what the slices read) has
    ``reads_to_device``: another source is read on the host and copied up, holding the slice there
    meanwhile. On the CPU, and for other units, unchanged."""
    if device_type == "cpu" or not all(getattr(s, "reads_to_device", False) for s in sources):
        return list(units)
    return [replace(u, hold_bytes=1) if expert_slice(u) is not None else u for u in units]


def release_units(specs: Sequence[TensorSpec], stacks: Mapping[str, ExpertStack], slice_bytes: int, layers: int, *,
                  stack_read_bytes: Mapping[str, int], row_reads: bool = True,
                  read_bytes: Callable[[TensorSpec], int] | None = None) -> list[Unit]:
    """The units of an HF output in inventory order: each run of dense tensors (``dense_units``, reading
    ``read_bytes(spec)`` per whole tensor), then the stacked experts that follow it slice by slice
    (``stack_units`` of ``stacks[base]``, reading ``stack_read_bytes[base]`` in all)."""
    units: list[Unit] = []
    dense: list[TensorSpec] = []
    seen: set[str] = set()
    for spec in specs:
        if spec.part is None:
            dense.append(spec)
            continue
        base = spec.base or ""
        if base in seen:
            continue
        seen.add(base)
        units += dense_units(dense, slice_bytes, layers, row_reads=row_reads, read_bytes=read_bytes)
        dense = []
        units += stack_units(stacks[base], slice_bytes, layers, read_bytes=stack_read_bytes[base])
    return units + dense_units(dense, slice_bytes, layers, row_reads=row_reads, read_bytes=read_bytes)


__all__ = ["expert_slices", "expert_slice", "read_on_device", "where_of", "dense_units", "stack_units", "release_units"]
