"""Tiny Inkling 2 checkpoints written by transformers' own ``save_pretrained`` (the oracle).

transformers 5.24 is a test-only dependency; callers skip when it is missing.
"""

from __future__ import annotations

from pathlib import Path

from conftest import oracle

TEXT = dict(vocab_size=256, unpadded_vocab_size=250, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
            sliding_window_size=32, rel_extent=48, d_rel=8, moe_intermediate_size=32, n_routed_experts=8,
            num_experts_per_tok=2, n_layers_per_attn_res_block=2, eos_token_id=2, conv_kernel_size=4,
            layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"])
VISION = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, patch_size=4, posemb_grid_size=4,
              projection_hidden_dim=48, text_hidden_size=64)


def transformers_or_skip():
    return oracle("transformers", "transformers==5.24.0", minversion="5.24")


def tiny_config(**text_overrides):
    tf = transformers_or_skip()
    return tf.Inkling2Config(text_config={**TEXT, **text_overrides}, vision_config=dict(VISION))


def save_tiny(path: Path, *, seed: int = 0, bf16: bool = True, **text_overrides) -> Path:
    """A random tiny model saved by transformers; ``bf16`` reloads it in bfloat16 and saves again, so the
    file holds the release dtype pattern (router, short convolutions and residual queries F32, rest BF16)."""
    import torch

    tf = transformers_or_skip()
    torch.manual_seed(seed)
    model = tf.Inkling2ForConditionalGeneration(tiny_config(**text_overrides))
    if not bf16:
        model.save_pretrained(path)
        return path
    f32 = path.parent / (path.name + "-f32")
    model.save_pretrained(f32)
    tf.Inkling2ForConditionalGeneration.from_pretrained(f32, dtype=torch.bfloat16).save_pretrained(path)
    return path


def load(path: Path, dtype=None):
    """(model, loading info) through transformers' from_pretrained."""
    import torch

    tf = transformers_or_skip()
    return tf.Inkling2ForConditionalGeneration.from_pretrained(path, dtype=dtype or torch.bfloat16,
                                                               output_loading_info=True)


def logits(model, seed: int = 1, tokens: int = 24):
    import torch

    g = torch.Generator().manual_seed(seed)
    vocab = model.config.text_config.unpadded_vocab_size
    ids = torch.randint(0, vocab, (2, tokens), generator=g)
    with torch.no_grad():
        return model(input_ids=ids).logits
