"""Model configs: the real Inkling 2 Small and the small look-alikes used for fixtures and benches."""

from __future__ import annotations

from typing import Any

MODEL_TYPE = "inkling2"
ARCHITECTURES = ["Inkling2ForConditionalGeneration"]


def _layer_types(n: int) -> list[str]:
    # Every fourth layer attends over the whole context; the rest use a sliding window.
    return ["full_attention" if i % 4 == 3 else "sliding_attention" for i in range(n)]


def _text(**kw: Any) -> dict[str, Any]:
    base = {
        "model_type": "inkling2_text",
        "hidden_size": 4608, "num_hidden_layers": 48, "num_attention_heads": 48,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 201024,
        "n_routed_experts": 384, "n_shared_experts": 0, "num_experts_per_tok": 8,
        "moe_intermediate_size": 2304, "intermediate_size": 18432, "swiglu_limit": 7.0,
        "sliding_window": 4096, "relative_bias_buckets": 256, "attn_residual_block_size": 8,
        "conv_kernel_size": 4, "num_nextn_predict_layers": 1, "max_position_embeddings": 1048576,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    }
    base.update(kw)
    base["layer_types"] = _layer_types(base["num_hidden_layers"])
    return base


def _vision(**kw: Any) -> dict[str, Any]:
    base = {
        "model_type": "inkling2_vision", "depth": 40, "hidden_size": 1792, "intermediate_size": 10240,
        "num_heads": 16, "in_channels": 3, "patch_size": 14, "temporal_patch_size": 2,
        "spatial_merge_size": 2, "out_hidden_size": 4608,
    }
    base.update(kw)
    return base


# size name -> (text_config overrides, vision_config overrides, default precision plan of "mixed")
PRESETS: dict[str, tuple[dict[str, Any], dict[str, Any], str]] = {
    "full": ({}, {}, "0-39:nvfp4,40-47:mxfp8"),
    "tiny": (
        dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
             vocab_size=512, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
             intermediate_size=256, sliding_window=64, relative_bias_buckets=32, attn_residual_block_size=2,
             max_position_embeddings=4096),
        dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=4, out_hidden_size=256),
        "0-1:nvfp4,2-3:mxfp8",
    ),
    "small": (
        dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8, head_dim=32,
             vocab_size=1024, n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
             intermediate_size=1024, sliding_window=128, relative_bias_buckets=64, attn_residual_block_size=4,
             max_position_embeddings=8192),
        dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=4, patch_size=4, out_hidden_size=512),
        "0-5:nvfp4,6-7:mxfp8",
    ),
    # The real expert matrices (2304 x 4608) with few experts and layers: memory and speed work.
    "wide": (
        dict(num_hidden_layers=4, vocab_size=2048, n_routed_experts=16, intermediate_size=4608,
             max_position_embeddings=65536),
        dict(depth=1, hidden_size=128, intermediate_size=256, num_heads=4, patch_size=4),
        "0-1:nvfp4,2-3:mxfp8",
    ),
}


def preset_config(size: str, *, layers: int | None = None, experts: int | None = None) -> dict[str, Any]:
    """A whole ``config.json`` (BF16, no quantization config) for a preset size."""
    text_kw, vision_kw, _ = PRESETS[size]
    text_kw = dict(text_kw)
    if layers is not None:
        text_kw["num_hidden_layers"] = layers
    if experts is not None:
        text_kw["n_routed_experts"] = experts
        text_kw["num_experts_per_tok"] = min(text_kw.get("num_experts_per_tok", 8), experts)
    return {
        "model_type": MODEL_TYPE,
        "architectures": list(ARCHITECTURES),
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "text_config": _text(**text_kw),
        "vision_config": _vision(**vision_kw),
    }


def preset_plan(size: str, variant: str, num_layers: int) -> str:
    """The plan text of a variant (bf16 / mixed / mxfp8 / nvfp4) for a preset size."""
    if variant == "mixed":
        plan = PRESETS[size][2]
        if num_layers != _default_layers(size):
            half = max(1, num_layers * 5 // 6) if size == "full" else max(1, num_layers // 2)
            plan = f"0-{half - 1}:nvfp4" + (f",{half}-{num_layers - 1}:mxfp8" if half < num_layers else "")
        return plan
    return variant


def _default_layers(size: str) -> int:
    return PRESETS[size][0].get("num_hidden_layers", 48)
