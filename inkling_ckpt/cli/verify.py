"""``inkling-ckpt verify``: how far one checkpoint is from another, tensor by tensor or at the outputs."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

from .app import app, declares
from .options import (DEVICE, JSON, QUIET, REVISION, SLICE_MB, TOKEN, VERBOSE, WORKERS, MEMORY_MB, ForwardDtype, emit, hub,
                      joined, setup)

# The report modules are imported when a mode runs (the forward mode needs nothing of the
# tensor comparison, and the tensor mode nothing of transformers); --help must not need them.
SCHEMA = "inkling-ckpt/verify/1"  # = verify.compare.SCHEMA
_FORWARD_SCHEMA = "inkling-ckpt/verify-forward/1"  # = verify.forward.SCHEMA

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
    ('It runs on the shared pipeline: --device decodes and compares there (the figures are the same on every '
     'device), --slice-mb is what one unit reads of both sides, --workers units run at once. Under torchrun '
     '--nproc_per_node N the ranks split the units; rank 0 prints the one report (its "ranks" field says what '
     'each rank did) and every rank exits with the same status.'),
    ('--forward instead runs both release-layout checkpoints through transformers\' Inkling 2 model (the '
     "'forward' extra: transformers 5.24) on one token batch, streamed one decoder layer at a time "
     '(quantized experts decoded on the fly), and reports KL(A||B) of the next-token distribution (mean and '
     'max over positions), top-1 agreement, max |delta logit| and, per layer, the relative error of the hidden '
     f'state after that layer. Tokens: --tokens FILE (JSON list(s) of ids, or one sequence of ids per line) or '
     f'--random N (--batch sequences of N ids from --seed; the default is --random 128). --json: schema '
     f'{_FORWARD_SCHEMA} (inkling_ckpt/verify/forward.py); --max-kl fails (exit 1) above that KL. The model '
     f'runs on --device (auto: CUDA when present), in one process, each layer\'s routed experts --slice-mb '
     f'at a time.'),
])


@app.command("verify", help=_HELP)
@declares(reads=["a", "b", "tokens", "config"], writes=["plot"])
def verify_cmd(
    a: str = typer.Argument(..., metavar="CKPT_A", help="Reference checkpoint (e.g. the BF16 source)."),
    b: str = typer.Argument(..., metavar="CKPT_B", help="Checkpoint to measure against A."),
    plot: Optional[Path] = typer.Option(None, "--plot", metavar="FILE", help="Write SQNR per layer by format to this PNG."),
    min_sqnr: Optional[float] = typer.Option(None, "--min-sqnr", metavar="DB",
                                             help="Fail (exit 1) if any tensor is below this SQNR (dB)."),
    exact: bool = typer.Option(False, "--exact", help="Fail (exit 1) unless every tensor is bit-exact."),
    top: int = typer.Option(15, "--top", metavar="N", help="Worst tensors to list in the table."),
    forward: bool = typer.Option(False, "--forward", help="Compare model outputs (needs the 'forward' extra)."),
    tokens: Optional[Path] = typer.Option(None, "--tokens", metavar="FILE",
                                          help="--forward: token ids to run (JSON or text)."),
    random: Optional[int] = typer.Option(None, "--random", metavar="N", help="--forward: N random tokens per sequence."),
    batch: int = typer.Option(2, "--batch", metavar="N", help="--forward --random: sequences in the batch."),
    seed: int = typer.Option(0, "--seed", metavar="N", help="--forward --random: seed of the token ids."),
    dtype: ForwardDtype = typer.Option(ForwardDtype.auto, "--dtype", help="--forward: auto is A's config dtype."),
    max_kl: Optional[float] = typer.Option(None, "--max-kl", metavar="X",
                                           help="--forward: fail (exit 1) if max KL(A||B) exceeds this."),
    config: Optional[Path] = typer.Option(None, "--config", metavar="CONFIG",
                                          help="Model config.json (or a folder holding one) for a torch_dist side not "
                                               "written by inkling-ckpt; default: the other side's."),
    revision: Optional[str] = REVISION,
    token: Optional[str] = TOKEN,
    as_json: bool = JSON,
    quiet: bool = QUIET,
    verbose: int = VERBOSE,
    device: str = DEVICE,
    slice_mb: int = SLICE_MB,
    workers: int = WORKERS,
    memory_mb: int = MEMORY_MB,
) -> None:
    setup(verbose)
    from .. import api
    from ..errors import ConfigError

    if forward:
        tensor_only = {"--plot": plot is not None, "--min-sqnr": min_sqnr is not None, "--exact": exact,
                       "--config": config is not None, "--workers": workers != WORKERS.default,
                       "--memory-mb": memory_mb != MEMORY_MB.default}
        given = [k for k, v in tensor_only.items() if v]
        if given:
            raise ConfigError(f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply with --forward")
        from ..pipeline import launched_ranks
        from ..verify.forward import render_forward_report

        if launched_ranks() > 1:
            raise ConfigError("verify --forward runs in one process (each rank would run the whole model); "
                              "start it without torchrun")

        with hub(revision, token):
            rep = api.verify_forward(a, b, tokens=tokens, random=random, batch=batch, seed=seed, device=device,
                                     dtype=dtype.value, max_kl=max_kl, progress=not quiet, slice_mb=slice_mb)
        emit(rep, as_json, render_forward_report)
        if not rep["thresholds"]["passed"]:
            if as_json:
                print(f"inkling-ckpt: verify --forward: max KL {rep['logits']['kl_max']:.6g} exceeds {max_kl}",
                      file=sys.stderr)
            raise typer.Exit(1)
        return
    forward_only = {"--tokens": tokens is not None, "--random": random is not None, "--max-kl": max_kl is not None}
    given = [k for k, v in forward_only.items() if v]
    if given:
        raise ConfigError(f"{', '.join(given)} only {'applies' if len(given) == 1 else 'apply'} with --forward")
    from ..verify.compare import render_report

    with hub(revision, token), joined():
        rep = api.verify_tensors(a, b, min_sqnr=min_sqnr, exact=exact, config=config, plot=plot, progress=not quiet,
                                 device=device, slice_mb=slice_mb, workers=workers, memory_mb=memory_mb)
    first = int(os.environ.get("RANK", "0")) == 0  # under torchrun: one report, from rank 0
    if first:
        emit(rep, as_json, lambda r: render_report(r, top=top))
    if not rep["thresholds"]["passed"]:  # every rank holds the whole report: the same exit status everywhere
        if as_json and first:
            print(f"inkling-ckpt: verify: {rep['thresholds']['failures']} tensors fail the threshold", file=sys.stderr)
        raise typer.Exit(1)
