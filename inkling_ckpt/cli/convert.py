"""``inkling-ckpt convert``: HF ⇄ Megatron torch_dist, and HF → HF under a new precision plan."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from .app import app, declares
from .checkpoint import report
from .options import (DEVICE, DRY_RUN, DTYPE, FORCE, JSON, KEEP_SHARDS, NONFINITE, PLAN_HELP, PRESET, QUIET, READ_PRESET,
                      REVISION, SLICE_MB, TOKEN, VERBOSE, WORKERS, MEMORY_MB, DenseDtype, Preset, Scales, hub, joined, setup)

convert_app = typer.Typer(
    name="convert",
    help=(
        "Convert between Hugging Face checkpoints (BF16, MXFP8, NVFP4, mixed) and Megatron-Core torch_dist.\n\n"
        "Every conversion streams tensor by tensor (memory stays at a few tensors), validates the whole "
        "input before writing, publishes DST atomically, skips a finished job unless --force, and resumes "
        "an interrupted one when rerun with the same arguments."
    ),
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(convert_app)


def _dt(dtype: "DenseDtype | None") -> str | None:
    return None if dtype is None else dtype.value


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


@convert_app.command("hf-to-megatron")
@declares(reads=["src"], writes=["dst"])
def hf_to_megatron_cmd(
    src: str = typer.Argument(..., metavar="SRC", help="HF checkpoint folder (or hub repo id): BF16, MXFP8, NVFP4 or "
                                                       "mixed."),
    dst: Path = typer.Argument(..., metavar="DST", help="Megatron save folder to create (holds "
                                                        "latest_checkpointed_iteration.txt and release/)."),
    preset: Preset = PRESET,
    dtype: Optional[DenseDtype] = typer.Option(None, "--dtype", help="bf16: round routed experts SRC stores in F32 or "
                                               "F16 to BF16, as Megatron holds them (refused without it)."),
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
    """Write SRC as a Megatron-Core torch_dist checkpoint (per-layer keys, global shapes).

    Routed experts are decoded from their layer's format to BF16 and de-interleaved per expert (`decoder.layers.N.mlp.experts.experts.linear_fc1.weight` = [E, 2F, H], gate rows then up rows), stored one chunk per expert; every other tensor keeps its stored dtype. q/k/v/r are four sub-keys of `linear_qkv.weight`. The vision tower is not part of a Megatron checkpoint (megatron-to-hf takes it from --reference). common.pt keeps the source config.json (under 'inkling'), so inspect, verify and memory read the folder as it is. Load it with any TP/EP/PP; metadata.json is written last.

    Under `torchrun --nproc_per_node N` the ranks split the layers and write one checkpoint together (the same files as a one-process run).

    Example: inkling-ckpt convert hf-to-megatron fixtures/tiny-mixed /tmp/tiny-megatron
    """
    setup(verbose)
    from .. import api

    with hub(revision, token):
        if dry_run:
            rep = api.convert_hf_to_megatron(src, dst, preset=preset.value, dry_run=True, dtype=_dt(dtype),
                                             device=device)
        else:
            with joined():
                rep = api.convert_hf_to_megatron(src, dst, preset=preset.value, allow_nonfinite=allow_nonfinite,
                                                 force=force, progress=not quiet and _rank() == 0, dtype=_dt(dtype),
                                                 device=device, slice_mb=slice_mb, workers=workers, memory_mb=memory_mb)
    if _rank() == 0:
        report(rep, as_json)


@convert_app.command("megatron-to-hf")
@declares(reads=["src", "reference"], writes=["dst"])
def megatron_to_hf_cmd(
    src: Path = typer.Argument(..., metavar="SRC", help="Megatron torch_dist checkpoint: the save folder or an "
                                                        "iteration folder (release/, iter_N/)."),
    dst: Path = typer.Argument(..., metavar="DST", help="Destination HF checkpoint folder (published atomically)."),
    reference: str = typer.Option(..., "--reference", metavar="REF",
                                  help="The HF checkpoint the weights came from: gives the configs, the vision tower, "
                                       "the default plan and the kept scales."),
    plan: Optional[str] = typer.Option(None, "--plan", metavar="PLAN", help=PLAN_HELP + " Default: the reference's."),
    scales: Scales = typer.Option(Scales.keep, "--scales",
                                  help="keep: each NVFP4 expert's amax from --reference, and the reference's bytes "
                                       "for unchanged blocks (an untouched checkpoint comes back byte for byte); "
                                       "fresh: every scale from the weights. Where the reference holds no layer in "
                                       "the plan's format there is nothing to keep: the report says so."),
    preset: Optional[Preset] = READ_PRESET,
    dtype: Optional[DenseDtype] = DTYPE,
    max_shard_size: Optional[str] = KEEP_SHARDS,
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
    """Bring trained Megatron weights back to HF in the served precision.

    Each layer's routed experts are re-interleaved and re-encoded in the layer's format (BF16, MXFP8 or NVFP4); everything else is copied back in its stored dtype. The vision tower and the configs come from --reference. With --scales keep and unchanged weights the output is byte-identical to the reference.

    Example: inkling-ckpt convert megatron-to-hf /tmp/tiny-megatron /tmp/tiny-back --reference fixtures/tiny-mixed
    """
    setup(verbose)
    from .. import api

    with hub(revision, token), joined(dry_run):
        report(api.convert_megatron_to_hf(src, dst, reference, plan=plan, scales=scales.value,
                                          preset=preset.value if preset else None,
                                          max_shard_size=max_shard_size, allow_nonfinite=allow_nonfinite, force=force,
                                          dry_run=dry_run, progress=not quiet, dtype=_dt(dtype), device=device,
                                          slice_mb=slice_mb, workers=workers, memory_mb=memory_mb), as_json)


@convert_app.command("hf-to-hf")
@declares(reads=["src"], writes=["dst"])
def hf_to_hf_cmd(
    src: str = typer.Argument(..., metavar="SRC", help="Source HF checkpoint (any variant)."),
    dst: Path = typer.Argument(..., metavar="DST", help="Destination folder (published atomically)."),
    plan: str = typer.Option(..., "--plan", metavar="PLAN", help=PLAN_HELP),
    scales: Scales = typer.Option(Scales.fresh, "--scales",
                                  help="fresh: every scale from the weights; keep: layers SRC already stores in "
                                       "their target format keep SRC's NVFP4 amax and the bytes of unchanged blocks "
                                       "(refused when SRC stores no layer in its target format)."),
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
    """Re-encode routed experts under another precision plan (mixed → MXFP8, anything → BF16, …).

    Layers whose format does not change are copied part for part; others are decoded to BF16 and encoded in the target format. Everything else is copied bit for bit.

    Example: inkling-ckpt convert hf-to-hf fixtures/tiny-mixed /tmp/tiny-mx --plan mxfp8
    """
    setup(verbose)
    from .. import api

    with hub(revision, token), joined(dry_run):
        report(api.convert_hf_to_hf(src, dst, plan, scales=scales.value, max_shard_size=max_shard_size,
                                    allow_nonfinite=allow_nonfinite, force=force, dry_run=dry_run,
                                    progress=not quiet, dtype=_dt(dtype), device=device, slice_mb=slice_mb,
                                    workers=workers, memory_mb=memory_mb), as_json)
