"""Reading and writing the compressed-tensors (llm-compressor) naming of NVFP4 parts.

Same bytes as ModelOpt's convention, other names, and global scales in the quantize
direction (reference/quant-formats.md §2.2, §3.2)::

    weight_packed        <-> weight
    weight_scale         <-> weight_scale
    weight_global_scale  <-> weight_scale_2 = 1 / weight_global_scale
    input_global_scale   <-> input_scale    = 1 / input_global_scale

Reciprocals are one IEEE float32 division. ``1/(1/s)`` need not equal ``s`` bit for bit,
so a ModelOpt -> compressed-tensors -> ModelOpt trip can move a global scale by one ulp.
compressed-tensors stores the global scales with shape [1]; reading accepts [1] or 0-d
and gives 0-d, writing gives [1]. Other keys pass through unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import FormatError

__all__ = ["from_compressed_tensors", "to_compressed_tensors"]

_RENAMES = {"weight_packed": "weight"}
_RECIPROCALS = {"weight_global_scale": "weight_scale_2", "input_global_scale": "input_scale"}


def _reciprocal(t: torch.Tensor, key: str, shape: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.numel() != 1:
        raise FormatError(f"compressed-tensors: {key} must be a one-element tensor, got {getattr(t, 'shape', t)}")
    if t.dtype != torch.float32:
        raise FormatError(f"compressed-tensors: {key} must be float32, got {t.dtype}")
    one = torch.ones((), dtype=torch.float32, device=t.device)
    return (one / t.reshape(())).reshape(shape)


def from_compressed_tensors(parts: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """compressed-tensors NVFP4 part names -> ModelOpt names (reciprocal global scales, 0-d)."""
    out: dict[str, torch.Tensor] = {}
    for k, v in parts.items():
        if k in _RECIPROCALS:
            new = _RECIPROCALS[k]
            if new in parts:
                raise FormatError(f"compressed-tensors: both {k!r} and {new!r} present")
            out[new] = _reciprocal(v, k, ())
        elif k in _RENAMES:
            if _RENAMES[k] in parts:
                raise FormatError(f"compressed-tensors: both {k!r} and {_RENAMES[k]!r} present")
            out[_RENAMES[k]] = v
        else:
            out[k] = v
    return out


def to_compressed_tensors(parts: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """ModelOpt NVFP4 part names -> compressed-tensors names (reciprocal global scales, shape [1])."""
    back_r = {v: k for k, v in _RECIPROCALS.items()}
    back_n = {v: k for k, v in _RENAMES.items()}
    out: dict[str, torch.Tensor] = {}
    for k, v in parts.items():
        if k in back_r:
            out[back_r[k]] = _reciprocal(v, k, (1,))
        elif k in back_n:
            out[back_n[k]] = v
        else:
            out[k] = v
    return out
