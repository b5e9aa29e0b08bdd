"""Fake quantization for training: decode(encode(x)) with a straight-through gradient."""

from __future__ import annotations

from typing import Any

import torch

from ._base import Format


class _FakeQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fmt: Format, kw: dict) -> torch.Tensor:
        return _roundtrip(x, fmt, kw)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None  # straight-through: identity


def _roundtrip(x: torch.Tensor, fmt: Format, kw: dict) -> torch.Tensor:
    if fmt.name == "bf16":
        # bf16's "quantization" is the cast itself; encode() refuses to cast silently.
        return x.to(torch.bfloat16).to(x.dtype)
    return fmt.decode(fmt.encode(x, **kw), dtype=x.dtype)


def fake_quant(x: torch.Tensor, fmt_or_name: Format | str, **encode_kw: Any) -> torch.Tensor:
    """``decode(encode(x))`` in x's dtype; the backward pass is the identity (straight-through).

    ``encode_kw`` goes to ``encode`` (e.g. ``weight_scale_2``, ``allow_nonfinite``).
    """
    from . import get_format

    fmt = get_format(fmt_or_name) if isinstance(fmt_or_name, str) else fmt_or_name
    return _FakeQuant.apply(x, fmt, dict(encode_kw))
