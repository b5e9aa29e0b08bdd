"""Commands on one HF checkpoint: make-fixture, inspect, quantize, dequantize."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import typer

from .app import app, declares
from .options import (CONFIG, DEVICE, DRY_RUN, DTYPE, FORCE, JSON, KEEP_SHARDS, NONFINITE, PLAN_HELP, QUIET, REVISION,
                      SLICE_MB, TOKEN, VERBOSE, WORKERS, MEMORY_MB, DenseDtype, Scales, Size, Variant, emit, hub,
                      joined, render_job, setup)


def report(rep: dict[str, Any], as_json: bool) -> None:
    """Print a writing job's report (JSON or the closing line and its notes); under torchrun, rank 0 only."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    emit(rep, as_json, render_job)


@app.command("make-fixture")
@declares(writes=["out"])
def make_fixture(
    out: Path = typer.Argument(..., metavar="OUT", help="Folder to write the checkpoint (or with --lora the adapter "
                                                       "dump) into."),
    variant: Variant = typer.Option(Variant.bf16, "--variant", help="mixed: NVFP4 then MXFP8 layers."),
    size: Size = typer.Option(Size.tiny, "--size", help="tiny (a few MB), small, or wide (real 2304x4608 experts, GBs)."),
    layers: Optional[int] = typer.Option(None, "--layers", metavar="N", help="Override the number of decoder layers."),
    experts: Optional[int] = typer.Option(None, "--experts", metavar="N", help="Override the number of routed experts."),
    max_shard_size: str = typer.Option("2MB", "--max-shard-size", metavar="SIZE",
                                       help="Largest shard (small, to exercise sharding)."),
    lora: bool = typer.Option(False, "--lora", help="Write a trainer-side LoRA adapter dump for this fixture instead "
                                                    "(OUT/lora.safetensors, Megatron-Bridge names): the input of "
                                                    "`lora export`."),
    lora_rank: int = typer.Option(8, "--lora-rank", metavar="R", help="With --lora: the adapter rank."),
    lora_alpha: int = typer.Option(16, "--lora-alpha", metavar="ALPHA", help="With --lora: lora_alpha (in the dump's "
                                                                             "metadata)."),
    dry_run: bool = DRY_RUN,
    as_json: bool = JSON,
    force: bool = FORCE,
    quiet: bool = QUIET,
    verbose: int = VERBOSE,
) -> None:
    """Write a deterministic, Inkling-2-shaped HF checkpoint with trained-looking weights.

    The quantized variants are exactly what `quantize` makes of the BF16 one. With --lora, OUT is a
    trainer adapter dump for the fixture of --size/--layers/--experts instead:

      inkling-ckpt make-fixture /tmp/dump --lora
      inkling-ckpt lora export /tmp/dump /tmp/adapter --config fixtures/tiny-bf16
      inkling-ckpt lora merge fixtures/tiny-mixed /tmp/adapter /tmp/merged
    """
    setup(verbose)
    from .. import api

    rep = api.make_fixture(out, variant=variant.value, size=size.value, layers=layers, experts=experts,
                           max_shard_size=max_shard_size, lora=lora, lora_rank=lora_rank, lora_alpha=lora_alpha,
                           force=force, dry_run=dry_run, progress=not quiet)
    if lora and not as_json and rep["status"] != "dry-run":
        from ..units import fmt_bytes

        rep_line = "already holds this dump; nothing to do" if rep["status"] == "skipped" else "wrote"
        typer.echo(f"{rep_line} {out}/{rep['file']}: LoRA trainer dump, {rep['tensors']} tensors, "
                   f"{fmt_bytes(rep['bytes'])}, r={rep['r']}, alpha={rep['lora_alpha']}")
        return
    report(rep, as_json)


