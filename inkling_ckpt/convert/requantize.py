"""HF → HF under a new precision plan: ``quantize``, ``dequantize`` and ``convert hf-to-hf``.

Streams from any tensor source (an :class:`HFCheckpoint` or a synthetic checkpoint) into an
atomically published folder. Non-expert tensors are copied bit for bit (in the source's own
dtypes); a layer's stacked experts go a few experts at a time — copied part for part when the
layer keeps its format, else decoded to BF16 and encoded in the target format — so memory is
bounded by an expert slice, never a layer. The units run through :mod:`inkling_ckpt.pipeline`
(device, worker threads, ranks, unit-grain resume).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch

from ..errors import CheckpointError
from ..formats.stacked import UNQUANTIZED, natural_dtype
from ..layouts.hf import DEFAULT_MAX_SHARD, reference_sharding
from ..model.config import InklingConfig
from ..model.inventory import ExpertStack, TensorSpec, expert_stacks, inventory
from ..model.precision import PrecisionPlan, dense_as
from ..model.quant_config import output_config
from ..pipeline import (
    DEFAULT_SLICE_BYTES, Executor, Options, Result, Unit, device_kind, estimate, expert_slice, read_on_device,
    release_units, write_hf,
)
from ..pipeline.units import expert_slices as _expert_slices
from .experts import ExpertEncoder, ScalePolicy, ScaleSource, decode_slice, parts_extents, read_parts

#: Bytes of BF16 expert weights handled at once by default (``--slice-mb``; bounds memory: the
#: slice, its float32 temporaries in the codecs are chunked separately).
SLICE_BYTES = DEFAULT_SLICE_BYTES
#: Host bytes an expert slice's encode holds on the CPU beside what it reads and writes: the codec's
#: chunk temporaries (``formats._base.CHUNK_ELEMS`` float32 values, their codes, the packing). One
#: worker on the 2-core box peaked 11 MiB over a BF16 -> NVFP4 unit's read + write, once warm.
ENCODE_WORKSPACE_BYTES = 16 << 20


class TensorSource(Protocol):
    """A checkpoint that hands out its stored tensors by HF name."""

    config: dict[str, Any]
    cfg: InklingConfig
    plan: PrecisionPlan

    @property
    def tensors(self) -> Mapping[str, Any]: ...  # the stored names (values are layout-specific)

    def get(self, name: str) -> torch.Tensor: ...
    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor: ...
    def dtypes(self) -> dict[str, torch.dtype]: ...
    def vision_specs(self) -> list[TensorSpec]: ...
    def extra_files(self) -> Mapping[str, bytes | Path]: ...
    def describe(self) -> dict[str, Any]: ...


def expert_slices(stack: ExpertStack, slice_bytes: int = SLICE_BYTES) -> list[tuple[int, int]]:
    """(first, last) expert ranges of a stacked weight, each about ``slice_bytes`` of BF16."""
    return _expert_slices(stack, slice_bytes)


def requantize(
    src: TensorSource,
    dst: str | Path,
    plan: PrecisionPlan,
    *,
    scales: ScalePolicy = "fresh",
    reference: ScaleSource | None = None,
    max_shard_size: int | str | None = None,
    allow_nonfinite: bool = False,
    force: bool = False,
    progress: bool = True,
    command: str = "requantize",
    dtype: str | None = None,
    options: Options | None = None,
) -> Result:
    """Write ``src`` re-encoded under ``plan`` to ``dst`` (atomic; resumable; skipped when done).

    ``dtype`` (``bf16``, ``f16``, ``f32``): the dtype of the layers ``plan`` leaves unquantized;
    without it, a layer stored wider than the plan writes it is refused (``model.precision.dense_as``).

    ``max_shard_size`` None: the source's files when the output keeps its tensors, else 5GB shards.

    ``options`` picks the device, slice budget and workers (default: ``--device auto``); under
    torchrun the ranks split the output shards and publish one checkpoint.
    """
    cfg = src.cfg
    if len(plan) != cfg.num_hidden_layers:
        raise CheckpointError(f"the precision plan covers {len(plan)} layers, but the source has {cfg.num_hidden_layers}")
    plan = dense_as(plan, src.plan, dtype)
    if scales == "keep" and reference is None and not set(src.plan.used_formats()) <= set(UNQUANTIZED):
        reference = src  # a quantized source carries its own scales
    encoder = ExpertEncoder(plan, scales=scales, reference=reference, allow_nonfinite=allow_nonfinite)
    specs = inventory(cfg, plan, dtypes=src.dtypes(), vision=src.vision_specs())
    config = output_config(src.config, cfg, plan)
    files = reference_sharding(src, specs) if max_shard_size is None else None
    job = {"command": command, "source": src.describe(), "plan": str(plan), "scales": scales,
           "reference": reference.describe() if reference is not None and reference is not src else None,  # type: ignore[attr-defined]
           "max_shard_size": "source" if files is not None else str(max_shard_size or DEFAULT_MAX_SHARD),
           "allow_nonfinite": allow_nonfinite}
    ex = Executor(options or Options(progress=progress), desc=command)
    read_from = [src] if reference is None else [src, reference]
    units = read_on_device(plan_units(src, specs, plan, ex.slice_bytes), ex.device.type, read_from)
    result = write_hf(ex, dst, job, specs, config, src.extra_files(), units, transform(src, plan, encoder, ex),
                      max_shard_size=max_shard_size or DEFAULT_MAX_SHARD, files=files, force=force,
                      extents=reads(src, plan, encoder))
    if "nvfp4" in plan.used_formats() and not result.skipped:
        result.notes.append("NVFP4 experts carry no activation scales (none is pinned by the release format): "
                            "the serving engine calibrates them")
    return result


def describe_requantize(src: TensorSource, plan: PrecisionPlan, *, command: str = "quantize", device: str = "auto",
                        ranks: int = 1, slice_bytes: int = SLICE_BYTES) -> dict[str, Any]:
    """What ``quantize`` / ``dequantize`` / ``hf-to-hf`` would read and write (from headers), and the
    time at this machine's measured rate (``estimate``) — for a ``--dry-run``."""
    if len(plan) != src.cfg.num_hidden_layers:
        raise CheckpointError(f"the precision plan covers {len(plan)} layers, but the source has {src.cfg.num_hidden_layers}")
    specs = inventory(src.cfg, plan, dtypes=src.dtypes(), vision=src.vision_specs())
    units = plan_units(src, specs, plan, slice_bytes)
    read, written = sum(u.read_bytes for u in units), sum(s.nbytes for s in specs)
    return {"plan": str(plan), "tensors": len(specs), "units": len(units), "bytes_read": read, "bytes_written": written,
            "layers": {fmt: sum(1 for i in range(len(plan)) if plan.format_of(i) == fmt) for fmt in plan.used_formats()},
            "estimate": estimate(command, read, written, device_kind(device), ranks)}


