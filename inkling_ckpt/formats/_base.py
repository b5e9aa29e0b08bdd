"""Shared plumbing of the codecs: the Format interface, input checks, row chunking."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from ..errors import FormatError, NonFiniteError

Parts = dict[str, torch.Tensor]
PartSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]

#: Inputs the quantizing codecs accept (no silent casts from anything else).
FLOAT_INPUTS = (torch.bfloat16, torch.float16, torch.float32)

#: Elements per row chunk: memory stays bounded whatever the tensor size, and a chunk's float32
#: temporaries (4 MiB each) are reused from the heap (``pipeline/memory.py``). Larger than the
#: cache on purpose: on the 16-core H200 node one process's workers ran NVFP4 encode at 343 Melem/s
#: with 2^18-element chunks (4 workers x 4 torch threads; ~20 torch calls per chunk, each taking
#: the GIL and splitting work over threads) and at 893 with 2^20 (decode 1333 -> 1798, MXFP8
#: encode 458 -> 1786); the 2-core box measured the same within noise.
CHUNK_ELEMS = 1 << 20


class Format:
    """A tensor storage format: how one logical ``[..., in]`` weight is laid out on disk.

    Subclasses set ``name``, ``block`` and ``quant_algo`` and implement ``parts``,
    ``encode`` and ``decode``; ``encode_group`` defaults to encoding each member alone.
    """

    name: str
    block: int
    quant_algo: str | None

    # -- interface ------------------------------------------------------------------------
    def parts(self, shape: Sequence[int]) -> PartSpec:
        """On-disk tensors (HF suffix -> (shape, dtype)) for a logical weight of ``shape``, in on-disk order."""
        raise NotImplementedError

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
        """Encode ``x`` (``[..., in]``, bf16/fp16/fp32) into this format's parts, on x's device."""
        raise NotImplementedError

    def encode_group(
        self,
        xs: Sequence[torch.Tensor],
        *,
        names: Sequence[str] | None = None,
        **kw: Any,
    ) -> list[Parts]:
        """Encode a fused group (e.g. an expert's gate_proj and up_proj). Default: each on its own."""
        names = _group_names(xs, names)
        return [self.encode(x, name=n, **kw) for x, n in zip(xs, names, strict=True)]

    def decode(self, parts: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Decode parts back to a ``dtype`` tensor (computed in float32, then cast)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<Format {self.name}>"


# -- helpers shared by the codecs ---------------------------------------------------------


def _group_names(xs: Sequence[torch.Tensor], names: Sequence[str] | None) -> list[str]:
    if names is None:
        return [f"tensor[{i}]" for i in range(len(xs))]
    names = list(names)
    if len(names) != len(xs):
        raise FormatError(f"encode_group: {len(xs)} tensors but {len(names)} names")
    return names


def check_width(fmt_name: str, shape: Sequence[int], block: int) -> tuple[int, int]:
    """(rows, width) of a ``[..., width]`` shape; FormatError unless width is a multiple of block."""
    shape = tuple(int(s) for s in shape)
    if len(shape) < 1:
        raise FormatError(f"{fmt_name}: a 0-d tensor cannot be block-quantized (shape ())")
    width = shape[-1]
    if width % block != 0 or width == 0:
        raise FormatError(
            f"{fmt_name}: input width {width} (shape {list(shape)}) is not a positive multiple "
            f"of the block size {block}"
        )
    rows = 1
    for s in shape[:-1]:
        rows *= s
    return rows, width


def check_input(fmt_name: str, x: torch.Tensor, name: str, block: int) -> tuple[int, int]:
    if not isinstance(x, torch.Tensor):
        raise FormatError(f"{fmt_name}: {name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_INPUTS:
        raise FormatError(
            f"{fmt_name}: {name}: cannot quantize dtype {x.dtype}; expected one of "
            f"{', '.join(str(d) for d in FLOAT_INPUTS)}"
        )
    try:
        return check_width(fmt_name, x.shape, block)
    except FormatError as e:
        raise FormatError(f"{e} [{name}]") from None


def raise_nonfinite(x: torch.Tensor, name: str) -> None:
    """Raise NonFiniteError naming ``name``, the first bad index and the count (x is known to hold some)."""
    bad = ~torch.isfinite(x)
    count = int(bad.sum())
    flat = int(torch.argmax(bad.reshape(-1).to(torch.uint8)))
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), x.shape))
    value = float(x.reshape(-1)[flat])
    raise nonfinite_error(name, value, index, count, x.numel())