@app.command("inspect")
def inspect_cmd(
    ckpt: str = typer.Argument(..., metavar="CKPT", help="Checkpoint folder: HF (or hub repo id), sharded (inkling-ckpt "
                                                         "shard) or Megatron torch_dist (convert hf-to-megatron)."),
    config: Optional[Path] = CONFIG,
    revision: Optional[str] = REVISION,
    token: Optional[str] = TOKEN,
    as_json: bool = JSON,
    verbose: int = VERBOSE,
) -> None:
    """Variant, precision plan, tensors per layer and format, and bytes — from headers only.

    The layout is detected from the folder. A torch_dist folder is shown as the release tensors it holds (read back through the key mapping: routed experts BF16, no vision tower).
    """
    setup(verbose)
    from .. import api
    from ..verify.inspect import render_inspect

    with hub(revision, token):
        emit(api.inspect(ckpt, config=config), as_json, render_inspect)


@app.command("quantize")
@declares(reads=["src", "reference"], writes=["dst"])
def quantize(
    src: str = typer.Argument(..., metavar="SRC", help="Source HF checkpoint (BF16, or already quantized)."),
    dst: Path = typer.Argument(..., metavar="DST", help="Destination folder (published atomically)."),
    plan: str = typer.Option(..., "--plan", metavar="PLAN", help=PLAN_HELP),
    scales: Scales = typer.Option(Scales.fresh, "--scales",
                                  help="fresh: global scales from these weights; keep: NVFP4 amax (and the bytes of "
                                       "unchanged blocks) from --reference, or from SRC when it is quantized."),
    reference: Optional[str] = typer.Option(None, "--reference", metavar="REF",
                                            help="Quantized checkpoint to keep scales from (--scales keep)."),
    max_shard_size: Optional[str] = KEEP_SHARDS,
    dtype: Optional[DenseDtype] = DTYPE,
    allow_nonfinite: bool = NONFINITE,
    revision: Optional[str] = REVISION,
    token: Optional[str] = TOKEN,
    dry_run: bool = DRY_RUN,
    as_json: bool = JSON,
    force: bool = FORCE,
    quiet: bool = QUIET,
    verbose: int = VERBOSE,
    device: str = DEVICE,
    slice_mb: int = SLICE_MB,
    workers: int = WORKERS,
    memory_mb: int = MEMORY_MB,
) -> None:
    """Quantize routed experts per layer (NVFP4/MXFP8); everything else is copied bit for bit.

    Under `torchrun --nproc_per_node N` the ranks split the output shards and publish one checkpoint (the same bytes as one process).

    Example: inkling-ckpt quantize fixtures/tiny-bf16 /tmp/tiny-q --plan 0-1:nvfp4,2-3:mxfp8
    """
    setup(verbose)
    from .. import api

    with hub(revision, token), joined(dry_run):
        report(api.quantize(src, dst, plan, scales=scales.value, reference=reference, max_shard_size=max_shard_size,
                            allow_nonfinite=allow_nonfinite, force=force, dry_run=dry_run, progress=not quiet,
                            dtype=dtype.value if dtype else None, device=device, slice_mb=slice_mb,
                            workers=workers, memory_mb=memory_mb), as_json)


@app.command("dequantize")
@declares(reads=["src"], writes=["dst"])
def dequantize(
    src: str = typer.Argument(..., metavar="SRC", help="Quantized HF checkpoint."),
    dst: Path = typer.Argument(..., metavar="DST", help="Destination folder for the BF16 checkpoint."),
    max_shard_size: Optional[str] = KEEP_SHARDS,
    dtype: Optional[DenseDtype] = DTYPE,
    revision: Optional[str] = REVISION,
    token: Optional[str] = TOKEN,
    dry_run: bool = DRY_RUN,
    as_json: bool = JSON,
    force: bool = FORCE,
    quiet: bool = QUIET,
    verbose: int = VERBOSE,
    device: str = DEVICE,
    slice_mb: int = SLICE_MB,
    workers: int = WORKERS,
    memory_mb: int = MEMORY_MB,
) -> None:
    """Decode every routed expert to BF16 (under torchrun: the ranks split the output shards)."""
    setup(verbose)
    from .. import api

    with hub(revision, token), joined(dry_run):
        report(api.dequantize(src, dst, max_shard_size=max_shard_size, force=force, dry_run=dry_run,
                              progress=not quiet, dtype=dtype.value if dtype else None, device=device,
                              slice_mb=slice_mb, workers=workers, memory_mb=memory_mb), as_json)
