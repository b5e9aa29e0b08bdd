"""``inkling-ckpt verify``: how far one checkpoint is from another, tensor by tensor or at the outputs."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Optional

import typer

from ..errors import ConfigError, PlanError
from .app import app, declares

# The report modules are imported when a mode runs (the forward mode needs nothing of the
# tensor comparison, and the tensor mode nothing of transformers); --help must not need them.
SCHEMA = "inkling-ckpt/verify-report/v1"  # = verify.compare.SCHEMA
_FORWARD_SCHEMA = "inkling-ckpt/verify-forward/v1"  # = verify.forward.SCHEMA

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
    ('--forward instead runs both release-layout checkpoints through transformers\' Inkling 2 model (the '
     "'forward' extra: transformers 5.24) on one token batch, streamed one decoder layer at a time "
     '(quantized experts decoded on the fly), and reports KL(A||B) of the next-token distribution (mean and '
     'max over positions), top-1 agreement, max |delta logit| and, per layer, the relative error of the hidden '
     f'state after that layer. Tokens: --tokens FILE (JSON list(s) of ids, or one sequence of ids per line) or '
     f'--random N (--batch sequences of N ids from --seed; the default is --random 128). --json: schema '
     f'{_FORWARD_SCHEMA} (inkling_ckpt/verify/forward.py); --max-kl fails (exit 1) above that KL.'),
])


@app.command("verify", help=_HELP)
@declares(reads=["a", "b", "tokens", "config"], writes=["plot"])
def verify_cmd(
    a: str = typer.Argument(..., metavar="CKPT_A", help="Reference checkpoint (e.g. the BF16 source)."),
    b: str = typer.Argument(..., metavar="CKPT_B", help="Checkpoint to measure against A."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable report on stdout."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write SQNR per layer by format to this PNG."),
    min_sqnr: Optional[float] = typer.Option(None, "--min-sqnr", help="Fail (exit 1) if any tensor is below this SQNR (dB)."),
    exact: bool = typer.Option(False, "--exact", help="Fail (exit 1) unless every tensor is bit-exact."),
    top: int = typer.Option(15, "--top", help="Worst tensors to list in the table."),
    forward: bool = typer.Option(False, "--forward", help="Compare model outputs (needs the 'forward' extra)."),
    tokens: Optional[Path] = typer.Option(None, "--tokens", help="--forward: token ids to run (JSON or text)."),
    random: Optional[int] = typer.Option(None, "--random", help="--forward: N random tokens per sequence."),
    batch: int = typer.Option(2, "--batch", help="--forward --random: sequences in the batch."),
    seed: int = typer.Option(0, "--seed", help="--forward --random: seed of the token ids."),
    device: str = typer.Option("cpu", "--device", help="--forward: cpu or cuda[:N]."),
    dtype: str = typer.Option("auto", "--dtype", help="--forward: auto (A's config dtype), bfloat16 or float32."),
    max_kl: Optional[float] = typer.Option(None, "--max-kl", help="--forward: fail (exit 1) if max KL(A||B) exceeds this."),
    config: Optional[Path] = typer.Option(None, "--config", help="Model config.json (or a folder holding one) for a "
                                          "torch_dist side not written by inkling-ckpt; default: the other side's."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    if min_sqnr is not None and not math.isfinite(min_sqnr):
        raise PlanError(f"--min-sqnr {min_sqnr}: must be a finite number of dB")
    if forward:
        _forward(a, b, as_json=as_json, tokens=tokens, random=random, batch=batch, seed=seed, device=device,
                 dtype=dtype, max_kl=max_kl, quiet=quiet,
                 tensor_only={"--plot": plot is not None, "--min-sqnr": min_sqnr is not None, "--exact": exact,
                              "--config": config is not None})
        return
    forward_only = {"--tokens": tokens is not None, "--random": random is not None, "--max-kl": max_kl is not None}
    given = [k for k, v in forward_only.items() if v]
    if given:
        raise ConfigError(f"{', '.join(given)} only {'applies' if len(given) == 1 else 'apply'} with --forward")
    from ..verify.compare import build_report, compare, plot_report, render_report

    rep = build_report(compare(a, b, progress=not quiet, config=config), min_sqnr=min_sqnr, exact=exact)
    if plot is not None:
        plot_report(rep, plot)
    typer.echo(json.dumps(rep, indent=2) if as_json else render_report(rep, top=top))
    if not rep["thresholds"]["passed"]:
        if as_json:
            print(f"inkling-ckpt: verify: {rep['thresholds']['failures']} tensors fail the threshold", file=sys.stderr)
        raise typer.Exit(1)


def _forward(a: str, b: str, *, as_json: bool, tokens: Optional[Path], random: Optional[int], batch: int,
             seed: int, device: str, dtype: str, max_kl: Optional[float], quiet: bool,
             tensor_only: dict[str, bool]) -> None:
    given = [k for k, v in tensor_only.items() if v]
    if given:
        raise ConfigError(f"{', '.join(given)} {'does' if len(given) == 1 else 'do'} not apply with --forward")
    if tokens is not None and random is not None:
        raise ConfigError("give --tokens FILE or --random N, not both")
    from ..layouts.detect import HF, TORCH_DIST, detect_layout

    for path in (a, b):
        kind = detect_layout(path)
        if kind != HF:
            back = "convert megatron-to-hf" if kind == TORCH_DIST else "shard --merge"
            raise ConfigError(f"{path}: a {kind} folder; --forward runs HF release checkpoints (compare it tensor by "
                              f"tensor without --forward, or make an HF checkpoint of it with {back})")
    from ..verify.forward import compare_forward, load_transformers, read_tokens, render_forward_report

    load_transformers()  # the one-line missing-extra error before anything else
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its load-time notices (e.g. kernel fallbacks) are not this report's
    ids = None
    if tokens is not None:
        ids = read_tokens(tokens, vocab_size=_vocab_size(a))
    elif random is None:
        random = 128
    rep = compare_forward(a, b, input_ids=ids, random=random, batch=batch, seed=seed, device=device, dtype=dtype,
                          max_kl=max_kl, progress=not quiet, tokens_label=str(tokens) if tokens else None)
    typer.echo(json.dumps(rep, indent=2) if as_json else render_forward_report(rep))
    if not rep["thresholds"]["passed"]:
        if as_json:
            print(f"inkling-ckpt: verify --forward: max KL {rep['logits']['kl_max']:.6g} exceeds {max_kl}",
                  file=sys.stderr)
        raise typer.Exit(1)


def _vocab_size(folder: str) -> int:
    from ..verify.forward import _load_config, load_transformers

    return int(_load_config(load_transformers(), folder).get_text_config().vocab_size)