def nonfinite_error(name: str, value: float, index: tuple[int, ...], count: int, numel: int) -> NonFiniteError:
    """The error :func:`raise_nonfinite` raises, for callers that find the first bad element piecewise."""
    return NonFiniteError(
        f"{name}: non-finite value {value} at index {index} ({count} non-finite of {numel})",
        "pass allow_nonfinite to encode them as NaN blocks",
    )


def row_chunks(rows: int, width: int, chunk_elems: int | None = None) -> Iterator[tuple[int, int]]:
    """(start, stop) row ranges of at most ~chunk_elems (default CHUNK_ELEMS) elements, at least one row each."""
    step = max(1, (CHUNK_ELEMS if chunk_elems is None else chunk_elems) // max(1, width))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def scalar_f32(v: torch.Tensor | float, device: torch.device, what: str) -> torch.Tensor:
    """A 0-d float32 tensor from a Python number or a 0-d / one-element tensor (value kept verbatim)."""
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise FormatError(f"{what}: expected a scalar, got shape {list(v.shape)}")
        if not v.is_floating_point():
            raise FormatError(f"{what}: expected a float scalar, got {v.dtype}")
        return v.detach().reshape(()).to(device=device, dtype=torch.float32)
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise FormatError(f"{what}: expected a number, got {type(v).__name__}") from None
    return torch.tensor(f, dtype=torch.float32, device=device)


def require_parts(fmt_name: str, parts: Mapping[str, torch.Tensor], spec: Mapping[str, torch.dtype]) -> None:
    missing = [k for k in spec if k not in parts]
    if missing:
        raise FormatError(f"{fmt_name}: missing parts {missing} (got {sorted(parts)})")
    for k, dt in spec.items():
        t = parts[k]
        if not isinstance(t, torch.Tensor):
            raise FormatError(f"{fmt_name}: part {k!r} is not a tensor")
        if t.dtype != dt:
            raise FormatError(f"{fmt_name}: part {k!r} has dtype {t.dtype}, expected {dt}")


# -- integer views of float tensors (fast paths) -------------------------------------------------

_INT_VIEW = {
    torch.bfloat16: (torch.int16, 0x7FFF, 16),
    torch.float16: (torch.int16, 0x7FFF, 16),
    torch.float32: (torch.int32, 0x7FFFFFFF, 32),
}


def block_amax_bits(xb: torch.Tensor, buf: torch.Tensor | None = None) -> torch.Tensor:
    """float32 max |x| over the last dim, via integers: clear the sign bit, take the integer max.

    Non-negative IEEE floats order like their bit patterns, and NaN patterns sort above Inf,
    so a block holding NaN yields NaN, as torch.amax would. About 3x faster than abs().amax()
    for bf16 on CPU (no float conversion, no abs temporary of the float dtype). ``buf``: a reused
    buffer for the magnitudes (x's integer width, at least x's size).
    """
    itype, mask, _ = _INT_VIEW[xb.dtype]
    xi = xb.view(itype)
    mags = xi & mask if buf is None else torch.bitwise_and(xi, mask, out=buf.view(-1)[:xb.numel()].view(xb.shape))
    return mags.amax(dim=-1).view(xb.dtype).float()


def check_out_dtype(dtype: torch.dtype) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise FormatError(f"decode: target dtype must be a float dtype, got {dtype}")


def check_out_buffer(out: object, shape: Sequence[int], dtype: torch.dtype, device: torch.device, what: str) -> None:
    """FormatError unless ``out`` (a buffer to decode into) is a contiguous ``dtype`` tensor of ``shape`` on ``device``."""
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(shape) or out.dtype != dtype \
            or out.device != device or not out.is_contiguous():
        got = (f"{out.dtype} {list(out.shape)} on {out.device}{'' if out.is_contiguous() else ', not contiguous'}"
               if isinstance(out, torch.Tensor) else type(out).__name__)
        raise FormatError(f"{what}: out must be a contiguous {dtype} {list(shape)} on {device}, got {got}")


def reject_nvfp4_options(fmt_name: str, name: str, what: str, **options: object) -> None:
    """FormatError when a format without a global scale is handed NVFP4's scale options."""
    for opt, v in options.items():
        if v is not None:
            raise FormatError(f"{fmt_name}: {name}: {opt} is an NVFP4 option; {what}")
