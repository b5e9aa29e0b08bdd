"""``inkling-ckpt lora``: export a trainer's adapter for the engines, merge one into a checkpoint, inspect."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from .app import app, declares
from .options import (DEVICE, DRY_RUN, FORCE, JSON, QUIET, SLICE_MB, VERBOSE, WORKERS, MEMORY_MB, emit, figures, joined, render_job,
                      setup)

lora_app = typer.Typer(
    name="lora",
    help="LoRA adapters: trainer (Megatron) -> engine (PEFT) export, merge into a release checkpoint, inspect.",
    no_args_is_help=True,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(lora_app, name="lora")


@lora_app.command("export")
@declares(reads=["trainer_adapter", "config"], writes=["out"])
def export_cmd(
    trainer_adapter: Path = typer.Argument(..., metavar="TRAINER_ADAPTER",
                                           help="Megatron torch_dist folder, or a .safetensors dump (file or folder) "
                                                "of the trainer's LoRA parameters (Megatron-Bridge names; "
                                                "`make-fixture OUT --lora` writes one)."),
    out: Path = typer.Argument(..., metavar="OUT", help="Adapter folder to write (published atomically)."),
    config: Path = typer.Option(..., "--config", metavar="BASE", help="The base release checkpoint folder or its "
                                                                      "config.json (shapes are checked against it)."),
    alpha: Optional[float] = typer.Option(None, "--alpha", metavar="ALPHA", help="lora_alpha (scaling alpha/r); "
                                                                                 "default: the dump's metadata "
                                                                                 "'lora_alpha'."),
    cast: bool = typer.Option(False, "--cast", help="Round float32/float16 factors to BF16 (else they are refused)."),
    target_modules: str = typer.Option("all-linear", "--target-modules", metavar="MODULES",
                                       help="adapter_config target_modules: 'all-linear' or a comma list."),
    dry_run: bool = DRY_RUN,
    as_json: bool = JSON,
    force: bool = FORCE,
    quiet: bool = QUIET,
    verbose: int = VERBOSE,
) -> None:
    """Write OUT/adapter_config.json, adapter_model.safetensors (engine names, BF16, shared-outer experts) and adapter_sha256.json (the sync check's manifest).

    Everything is validated from the headers before anything is written: unknown or excluded modules (the attention sink projection), a factor without its pair, ranks that disagree, shapes that do not fit --config."""
    setup(verbose)
    from .. import api

    rep = api.lora_export(trainer_adapter, out, config=config, alpha=alpha, cast=cast, target_modules=target_modules,
                          force=force, dry_run=dry_run, progress=not quiet)
    emit(rep, as_json, _render_export)


def _render_export(rep: dict[str, Any]) -> str:
    from ..units import fmt_bytes

    if rep["status"] == "skipped":
        return render_job(rep)
    how = {"dry-run": "would write", "resumed": "resumed and finished", "written": "wrote"}[rep["status"]]
    ignored = rep["ignored_tensors"]
    return (f"{how} {rep['output']}: {rep['tensors']} tensors, {fmt_bytes(rep['bytes'])}, r={rep['r']}, "
            f"alpha={rep['lora_alpha']}"
            + (f"; {'would ignore' if rep['status'] == 'dry-run' else 'ignored'} {ignored} non-adapter tensors"
               if ignored else "")
            + ("; dry run, nothing written" if rep["status"] == "dry-run" else ""))


@lora_app.command("merge")
@declares(reads=["base", "adapter"], writes=["out"])
def merge_cmd(
    base: Path = typer.Argument(..., metavar="BASE", help="Release checkpoint folder (BF16, mixed or MXFP8)."),
    adapter: Path = typer.Argument(..., metavar="ADAPTER", help="Adapter folder (adapter_config.json + "
                                                                "adapter_model.safetensors)."),
    out: Path = typer.Argument(..., metavar="OUT", help="Checkpoint folder to write (published atomically; rerun "
                                                        "resumes)."),
    sqnr: bool = typer.Option(False, "--sqnr", help="Report each merged quantized expert tensor's SQNR vs its float "
                                                    "merge."),
    device: str = DEVICE,
    slice_mb: int = SLICE_MB,
    workers: int = WORKERS,
    memory_mb: int = MEMORY_MB,
    dry_run: bool = DRY_RUN,
    as_json: bool = JSON,
    force: bool = FORCE,
    quiet: bool = QUIET,
    verbose: int = VERBOSE,
) -> None:
    """Write a release checkpoint with W + (alpha/r)·B·A for every adapted tensor.

    Each is decoded to float32, merged, and re-encoded in its layer's format with the base's kept scales (NVFP4: per-expert amax and denominator kept; MXFP8: fresh block scales). Untouched tensors, and experts whose delta is zero, keep their bytes: a zero adapter reproduces BASE byte for byte. A few experts in memory at a time; a rerun resumes; under torchrun the ranks split BASE's shard files."""
    setup(verbose)
    from .. import api

    with joined(dry_run):
        rep = api.lora_merge(base, adapter, out, sqnr=sqnr, force=force, dry_run=dry_run, progress=not quiet,
                             device=device, slice_mb=slice_mb, workers=workers, memory_mb=memory_mb)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun: one report, from rank 0
        emit(rep, as_json, _render_merge)


def _render_merge(rep: dict[str, Any]) -> str:
    from ..units import fmt_bytes

    if rep["status"] == "skipped":
        return render_job(rep)
    if rep["status"] == "dry-run":
        by_fmt: dict[str, list[int]] = {}
        for row in rep["merged"]:
            c = by_fmt.setdefault(row["format"], [0, 0])
            c[0] += 1
            c[1] += row["bytes"]
        return (f"would write {rep['output']}: {len(rep['merged'])} base tensors merged ("
                + ", ".join(f"{k}: {n} tensors, {fmt_bytes(b)}" for k, (n, b) in sorted(by_fmt.items()))
                + "); everything else copied byte for byte; dry run, nothing written"
                + (f"\n  estimate: {rep['estimate']['estimate']}" if isinstance(rep.get("estimate"), dict) else ""))
    how = "resumed and finished" if rep["status"] == "resumed" else "wrote"
    lines = [f"{how} {rep['output']}: {len(rep['changed'])} tensors merged, {fmt_bytes(rep['bytes'])}"
             + (f", {rep['unchanged_experts']} experts with a zero delta kept as they were"
                if rep["unchanged_experts"] else "") + figures(rep)]
    lines += [f"  {name}: SQNR {db:.2f} dB" for name, db in rep["sqnr_db"].items()]
    return "\n".join(lines)


@lora_app.command("inspect")
def inspect_cmd(
    adapter: Path = typer.Argument(..., metavar="ADAPTER", help="Adapter folder."),
    verify: bool = typer.Option(False, "--verify", help="Rehash every tensor against adapter_sha256.json (exit 1 on "
                                                        "mismatch)."),
    as_json: bool = JSON,
    verbose: int = VERBOSE,
) -> None:
    """Rank, alpha, modules and layers, bytes, shared-outer layout — from headers only (--verify reads data)."""
    setup(verbose)
    from .. import api
    from ..lora import render_adapter

    info = api.lora_inspect(adapter, verify=verify)
    emit(info, as_json, render_adapter)
    man = info["manifest"]
    if verify and (man is None or not man.get("ok")):
        print("inkling-ckpt: lora inspect: " + ("no adapter_sha256.json to verify against" if man is None
                                                 else "tensors differ from the sha256 manifest"), file=sys.stderr)
        raise typer.Exit(1)