def plan_units(src: TensorSource, specs: list[TensorSpec], plan: PrecisionPlan, slice_bytes: int) -> list[Unit]:
    """The job's units in output order: each layer's dense tensors, then its experts slice by slice.

    Each is charged (``hold_bytes``) what :func:`transform` holds of it on the host at once: what
    it reads, which is what it writes when nothing is re-encoded (dense tensors, a layer that keeps
    its format); else what it reads and writes, the decoded values between two quantized formats,
    and an encode's chunk temporaries (:data:`ENCODE_WORKSPACE_BYTES`). On a GPU ``requantize``
    charges expert slices again (``read_on_device``).
    """
    in_stacks = {st.name: st for st in expert_stacks(src.cfg, src.plan)}
    stacks = {st.name: st for st in expert_stacks(src.cfg, plan)}
    units = release_units(specs, stacks, slice_bytes, src.cfg.num_hidden_layers,
                          stack_read_bytes={n: st.stored_bytes for n, st in in_stacks.items()},
                          row_reads=getattr(src, "row_reads", True))
    return [replace(u, hold_bytes=_hold(u, in_stacks)) for u in units]


def _hold(unit: Unit, in_stacks: Mapping[str, ExpertStack]) -> int:
    sl = expert_slice(unit)
    inp = in_stacks[sl[0].name] if sl is not None else None
    if sl is None or inp is None or sl[0].fmt == inp.fmt:
        return max(unit.read_bytes, unit.write_bytes, 1)  # the bytes read are the result
    out, first, last = sl
    hold = unit.read_bytes + unit.write_bytes
    if out.fmt not in UNQUANTIZED:  # an encode: its temporaries, and from a quantized source the BF16 between
        hold += ENCODE_WORKSPACE_BYTES
        if inp.fmt not in UNQUANTIZED:
            _, rows, cols = out.shape
            hold += (last - first) * rows * cols * natural_dtype(inp.fmt).itemsize
    return hold


