"""The options every command shares, the choice types, and the output helpers.

Nothing here imports torch or the library's heavy modules: ``--help`` and ``--version`` answer
from these definitions alone; each command imports :mod:`inkling_ckpt.api` in its body.
Metavars: arguments and option values are UPPER-case names (``SRC``, ``--plan PLAN``,
``--tp N``); an option with fixed choices shows them (``--scales <fresh|keep>``).
"""

from __future__ import annotations

import json
import logging
import sys
from enum import Enum
from typing import Any, Callable, Optional

import typer

from ..units import fmt_bytes, ranks_phrase


class Scales(str, Enum):
    fresh = "fresh"
    keep = "keep"


class Variant(str, Enum):
    bf16 = "bf16"
    mixed = "mixed"
    mxfp8 = "mxfp8"
    nvfp4 = "nvfp4"


class Size(str, Enum):
    tiny = "tiny"
    small = "small"
    wide = "wide"


class DenseDtype(str, Enum):
    """= ``formats.stacked.UNQUANTIZED``: routed experts stored unquantized."""

    bf16 = "bf16"
    f16 = "f16"
    f32 = "f32"


class Preset(str, Enum):
    """= ``model.mapping.PRESETS`` (a test keeps them equal)."""

    miles = "miles"
    bridge = "bridge"


class EmbedDtype(str, Enum):
    bf16 = "bf16"
    f32 = "f32"


class KvDtype(str, Enum):
    """= ``plan.memory.KV_DTYPES`` (a test keeps them equal)."""

    bf16 = "bf16"
    mxfp8 = "mxfp8"


class ForwardDtype(str, Enum):
    auto = "auto"
    bfloat16 = "bfloat16"
    float32 = "float32"


# ---- options shared by many commands ----------------------------------------------------------

FORCE = typer.Option(False, "--force", help="Replace the output even if it holds a finished or different one.")
QUIET = typer.Option(False, "--quiet", "-q", help="No progress bar.")
VERBOSE = typer.Option(0, "--verbose", "-v", count=True,
                       help="More detail on stderr: -v logs each stage, -vv also prints a traceback with an error.")
JSON = typer.Option(False, "--json", help="Print the report as JSON (versioned 'schema' key) instead of text.")
DRY_RUN = typer.Option(False, "--dry-run", help="Validate the input and report what would be written; write nothing "
                                                 "(no output folder, no staging folder).")
SHARD_SIZE = typer.Option("5GB", "--max-shard-size", metavar="SIZE",
                          help="Largest safetensors file, e.g. 5GB, 500MB, 2MiB.")
#: For commands writing an HF checkpoint from another one: by default the source's files are kept.
KEEP_SHARDS = typer.Option(None, "--max-shard-size", metavar="SIZE",
                           help="Largest safetensors file, e.g. 5GB, 500MB, 2MiB. Default: the files and index of the "
                                "checkpoint whose tensors the output holds exactly (source or reference), else 5GB.")
DTYPE = typer.Option(None, "--dtype", help="Dtype of the routed experts the output holds unquantized. Default: their "
                     "stored dtype where the source holds them unquantized (a cast that would round them, F32 -> BF16, "
                     "is refused and names this option), else BF16.")
NONFINITE = typer.Option(False, "--allow-nonfinite", help="Quantize NaN/Inf as the references do instead of failing.")
CONFIG = typer.Option(None, "--config", metavar="CONFIG",
                      help="For a torch_dist folder not written by inkling-ckpt (whose common.pt keeps no copy): the "
                           "model's config.json, or the HF folder holding it.")
REVISION = typer.Option(None, "--revision", metavar="REV",
                        help="For hub repo ids: the branch, tag or commit to fetch (or write ORG/NAME@REV).")
TOKEN = typer.Option(None, "--token", metavar="TOKEN", envvar="HF_TOKEN", show_envvar=True,
                     help="For hub repo ids: access token (default: HF_TOKEN, or the token of `hf auth login`).")
PRESET = typer.Option(Preset.miles, "--preset",
                      help="Megatron key layout: miles (one Megatron layer per decoder layer, as Miles' Inkling) or "
                           "bridge (Megatron-Core HybridModel: attention of layer i at 2i, its MoE at 2i+1).")
DEVICE = typer.Option("auto", "--device", metavar="DEVICE",
                      help="Where experts are decoded/encoded: auto (CUDA when present), cpu or cuda (under torchrun: "
                           "each rank's local GPU). The bytes are the same on every device.")
SLICE_MB = typer.Option(0, "--slice-mb", min=0, metavar="MIB",
                        help="BF16 MiB of experts one unit handles (at least one expert; 0: 64 on a GPU, 32 on the "
                             "CPU): bounds host and GPU memory; shrink it when the GPU runs out of memory.")
WORKERS = typer.Option(0, "--workers", min=0, metavar="N",
                       help="Units transformed at once (0: one per core, at most 4 on the CPU and 8 on a GPU, at least 2 on a GPU). Under "
                            "torchrun the ranks on one node split its cores.")
