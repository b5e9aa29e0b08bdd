"""inkling-ckpt: checkpoints of Inkling 2 Small between Hugging Face, Megatron and serving layouts."""

__version__ = "0.1.0"