def reads(src: TensorSource, plan: PrecisionPlan, encoder: ExpertEncoder) -> Callable[[Unit], list[tuple[Any, int, int]]]:
    """What :func:`transform`'s units read (of the source, and of a reference whose scales they keep),
    for the executor's read-ahead."""
    in_stacks = {st.name: st for st in expert_stacks(src.cfg, src.plan)}

    def run(unit: Unit) -> list[tuple[Any, int, int]]:
        sl = expert_slice(unit)
        if sl is None:
            return dense_reads(src, unit.pieces)
        out, first, last = sl
        inp = in_stacks[out.name]
        kept = [] if out.fmt == inp.fmt else encoder.reads(out, first, last)
        return parts_extents(src, inp, first, last) + kept
    return run


def transform(src: TensorSource, plan: PrecisionPlan, encoder: ExpertEncoder, ex: Executor) -> Callable[[Unit], dict[str, torch.Tensor]]:
    """Read → (decode → encode on the executor's device) → the unit's output tensors by name."""
    in_stacks = {st.name: st for st in expert_stacks(src.cfg, src.plan)}

    def run(unit: Unit) -> dict[str, torch.Tensor]:
        sl = expert_slice(unit)
        if sl is None:
            return read_dense(src, unit.pieces)
        out, first, last = sl
        inp = in_stacks[out.name]
        # On a GPU the slice goes up and its result is written from there (the writer brings it down
        # piece by piece): the host holds neither, which is what read_on_device charges.
        if out.fmt == inp.fmt:
            got = read_parts(src, inp, first, last, device=ex.device)  # same format: the stored bytes as they are
        else:
            # Unquantized output: decoded straight to its dtype (one rounding); quantized: from the
            # source's natural dtype (an F32 source is encoded from its F32 values).
            x = decode_slice(src, inp, first, last, allow_nonfinite=encoder.allow_nonfinite,
                             dtype=UNQUANTIZED.get(out.fmt), device=ex.device)
            got = encoder.encode(out, first, x)
        return {out.name + k: v for k, v in got.items()}
    return run


def read_dense(src: Any, pieces: Sequence[tuple[str, int, int]]) -> dict[str, torch.Tensor]:
    """The rows of each piece of dense tensors, read as stored."""
    out: dict[str, torch.Tensor] = {}
    for name, a, b in pieces:
        rows = _rows(src, name)
        if rows is not None and (a, b) != (0, rows) and getattr(src, "row_reads", True):
            out[name] = src.read_rows(name, a, b)  # exactly rows a:b, reading only them
            continue
        t = src.get(name)  # whole; a source that cannot read rows apart has them cut from it
        out[name] = t[a:b] if t.dim() and (a, b) != (0, t.shape[0]) else t
    return out


def dense_reads(src: Any, pieces: Sequence[tuple[str, int, int]]) -> list[tuple[Any, int, int]]:
    """The byte ranges :func:`read_dense` of the same pieces reads from ``src``, for the executor's
    read-ahead (none from a source that cannot say: no ``extents``)."""
    ext = getattr(src, "extents", None)
    if ext is None:
        return []
    out: list[tuple[Any, int, int]] = []
    for name, a, b in pieces:
        rows = _rows(src, name)
        if rows is not None and (a, b) != (0, rows) and getattr(src, "row_reads", True):
            out += ext(name, a, b)
        else:
            out += ext(name, 0, rows if rows is not None else 1)
    return out


def _rows(src: Any, name: str) -> int | None:
    """Rows of a stored tensor from the source's headers (None: a scalar, or not known)."""
    tensors = getattr(src, "tensors", None)
    st = tensors.get(name) if isinstance(tensors, Mapping) else None
    shape = st.get("shape") if isinstance(st, Mapping) else getattr(st, "shape", None)  # a manifest entry, or a header's
    return int(shape[0]) if shape else None


__all__ = ["requantize", "describe_requantize", "plan_units", "transform", "read_dense", "dense_reads", "expert_slices", "Result", "TensorSource"]
