"""inkling-ckpt: checkpoints of Inkling 2 Small between Hugging Face, Megatron and serving layouts.

The jobs are functions here (``inkling_ckpt.quantize``, ``convert_hf_to_megatron``, …, see
:mod:`inkling_ckpt.api`); they are imported on first use, so ``import inkling_ckpt`` stays cheap.
The ``verify`` command is ``verify_tensors`` / ``verify_forward`` here: ``inkling_ckpt.verify`` is
the subpackage that implements them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_API = (
    "quantize", "dequantize", "convert_hf_to_hf", "convert_hf_to_megatron", "convert_megatron_to_hf", "shard",
    "merge_shards", "verify_tensors", "verify_forward", "inspect", "memory", "lora_export", "lora_merge", "lora_inspect",
    "make_fixture", "hub_access",
)

if TYPE_CHECKING:
    from .api import (convert_hf_to_hf, convert_hf_to_megatron, convert_megatron_to_hf, dequantize, hub_access,  # noqa: F401
                      inspect, lora_export, lora_inspect, lora_merge, make_fixture, memory, merge_shards, quantize,
                      shard, verify_forward, verify_tensors)


def __getattr__(name: str) -> Any:
    if name in _API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'inkling_ckpt' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])


__all__ = ["__version__", *_API]
