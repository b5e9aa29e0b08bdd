"""``inkling-ckpt shard``: split a checkpoint for a TP/EP plan (and ``--merge`` it back)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ..errors import PlanError
from ..layouts.hf import HFCheckpoint, looks_like_repo_id, parse_size
from ..layouts.sharded import ShardPlan, describe_plan, merge, shard
from ..plan.memory import CATEGORIES, rank_memory, render_ranks
from ..layouts.limits import MAX_RANKS, check_count
from ..layouts.paths import check_dst
from .app import app
from .checkpoint import Variant
from .memory import EmbedDtype, _holds_weights, bare_config

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
    ('--dry-run prints the plan and per-rank bytes from the headers alone; SRC may then be a bare config.json '
     '(e.g. fixtures/full-size/config.json, or a hub repo id: only its config is fetched) planned as --variant '
     '(default mixed) or --plan, with BF16 non-expert tensors. --merge SRC DST rebuilds the '
     'original checkpoint byte for byte (checksums verified).'),
])


def _bare_config(src: str) -> bool:
    """A config.json, a folder holding only one, or a hub repo id (only its config is fetched for a dry run)."""
    p = Path(src)
    if not p.exists():
        return looks_like_repo_id(src)
    return p.is_file() or _holds_weights(p) is None


@app.command("shard", help=_HELP)
def shard_cmd(
    src: str = typer.Argument(..., help="HF checkpoint to split (with --merge: the sharded folder)."),
    dst: Optional[Path] = typer.Argument(None, help="Output folder, published atomically (not needed with --dry-run)."),
    tp: Optional[int] = typer.Option(None, "--tp", help="Tensor-parallel ranks (attention, vocab; total ranks)."),
    ep: int = typer.Option(1, "--ep", help="Expert-parallel ranks; must divide --tp and the expert count."),
    merge_: bool = typer.Option(False, "--merge", help="Reassemble the sharded folder SRC into DST instead."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and per-rank bytes; read no tensor data."),
    as_json: bool = typer.Option(False, "--json", help="With --dry-run: machine-readable output."),
    variant: Optional[Variant] = typer.Option(None, "--variant", help="With --dry-run on a bare config: which released "
                                              "variant to plan (default mixed = layers 0-39 NVFP4, 40-47 MXFP8)."),
    plan_text: Optional[str] = typer.Option(None, "--plan", help="With --dry-run on a bare config: an explicit "
                                            "precision plan instead of --variant."),
    max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest safetensors file per rank."),
    force: bool = typer.Option(False, "--force", help="Replace DST even if it holds a finished or different output."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    check_count(tp, "--tp", MAX_RANKS)
    check_count(ep, "--ep", MAX_RANKS)
    if merge_:
        if tp is not None or dry_run:
            raise PlanError("--merge takes no --tp/--dry-run: the plan is read from the manifest")
        if dst is None:
            raise PlanError("--merge needs DST, the folder to rebuild the checkpoint in")
        check_dst(dst, [src])
        merged = merge(src, dst, force=force, progress=not quiet)
        if merged.skipped:
            typer.echo(f"{dst}: already holds this merge; nothing to do (--force to redo)")
        else:
            typer.echo(f"merged into {dst}: {merged.files} files, {merged.bytes / 2**20:.1f} MiB, byte-identical to the source")
        return
    if tp is None:
        raise PlanError("--tp is required (and --ep, default 1)")
    if not dry_run and (variant is not None or plan_text is not None):
        raise PlanError("--variant/--plan plan a bare config.json with --dry-run; a checkpoint is split as it is stored")
    if dry_run:
        if _bare_config(src):
            cfg, precision, specs, where, note = bare_config(src, variant if plan_text else variant or Variant.mixed, plan_text,
                                                                   EmbedDtype.bf16)
        else:
            if variant is not None or plan_text is not None:
                raise PlanError(f"{src} holds weights: its precision plan is read from it (drop --variant/--plan)")
            ckpt = HFCheckpoint.open(src)
            cfg, precision, specs, where, note = ckpt.cfg, ckpt.plan, ckpt.expected(), str(ckpt.root), None
        plan = ShardPlan.build(cfg, precision, tp, ep, specs)
        info = describe_plan(plan)
        ranks = rank_memory(plan)
        if as_json:
            typer.echo(json.dumps({**info, "source": where, "variant": precision.variant,
                                   "precision_plan": str(precision), "dtypes": note or "as stored (from the headers)",
                                   "ranks": ranks}, indent=2))
            return
        p = info["plan"]
        typer.echo(f"{where}: {precision.variant} ({precision}); tp {p['tp']}, ep {p['ep']}, moe_tp {p['moe_tp']}")
        if note:
            typer.echo(f"dtypes {note}")
        typer.echo("")
        typer.echo("experts:")
        for e, v in info["experts"].items():
            typer.echo(f"  EP rank {e}: experts {v['experts'][0]}-{v['experts'][1] - 1} on ranks {v['ranks']}")
        typer.echo("")
        typer.echo("split rules:")
        for pattern, r in info["rules"].items():
            typer.echo(f"  {pattern:<64} {r['describe']} [{r['tensors']}]")
        typer.echo("")
        by_cat = dict.fromkeys(CATEGORIES, 0)
        for s in specs:
            by_cat[s.category.value] += s.nbytes
        typer.echo(render_ranks(ranks, sum(by_cat.values()), by_cat))
        return
    if dst is None:
        raise PlanError("DST is required (or pass --dry-run)")
    check_dst(dst, [src])
    res = shard(src, dst, tp, ep, max_shard_size=parse_size(max_shard_size), force=force, progress=not quiet)
    if res.skipped:
        typer.echo(f"{dst}: already holds this shard job; nothing to do (--force to redo)")
        return
    how = "resumed and finished" if res.resumed else "wrote"
    typer.echo(f"{how} {dst}: {tp} ranks, {res.tensors} tensors, {res.source_bytes / 2**20:.1f} MiB in, "
               f"{res.written_bytes / 2**20:.1f} MiB over all ranks (largest rank {max(res.rank_bytes) / 2**20:.1f} MiB)")
