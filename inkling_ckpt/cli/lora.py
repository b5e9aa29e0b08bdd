"""``inkling-ckpt lora``: export a trainer's adapter for the engines, merge one into a checkpoint, inspect."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from .app import app, declares

lora_app = typer.Typer(
    name="lora",
    help="LoRA adapters: trainer (Megatron) -> engine (PEFT) export, merge into a release checkpoint, inspect.",
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(lora_app, name="lora")

FORCE_OPT = typer.Option(False, "--force", help="Replace OUT even if it holds a finished or different output.")
QUIET_OPT = typer.Option(False, "--quiet", "-q", help="No progress bar.")


@lora_app.command("export")
@declares(reads=["trainer_adapter", "config"], writes=["out"])
def export_cmd(
    trainer_adapter: Path = typer.Argument(..., metavar="TRAINER_ADAPTER",
                                           help="Megatron torch_dist folder, or a .safetensors dump (file or folder) "
                                                "of the trainer's LoRA parameters (Megatron-Bridge names)."),
    out: Path = typer.Argument(..., metavar="OUT", help="Adapter folder to write (published atomically)."),
    config: Path = typer.Option(..., "--config", help="The base release checkpoint folder or its config.json "
                                                      "(shapes are checked against it)."),
    alpha: Optional[float] = typer.Option(None, "--alpha", help="lora_alpha (scaling alpha/r); default: the dump's "
                                                                "metadata 'lora_alpha'."),
    cast: bool = typer.Option(False, "--cast", help="Round float32/float16 factors to BF16 (else they are refused)."),
    target_modules: str = typer.Option("all-linear", "--target-modules",
                                       help="adapter_config target_modules: 'all-linear' or a comma list."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate from headers and say what would be written; write nothing."),
    force: bool = FORCE_OPT,
    quiet: bool = QUIET_OPT,
) -> None:
    """Write OUT/adapter_config.json, adapter_model.safetensors (engine names, BF16, shared-outer experts) and adapter_sha256.json (the sync check's manifest).

    Everything is validated from the headers before anything is written: unknown or excluded modules (the attention sink projection), a factor without its pair, ranks that disagree, shapes that do not fit --config."""
    from ..lora import export_adapter

    tm: object = target_modules if target_modules in ("all-linear", "all") else [s.strip() for s in target_modules.split(",") if s.strip()]
    if alpha is not None and alpha.is_integer():
        alpha = int(alpha)
    res = export_adapter(trainer_adapter, out, config=config, alpha=alpha, cast=cast, target_modules=tm, force=force,
                         progress=not quiet, dry_run=dry_run)
    if dry_run:
        typer.echo(f"would write {out}: {res.tensors} tensors, {res.bytes / 2**20:.2f} MiB, r={res.rank}, alpha={res.alpha}"
                   + (f"; would ignore {res.ignored} non-adapter tensors" if res.ignored else ""))
        return
    if res.skipped:
        typer.echo(f"{out}: already holds this export; nothing to do (--force to redo)")
        return
    how = "resumed and finished" if res.resumed else "wrote"
    typer.echo(f"{how} {out}: {res.tensors} tensors, {res.bytes / 2**20:.2f} MiB, r={res.rank}, alpha={res.alpha}"
               + (f"; ignored {res.ignored} non-adapter tensors" if res.ignored else ""))


@lora_app.command("merge")
@declares(reads=["base", "adapter"], writes=["out"])
def merge_cmd(
    base: Path = typer.Argument(..., metavar="BASE", help="Release checkpoint folder (BF16, mixed or MXFP8)."),
    adapter: Path = typer.Argument(..., metavar="ADAPTER", help="Adapter folder (adapter_config.json + adapter_model.safetensors)."),
    out: Path = typer.Argument(..., metavar="OUT", help="Checkpoint folder to write (published atomically; rerun resumes)."),
    sqnr: bool = typer.Option(False, "--sqnr", help="Report each merged quantized expert tensor's SQNR vs its float merge."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate and list what would be merged (headers only); write nothing."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable summary."),
    force: bool = FORCE_OPT,
    quiet: bool = QUIET_OPT,
) -> None:
    """Write a release checkpoint with W + (alpha/r)·B·A for every adapted tensor.

    Each is decoded to float32, merged, and re-encoded in its layer's format with the base's kept scales (NVFP4: per-expert amax and denominator kept; MXFP8: fresh block scales). Untouched tensors, and experts whose delta is zero, keep their bytes: a zero adapter reproduces BASE byte for byte. A few experts in memory at a time; a rerun resumes."""
    from ..lora import merge
    from ..lora.merge import plan_merge

    if dry_run:
        plan = plan_merge(base, adapter)
        if as_json:
            typer.echo(json.dumps(plan, indent=2))
            return
        by_fmt: dict[str, list[int]] = {}
        for row in plan:
            c = by_fmt.setdefault(row["format"], [0, 0])
            c[0] += 1
            c[1] += row["bytes"]
        typer.echo(f"would write {out}: {len(plan)} base tensors merged ("
                   + ", ".join(f"{k}: {n} tensors, {b / 2**20:.1f} MiB" for k, (n, b) in sorted(by_fmt.items()))
                   + "); everything else copied byte for byte")
        return
    res = merge(base, adapter, out, force=force, progress=not quiet, measure=sqnr)
    if as_json:
        typer.echo(json.dumps({"dst": str(res.dst), "skipped": res.skipped, "resumed": res.resumed, "files": res.files,
                               "changed": res.changed, "unchanged_experts": res.unchanged_experts, "bytes": res.bytes,
                               "sqnr_db": res.sqnr}, indent=2))
        return
    if res.skipped:
        typer.echo(f"{out}: already holds this merge; nothing to do (--force to redo)")
        return
    how = "resumed and finished" if res.resumed else "wrote"
    typer.echo(f"{how} {out}: {len(res.changed)} tensors merged, {res.bytes / 2**20:.1f} MiB"
               + (f", {res.unchanged_experts} experts with a zero delta kept as they were" if res.unchanged_experts else ""))
    for name, db in res.sqnr.items():
        typer.echo(f"  {name}: SQNR {db:.2f} dB")


@lora_app.command("inspect")
def inspect_cmd(
    adapter: Path = typer.Argument(..., metavar="ADAPTER", help="Adapter folder."),
    verify: bool = typer.Option(False, "--verify", help="Rehash every tensor against adapter_sha256.json (exit 1 on mismatch)."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Rank, alpha, modules and layers, bytes, shared-outer layout — from headers only (--verify reads data)."""
    from ..lora import inspect_adapter, render_adapter

    info = inspect_adapter(adapter, verify=verify)
    typer.echo(json.dumps(info, indent=2) if as_json else render_adapter(info))
    man = info["manifest"]
    if verify and (man is None or not man.get("ok")):
        print("inkling-ckpt: lora inspect: " + ("no adapter_sha256.json to verify against" if man is None
                                                 else "tensors differ from the sha256 manifest"), file=sys.stderr)
        raise typer.Exit(1)
