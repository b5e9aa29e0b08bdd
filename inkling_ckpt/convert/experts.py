"""Re-encoding a layer's stacked routed experts (or a slice of them) into its format, with a scale policy.

Shared by every path that produces served experts: ``quantize``/``convert hf-to-hf``,
``convert megatron-to-hf`` and the weight-sync library. A stacked ``w13`` carries gate and up
interleaved, so one NVFP4 global factor per expert covers both by construction. ``keep``
takes each NVFP4 expert's ``amax`` from a reference checkpoint and keeps the reference's bytes
of every block whose values are unchanged, so an untouched weight comes back byte-identical.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Literal, Mapping, Protocol, Sequence, cast

import torch

from ..errors import PlanError
from ..formats import get_format
from ..formats.stacked import AMAX, DENOM, SCALE, UNQUANTIZED, WEIGHT, decode_stacked, encode_stacked, natural_dtype
from ..layouts.pread import off_host
from ..model.inventory import ExpertStack
from ..model.precision import PrecisionPlan

ScalePolicy = Literal["fresh", "keep"]
SCALE_POLICIES = ("fresh", "keep")


class ScaleSource(Protocol):
    """A checkpoint that hands out expert slices of its stored tensors (an HFCheckpoint)."""

    plan: PrecisionPlan

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor: ...
    def get(self, name: str) -> torch.Tensor: ...


def read_parts(src: ScaleSource, stack: ExpertStack, first: int, last: int, *,
               rows: tuple[int, int] | None = None,
               device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """The stored parts of experts ``first:last`` of one stacked weight (scalars read whole), on
    ``device`` (default the CPU). A source with ``reads_to_device`` reads them straight onto a GPU
    (through small pinned buffers: no host copy of the slice); any other is read, then copied.

    ``rows`` ``(lo, hi)``: only those rows of the one expert ``first`` (an :func:`expert_pieces`
    piece), from a source that :func:`reads_pieces`: weight and block scales by rows, a per-expert
    part by expert."""
    dev = off_host(device)
    direct = dev is not None and getattr(src, "reads_to_device", False)
    onto: Any = src  # a source with reads_to_device takes device= (ScaleSource does not promise it)
    kw = {"device": dev} if direct else {}
    lo, hi = rows if rows is not None else (0, stack.shape[1])
    inner = (lo, hi) != (0, stack.shape[1])
    out: dict[str, torch.Tensor] = {}
    for spec in stack.parts():
        if spec.shape == ():
            t = onto.get(spec.name, **kw)
        elif inner and len(spec.shape) >= 2 and spec.shape[1] == stack.shape[1]:
            t = onto.read_expert_rows(spec.name, first, lo, hi, **kw)
        else:
            t = onto.read_rows(spec.name, first, last, **kw)
        out[cast(str, spec.part)] = t if dev is None or direct else t.to(dev)  # a stacked part always has its suffix
    return out


def parts_extents(src: Any, stack: ExpertStack, first: int, last: int) -> list[tuple[Any, int, int]]:
    """The byte ranges :func:`read_parts` of the same experts reads from ``src`` (a scalar part whole),
    for the executor's read-ahead; none from a source that cannot say (no ``extents``)."""
    ext = getattr(src, "extents", None)
    if ext is None:
        return []
    out: list[tuple[Any, int, int]] = []
    for spec in stack.parts():
        out += ext(spec.name, 0, 1) if spec.shape == () else ext(spec.name, first, last)
    return out


def reads_pieces(src: Any) -> bool:
    """Whether ``src`` reads rows inside one expert (``read_parts(..., rows=)`` then reads only a piece's bytes)."""
    return callable(getattr(src, "read_expert_rows", None))


