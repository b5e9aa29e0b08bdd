"""HF → HF under a new precision plan: ``quantize``, ``dequantize`` and ``convert hf-to-hf``.

Streams one tensor (one expert) at a time from any tensor source (an :class:`HFCheckpoint` or a
synthetic checkpoint) into an atomically published folder. Non-expert tensors are copied
bit for bit; an expert whose layer keeps its format is copied part for part; otherwise it is
decoded to BF16 (when stored quantized) and encoded in the target format.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from ..errors import CheckpointError
from ..formats import get_format
from ..layouts.hf import QUANT_CONFIG, HFWriter, write_extra_files, write_json
from ..layouts.staging import Staging
from ..model.config import InklingConfig
from ..model.inventory import EXPERT_PROJS, ExpertLinear, TensorSpec, expert_linears, inventory
from ..model.precision import PrecisionPlan
from ..model.quant_config import build_quant_configs
from ..progress import ByteProgress
from .experts import ExpertEncoder, ScalePolicy, ScaleSource


class TensorSource(Protocol):
    """A checkpoint that hands out its stored tensors by HF name."""

    config: dict[str, Any]
    cfg: InklingConfig
    plan: PrecisionPlan

    def get(self, name: str) -> torch.Tensor: ...
    def extra_files(self) -> dict[str, bytes]: ...
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


def output_config(source_config: dict[str, Any], cfg: InklingConfig, plan: PrecisionPlan) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(config.json, hf_quant_config.json or None) of a checkpoint stored under ``plan``."""
    hf_quant, flat = build_quant_configs(cfg, plan)
    config = {k: v for k, v in source_config.items() if k != "quantization_config"}
    if flat is not None:
        config["quantization_config"] = flat
    return config, hf_quant


def decode_linear(src: TensorSource, lin: ExpertLinear) -> torch.Tensor:
    """A stored routed-expert linear decoded to its logical BF16 weight."""
    parts = {spec.part: src.get(spec.name) for spec in lin.parts()}
    if lin.fmt == "bf16":
        return parts["weight"]
    return get_format(lin.fmt).decode(parts, torch.bfloat16)


def requantize(
    src: TensorSource,
    dst: str | Path,
    plan: PrecisionPlan,
    *,
    scales: ScalePolicy = "fresh",
    reference: ScaleSource | None = None,
    max_shard_size: int | str = "5GB",
    allow_nonfinite: bool = False,
    force: bool = False,
    progress: bool = True,
    command: str = "requantize",
) -> Result:
    """Write ``src`` re-encoded under ``plan`` to ``dst`` (atomic; resumable; skipped when done)."""
    cfg = src.cfg
    if len(plan) != cfg.num_hidden_layers:
        raise CheckpointError(f"plan covers {len(plan)} layers, the source has {cfg.num_hidden_layers}")
    if scales == "keep" and reference is None and src.plan.used_formats() != ["bf16"]:
        reference = src  # a quantized source carries its own scales
    encoder = ExpertEncoder(plan, scales=scales, reference=reference, allow_nonfinite=allow_nonfinite)
    specs = inventory(cfg, plan)
    config, hf_quant = output_config(src.config, cfg, plan)
    job = {"command": command, "source": src.describe(), "plan": str(plan), "scales": scales,
           "reference": reference.describe() if reference is not None and reference is not src else None,
           "max_shard_size": str(max_shard_size), "allow_nonfinite": allow_nonfinite}
    return write_hf_checkpoint(
        dst, job, specs, config, hf_quant, src.extra_files(),
        lambda writer, advance: _stream(src, writer, specs, plan, encoder, advance),
        encoder=encoder, plan=plan, max_shard_size=max_shard_size, force=force, progress=progress, desc=command,
    )


def write_hf_checkpoint(
    dst: str | Path,
    job: dict[str, Any],
    specs: list[TensorSpec],
    config: dict[str, Any],
    hf_quant: dict[str, Any] | None,
    extra_files: dict[str, bytes],
    produce: Callable[[HFWriter, Callable[[int], None]], None],
    *,
    encoder: ExpertEncoder,
    plan: PrecisionPlan,
    max_shard_size: int | str,
    force: bool,
    progress: bool,
    desc: str,
) -> Result:
    """Publish an HF checkpoint of ``specs`` at ``dst``: the part every HF-writing converter shares.

    ``produce(writer, advance)`` writes the tensors ``writer.needed()`` still asks for (a
    resumed job skips finished shards). Configs and pass-through files follow; the folder is
    published atomically, or skipped when ``dst`` already holds this job.
    """
    result = Result(Path(dst))
    with Staging(dst, job, force=force) as st:
        if st.done:
            result.skipped = True
            return result
        result.resumed = st.resumed
        writer = HFWriter(st, specs, max_shard_size)
        total = sum(s.nbytes for s in specs)
        todo = sum(s.nbytes for s in specs if writer.needed(s.name))
        with ByteProgress(total, desc=desc, enabled=progress, initial=total - todo) as bar:
            try:
                produce(writer, bar.advance)
            finally:
                writer.abort()
            writer.close()
        write_json(st.path / "config.json", config)
        if hf_quant is not None:
            write_json(st.path / QUANT_CONFIG, hf_quant)
        write_extra_files(extra_files, st.path)
        result.tensors = len(specs)
        result.bytes = total
    if encoder.used_default_input_scale and "nvfp4" in plan.used_formats():
        result.notes.append("NVFP4 input_scale set to 1.0 (no calibration data): calibrate before serving W4A4")
    return result


def _stream(src: TensorSource, writer: HFWriter, specs: list[TensorSpec], plan: PrecisionPlan,
            encoder: ExpertEncoder, advance: Callable[[int], None]) -> None:
    sizes = {s.name: s.nbytes for s in specs}
    for spec in specs:
        if spec.part is None and writer.needed(spec.name):
            writer.write(spec.name, src.get(spec.name))
            advance(spec.nbytes)
    n = len(EXPERT_PROJS)
    for layer in range(src.cfg.num_hidden_layers):
        dst_lins = list(expert_linears(src.cfg, plan, layer))
        src_lins = list(expert_linears(src.cfg, src.plan, layer))
        for k in range(0, len(dst_lins), n):  # one expert: its gate, up and down linears
            outs, ins = dst_lins[k:k + n], src_lins[k:k + n]
            names = [spec.name for lin in outs for spec in lin.parts()]
            if not any(writer.needed(name) for name in names):
                continue
            if outs[0].fmt == ins[0].fmt:
                tensors = {name: src.get(name) for name in names}
            else:
                weights = {lin.proj: decode_linear(src, lin) for lin in ins}
                tensors = encoder.encode(layer, outs[0].expert, weights)
            for name in names:
                if writer.needed(name):
                    writer.write(name, tensors[name])
                    advance(sizes[name])


__all__ = ["requantize", "write_hf_checkpoint", "Result", "TensorSource", "output_config", "decode_linear"]
