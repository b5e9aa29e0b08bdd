"""Commands on one HF checkpoint: make-fixture, inspect, quantize, dequantize."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from ..convert.requantize import Result, requantize
from ..errors import PlanError
from ..verify.inspect import inspect_checkpoint, render_inspect
from ..layouts.detect import open_checkpoint
from ..layouts.hf import HFCheckpoint, parse_size
from ..layouts.limits import check_count
from ..layouts.paths import check_dst
from ..model.precision import PrecisionPlan
from ..model.presets import PRESETS, preset_plan
from ..model.synth import SynthSource
from .app import app


class Variant(str, Enum):
    bf16 = "bf16"
    mixed = "mixed"
    mxfp8 = "mxfp8"
    nvfp4 = "nvfp4"


class ScalesOpt(str, Enum):
    fresh = "fresh"
    keep = "keep"


class Size(str, Enum):
    tiny = "tiny"
    small = "small"
    wide = "wide"


MAX_FIXTURE_LAYERS = 256  # synthetic checkpoints: far beyond any test, well below a hang
MAX_FIXTURE_EXPERTS = 4096
SHARD_OPT = typer.Option(None, "--max-shard-size", help="Largest safetensors shard, e.g. 5GB, 500MB. Default: the "
                         "source's (or --reference's) files and index when the output holds exactly its tensors, "
                         "else 5GB.")
FORCE_OPT = typer.Option(False, "--force", help="Replace DST even if it holds a finished or different output.")
QUIET_OPT = typer.Option(False, "--quiet", "-q", help="No progress bar.")
CONFIG_OPT = typer.Option(None, "--config", help="For a torch_dist folder not written by inkling-ckpt (whose "
                          "common.pt keeps no copy): the model's config.json, or the HF folder holding it.")
class DenseDtype(str, Enum):
    bf16 = "bf16"
    f16 = "f16"
    f32 = "f32"


DTYPE_OPT = typer.Option(None, "--dtype", help="Dtype of the routed experts the output holds unquantized. Default: "
                         "their stored dtype where the source holds them unquantized (a cast that would round them, "
                         "F32 -> BF16, is refused and names this option), else BF16.")
NONFINITE_OPT = typer.Option(False, "--allow-nonfinite", help="Quantize NaN/Inf as the references do instead of failing.")


def report(result: Result, what: str) -> None:
    """One summary line (and notes) for a finished, resumed or skipped job."""
    if result.skipped:
        typer.echo(f"{result.dst}: already holds this {what}; nothing to do (--force to redo)")
        return
    how = "resumed and finished" if result.resumed else "wrote"
    typer.echo(f"{how} {result.dst}: {result.tensors} tensors, {result.bytes / 2**20:.1f} MiB")
    for note in result.notes:
        typer.echo(f"note: {note}")


@app.command("make-fixture")
def make_fixture(
    out: Path = typer.Argument(..., help="Folder to write the checkpoint into."),
    variant: Variant = typer.Option(Variant.bf16, help="bf16, mixed (NVFP4 then MXFP8 layers), mxfp8 or nvfp4."),
    size: Size = typer.Option(Size.tiny, help="tiny (a few MB), small, or wide (real 2304x4608 experts, GBs)."),
    layers: Optional[int] = typer.Option(None, help="Override the number of decoder layers."),
    experts: Optional[int] = typer.Option(None, help="Override the number of routed experts."),
    max_shard_size: str = typer.Option("2MB", "--max-shard-size", help="Largest shard (small, to exercise sharding)."),
    force: bool = FORCE_OPT,
    quiet: bool = QUIET_OPT,
) -> None:
    """Write a deterministic, Inkling-2-shaped HF checkpoint with trained-looking weights.

    The quantized variants are exactly what `quantize` makes of the BF16 one.
    """
    check_count(layers, "--layers", MAX_FIXTURE_LAYERS)
    check_count(experts, "--experts", MAX_FIXTURE_EXPERTS)
    src = SynthSource(size.value, layers=layers, experts=experts)
    plan = PrecisionPlan.parse(preset_plan(size.value, variant.value, src.cfg.num_hidden_layers), src.cfg.num_hidden_layers)
    result = requantize(src, out, plan, max_shard_size=parse_size(max_shard_size), force=force,
                        progress=not quiet, command="make-fixture")
    report(result, "fixture")


@app.command("inspect")
def inspect_cmd(
    ckpt: str = typer.Argument(..., help="Checkpoint folder: HF (or hub repo id), sharded (inkling-ckpt shard) or "
                                         "Megatron torch_dist (convert hf-to-megatron)."),
    config: Optional[Path] = CONFIG_OPT,
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Variant, precision plan, tensors per layer and format, and bytes — from headers only.

    The layout is detected from the folder. A torch_dist folder is shown as the release tensors it holds (read back through the key mapping: routed experts BF16, no vision tower).
    """
    src = open_checkpoint(ckpt, config=config)
    try:
        info = inspect_checkpoint(src)
    finally:
        src.close()
    typer.echo(json.dumps(info, indent=2) if as_json else render_inspect(info))


