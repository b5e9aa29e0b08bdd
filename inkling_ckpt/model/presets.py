"""Model configs: the real Inkling 2 Small (transformers 5.24's defaults) and small look-alikes.

``FULL_TEXT``/``FULL_VISION`` are what ``Inkling2Config().save_pretrained`` writes (the released
model: 594,046,172,160 parameters). The look-alikes keep every structural feature — sliding and
full layers, block attention residuals, padded vocabulary, stacked experts, the vision tower —
at sizes the tests and benches can afford.
"""

from __future__ import annotations

import copy
from typing import Any

from .config import FULL, SLIDING

MODEL_TYPE = "inkling2"
ARCHITECTURES = ["Inkling2ForConditionalGeneration"]
IMAGE_TOKEN_ID = 200054

FULL_TEXT: dict[str, Any] = {
    "attention_dropout": 0.0, "bos_token_id": None, "conv_kernel_size": 4, "d_rel": 16, "eos_token_id": 200006,
    "final_logit_softcapping": 30.0, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4608,
    "initializer_range": 0.02, "log_scaling_alpha": 0.1, "log_scaling_n_floor": 128000,
    "max_position_embeddings": 1048576, "mlp_gate_softcap": 4.0, "mlp_up_softcap": 25.0,
    "model_type": "inkling2_text", "moe_intermediate_size": 2304, "n_layers_per_attn_res_block": 6,
    "n_routed_experts": 384, "num_attention_heads": 48, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_key_value_heads": 8, "pad_token_id": None, "qk_l2_clip_threshold": 22.627416997969522,
    "rel_extent": 1024, "rel_l2_clip_threshold": 8.0, "rms_norm_eps": 1e-06, "route_scale": 8.0,
    "scoring_func": "sigmoid", "sliding_window_size": 1024, "swa_head_dim": 128, "swa_num_attention_heads": 48,
    "swa_num_key_value_heads": 8, "unpadded_vocab_size": 200058, "use_cache": True, "vocab_size": 201024,
}
FULL_VISION: dict[str, Any] = {
    "attention_dropout": 0.0, "hidden_act": "gelu", "hidden_size": 1024, "initializer_range": 0.02,
    "intermediate_size": 4096, "layer_norm_eps": 1e-05, "layer_scale_init_value": 0.1, "mlp_ratio": 4.0,
    "model_type": "inkling2_vision", "num_attention_heads": 16, "num_channels": 3, "num_hidden_layers": 23,
    "patch_size": 20, "posemb_grid_size": 32, "projection_hidden_dim": 4096, "projector_bias": False,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"}, "spatial_merge_size": 2,
    "text_hidden_size": 4608,
}


def default_layer_types(n: int, every: int = 6) -> list[str]:
    """transformers' rule: layer i is full attention where (i + 1) % 6 == 0."""
    return [FULL if (i + 1) % every == 0 else SLIDING for i in range(n)]


_SMALL_VISION = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
                     posemb_grid_size=4, projection_hidden_dim=48)

# size name -> (text_config overrides, vision_config overrides, full-attention period, "mixed" plan)
PRESETS: dict[str, tuple[dict[str, Any], dict[str, Any], int, str]] = {
    "full": ({}, {}, 6, "0-39:nvfp4,40-47:mxfp8"),
    "tiny": (
        dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=32, d_rel=8,
             sliding_window_size=32, rel_extent=48, vocab_size=512, unpadded_vocab_size=500, n_routed_experts=8,
             num_experts_per_tok=2, moe_intermediate_size=64, n_layers_per_attn_res_block=2,
             max_position_embeddings=4096, eos_token_id=2),
        _SMALL_VISION, 2, "0-1:nvfp4,2-3:mxfp8",
    ),
    "small": (
        dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             swa_num_attention_heads=8, swa_num_key_value_heads=4, swa_head_dim=64, d_rel=8,
             sliding_window_size=64, rel_extent=128, vocab_size=1024, unpadded_vocab_size=1000, n_routed_experts=16,
             num_experts_per_tok=4, moe_intermediate_size=256, n_layers_per_attn_res_block=4,
             max_position_embeddings=8192, eos_token_id=2),
        dict(_SMALL_VISION, hidden_size=64, intermediate_size=256, num_hidden_layers=2), 4, "0-5:nvfp4,6-7:mxfp8",
    ),
    # The real expert matrices (w13 4608 x 4608, w2 4608 x 2304) with few experts and layers.
    "wide": (
        dict(num_hidden_layers=4, vocab_size=2048, unpadded_vocab_size=2000, n_routed_experts=16,
             n_layers_per_attn_res_block=2, max_position_embeddings=65536, eos_token_id=2),
        dict(_SMALL_VISION, hidden_size=64, intermediate_size=256), 2, "0-1:nvfp4,2-3:mxfp8",
    ),
}


def preset_config(size: str, *, layers: int | None = None, experts: int | None = None) -> dict[str, Any]:
    """A whole ``config.json`` (BF16, no quantization config) for a preset size."""
    text_kw, vision_kw, period, _ = PRESETS[size]
    text = {**copy.deepcopy(FULL_TEXT), **text_kw}
    if layers is not None:
        text["num_hidden_layers"] = layers
    if experts is not None:
        text["n_routed_experts"] = experts
        text["num_experts_per_tok"] = min(text["num_experts_per_tok"], experts)
    text["layer_types"] = default_layer_types(text["num_hidden_layers"], period)
    vision = {**copy.deepcopy(FULL_VISION), **vision_kw, "text_hidden_size": text["hidden_size"]}
    return {
        "architectures": list(ARCHITECTURES),
        "dtype": "bfloat16",
        "image_token_id": IMAGE_TOKEN_ID,
        "model_type": MODEL_TYPE,
        "text_config": text,
        "vision_config": vision,
    }


def preset_plan(size: str, variant: str, num_layers: int) -> str:
    """The plan text of a variant (bf16 / mixed / mxfp8 / nvfp4) for a preset size."""
    if variant == "mixed":
        plan = PRESETS[size][3]
        if num_layers != _default_layers(size):
            half = max(1, num_layers * 5 // 6) if size == "full" else max(1, num_layers // 2)
            plan = f"0-{half - 1}:nvfp4" + (f",{half}-{num_layers - 1}:mxfp8" if half < num_layers else "")
        return plan
    return variant


def _default_layers(size: str) -> int:
    return PRESETS[size][0].get("num_hidden_layers", 48)
