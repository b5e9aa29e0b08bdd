"""Tiny Inkling 2 release checkpoints written by transformers itself (test-only oracle).

``Inkling2ForConditionalGeneration(...).save_pretrained`` writes the BF16 checkpoint (through
``_tiny_tf.save_tiny``: the router, short convolutions and residual queries stay F32 as
transformers keeps them), saved again in several files; the quantized variants replace each
layer's stacked experts by :func:`~inkling_ckpt.formats.stacked.encode_stacked` parts. Sliding
and full layers have different head counts here (8 query / 2 KV heads on full layers, 4 / 4 on
sliding ones) so per-layer geometry is exercised, and tp 4 replicates the full layers' KV heads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from inkling_ckpt.formats.stacked import encode_stacked
from inkling_ckpt.model.inventory import EXPERT_ROWS
from inkling_ckpt.model.precision import PrecisionPlan
from inkling_ckpt.model.quant_config import release_quant_config
from inkling_ckpt.model.config import InklingConfig
from _tiny_tf import TEXT as TF_TEXT, VISION as TF_VISION, load, save_tiny

#: Per-kind head counts that differ, and experts wide enough for an MXFP8 moe-TP split (64 / 2 = 32).
OVERRIDES = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8, swa_num_attention_heads=4,
                 swa_num_key_value_heads=4, swa_head_dim=16, moe_intermediate_size=64)
TEXT = {**TF_TEXT, **OVERRIDES}
VISION = TF_VISION
PLANS = {"bf16": "bf16", "mixed": "0-1:nvfp4,2-3:mxfp8", "mxfp8": "mxfp8"}


def transformers_model(work: Path):
    """The BF16 model as transformers loads it from its own checkpoint (``_tiny_tf.save_tiny``)."""
    model, _ = load(save_tiny(work / "base", **OVERRIDES))
    return model


def _tensors(root: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def write_variants(model, work: Path) -> dict[str, Path]:
    """bf16 (save_pretrained, several shards), mixed and mxfp8 (experts re-encoded), under ``work``."""
    bf16 = work / "tiny-bf16"
    model.save_pretrained(bf16, max_shard_size="200KB")
    out = {"bf16": bf16}
    tensors = _tensors(bf16)
    config = json.loads((bf16 / "config.json").read_text())
    cfg = InklingConfig.from_dict(config)
    for variant in ("mixed", "mxfp8"):
        plan = PrecisionPlan.parse(PLANS[variant], cfg.num_hidden_layers)
        t = dict(tensors)
        for layer in range(cfg.num_hidden_layers):
            for row in EXPERT_ROWS:
                base = row.name(layer)
                for suffix, part in encode_stacked(plan.format_of(layer), t.pop(base), name=base).items():
                    t[base + suffix] = part
        dst = work / f"tiny-{variant}"
        dst.mkdir()
        names = sorted(t)
        files = {f"model-{i + 1:05d}-of-00003.safetensors": names[i::3] for i in range(3)}
        weight_map = {}
        for f, group in files.items():
            save_file({n: t[n].contiguous() for n in group}, str(dst / f), metadata={"format": "pt"})
            weight_map.update({n: f for n in group})
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        qc = release_quant_config(cfg, plan)
        (dst / "config.json").write_text(json.dumps({**config, **({"quantization_config": qc} if qc else {})}))
        (dst / "generation_config.json").write_bytes((bf16 / "generation_config.json").read_bytes())
        out[variant] = dst
    return out


# ---- pytest fixtures shared by the shard / memory tests (``cli`` is conftest's) ----------------------------------------

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_release(tmp_path_factory):
    """{"model": transformers' BF16 model, "bf16" / "mixed" / "mxfp8": checkpoint folders}."""
    pytest.importorskip("transformers")
    work = tmp_path_factory.mktemp("release")
    model = transformers_model(work)
    return {"model": model, **write_variants(model, work)}


def tiny_config(**text) -> InklingConfig:
    """The tiny release config (no transformers needed), with text_config overrides."""
    return InklingConfig.from_dict({"text_config": {**TEXT, **text}, "vision_config": VISION})
