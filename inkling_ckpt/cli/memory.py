"""``inkling-ckpt memory``: what each GPU holds under a TP/EP plan, and the KV cache left over."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .app import app
from .options import JSON, REVISION, TOKEN, VERBOSE, EmbedDtype, KvDtype, Variant, emit, hub, setup

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
     + "H200 141, B200 192, GB200 192, B300 288, GB300 288, MI355X 288, VR200 288 (= plan.memory.GPU_PRESETS)."),
    ("On the release config with a release plan (mixed = 0-39:nvfp4,40-47:mxfp8, or mxfp8) the report "
     "compares its totals with the cookbook's and says where they differ and why."),
])


@app.command("memory", help=_HELP)
def memory_cmd(
    source: str = typer.Argument(..., metavar="CKPT_OR_CONFIG", help="Checkpoint folder, or config.json."),
    tp: int = typer.Option(..., "--tp", metavar="N", help="Tensor-parallel ranks (GPUs)."),
    ep: int = typer.Option(1, "--ep", metavar="N", help="Expert-parallel ranks."),
    variant: Optional[Variant] = typer.Option(None, "--variant", help="With a bare config: which released variant "
                                              "(mixed = layers 0-39 NVFP4, 40-47 MXFP8 on the full model)."),
    plan_text: Optional[str] = typer.Option(None, "--plan", metavar="PLAN",
                                            help="With a bare config: an explicit precision plan."),
    embed_dtype: Optional[EmbedDtype] = typer.Option(None, "--embed-dtype", help="With a bare config: dtype of embed "
                                                     "and unembed (default bf16; the cookbook's figures are f32)."),
    gpu: Optional[list[str]] = typer.Option(None, "--gpu", metavar="GPU",
                                            help="GPU preset(s) to check, e.g. H200 (default: all)."),
    gpu_memory: Optional[str] = typer.Option(None, "--gpu-memory", metavar="SIZE",
                                             help="Exact GPU memory instead of a preset, e.g. 143771MiB."),
    mem_fraction: float = typer.Option(0.9, "--mem-fraction", metavar="F",
                                       help="Share of GPU memory for weights + KV cache."),
    kv_dtype: KvDtype = typer.Option(KvDtype.bf16, "--kv-dtype", help="KV-cache element format."),
    context: Optional[int] = typer.Option(None, "--context", metavar="N",
                                          help="Sequence length for the 'sequences' column (default "
                                               "min(max_position_embeddings, 131072))."),
    config: Optional[Path] = typer.Option(None, "--config", metavar="CONFIG",
                                          help="For a torch_dist folder not written by inkling-ckpt (whose common.pt "
                                               "keeps no copy): the model's config.json or its HF folder."),
    revision: Optional[str] = REVISION,
    token: Optional[str] = TOKEN,
    as_json: bool = JSON,
    verbose: int = VERBOSE,
) -> None:
    setup(verbose)
    from .. import api
    from ..plan.memory import render_memory

    with hub(revision, token):
        rep = api.memory(source, tp=tp, ep=ep, variant=variant.value if variant else None, plan=plan_text,
                         embed_dtype=embed_dtype.value if embed_dtype else None, gpus=gpu, gpu_memory=gpu_memory,
                         mem_fraction=mem_fraction, kv_dtype=kv_dtype.value, context=context, config=config)
    emit(rep, as_json, render_memory)