def expert_pieces(experts: Sequence[int], rows: int, cols: int, elems: int,
                  row_multiple: int = 1) -> list[tuple[list[int], int, int]]:
    """``(experts, first row, last row)``: the pieces of about ``elems`` elements in which
    ``experts`` (indices into a slice) of a stacked [E, rows, cols] weight are worked on - whole
    experts together while they fit, else one expert a block of rows at a time (a multiple of
    ``row_multiple`` rows, at least one multiple: w13's gate/up pairs stay in one piece with 2).
    A fixed cut: float sums over the pieces do not depend on the device, workers or ranks."""
    experts = list(experts)
    if rows * cols <= elems:
        step = elems // (rows * cols)
        return [(experts[i:i + step], 0, rows) for i in range(0, len(experts), step)]
    block = max(row_multiple, elems // cols // row_multiple * row_multiple)
    return [([e], r, min(rows, r + block)) for e in experts for r in range(0, rows, block)]


def largest_piece(n: int, rows: int, cols: int, elems: int, row_multiple: int = 1) -> int:
    """Elements of the largest :func:`expert_pieces` piece of ``n`` experts (what a unit working a
    piece at a time holds at once, beside the slice)."""
    return max(len(js) * (hi - lo) * cols for js, lo, hi in expert_pieces(range(max(1, n)), rows, cols, elems, row_multiple))


class PieceBuffer:
    """One buffer that a unit's pieces are decoded (or formed) into one after another, grown to the
    largest: fresh host memory of a piece's size is mapped apart (``pipeline.memory``) and the page
    faults of touching it cost about as much as decoding it. Lives as long as the unit's work; what
    :meth:`take` returned is overwritten by the next take."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        self.dtype = dtype
        self._t: torch.Tensor | None = None

    def take(self, *shape: int) -> torch.Tensor:
        """A contiguous tensor of ``shape`` over the buffer (its values are left over)."""
        n = math.prod(shape)
        if self._t is None or self._t.numel() < n:
            self._t = None  # the old one goes first
            self._t = torch.empty(n, dtype=self.dtype)
        return self._t[:n].view(shape)


def expert_index(experts: Sequence[int]) -> slice | torch.Tensor:
    """Experts ``experts`` (indices into a slice) as an index: a slice when they are consecutive (a view)."""
    experts = list(experts)
    if experts == list(range(experts[0], experts[-1] + 1)):
        return slice(experts[0], experts[-1] + 1)
    return torch.tensor(experts)


def cut_piece(parts: Mapping[str, torch.Tensor], experts: Sequence[int], lo: int, hi: int) -> dict[str, torch.Tensor]:
    """Rows ``lo:hi`` of experts ``experts`` (indices into the slice) of a slice's stored parts - an
    :func:`expert_pieces` piece, views where the experts are consecutive: weight and block scales by
    experts and rows, a per-expert part (NVFP4 amax) by experts, a scalar (or a one-element
    denominator) whole."""
    idx = expert_index(experts)
    out = {}
    for s, t in parts.items():
        if t.dim() == 0 or (s == DENOM and t.numel() == 1):
            out[s] = t
        elif t.dim() == 1:
            out[s] = t[idx]
        else:
            out[s] = t[idx, lo:hi]
    return out


def decode_slice(src: ScaleSource, stack: ExpertStack, first: int, last: int, *,
                 allow_nonfinite: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """Experts ``first:last`` of a stored stacked weight [n, rows, cols], decoded to ``dtype`` on ``device``.

    Default dtype: the format's natural dtype (BF16 for quantized formats, the stored dtype for
    unquantized ones), so nothing is narrowed unless the caller asks for it. Default device: where
    the parts are read (the CPU); the result stays there.
    """
    parts = read_parts(src, stack, first, last, device=device)
    out = decode_stacked(stack.fmt, parts, dtype or natural_dtype(stack.fmt), name=stack.name,
                         allow_nonfinite=allow_nonfinite)
    if dtype is not None and _narrows(dtype, natural_dtype(stack.fmt)):  # e.g. --dtype f16
        check_cast_range(out, lambda: decode_stacked(stack.fmt, parts, torch.float32, name=stack.name,
                                                     allow_nonfinite=True), stack.name, first)
    return out


class ExpertEncoder:
    """Encodes stacked routed experts for a precision plan.

    ``scales="keep"`` needs ``reference`` (its layer must be in the target format for NVFP4):
    each NVFP4 expert reuses the reference's ``amax``, and every block whose new values equal the
    reference's decoded values bit for bit keeps the reference's bytes. Decoding loses what
    values alone cannot recover — MXFP8 blocks whose largest element rounded down re-encode one
    scale lower (same values, other bytes), NVFP4 elements that rounded to -0 decode to -0.0 —
    so without this rule an unchanged weight would not come back byte-identical.
    """

    def __init__(self, plan: PrecisionPlan, *, scales: ScalePolicy = "fresh", reference: ScaleSource | None = None,
                 allow_nonfinite: bool = False, mxfp8_options: Mapping[str, str] | None = None):
        if scales not in SCALE_POLICIES:
            raise PlanError(f"unknown scale policy {scales!r}; choose one of {', '.join(SCALE_POLICIES)}")
        if scales == "keep":
            if reference is None:
                raise PlanError("--scales keep needs a reference checkpoint to take the scales from")
            for i in range(len(plan)):
                if plan.format_of(i) == "nvfp4" and reference.plan.format_of(i) != "nvfp4":
                    raise PlanError(f"--scales keep: layer {i} is nvfp4 in the plan but {reference.plan.format_of(i)} "
                                    "in the reference, which has no NVFP4 scales to keep")
        self.plan = plan
        self.scales = scales
        self.reference = reference
        self.allow_nonfinite = allow_nonfinite
        self._mx = get_format("mxfp8", **dict(mxfp8_options or {}))

    def _kept_from(self, stack: ExpertStack) -> ScaleSource | None:
        """The reference whose scales and bytes ``stack`` keeps (``scales="keep"``, same format), else None."""
        if self.scales == "keep" and self.reference is not None \
                and self.reference.plan.format_of(stack.layer) == stack.fmt:
            return self.reference
        return None

    def reads(self, stack: ExpertStack, first: int, last: int) -> list[tuple[Any, int, int]]:
        """What :meth:`encode` of those experts reads of the reference (for the executor's read-ahead)."""
        ref = self._kept_from(stack)
        if ref is None or stack.fmt in UNQUANTIZED:
            return []
        return parts_extents(ref, stack, first, last)

    def encode(self, stack: ExpertStack, first: int, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Experts ``first:first+n`` of ``stack`` ([n, rows, cols]; BF16, or a source's F32/F16) → its stored
        parts (suffix → tensor). Quantized formats encode the values as given (float32 input: ModelOpt's bytes
        on those values); unquantized ones are written in their dtype.

        Runs where ``x`` is (the parts come back on that device). NVFP4's scalar ``_outer_scale_denominator`` is included (the same for every slice).
        """
        fmt = stack.fmt
        last = first + x.shape[0]
        ref = self._kept_from(stack)
        if fmt in UNQUANTIZED:
            # The plan was resolved against the source (model.precision.dense_as): a cast that
            # rounds was asked for with --dtype; any other is exact (BF16 -> F32).
            y = x.to(UNQUANTIZED[fmt])
            if _narrows(y.dtype, x.dtype):
                check_cast_range(y, lambda: x, stack.name, first)
            return encode_stacked(fmt, y, name=stack.name, allow_nonfinite=self.allow_nonfinite)
        ref_parts = read_parts(ref, stack, first, last, device=x.device) if ref is not None else None
        amax = ref_parts[AMAX] if ref_parts is not None and fmt == "nvfp4" else None
        codec = self._mx if fmt == "mxfp8" else fmt
        parts = encode_stacked(codec, x, name=stack.name, amax=amax, allow_nonfinite=self.allow_nonfinite)
        if ref_parts is not None:
            parts = reuse_unchanged_blocks(fmt, x, parts, ref_parts)
        return parts


def overflow_at(y: torch.Tensor, wide: Callable[[], torch.Tensor]) -> tuple[tuple[int, ...], float] | None:
    """Where ``y`` is not finite and the same values computed wider (``wide()``, only called when
    ``y`` holds a non-finite value) are finite (an overflow, or inf - inf after one): the first such
    index and its wide value; else None (also where ``y``'s non-finite values were already so)."""
    if bool(torch.isfinite(y).all()):
        return None
    x = wide()
    over = ~torch.isfinite(y) & torch.isfinite(x)
    if not bool(over.any()):
        return None
    return tuple(int(i) for i in torch.nonzero(over)[0]), float(x[over][0])


def check_cast_range(y: torch.Tensor, wide: Callable[[], torch.Tensor], name: str, first: int = 0) -> None:
    """PlanError where ``y`` (values cast to a narrower dtype, as --dtype asked) overflowed
    (:func:`overflow_at`): --dtype permits rounding, not overflow. ``first``: ``y``'s first expert."""
    hit = overflow_at(y, wide)
    if hit is not None:
        at, value = hit
        dt = str(y.dtype).removeprefix("torch.")
        raise PlanError(f"{name}: value {value:g} at {(at[0] + first, *at[1:])} is beyond {dt}'s range "
                        f"(max {torch.finfo(y.dtype).max:g}): --dtype rounds, it does not overflow; choose a wider --dtype")


def _narrows(dtype: torch.dtype, wider: torch.dtype) -> bool:
    """Whether casting ``wider`` values to ``dtype`` can overflow (a smaller largest finite value)."""
    return torch.finfo(dtype).max < torch.finfo(wider).max


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers of the same width (so -0.0 != +0.0 and NaN == NaN)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.dtype.itemsize])


#: Bytes of ``x`` compared at a time on the CPU: the decoded reference and the comparison are
#: that size instead of the slice's (a worker of megatron-to-hf held ~190 MB, a third of it these).
CHECK_BYTES = 8 << 20


def _as_blocks(nblocks: int, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each of ``ts`` [..., nblocks * k] as [..., nblocks, words]: a block's bytes as the widest
    integers (at most 8 bytes) that divide them in every tensor, so comparing or picking whole
    blocks touches 2-8x fewer elements than element by element (the same bits either way)."""
    for width, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if all((t.shape[-1] * t.element_size()) % (nblocks * width) == 0 for t in ts):
            try:
                return tuple(t.view(dtype).reshape(*t.shape[:-1], nblocks, -1) for t in ts)
            except RuntimeError:  # strides or offset not a multiple of the width
                continue
    return tuple(t.view(torch.uint8).reshape(*t.shape[:-1], nblocks, -1) for t in ts)


def reuse_unchanged_blocks(fmt: str, x: torch.Tensor, new: dict[str, torch.Tensor],
                           ref: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``new`` with every block whose values equal the reference's decoded block taken from ``ref``.

    Blocks run along the last dimension, one ``_scale`` column each; a block's element bytes
    are the same share of a weight row. Per-expert factors are taken as they are in ``new`` (the
    caller passes the reference's when keeping them). On the CPU the reference is decoded and
    compared a band of rows at a time (:data:`CHECK_BYTES`); on a device in one go (its memory
    is bounded by the slice, and each decode call synchronizes once).
    """
    n, rows, nblocks = ref[SCALE].shape
    row_bytes = max(1, n * x[0, 0].nbytes) if x.numel() else 1
    step = rows if x.device.type != "cpu" else max(1, CHECK_BYTES // row_bytes)
    bands = []
    for r0 in range(0, max(rows, 1), step):
        r1 = min(rows, r0 + step)
        # Weight and block scales by rows (the per-expert factors apply to every row).
        part = {k: (v[:, r0:r1].contiguous() if k in (WEIGHT, SCALE) else v) for k, v in ref.items()}
        decoded, values = _as_blocks(nblocks, decode_stacked(fmt, part, x.dtype, allow_nonfinite=True), x[:, r0:r1])
        bands.append((decoded == values).all(-1))
        del decoded, values
    same = bands[0] if len(bands) == 1 else torch.cat(bands, dim=1)
    if not bool(same.any()):
        return new
    out = dict(new)
    w_new, w_ref = new[WEIGHT], ref[WEIGHT]
    if bool(same.all()):  # every block unchanged (a round trip): a copy of the reference's bytes
        out[WEIGHT] = _bits(w_ref).view(w_new.dtype).reshape(w_new.shape).clone()
        out[SCALE] = _bits(ref[SCALE]).view(new[SCALE].dtype).clone()
        return out
    b_ref, b_new = _as_blocks(nblocks, w_ref, w_new)
    out[WEIGHT] = torch.where(same[..., None], b_ref, b_new).reshape(*w_new.shape[:-1], -1).view(w_new.dtype)
    out[SCALE] = torch.where(same, _bits(ref[SCALE]), _bits(new[SCALE])).view(new[SCALE].dtype)
    return out


__all__ = ["ExpertEncoder", "ScalePolicy", "ScaleSource", "SCALE_POLICIES", "cut_piece", "decode_slice", "expert_index",
           "expert_pieces", "largest_piece", "read_parts",
           "reads_pieces",
           "reuse_unchanged_blocks"]
