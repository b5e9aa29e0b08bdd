"""``inkling-ckpt memory``: what each GPU holds under a TP/EP plan, and the KV cache left over."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Optional

import torch
import typer

from ..errors import ConfigError, PlanError
from ..layouts.detect import HF, TORCH_DIST, detect_layout, open_checkpoint
from ..layouts.hf import INDEX, fetch_config, looks_like_repo_id, parse_size
from ..model.config import read_json
from ..model.inventory import inventory, vision_specs
from ..model.precision import PrecisionPlan
from ..model.presets import preset_plan
from ..plan.memory import GPU_PRESETS, KV_DTYPES, bare_config_dtypes, memory_report, render_memory
from ..layouts.limits import MAX_RANKS, check_count, check_config_bounds, config_from_dict
from .app import app
from .checkpoint import Variant


class EmbedDtype(str, Enum):
    bf16 = "bf16"
    f32 = "f32"


_EMBED = {EmbedDtype.bf16: torch.bfloat16, EmbedDtype.f32: torch.float32}

_HELP = "\n\n".join([
    'Bytes per GPU by category under --tp N --ep M, whether it fits, and the KV-cache pool.',
    ('CKPT_OR_CONFIG is a checkpoint folder — HF, sharded (inkling-ckpt shard) or Megatron torch_dist '
     '(convert hf-to-megatron: routed experts BF16, the vision tower counted from the config) — read from its '
     'headers only (no tensor data), or a bare '
     'config.json (or a folder holding only one) with --variant or --plan, so the full-size model can be '
     'planned with no weights on disk. A bare config assumes BF16 for every non-expert tensor; '
     '--embed-dtype f32 stores embed and unembed in F32 (what the release cookbook counts: +3.7 GB). '
     "Categories: routed experts, attention, embeddings/head, router and norms, vision tower; "
     "'replicated' is what other ranks hold too."),
    ("KV cache: K and V per attention layer for max(1, KV heads / tp) heads per rank; full-attention "
     "layers keep every token, sliding-window layers (swa heads) one window per sequence. "
     "Pool = mem-fraction x GPU memory - the largest rank's weights. GPU presets (GB as sold): "
     + ", ".join(f"{k} {v}" for k, v in GPU_PRESETS.items()) + "."),
    ("On the release config with a release plan (mixed = 0-39:nvfp4,40-47:mxfp8, or mxfp8) the report "
     "compares its totals with the cookbook's and says where they differ and why."),
])


def _holds_weights(p: Path) -> str | None:
    """The layout of a checkpoint folder with weights (HF, sharded, torch_dist); None for a bare config."""
    if not p.is_dir():
        return None
    kind = detect_layout(p)
    if kind == HF and not ((p / INDEX).is_file() or any(p.glob("*.safetensors"))):
        return None  # a folder holding only a config.json
    return kind


def _load(source: str, variant: Optional[Variant], plan_text: Optional[str], embed: Optional[EmbedDtype],
          config: Optional[Path] = None):
    p = Path(source)
    kind = _holds_weights(p)
    if kind is not None:
        if variant is not None or plan_text is not None or embed is not None:
            raise PlanError(f"{source} holds weights: its precision plan and dtypes are read from it "
                            "(drop --variant/--plan/--embed-dtype)")
        # Validated against the tensor table from headers / metadata only (no tensor data, no checksums).
        ckpt = open_checkpoint(p, config=config, layout=kind)
        try:
            specs, note = ckpt.expected(), "as stored (from the headers)"
            if kind == TORCH_DIST:
                note = "as stored in torch_dist (from its metadata): routed experts BF16"
                if ckpt.cfg.vision is not None:
                    # Served, the model carries its vision tower; Megatron holds the text model only.
                    specs = specs + vision_specs(ckpt.cfg)
                    note += "; vision tower not stored there, counted from the config (BF16)"
            return ckpt.cfg, ckpt.plan, specs, str(ckpt.root), note
        finally:
            ckpt.close()
    if config is not None:
        raise PlanError("--config is for a torch_dist folder that keeps no config; a bare config.json is "
                        "CKPT_OR_CONFIG itself")
    return bare_config(source, variant, plan_text, embed)


def bare_config(source: str, variant: Optional[Variant], plan_text: Optional[str], embed: Optional[EmbedDtype]):
    """A config.json (or a folder holding only one, or a hub repo's) planned as a checkpoint of
    ``variant`` / ``plan_text``: (cfg, plan, specs, where, note) with the bare-config dtype assumption."""
    p = Path(source)
    config_path = p / "config.json" if p.is_dir() else p
    if not p.exists() and looks_like_repo_id(source):
        config_path = fetch_config(source)
    if not config_path.is_file():
        raise ConfigError(f"{source} is neither a checkpoint folder nor a config.json")
    raw = read_json(config_path)
    check_config_bounds(raw, config_path)
    cfg = config_from_dict(raw, config_path)
    n = cfg.num_hidden_layers
    if plan_text is not None and variant is not None:
        raise PlanError("give --variant or --plan, not both")
    if plan_text is not None:
        plan = PrecisionPlan.parse(plan_text, n)
    elif variant is not None:
        plan = PrecisionPlan.parse(preset_plan("full", variant.value, n), n)
    else:
        raise PlanError(f"{config_path} has no weights: say which checkpoint with --variant (bf16, mixed, mxfp8, "
                        f"nvfp4) or --plan (e.g. 0-39:nvfp4,40-47:mxfp8)")
    e = embed or EmbedDtype.bf16
    specs = inventory(cfg, plan, dtypes=bare_config_dtypes(inventory(cfg, plan), _EMBED[e]))
    note = (f"assumed (bare config): every non-expert tensor BF16, embed/unembed {e.value.upper()}"
            + ("" if embed is not None else "; --embed-dtype f32 for F32 embed/unembed"))
    return cfg, plan, specs, str(config_path), note


@app.command("memory", help=_HELP)
def memory_cmd(
    source: str = typer.Argument(..., metavar="CKPT_OR_CONFIG", help="Checkpoint folder, or config.json."),
    tp: int = typer.Option(..., "--tp", help="Tensor-parallel ranks (GPUs)."),
    ep: int = typer.Option(1, "--ep", help="Expert-parallel ranks."),
    variant: Optional[Variant] = typer.Option(None, "--variant", help="With a bare config: which released variant "
                                              "(mixed = layers 0-39 NVFP4, 40-47 MXFP8 on the full model)."),
    plan_text: Optional[str] = typer.Option(None, "--plan", help="With a bare config: an explicit precision plan."),
    embed_dtype: Optional[EmbedDtype] = typer.Option(None, "--embed-dtype", help="With a bare config: dtype of embed "
                                                     "and unembed (default bf16; the cookbook's figures are f32)."),
    gpu: Optional[list[str]] = typer.Option(None, "--gpu", help="GPU preset(s) to check (default: all)."),
    gpu_memory: Optional[str] = typer.Option(None, "--gpu-memory", help="Exact GPU memory instead of a preset, e.g. 143771MiB."),
    mem_fraction: float = typer.Option(0.9, "--mem-fraction", help="Share of GPU memory for weights + KV cache."),
    kv_dtype: str = typer.Option("bf16", "--kv-dtype", help=f"KV-cache element format: {', '.join(KV_DTYPES)}."),
    context: Optional[int] = typer.Option(None, "--context", help="Sequence length for the 'sequences' column "
                                          "(default min(max_position_embeddings, 131072))."),
    config: Optional[Path] = typer.Option(None, "--config", help="For a torch_dist folder not written by inkling-ckpt "
                                          "(whose common.pt keeps no copy): the model's config.json or its HF folder."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    check_count(tp, "--tp", MAX_RANKS)
    check_count(ep, "--ep", MAX_RANKS)
    cfg, plan, specs, where, note = _load(source, variant, plan_text, embed_dtype, config)
    rep = memory_report(cfg, plan, specs, tp, ep, source=where, dtypes_note=note, gpus=gpu,
                        gpu_bytes=parse_size(gpu_memory) if gpu_memory else None,
                        mem_fraction=mem_fraction, kv_dtype=kv_dtype, context=context)
    typer.echo(json.dumps(rep, indent=2) if as_json else render_memory(rep))
