"""Fused GPU codecs (Triton) behind the reference codecs, bit-identical to them.

The reference codecs (``formats/nvfp4.py``, ``formats/mxfp8.py``) call :func:`wants` on their
input; for a CUDA tensor, with Triton importable and kernels not disabled, the heavy part
(the amax reduction, the encode pass, the decode pass) runs as one Triton kernel from
``ops``; everything else (argument checks, scale policy, error messages) stays in the
reference code, so both paths accept and reject the same inputs.

Triton is optional: nothing here imports it until a CUDA tensor arrives, and a CPU-only
install never imports it at all.

Switches: ``INKLING_CKPT_GPU_CODECS=0`` (environment) or ``with kernels_disabled():`` run the
reference torch code on CUDA tensors too (the bench's eager baseline); ``=interpret`` also
routes CPU tensors through the kernels, for Triton's interpreter (``TRITON_INTERPRET=1``) in
tests on machines without a GPU.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Iterator

import torch

_MODE = os.environ.get("INKLING_CKPT_GPU_CODECS", "1").strip().lower()
_enabled = _MODE not in ("0", "off", "false", "no")
_interpret = _MODE == "interpret"
_ops: Any = None  # the ops module once imported; False when Triton is missing
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _load() -> Any:
    global _ops
    if _ops is None:
        try:
            from . import ops as _m

            _ops = _m
        except ImportError:  # no Triton: the reference codec handles CUDA tensors too
            _ops = False
    return _ops


def kernels_available() -> bool:
    """True when CUDA tensors will be encoded/decoded by the Triton kernels."""
    return _enabled and (torch.cuda.is_available() or _interpret) and bool(_load())


def wants(t: torch.Tensor) -> bool:
    """Should the codec hand ``t`` to a kernel? (CUDA tensor, Triton importable, not disabled)."""
    if not _enabled or not (t.is_cuda or _interpret):
        return False
    return bool(_load())


def wants_decode(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return dtype in _OUT_DTYPES and wants(t)


@contextmanager
def kernels_disabled() -> Iterator[None]:
    """Run the reference torch code even on CUDA tensors inside this block."""
    global _enabled
    old = _enabled
    _enabled = False
    try:
        yield
    finally:
        _enabled = old


# -- codec hooks: same contract as the reference functions they stand in for ----------------


def amax_2d(x2: torch.Tensor, name: str, allow_nonfinite: bool) -> torch.Tensor:
    """0-d float32 amax of x2 (over finite values); NonFiniteError unless allowed (cf. nvfp4._amax)."""
    from .._base import raise_nonfinite

    amax, bad = _load().group_amax(x2.reshape(1, -1))
    if not allow_nonfinite and bool(bad[0]):
        raise_nonfinite(x2, name)
    return amax[0]


def nvfp4_encode_2d(x2: torch.Tensor, s2: torch.Tensor, name: str, allow_nonfinite: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [rows, w/2], scale e4m3 [rows, w/16]) of a 2-D tensor (cf. NVFP4Format._encode_2d)."""
    from .._base import raise_nonfinite

    rows, width = x2.shape
    w, sc, bad = _load().nvfp4_encode(x2.reshape(1, -1), s2.reshape(1))
    if not allow_nonfinite and bool(bad[0]):
        raise_nonfinite(x2, name)
    return w.view(rows, width // 2), sc.view(rows, width // 16)


def mxfp8_encode_2d(x2: torch.Tensor, scale_mode: str, element: str, name: str,
                    allow_nonfinite: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(elements [rows, w], scale uint8 [rows, w/32]) of a 2-D tensor (cf. MXFP8Format.encode)."""
    from .._base import raise_nonfinite

    rows, width = x2.shape
    q, sc, bad = _load().mxfp8_encode(x2.reshape(1, -1), scale_mode, element)
    if not allow_nonfinite and bool(bad[0]):
        raise_nonfinite(x2, name)
    return q.view(rows, width), sc.view(rows, width // 32)


def nvfp4_decode_2d(w2: torch.Tensor, sc2: torch.Tensor, s2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    rows, half = w2.shape
    return _load().nvfp4_decode(w2.reshape(1, -1), sc2.reshape(1, -1), s2.reshape(1), dtype).view(rows, half * 2)


def mxfp8_decode_2d(q2: torch.Tensor, sc2: torch.Tensor, element: str, dtype: torch.dtype) -> torch.Tensor:
    rows, width = q2.shape
    return _load().mxfp8_decode(q2.reshape(1, -1), sc2.reshape(1, -1), element, dtype).view(rows, width)
