"""HF → HF under a new precision plan: ``quantize``, ``dequantize`` and ``convert hf-to-hf``.

Streams from any tensor source (an :class:`HFCheckpoint` or a synthetic checkpoint) into an
atomically published folder. Non-expert tensors are copied bit for bit (in the source's own
dtypes); a layer's stacked experts go a few experts at a time — copied part for part when the
layer keeps its format, else decoded to BF16 and encoded in the target format — so memory is
bounded by an expert slice, never a layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import torch

from ..errors import CheckpointError
from ..layouts.hf import DEFAULT_MAX_SHARD, HFWriter, reference_sharding, write_extra_files, write_json
from ..layouts.staging import Staging
from ..model.config import InklingConfig
from ..formats.stacked import UNQUANTIZED
from ..model.inventory import ExpertStack, TensorSpec, expert_stacks, inventory
from ..model.precision import PrecisionPlan, dense_as
from ..model.quant_config import output_config
from ..progress import ByteProgress
from .experts import ExpertEncoder, ScalePolicy, ScaleSource, decode_slice, read_parts

#: Bytes of BF16 expert weights handled at once (bounds memory: the slice, its float32
#: temporaries in the codecs are chunked separately).
SLICE_BYTES = 64 * 2**20


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


@dataclass
class Result:
    """What a conversion did."""

    dst: Path
    skipped: bool = False
    resumed: bool = False
    tensors: int = 0
    bytes: int = 0
    notes: list[str] = field(default_factory=list)


def expert_slices(stack: ExpertStack, slice_bytes: int = SLICE_BYTES) -> list[tuple[int, int]]:
    """(first, last) expert ranges of a stacked weight, each about ``slice_bytes`` of BF16."""
    e, r, c = stack.shape
    step = max(1, slice_bytes // max(1, r * c * 2))
    return [(a, min(e, a + step)) for a in range(0, e, step)]


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
) -> Result:
    """Write ``src`` re-encoded under ``plan`` to ``dst`` (atomic; resumable; skipped when done).

    ``dtype`` (``bf16``, ``f16``, ``f32``): the dtype of the layers ``plan`` leaves unquantized;
    without it, a layer stored wider than the plan writes it is refused (``model.precision.dense_as``).

    ``max_shard_size`` None: the source's files when the output keeps its tensors, else 5GB shards.
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
    result = write_hf_checkpoint(
        dst, job, specs, config, src.extra_files(),
        lambda writer, advance: _stream(src, writer, specs, plan, encoder, advance),
        max_shard_size=max_shard_size or DEFAULT_MAX_SHARD, force=force, progress=progress, desc=command, files=files,
    )
    if "nvfp4" in plan.used_formats() and not result.skipped:
        result.notes.append("NVFP4 experts carry no activation scales (none is pinned by the release format): "
                            "the serving engine calibrates them")
    return result


def write_hf_checkpoint(
    dst: str | Path,
    job: dict[str, Any],
    specs: list[TensorSpec],
    config: dict[str, Any],
    extra_files: Mapping[str, bytes | Path],
    produce: Callable[[HFWriter, Callable[[int], None]], None],
    *,
    max_shard_size: int | str,
    force: bool,
    progress: bool,
    desc: str,
    files: Mapping[str, str] | None = None,
) -> Result:
    """Publish an HF checkpoint of ``specs`` at ``dst``: the part every HF-writing converter shares.

    ``produce(writer, advance)`` writes the tensors ``writer.needed()`` still asks for (a
    resumed job skips finished shards). ``files``: tensor → file (a reference's sharding,
    :func:`~inkling_ckpt.layouts.hf.reference_sharding`) instead of splitting by ``max_shard_size``. Configs and pass-through files follow; the folder is
    published atomically, or skipped when ``dst`` already holds this job.
    """
    result = Result(Path(dst))
    with Staging(dst, job, force=force) as st:
        if st.done:
            result.skipped = True
            return result
        result.resumed = st.resumed
        writer = HFWriter(st, specs, max_shard_size, files)
        total = sum(s.nbytes for s in specs)
        todo = sum(s.nbytes for s in specs if writer.needed(s.name))
        with ByteProgress(total, desc=desc, enabled=progress, initial=total - todo) as bar:
            try:
                produce(writer, bar.advance)
            finally:
                writer.abort()
            writer.close()
        write_json(st.path / "config.json", config)
        write_extra_files(dict(extra_files), st.path)
        result.tensors = len(specs)
        result.bytes = total
    return result


def _stream(src: TensorSource, writer: HFWriter, specs: list[TensorSpec], plan: PrecisionPlan,
            encoder: ExpertEncoder, advance: Callable[[int], None]) -> None:
    for spec in specs:
        if spec.part is None and writer.needed(spec.name):
            writer.write(spec.name, src.get(spec.name))
            advance(spec.nbytes)
    for layer in range(src.cfg.num_hidden_layers):
        for out_stack, in_stack in zip(expert_stacks(src.cfg, plan, layer), expert_stacks(src.cfg, src.plan, layer), strict=True):
            write_stack(writer, out_stack, advance, partial(_slice, src, encoder, out_stack, in_stack))


def _slice(src: TensorSource, encoder: ExpertEncoder, out: ExpertStack, inp: ExpertStack, first: int,
           last: int) -> dict[str, torch.Tensor]:
    if out.fmt == inp.fmt:
        return read_parts(src, inp, first, last)  # same format: the stored bytes as they are
    # Unquantized output: decoded straight to its dtype (one rounding); quantized: from the
    # source's natural dtype (an F32 source is encoded from its F32 values).
    x = decode_slice(src, inp, first, last, allow_nonfinite=encoder.allow_nonfinite, dtype=UNQUANTIZED.get(out.fmt))
    return encoder.encode(out, first, x)


def write_stack(writer: HFWriter, stack: ExpertStack, advance: Callable[[int], None],
                produce: Callable[[int, int], Mapping[str, torch.Tensor]]) -> None:
    """Write one stacked expert weight's parts slice by slice; ``produce(first, last)`` gives a slice's parts."""
    parts = stack.parts()
    if not any(writer.needed(p.name) for p in parts):
        return
    for first, last in expert_slices(stack):
        write_slice(writer, stack, first, last, produce(first, last), advance)


def write_slice(writer: HFWriter, stack: ExpertStack, first: int, last: int, got: Mapping[str, torch.Tensor],
                advance: Callable[[int], None]) -> None:
    """Write experts ``first:last`` of a stacked weight (its parts, suffix → tensor) at their rows.

    Every slice carries the NVFP4 scalar denominator; it is written with the first slice only.
    Parts in a shard a resumed job already finished are skipped.
    """
    for p in stack.parts():
        if not writer.needed(p.name):
            continue
        t = got[p.part]  # type: ignore[index]
        if p.shape == ():
            if first == 0:
                writer.write(p.name, t)
                advance(p.nbytes)
        else:
            writer.write_rows(p.name, first, t)
            advance(p.nbytes * (last - first) // p.shape[0])


__all__ = ["requantize", "write_hf_checkpoint", "write_stack", "write_slice", "expert_slices", "Result", "TensorSource"]