def _plan_for(src: HFCheckpoint, text: str) -> PrecisionPlan:
    return PrecisionPlan.parse(text, src.cfg.num_hidden_layers)


def _dtype(value: "DenseDtype | None") -> str | None:
    return None if value is None else value.value


def _size(text: str | None) -> int | None:
    """``--max-shard-size`` in bytes; None keeps the source's files where the output allows."""
    return None if text is None else parse_size(text)


@app.command("quantize")
def quantize(
    src: str = typer.Argument(..., help="Source HF checkpoint (BF16, or already quantized)."),
    dst: Path = typer.Argument(..., help="Destination folder (published atomically)."),
    plan: str = typer.Option(..., "--plan", help="Per-layer expert formats, e.g. 0-39:nvfp4,40-47:mxfp8 or mxfp8."),
    scales: ScalesOpt = typer.Option(ScalesOpt.fresh, "--scales",
                                     help="fresh: global scales from these weights; keep: from --reference "
                                          "(unchanged weights then reproduce the reference bytes)."),
    reference: Optional[str] = typer.Option(None, "--reference", help="Quantized checkpoint to keep scales from."),
    dtype: Optional[DenseDtype] = DTYPE_OPT,
    max_shard_size: Optional[str] = SHARD_OPT,
    allow_nonfinite: bool = NONFINITE_OPT,
    force: bool = FORCE_OPT,
    quiet: bool = QUIET_OPT,
) -> None:
    """Quantize routed experts per layer (NVFP4/MXFP8); everything else is copied bit for bit."""
    check_dst(dst, [src, reference])
    ckpt = HFCheckpoint.open(src)
    ref = HFCheckpoint.open(reference) if reference else None
    result = requantize(ckpt, dst, _plan_for(ckpt, plan), scales=scales.value, reference=ref,
                        max_shard_size=_size(max_shard_size), allow_nonfinite=allow_nonfinite, force=force,
                        progress=not quiet, command="quantize", dtype=_dtype(dtype))
    report(result, "quantization")


@app.command("dequantize")
def dequantize(
    src: str = typer.Argument(..., help="Quantized HF checkpoint."),
    dst: Path = typer.Argument(..., help="Destination folder for the BF16 checkpoint."),
    dtype: Optional[DenseDtype] = DTYPE_OPT,
    max_shard_size: Optional[str] = SHARD_OPT,
    force: bool = FORCE_OPT,
    quiet: bool = QUIET_OPT,
) -> None:
    """Decode every routed expert to BF16 (or --dtype)."""
    check_dst(dst, [src])
    ckpt = HFCheckpoint.open(src)
    target = PrecisionPlan.uniform(dtype.value if dtype else "bf16", ckpt.cfg.num_hidden_layers)
    if target == ckpt.plan:
        raise PlanError(f"{src} is already {ckpt.plan.variant.upper()}: nothing to decode")
    result = requantize(ckpt, dst, target, max_shard_size=_size(max_shard_size), force=force, progress=not quiet,
                        command="dequantize", dtype=_dtype(dtype))
    report(result, "dequantization")


__all__ = ["PRESETS", "report"]
