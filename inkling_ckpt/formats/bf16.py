"""bf16: the unquantized storage format (one ``weight`` tensor, no scales).

It never casts: ``encode`` takes a bfloat16 tensor and returns it (contiguous). A caller
holding fp32/fp16 writes ``fmt.encode(x.to(torch.bfloat16))`` so the cast is visible at the
call site. Non-finite values are an error unless ``allow_nonfinite`` (then kept as they are).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..errors import FormatError
from ._base import Format, Parts, PartSpec, check_out_dtype, raise_nonfinite, reject_nvfp4_options, row_chunks


class BF16Format(Format):
    """Plain bfloat16 weights: parts ``{"weight": [...]}``; block 1, no ModelOpt quant_algo."""

    name = "bf16"
    block = 1
    quant_algo = None

    def parts(self, shape: Sequence[int]) -> PartSpec:
        return {"weight": (tuple(int(s) for s in shape), torch.bfloat16)}

    def encode(
        self,
        x: torch.Tensor,
        *,
        name: str = "tensor",
        weight_scale_2: torch.Tensor | float | None = None,
        global_amax: torch.Tensor | float | None = None,
        input_scale: torch.Tensor | float | None = None,
        allow_nonfinite: bool = False,
    ) -> Parts:
        """Return ``{"weight": x}`` for a bfloat16 ``x``; FormatError for any other dtype (no silent casts)."""
        reject_nvfp4_options("bf16", name, "bf16 has no scales", weight_scale_2=weight_scale_2, global_amax=global_amax,
                             input_scale=input_scale)
        if not isinstance(x, torch.Tensor):
            raise FormatError(f"bf16: {name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype != torch.bfloat16:
            raise FormatError(
                f"bf16: {name}: tensor is {x.dtype}, not torch.bfloat16; cast explicitly at the call "
                f"site (fmt.encode(x.to(torch.bfloat16))) - the codec does not cast silently"
            )
        x = x.detach().contiguous()
        if not allow_nonfinite and x.numel():
            flat = x.view(-1)
            for r0, r1 in row_chunks(flat.numel(), 1, chunk_elems=1 << 24):
                # min and max propagate NaN and reach ±inf: one reduction, ~50x cheaper than isfinite().all()
                if not all(bool(torch.isfinite(v)) for v in torch.aminmax(flat[r0:r1])):
                    raise_nonfinite(x, name)
        return {"weight": x}

    def decode(self, parts: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The ``weight`` part cast to ``dtype``."""
        check_out_dtype(dtype)
        w = parts.get("weight")
        if not isinstance(w, torch.Tensor):
            raise FormatError(f"bf16: missing part 'weight' (got {sorted(parts)})")
        if w.dtype != torch.bfloat16:
            raise FormatError(f"bf16: part 'weight' has dtype {w.dtype}, expected torch.bfloat16")
        return w.to(dtype)
