"""The element and scale encodings behind NVFP4 and MXFP8, as one table.

Every codec in this package takes its constants (bits, bias, max, NaN codes) from
:data:`ENCODINGS`; nothing else hard-codes them. Decoding tables are built from the bit
formula below, in Python floats, so they do not depend on torch's float8 casts.

Minifloat code ``s | e | m`` (sign, ``ebits`` exponent, ``mbits`` mantissa):

* ``e == 0``: subnormal, ``(-1)^s * m / 2^mbits * 2^(1 - bias)``
* otherwise:  normal,    ``(-1)^s * (1 + m / 2^mbits) * 2^(e - bias)``
* special codes (NaN, Inf) per encoding, listed in the table.

E8M0 (the MX scale) is unsigned and has no mantissa: byte ``b`` is ``2^(b - 127)``,
``0xFF`` is NaN; there is no zero and no Inf. Facts: reference/quant-formats.md §1.1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

import torch

from ..errors import FormatError

__all__ = [
    "Encoding",
    "ENCODINGS",
    "E2M1",
    "E4M3",
    "E5M2",
    "E8M0",
    "decode_e2m1",
    "decode_e4m3",
    "decode_e5m2",
    "decode_e8m0",
    "decode_table",
]


@dataclass(frozen=True)
class Encoding:
    """One small float encoding: layout, bias, largest finite value and special codes."""

    name: str
    bits: int
    ebits: int
    mbits: int
    signed: bool
    bias: int
    max: float  # largest finite magnitude
    nan_codes: frozenset[int]
    inf_codes: frozenset[int]  # +Inf and -Inf codes, empty where there is no Inf
    torch_dtype: torch.dtype | None  # the storage dtype, None where stored packed in uint8

    @property
    def num_codes(self) -> int:
        return 1 << self.bits

    def value(self, code: int) -> float:
        """The exact value of ``code`` from the bit formula (Python float, NaN for NaN codes)."""
        if not 0 <= code < self.num_codes:
            raise FormatError(f"{self.name}: code {code} out of range 0..{self.num_codes - 1}")
        if code in self.nan_codes:
            return math.nan
        sign = 1.0
        body = code
        if self.signed:
            if code >> (self.bits - 1):
                sign = -1.0
            body = code & ((1 << (self.bits - 1)) - 1)
        if code in self.inf_codes:
            return sign * math.inf
        e = body >> self.mbits
        m = body & ((1 << self.mbits) - 1)
        if self.mbits == 0:  # E8M0: pure power of two, no subnormals
            return sign * math.ldexp(1.0, e - self.bias)
        if e == 0:
            return sign * math.ldexp(m / (1 << self.mbits), 1 - self.bias)
        return sign * math.ldexp(1.0 + m / (1 << self.mbits), e - self.bias)


def _minifloat(name, ebits, mbits, bias, nan, inf, dtype) -> Encoding:
    enc = Encoding(
        name=name,
        bits=1 + ebits + mbits,
        ebits=ebits,
        mbits=mbits,
        signed=True,
        bias=bias,
        max=0.0,
        nan_codes=frozenset(nan),
        inf_codes=frozenset(inf),
        torch_dtype=dtype,
    )
    finite = [abs(enc.value(c)) for c in range(enc.num_codes) if c not in enc.nan_codes | enc.inf_codes]
    return Encoding(**{**enc.__dict__, "max": max(finite)})


#: FP4 E2M1 (NVFP4/MXFP4 element): {0, 0.5, 1, 1.5, 2, 3, 4, 6}, sign in bit 3, no specials.
E2M1 = _minifloat("e2m1", 2, 1, 1, (), (), None)
#: FP8 E4M3 "fn" (no Inf): max 448, NaN 0x7F / 0xFF.
E4M3 = _minifloat("e4m3", 4, 3, 7, (0x7F, 0xFF), (), torch.float8_e4m3fn)
#: FP8 E5M2 (IEEE-like): max 57344, Inf 0x7C / 0xFC, NaN 0x7D-0x7F / 0xFD-0xFF.
E5M2 = _minifloat(
    "e5m2", 5, 2, 15, (0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF), (0x7C, 0xFC), torch.float8_e5m2
)
#: E8M0 scale (MX): unsigned power of two 2^(b-127), b in 0..254; 0xFF is NaN. Stored as uint8.
E8M0 = Encoding(
    name="e8m0",
    bits=8,
    ebits=8,
    mbits=0,
    signed=False,
    bias=127,
    max=math.ldexp(1.0, 127),
    nan_codes=frozenset({0xFF}),
    inf_codes=frozenset(),
    torch_dtype=torch.uint8,
)

ENCODINGS: MappingProxyType[str, Encoding] = MappingProxyType(
    {e.name: e for e in (E2M1, E4M3, E5M2, E8M0)}
)

_TABLES: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}


def decode_table(enc: Encoding, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Tensor of ``enc.num_codes`` values, entry ``c`` = value of code ``c`` (cached per device and dtype).

    Every value of these encodings is exactly representable in float32 (2^-127 as a subnormal).
    Another ``dtype`` (BF16: E4M3, E5M2 and E8M0 fit it) must hold every value exactly too, NaN
    entries aside, else FormatError.
    """
    device = torch.device(device)
    key = (enc.name, device, dtype)
    table = _TABLES.get(key)
    if table is None:
        exact = torch.tensor([enc.value(c) for c in range(enc.num_codes)], dtype=torch.float32)
        table = exact.to(dtype)
        ok = ~exact.isnan()
        if not torch.equal(table[ok].float(), exact[ok]):
            raise FormatError(f"{enc.name}: not every value is exact in {dtype}")
        table = table.to(device)
        _TABLES[key] = table
    return table


def _as_codes(codes: torch.Tensor, what: str) -> torch.Tensor:
    if codes.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) or codes.dtype == getattr(
        torch, "float8_e8m0fnu", None
    ):
        return codes.view(torch.uint8)
    if codes.dtype not in (torch.uint8, torch.int16, torch.int32, torch.int64):
        raise FormatError(f"{what}: expected integer codes, got {codes.dtype}")
    return codes


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Exact float32 values of E2M1 codes (one code per element, the low 4 bits are used)."""
    c = _as_codes(codes, "decode_e2m1")
    return decode_table(E2M1, c.device)[(c & 0xF).long()]


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """Exact float32 values of E4M3 bytes (uint8 or float8_e4m3fn); 0x7F/0xFF give NaN."""
    c = _as_codes(codes, "decode_e4m3")
    return decode_table(E4M3, c.device)[(c & 0xFF).long()]


def decode_e5m2(codes: torch.Tensor) -> torch.Tensor:
    """Exact float32 values of E5M2 bytes (uint8 or float8_e5m2)."""
    c = _as_codes(codes, "decode_e5m2")
    return decode_table(E5M2, c.device)[(c & 0xFF).long()]


def decode_e8m0(codes: torch.Tensor) -> torch.Tensor:
    """Exact float32 scale ``2^(b-127)`` of E8M0 bytes (uint8 or float8_e8m0fnu); 0xFF gives NaN."""
    c = _as_codes(codes, "decode_e8m0")
    return decode_table(E8M0, c.device)[(c & 0xFF).long()]