MEMORY_MB = typer.Option(0, "--memory-mb", min=0, metavar="MIB",
                         help="Host memory the units in flight may hold together (what they read and write; at least one "
                              "unit always runs). 0 (default): what keeps the whole process near 1 GiB beside its own size "
                              "at the start (~0.25 GiB with torch on the CPU, ~0.6 GiB with CUDA up), 256-768 MiB (on a GPU "
                              "128 MiB more held back for the process's growth, at least 128 MiB), and a "
                              "unit also waits while the process's resident size plus it would pass 1 GiB. Raise it on a "
                              "big node to keep more units in flight (no resident-size check then).")
READ_PRESET = typer.Option(None, "--preset",
                           help="Megatron key layout of SRC: miles or bridge. Default: the one SRC records (inkling-ckpt "
                                "writes it into common.pt), else the one whose keys SRC holds.")
PLAN_HELP = ("Per-layer expert formats: FIRST-LAST:FORMAT rules (0-39:nvfp4,40-47:mxfp8) or one format (mxfp8, bf16);"
             " a layer no rule names holds its experts unquantized (see --dtype; the report lists the plan).")


# ---- set-up and output --------------------------------------------------------------------------

_state = {"verbose": 0}


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (a test's capture, a redirected stream)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def setup(verbose: int = 0) -> None:
    """Route the library's log to stderr at the level ``-v`` asks for (warnings only by default)."""
    _state["verbose"] = verbose
    level = logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG
    log = logging.getLogger("inkling_ckpt")
    log.setLevel(level)
    if not log.handlers:
        log.propagate = False  # one line per message, whatever the root logger does
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("inkling-ckpt: %(message)s"))
        log.addHandler(handler)


def verbosity() -> int:
    return _state["verbose"]


def emit(report: dict[str, Any], as_json: bool, render: Callable[[dict[str, Any]], str]) -> None:
    """Print a report: JSON (as the API returns it) or the text ``render`` makes of it."""
    typer.echo(json.dumps(report, indent=2) if as_json else render(report))


def render_job(rep: dict[str, Any]) -> str:
    """A writing job's report for people: one summary line, then its notes."""
    what = rep["command"]
    if rep["status"] == "dry-run":
        size = f", {fmt_bytes(rep['bytes'])}" if "bytes" in rep else ""
        count = f": {rep['tensors']} tensors{size}" if "tensors" in rep else size and f":{size[1:]}"
        lines = [f"dry run, nothing written: {what} would write {rep['output']}{count}"]
        for key in ("source_precision_plan", "precision_plan", "scales", "preset"):
            if rep.get(key) is not None:
                lines.append(f"  {key.replace('_', ' ')}: {rep[key]}")
        if isinstance(rep.get("estimate"), dict):
            lines.append(f"  estimate: {rep['estimate']['estimate']}")
        if rep.get("output_exists"):
            lines.append(f"  {rep['output']} exists: a run resumes or skips it, or refuses without --force")
    elif rep["status"] == "skipped":
        lines = [f"{rep['output']}: already holds this {what} output; nothing to do (--force to redo)"]
    else:
        how = "resumed and finished" if rep["status"] == "resumed" else "wrote"
        parts = [f"{rep['tensors']} tensors" if "tensors" in rep else None,
                 fmt_bytes(rep["bytes"]) if "bytes" in rep else None]
        lines = [f"{how} {rep['output']}: " + ", ".join(p for p in parts if p) + _figures(rep)]
    lines += [f"note: {n}" for n in rep.get("notes", [])]
    return "\n".join(lines)


def _figures(rep: dict[str, Any]) -> str:
    """The closing line's figures of a pipeline job: time, bytes read and written, rate, reuse, ranks, device."""
    if "seconds" not in rep:
        return ""
    secs = rep["seconds"]
    rate = (rep["bytes_read"] + rep["bytes_written"]) / secs / 1e6 if secs > 0 else 0.0
    out = (f" in {secs:.1f} s (read {fmt_bytes(rep['bytes_read'])}, wrote {fmt_bytes(rep['bytes_written'])}, "
           f"{rate:.0f} MB/s")
    if rep.get("bytes_reused"):
        out += f"; the resume reused {fmt_bytes(rep['bytes_reused'])}"
    return out + ranks_phrase((rep.get("ranks") or {}).get("each") or []) + ")"


def joined(dry_run: bool = False) -> Any:
    """Join torchrun's process group for a writing job (nothing to join for a dry run or one process)."""
    from contextlib import nullcontext

    if dry_run:
        return nullcontext()
    from ..pipeline import torchrun

    return torchrun()


def hub(revision: Optional[str], token: Optional[str]) -> Any:
    """The hub access context for this command's sources (``--revision``/``--token``)."""
    from ..layouts.hub import hub_access

    return hub_access(revision=revision, token=token)


def figures(rep: dict[str, Any]) -> str:
    """The closing line's figures, for a command that renders its own line (``lora merge``, ``shard``)."""
    return _figures(rep)
