"""``inkling-ckpt convert``: HF ⇄ Megatron torch_dist, and HF → HF under a new precision plan."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import typer

from ..convert.experts import SCALE_POLICIES
from ..convert.megatron import describe_hf_to_megatron, describe_megatron_to_hf, hf_to_megatron, megatron_to_hf
from ..convert.requantize import requantize
from ..errors import PlanError
from ..layouts.hf import HFCheckpoint
from ..layouts.paths import check_dst
from ..model.mapping import DEFAULT_PRESET, PRESETS, Preset, get_preset
from ..model.precision import PrecisionPlan
from .app import app
from .checkpoint import DTYPE_OPT, FORCE_OPT, NONFINITE_OPT, QUIET_OPT, SHARD_OPT, DenseDtype, _dtype, _size, report

convert_app = typer.Typer(
    name="convert",
    help=(
        "Convert between Hugging Face checkpoints (BF16, MXFP8, NVFP4, mixed) and Megatron-Core torch_dist.\n\n"
        "Every conversion streams tensor by tensor (memory stays at a few tensors), validates the whole "
        "input before writing, publishes DST atomically, skips a finished job unless --force, and resumes "
        "an interrupted one when rerun with the same arguments."
    ),
    no_args_is_help=True,
)
app.add_typer(convert_app)

PRESET_OPT = typer.Option(
    DEFAULT_PRESET, "--preset",
    help=f"Megatron key layout: {', '.join(PRESETS)} (miles: one Megatron layer per decoder layer, as Miles' "
         "Inkling; bridge: Megatron-Core HybridModel, attention of layer i at 2i and its MoE at 2i+1).")
READ_PRESET_OPT = typer.Option(
    None, "--preset",
    help=f"Megatron key layout of SRC: {', '.join(PRESETS)}. Default: the one SRC records (inkling-ckpt writes it into "
         "common.pt), else the one whose keys SRC holds.")
DRY_RUN_OPT = typer.Option(False, "--dry-run", help="Validate the input and print (JSON) what would be written; write nothing.")

SCALES_HELP = (
    "Expert scales: 'keep' takes each NVFP4 expert's amax from the reference and reuses the reference's bytes for "
    "unchanged blocks (unchanged weights then come back byte-identical), 'fresh' derives every scale from the weights."
)


@contextmanager
def _torchrun() -> Iterator[None]:
    """Join the process group when started by torchrun (gloo: the collectives only exchange plans)."""
    import torch.distributed as dist

    started = False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
        started = True
    try:
        yield
    finally:
        if started:
            dist.destroy_process_group()


def _steady_memory() -> None:
    """Make glibc return large freed blocks to the OS at once (Linux/glibc only; else a no-op).

    glibc raises its mmap threshold as big blocks are freed, after which tensors of up to 32 MiB
    come from the heap and linger there; a fixed 1 MiB threshold keeps the resident set at the
    few tensors in flight, and the same from one run to the next.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        M_MMAP_THRESHOLD = -3
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 20)
    except (OSError, AttributeError):
        pass


