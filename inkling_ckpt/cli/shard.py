"""``inkling-ckpt shard``: split a checkpoint for a TP/EP plan (and ``--merge`` it back)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import typer

from .app import app, declares
from .options import (DRY_RUN, FORCE, JSON, QUIET, REVISION, SHARD_SIZE, TOKEN, VERBOSE, WORKERS, MEMORY_MB, Variant, emit, figures,
                      hub, joined, render_job, setup)

_HELP = "\n\n".join([
    'Split an HF checkpoint into one folder per TP rank for --tp N --ep M.',
    ("Each rank folder holds HF-named safetensors with that rank's local shapes and its own index; "
     "DST/inkling-shard.json records the plan, every tensor's split rule and global shape, expert "
     "ownership and a sha256 per file. Query heads split over tp (wq_du, gate_attn, attn_sink_proj, wr_du, "
     "the l2-clip scales; wo_ud by columns), KV heads too (wk_dv, wv_dv, the K/V short convolutions; "
     "replicated when tp > KV heads), embed/unembed by vocab rows; router, norms, short convolutions, "
     "attn_res queries and the vision tower are replicated. Stacked experts: EP rank r owns experts "
     "[r*E/ep, (r+1)*E/ep) of dim 0 with every per-expert part (scales, _amax); moe_tp = tp/ep ranks share "
     "them, w13 rows split in whole (gate, up) pairs and w2 by columns (NVFP4 layers need moe_tp 1). "
     "Rank r is EP rank r // moe_tp."),
    ('--dry-run prints the plan and per-rank bytes from the headers alone. --merge SRC DST rebuilds the '
     'original checkpoint byte for byte (checksums verified).'),
])


@app.command("shard", help=_HELP)
@declares(reads=["src"], writes=["dst"])
def shard_cmd(
    src: str = typer.Argument(..., metavar="SRC", help="HF checkpoint to split (with --merge: the sharded folder)."),
    dst: Optional[Path] = typer.Argument(None, metavar="DST", help="Output folder, published atomically (not needed "
                                                                   "with --dry-run)."),
    tp: Optional[int] = typer.Option(None, "--tp", metavar="N", help="Tensor-parallel ranks (attention, vocab; total "
                                                                     "ranks)."),
    ep: int = typer.Option(1, "--ep", metavar="N", help="Expert-parallel ranks; must divide --tp and the expert count."),
    merge_: bool = typer.Option(False, "--merge", help="Reassemble the sharded folder SRC into DST instead."),
    variant: Optional[Variant] = typer.Option(None, "--variant", help="With --dry-run on a bare config: which released "
                                              "variant to plan (default mixed = layers 0-39 NVFP4, 40-47 MXFP8)."),
    plan_text: Optional[str] = typer.Option(None, "--plan", metavar="PLAN", help="With --dry-run on a bare config: "
                                            "an explicit precision plan instead of --variant."),
    max_shard_size: str = SHARD_SIZE,
    workers: int = WORKERS,
    memory_mb: int = MEMORY_MB,
    revision: Optional[str] = REVISION,
    token: Optional[str] = TOKEN,
    dry_run: bool = DRY_RUN,
    as_json: bool = JSON,
    force: bool = FORCE,
    quiet: bool = QUIET,
    verbose: int = VERBOSE,
) -> None:
    setup(verbose)
    from .. import api
    from ..errors import PlanError

    if merge_:
        if tp is not None:
            raise PlanError("--merge takes no --tp/--ep: the plan is read from the manifest")
        if dst is None:
            raise PlanError("--merge needs DST, the folder to rebuild the checkpoint in")
        with joined(dry_run):
            rep = api.merge_shards(src, dst, force=force, dry_run=dry_run, progress=not quiet, workers=workers, memory_mb=memory_mb)
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun: one report, from rank 0
            emit(rep, as_json, _render_merge)
        return
    if tp is None:
        raise PlanError("--tp is required (and --ep, default 1)")
    if dst is None and not dry_run:
        raise PlanError("DST is required (or pass --dry-run)")
    with hub(revision, token), joined(dry_run):
        rep = api.shard(src, dst, tp=tp, ep=ep, max_shard_size=max_shard_size, force=force, dry_run=dry_run,
                        progress=not quiet, variant=variant.value if variant else None, plan=plan_text, workers=workers, memory_mb=memory_mb)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun: one report, from rank 0
        emit(rep, as_json, _render_dry_run if dry_run else _render_shard)


def _render_shard(rep: dict[str, Any]) -> str:
    from ..units import fmt_bytes

    if rep["status"] == "skipped":
        return render_job(rep)
    how = "resumed and finished" if rep["status"] == "resumed" else "wrote"
    return (f"{how} {rep['output']}: {rep['parallel_plan']['tp']} ranks, {rep['tensors']} tensors, "
            f"{fmt_bytes(rep['source_bytes'])} in, {fmt_bytes(rep['bytes'])} over all ranks "
            f"(largest rank {fmt_bytes(max(rep['rank_bytes']))})" + figures(rep))


def _render_merge(rep: dict[str, Any]) -> str:
    from ..units import fmt_bytes

    if rep["status"] != "written":
        return render_job(rep)
    return (f"merged into {rep['output']}: {rep['files']} files, {fmt_bytes(rep['bytes'])}, byte-identical to the "
            f"source" + figures(rep))


def _render_dry_run(rep: dict[str, Any]) -> str:
    from ..plan.memory import render_ranks

    p = rep["parallel_plan"]
    lines = [f"{rep['source']}: {rep['variant']} ({rep['precision_plan']}); tp {p['tp']}, ep {p['ep']}, "
             f"moe_tp {p['moe_tp']}", f"dtypes {rep.get('dtypes', 'as stored')}", "", "experts:"]
    for e, v in rep["experts"].items():
        lines.append(f"  EP rank {e}: experts {v['experts'][0]}-{v['experts'][1] - 1} on ranks {v['ranks']}")
    lines += ["", "split rules:"]
    for pattern, r in rep["rules"].items():
        lines.append(f"  {pattern:<64} {r['describe']} [{r['tensors']}]")
    lines += ["", render_ranks(rep["ranks"], rep["checkpoint_bytes"], rep["checkpoint_bytes_by_category"]), ""]
    if isinstance(rep.get("estimate"), dict):
        lines.append(f"estimate: {rep['estimate']['estimate']}")
    lines.append("dry run: nothing written")
    return "\n".join(lines)
