"""PRIVATE STOP-GAP: per-expert decode/encode of the release's stacked expert tensors.

SWAP LATER for the coordinator's stacked-expert API in ``inkling_ckpt.formats`` (encode/decode a
whole ``[E, 2F, H]`` w13 in one call, NVFP4 global factor ``amax / 2688`` per expert). Until then
this wraps the per-tensor codecs (``get_format``) one expert at a time.

Release layout per format (spec/inkling2.md), for a stacked expert tensor ``P`` (``…w13_weight``
or ``…w2_weight``) of logical shape ``[E, rows, cols]``:

* bf16:  ``P`` float [E, rows, cols]
* mxfp8: ``P`` F8_E4M3 [E, rows, cols]; ``P_scale`` U8 [E, rows, cols/32]
* nvfp4: ``P`` U8 [E, rows, cols/2]; ``P_scale`` F8_E4M3 [E, rows, cols/16]; ``P_amax`` F32 [E];
  ``P_outer_scale_denominator`` F32 scalar (or [E]); global factor = amax / denominator.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..errors import CheckpointError
from ..formats import get_format

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class StackedFormat:
    """One row of the format table: the weight's dtype, its per-expert and kept side tensors."""

    name: str
    weight_dtype: tuple[torch.dtype, ...]
    per_expert: dict[str, torch.dtype]  # suffix -> dtype: rewritten expert by expert
    kept: dict[str, torch.dtype]  # suffix -> dtype: copied unchanged (global factors)
    pack: int  # logical columns per stored weight column


#: Detection order matters only in that each row's tensor set is checked exactly.
STACKED_FORMATS: tuple[StackedFormat, ...] = (
    StackedFormat("nvfp4", (torch.uint8,), {"_scale": torch.float8_e4m3fn},
                  {"_amax": torch.float32, "_outer_scale_denominator": torch.float32}, 2),
    StackedFormat("mxfp8", (torch.float8_e4m3fn,), {"_scale": torch.uint8}, {}, 1),
    StackedFormat("bf16", _FLOATS, {}, {}, 1),
)
_SIDE_SUFFIXES = {s for f in STACKED_FORMATS for s in (*f.per_expert, *f.kept)}


def detect(prefix: str, headers: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> StackedFormat:
    """The format of stacked tensor ``prefix`` from the tensors present (as transformers does)."""
    if prefix not in headers:
        raise CheckpointError(f"base checkpoint has no {prefix}")
    dtype = headers[prefix][1]
    present = {s for s in _SIDE_SUFFIXES if prefix + s in headers}
    for f in STACKED_FORMATS:
        if dtype in f.weight_dtype and present == set(f.per_expert) | set(f.kept):
            for s, dt in {**f.per_expert, **f.kept}.items():
                if headers[prefix + s][1] != dt:
                    raise CheckpointError(f"{prefix + s}: dtype {headers[prefix + s][1]}, {f.name} needs {dt}")
            return f
    raise CheckpointError(f"{prefix}: {dtype} with side tensors {sorted(present)} is no known expert format "
                          f"({', '.join(f.name for f in STACKED_FORMATS)})")


def logical_shape(fmt: StackedFormat, stored: tuple[int, ...]) -> tuple[int, ...]:
    return (*stored[:-1], stored[-1] * fmt.pack)


def global_factor(kept: Mapping[str, torch.Tensor], e: int) -> torch.Tensor:
    """NVFP4 per-expert global factor, f32(amax[e]) / f32(denominator) (one IEEE division)."""
    amax = kept["_amax"].reshape(-1)[e].to(torch.float32)
    den = kept["_outer_scale_denominator"]
    den = den.reshape(()) if den.numel() == 1 else den.reshape(-1)[e]
    return amax / den.to(torch.float32)


def decode_expert(fmt: StackedFormat, parts: Mapping[str, torch.Tensor], kept: Mapping[str, torch.Tensor],
                  e: int) -> torch.Tensor:
    """One expert's float32 ``[rows, cols]`` from its stored parts (suffix -> tensor, "" = weight)."""
    w = parts[""]
    if fmt.name == "bf16":
        return w.to(torch.float32)
    if fmt.name == "mxfp8":
        return get_format("mxfp8").decode({"weight": w, "weight_scale": parts["_scale"]}, dtype=torch.float32)
    # (e2m1 x block scale) first, exact in float32, then x global factor: the loader's order
    one = torch.ones((), dtype=torch.float32)
    v = get_format("nvfp4").decode({"weight": w, "weight_scale": parts["_scale"], "weight_scale_2": one},
                                   dtype=torch.float32)
    return v.mul_(global_factor(kept, e))


def encode_expert(fmt: StackedFormat, x: torch.Tensor, kept: Mapping[str, torch.Tensor], e: int,
                  weight_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Stored parts (suffix -> tensor) of one expert's float32 ``[rows, cols]``, with the kept global scales."""
    if fmt.name == "bf16":
        return {"": x.to(weight_dtype)}
    if fmt.name == "mxfp8":
        p = get_format("mxfp8").encode(x, name="expert")
        return {"": p["weight"], "_scale": p["weight_scale"]}
    p = get_format("nvfp4").encode(x, name="expert", weight_scale_2=global_factor(kept, e))
    return {"": p["weight"], "_scale": p["weight_scale"]}
