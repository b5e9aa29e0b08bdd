"""Fake quantization for training: decode(encode(x)) with a straight-through gradient."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import FormatError
from ._base import Format


class _FakeQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fmt: Format, x: torch.Tensor, kw: dict) -> torch.Tensor:
        return _roundtrip(fmt, x, kw)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        return None, grad, None  # straight-through: identity


def _roundtrip(fmt: Format, x: torch.Tensor, kw: dict) -> torch.Tensor:
    if fmt.name == "bf16":
        # bf16's "quantization" is the cast itself; encode() refuses to cast silently.
        return x.to(torch.bfloat16).to(x.dtype)
    return fmt.decode(fmt.encode(x, **kw), dtype=x.dtype)


def fake_quant(fmt_or_name: Format | str, x: torch.Tensor, **encode_kw: Any) -> torch.Tensor:
    """``decode(encode(x))`` in x's dtype; the backward pass is the identity (straight-through).

    The format comes first, as in every codec function (``encode_stacked(fmt, w)``,
    ``decode_stacked(fmt, parts)``). ``encode_kw`` goes to ``encode`` (e.g. ``weight_scale_2``,
    ``allow_nonfinite``).
    """
    from . import get_format

    if isinstance(fmt_or_name, torch.Tensor) or not isinstance(x, torch.Tensor):
        raise FormatError("fake_quant(fmt, x): the format comes first, then the tensor")
    fmt = get_format(fmt_or_name) if isinstance(fmt_or_name, str) else fmt_or_name
    return _FakeQuant.apply(fmt, x, dict(encode_kw))
