"""Block-scaled tensor formats (spec/formats.md): bf16, NVFP4 and MXFP8 codecs.

    fmt = get_format("nvfp4")        # or "mxfp8" (scale_mode="rceil"|"floor", element="e4m3"|"e5m2"), "bf16"
    parts = fmt.encode(w, name="model.layers.0.mlp.down_proj.weight")
    w2 = fmt.decode(parts, dtype=torch.bfloat16)

Each ``get_format`` call returns a new codec object; they hold no tensors.
"""

from __future__ import annotations

from typing import Any

from ..errors import FormatError
from ._base import Format
from .bf16 import BF16Format
from .compressed_tensors import from_compressed_tensors, to_compressed_tensors
from .fake import fake_quant
from .mxfp8 import MXFP8Format
from .nvfp4 import NVFP4Format, nvfp4_global_scale

__all__ = [
    "FORMAT_NAMES",
    "Format",
    "get_format",
    "fake_quant",
    "from_compressed_tensors",
    "to_compressed_tensors",
    "nvfp4_global_scale",
]

_FACTORIES = {"bf16": BF16Format, "nvfp4": NVFP4Format, "mxfp8": MXFP8Format}

#: The format keys a precision plan may use.
FORMAT_NAMES: tuple[str, ...] = tuple(_FACTORIES)


def get_format(name: str, **options: Any) -> Format:
    """The codec for format ``name`` ("bf16", "nvfp4", "mxfp8").

    Options: mxfp8 takes ``scale_mode`` ("rceil" default, "floor") and ``element``
    ("e4m3" default, "e5m2"). FormatError for an unknown name or option.
    """
    if isinstance(name, Format):
        if options:
            raise FormatError(f"get_format: options {sorted(options)} given with a Format object")
        return name
    key = str(name).strip().lower()
    factory = _FACTORIES.get(key)
    if factory is None:
        raise FormatError(f"unknown format {name!r}; known formats: {', '.join(FORMAT_NAMES)}")
    try:
        return factory(**options)
    except TypeError:
        raise FormatError(f"format {key!r} does not take options {sorted(options)}") from None