def _one_process(command: str) -> None:
    """Refuse torchrun for commands that write one HF folder from one process."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise PlanError(f"convert {command} runs in one process; start it without torchrun "
                        "(only hf-to-megatron splits its work over ranks)")


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _preset(name: str | None) -> Preset | None:
    return None if name is None else get_preset(name)


def _scales(value: str) -> str:
    if value not in SCALE_POLICIES:
        raise PlanError(f"--scales {value!r} is not a scale policy; choose one of {', '.join(SCALE_POLICIES)}")
    return value


@convert_app.command("hf-to-megatron")
def hf_to_megatron_cmd(
    src: str = typer.Argument(..., help="HF checkpoint folder (or hub repo id): BF16, MXFP8, NVFP4 or mixed."),
    dst: Path = typer.Argument(..., help="Megatron save folder to create (holds latest_checkpointed_iteration.txt and release/)."),
    preset: str = PRESET_OPT,
    dtype: Optional[DenseDtype] = typer.Option(None, "--dtype", help="bf16: round routed experts SRC stores in F32 or "
                                               "F16 to BF16, as Megatron holds them (refused without it)."),
    allow_nonfinite: bool = NONFINITE_OPT,
    force: bool = FORCE_OPT,
    quiet: bool = QUIET_OPT,
    dry_run: bool = DRY_RUN_OPT,
) -> None:
    """Write SRC as a Megatron-Core torch_dist checkpoint (per-layer keys, global shapes).

    Routed experts are decoded from their layer's format to BF16 and de-interleaved per expert (`decoder.layers.N.mlp.experts.experts.linear_fc1.weight` = [E, 2F, H], gate rows then up rows), stored one chunk per expert; every other tensor keeps its stored dtype. q/k/v/r are four sub-keys of `linear_qkv.weight`. The vision tower is not part of a Megatron checkpoint (megatron-to-hf takes it from --reference). common.pt keeps the source config.json (under 'inkling'), so inspect, verify and memory read the folder as it is. Load it with any TP/EP/PP; metadata.json is written last.

    Under `torchrun --nproc_per_node N` the ranks split the layers and write one checkpoint together (the same files as a one-process run).

    Example: inkling-ckpt convert hf-to-megatron fixtures/tiny-mixed /tmp/tiny-megatron
    """
    if not dry_run:
        check_dst(dst, [src])
    if dry_run:
        ranks = int(os.environ.get("WORLD_SIZE", "1"))
        info = describe_hf_to_megatron(HFCheckpoint.open(src), preset=get_preset(preset), ranks=ranks,
                                       dtype=_dtype(dtype))
        if _rank() == 0:
            typer.echo(json.dumps(info, indent=2))
        return
    _steady_memory()
    with _torchrun():
        ckpt = HFCheckpoint.open(src)
        result = hf_to_megatron(ckpt, dst, preset=get_preset(preset), allow_nonfinite=allow_nonfinite, force=force,
                                progress=not quiet and _rank() == 0, dtype=_dtype(dtype))
        if _rank() == 0:
            report(result, "conversion")


@convert_app.command("megatron-to-hf")
def megatron_to_hf_cmd(
    src: Path = typer.Argument(..., help="Megatron torch_dist checkpoint: the save folder or an iteration folder (release/, iter_N/)."),
    dst: Path = typer.Argument(..., help="Destination HF checkpoint folder (published atomically)."),
    reference: str = typer.Option(..., "--reference", help="The HF checkpoint the weights came from: gives the configs, "
                                                           "the vision tower, the default plan and the kept scales."),
    plan: Optional[str] = typer.Option(None, "--plan", help="Per-layer expert formats, e.g. 0-39:nvfp4,40-47:mxfp8 or bf16. "
                                                            "Default: the reference's."),
    scales: str = typer.Option("keep", "--scales", help=SCALES_HELP),
    preset: Optional[str] = READ_PRESET_OPT,
    dtype: Optional[DenseDtype] = DTYPE_OPT,
    max_shard_size: Optional[str] = SHARD_OPT,
    allow_nonfinite: bool = NONFINITE_OPT,
    force: bool = FORCE_OPT,
    quiet: bool = QUIET_OPT,
    dry_run: bool = DRY_RUN_OPT,
) -> None:
    """Bring trained Megatron weights back to HF in the served precision.

    Each layer's routed experts are re-interleaved and re-encoded in the layer's format (BF16, MXFP8 or NVFP4); everything else is copied back in its stored dtype. The vision tower and the configs come from --reference. With --scales keep and unchanged weights the output is byte-identical to the reference.

    Example: inkling-ckpt convert megatron-to-hf /tmp/tiny-megatron /tmp/tiny-back --reference fixtures/tiny-mixed
    """
    _one_process("megatron-to-hf")
    if not dry_run:
        check_dst(dst, [src, reference])
    _steady_memory()
    ref = HFCheckpoint.open(reference)
    p = PrecisionPlan.parse(plan, ref.cfg.num_hidden_layers) if plan else None
    if dry_run:
        typer.echo(json.dumps(describe_megatron_to_hf(src, ref, plan=p, preset=_preset(preset), dtype=_dtype(dtype)), indent=2))
        return
    result = megatron_to_hf(src, dst, ref, plan=p, scales=_scales(scales), preset=_preset(preset),  # type: ignore[arg-type]
                            max_shard_size=_size(max_shard_size), allow_nonfinite=allow_nonfinite,
                            force=force, progress=not quiet, dtype=_dtype(dtype))
    report(result, "conversion")


@convert_app.command("hf-to-hf")
def hf_to_hf_cmd(
    src: str = typer.Argument(..., help="Source HF checkpoint (any variant)."),
    dst: Path = typer.Argument(..., help="Destination folder (published atomically)."),
    plan: str = typer.Option(..., "--plan", help="Target per-layer expert formats: e.g. mxfp8, bf16, 0-39:nvfp4,40-47:mxfp8."),
    scales: str = typer.Option("fresh", "--scales", help=SCALES_HELP + " 'keep' needs an NVFP4 source layer."),
    dtype: Optional[DenseDtype] = DTYPE_OPT,
    max_shard_size: Optional[str] = SHARD_OPT,
    allow_nonfinite: bool = NONFINITE_OPT,
    force: bool = FORCE_OPT,
    quiet: bool = QUIET_OPT,
) -> None:
    """Re-encode routed experts under another precision plan (mixed → MXFP8, anything → BF16, …).

    Layers whose format does not change are copied part for part; others are decoded to BF16 and encoded in the target format. Everything else is copied bit for bit.

    Example: inkling-ckpt convert hf-to-hf fixtures/tiny-mixed /tmp/tiny-mx --plan mxfp8
    """
    _one_process("hf-to-hf")
    check_dst(dst, [src])
    _steady_memory()
    ckpt = HFCheckpoint.open(src)
    result = requantize(ckpt, dst, PrecisionPlan.parse(plan, ckpt.cfg.num_hidden_layers), scales=_scales(scales),  # type: ignore[arg-type]
                        max_shard_size=_size(max_shard_size), allow_nonfinite=allow_nonfinite, force=force,
                        progress=not quiet, command="hf-to-hf", dtype=_dtype(dtype))
    report(result, "conversion")
