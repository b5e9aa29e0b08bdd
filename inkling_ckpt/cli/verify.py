"""``inkling-ckpt verify``: how far one checkpoint is from another, tensor by tensor."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from ..verify.compare import SCHEMA, build_report, compare, plot_report, render_report
from .app import app

_HELP = "\n\n".join([
    'Compare checkpoint B against the reference A, tensor by tensor, after decoding.',
    ('A and B are checkpoints of the same model in any layout the toolkit writes, detected from the folder: HF '
     '(BF16, mixed, MXFP8, NVFP4), sharded (inkling-ckpt shard) or Megatron torch_dist (convert hf-to-megatron; '
     'read back through the key mapping as release tensors, routed experts BF16, no vision tower: vision tensors '
     'only one side holds are listed as not compared). Routed '
     'experts are decoded per stacked tensor (a layer\'s w13 / w2) to float32; other tensors are compared as stored. Per tensor, per '
     'layer and per format: bit-exact elements, max abs error, relative RMSE sqrt(sum e^2 / sum a^2), SQNR '
     '10*log10(sum a^2 / sum e^2); worst tensors first.'),
    (f'--json prints the report in schema {SCHEMA} (documented in inkling_ckpt/verify/compare.py). --plot '
     f"FILE.png draws SQNR per layer, one line per expert format (needs the 'plot' extra). Exit status: 0 "
     f'when the thresholds hold (--min-sqnr DB for every tensor, --exact for bit identity), 1 when they do '
     f'not, 2 on bad input.'),
])


@app.command("verify", help=_HELP)
def verify_cmd(
    a: str = typer.Argument(..., metavar="CKPT_A", help="Reference checkpoint (e.g. the BF16 source)."),
    b: str = typer.Argument(..., metavar="CKPT_B", help="Checkpoint to measure against A."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable report on stdout."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write SQNR per layer by format to this PNG."),
    min_sqnr: Optional[float] = typer.Option(None, "--min-sqnr", help="Fail (exit 1) if any tensor is below this SQNR (dB)."),
    exact: bool = typer.Option(False, "--exact", help="Fail (exit 1) unless every tensor is bit-exact."),
    top: int = typer.Option(15, "--top", help="Worst tensors to list in the table."),
    config: Optional[Path] = typer.Option(None, "--config", help="Model config.json (or a folder holding one) for a "
                                          "torch_dist side not written by inkling-ckpt; default: the other side's."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    rep = build_report(compare(a, b, progress=not quiet, config=config), min_sqnr=min_sqnr, exact=exact)
    if plot is not None:
        plot_report(rep, plot)
    typer.echo(json.dumps(rep, indent=2) if as_json else render_report(rep, top=top))
    if not rep["thresholds"]["passed"]:
        if as_json:
            print(f"inkling-ckpt: verify: {rep['thresholds']['failures']} tensors fail the threshold", file=sys.stderr)
        raise typer.Exit(1)
