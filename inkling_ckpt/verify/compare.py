"""Compare two checkpoints of one model tensor by tensor, after decoding.

``A`` is the reference, ``B`` the candidate; either may be an HF checkpoint (BF16, mixed,
MXFP8, NVFP4), a sharded folder (``inkling-ckpt shard``) or a Megatron torch_dist folder (read
back as release tensors through the key mapping, experts BF16: ``layouts.detect``). Routed
experts are compared per stacked tensor (a layer's ``…mlp.experts.w13_weight`` / ``w2_weight``),
each side decoded from its stored format to float32 a few experts (or one expert's block of rows)
at a time; every other tensor
is compared as stored (BF16/F32, widened to float32). A torch_dist folder holds no vision tower:
vision tensors only one side holds are listed under ``not_compared``, never silently dropped;
any other tensor missing on one side is an error.

Per compared tensor, with ``a``, ``b`` the float32 values and ``e = b − a``:

* ``exact``: elements whose float32 bits are equal (so -0.0 ≠ +0.0 and NaN = NaN at the same place);
* ``max_abs``: max ``|e|``;  ``rel_rmse``: ``sqrt(Σe² / Σa²)``;
* ``sqnr_db``: ``10·log10(Σa² / Σe²)`` (``null`` in JSON when ``e`` is all zero: exact).

Non-finite elements that differ count as inexact and are left out of the sums. Each square is
taken in float64 (exact for float32 values) and the squares are added in a fixed pairwise order
over fixed pieces, so every figure is the same to the bit whatever ``--device``, ``--workers``
or the number of torchrun ranks.

It runs on the shared executor (:mod:`inkling_ckpt.pipeline`): units planned from both sides'
headers (non-expert tensors batched or cut by rows, experts a slice at a time; ``--slice-mb`` is
what one unit reads of both sides together; between two HF folders a slice is read a decode piece
at a time), each read, decoded and compared on the executor's
device, ``--workers`` at once, the results pooled in plan order. Under torchrun the ranks split
the units and gather the results; every rank ends with the same report, rank 0 prints it.

Each tensor also gets a ``verdict``: ``exact`` (bit-identical values), ``rounding`` (B is not A's
value but exactly what narrowing A's value gives — the expected rounding, named in ``rounding``),
or ``mismatch``. The expected rounding is one of :data:`ROUNDINGS`: a BF16 side holding the BF16
decode of the other side's NVFP4 experts (what ``hf-to-megatron`` and transformers'
dequantizer write: each value e2m1 × E4M3 block scale × the expert's float32 factor
amax/2688 is computed in float32 and rounded to BF16's 8 significant bits; MXFP8 values fit
BF16 and never round), or a tensor stored narrower on one side (F32 → BF16/F16, the value
rounded to nearest: ``--dtype bf16`` conversions of a float32 checkpoint). The check is bit for bit: B must equal A narrowed, element for element.

Report (``--json``), schema ``inkling-ckpt/verify/1``::

    {"schema": "inkling-ckpt/verify/1",
     "a": {"source", "layout", "variant", "precision_plan"}, "b": {...},
     "summary": {"tensors", "bit_exact_tensors", "rounding_tensors", "mismatch_tensors", "elements",
                 "exact_elements", "exact_fraction", "min_sqnr_db", "max_abs"},
     "formats": {FORMAT: STATS},            # FORMAT: "nvfp4", "mxfp8", "bf16", "dense", or "x->y"
     "layers":  [{"layer", "format", **STATS}],       # routed experts per decoder layer
     "tensors": [{"name", "format", "layer", "verdict", "rounding", **STATS}],  # worst first
     "thresholds": {"min_sqnr_db", "exact", "passed", "failures", "first_failures"},
     "rounding": {REASON: {"tensors", "why"}},   # the expected roundings seen (--exact lets them pass)
     "not_compared": {"only_a": [NAME, ...], "only_b": [NAME, ...]},   # vision tensors one side lacks
     "seconds", "bytes_read",                # the run: wall time, bytes read of both sides by all ranks
     "ranks": {"count", "each": [{"rank", "device", "workers", "units", "bytes_read", "seconds", ...}]}}
    STATS = {"tensors", "bit_exact_tensors", "rounding_tensors", "elements", "exact_elements", "max_abs",
             "rel_rmse", "sqnr_db"}                   # per tensor: "tensors" == 1

``FORMAT`` is the expert format being measured: the quantized side's format when the other
side is BF16, the shared format when both agree, ``"x->y"`` when both are quantized
differently; ``"dense"`` is everything that is not a routed expert. Layer and format figures
pool the sums of their tensors (so their SQNR is energy-weighted, not a mean of dBs).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import astuple, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..errors import CheckpointError, ConfigError
from ..convert.experts import PieceBuffer, cut_piece, expert_pieces, largest_piece, parts_extents, read_parts, reads_pieces
from ..convert.requantize import dense_reads, read_dense
from ..formats.stacked import UNQUANTIZED, decode_stacked
from ..layouts.detect import HF, TORCH_DIST, detect_layout
from ..layouts.detect import open_checkpoint as _open
from ..model.inventory import ExpertStack, expert_stacks, is_vision
from ..units import fmt_bytes, ranks_phrase
from ..pipeline import Executor, Options, Unit, all_ok, assign, expert_slice, gather, read_on_device, release_units
from ..pipeline.executor import MAX_DEFAULT_WORKERS

SCHEMA = "inkling-ckpt/verify/1"
DENSE = "dense"
EXACT, ROUNDING, MISMATCH = "exact", "rounding", "mismatch"

#: The expected roundings: B differs from A only by narrowing A's exact value (see the module docstring).
ROUNDINGS: dict[str, str] = {
    "bf16-decode-of-nvfp4": (
        "a BF16 copy of NVFP4 experts holds their BF16 decode: e2m1 x E4M3 block scale x the expert's float32 "
        "factor amax/2688, rounded to BF16 (8 significant bits); it equals that decode bit for bit"),
    "narrowed": "a tensor stored narrower on one side (F32 -> BF16/F16): equal to the wider one rounded to nearest",
}


@dataclass
class Stats:
    """Pooled error sums of one or more tensors."""

    tensors: int = 0
    bit_exact_tensors: int = 0
    rounding_tensors: int = 0  # not bit-exact, but exactly the expected rounding of A
    elements: int = 0
    exact_elements: int = 0
    signal: float = 0.0  # Σa²
    noise: float = 0.0  # Σe²
    max_abs: float = 0.0

    def add(self, other: "Stats") -> None:
        self.tensors += other.tensors
        self.bit_exact_tensors += other.bit_exact_tensors
        self.rounding_tensors += other.rounding_tensors
        self.elements += other.elements
        self.exact_elements += other.exact_elements
        self.signal += other.signal
        self.noise += other.noise
        self.max_abs = max(self.max_abs, other.max_abs)

    @property
    def sqnr_db(self) -> float:
        if self.noise == 0.0:
            return math.inf
        if self.signal == 0.0:
            return -math.inf
        return 10.0 * math.log10(self.signal / self.noise)

    @property
    def rel_rmse(self) -> float:
        if self.signal == 0.0:
            return 0.0 if self.noise == 0.0 else math.inf
        return math.sqrt(self.noise / self.signal)

    def to_json(self) -> dict[str, Any]:
        return {"tensors": self.tensors, "bit_exact_tensors": self.bit_exact_tensors,
                "rounding_tensors": self.rounding_tensors, "elements": self.elements,
                "exact_elements": self.exact_elements, "max_abs": self.max_abs,
                "rel_rmse": _finite(self.rel_rmse), "sqnr_db": _finite(self.sqnr_db)}


def _finite(x: float) -> float | None:
    return None if math.isinf(x) or math.isnan(x) else x


def _pairwise(y: Any, add: Callable[[Any, Any], Any]) -> Any:
    """Sums of the float64 rows of ``y`` [k, n] (a torch tensor or a numpy array) by a fixed
    pairwise tree of elementwise adds, in place: the first half plus the second, the odd one out
    moved down, until one column is left (returned, [k]). Each add is IEEE float64, so the sums are
    the same to the bit on every device, library and thread count (no BLAS dot, no device
    reduction: their order, and so their rounding, varies)."""
    n = y.shape[-1]
    while n > 1:
        h = n // 2
        add(y[:, :h], y[:, h:2 * h])
        if n % 2:
            y[:, h] = y[:, n - 1]  # the odd one out moves down to the next level
        n = h + n % 2
    return y[:, 0]


def _sum_sq(x: torch.Tensor) -> float:
    """Σx² of a flat float32 tensor by :func:`_pairwise` over float64 squares (exact for float32 values)."""
    if not x.numel():
        return 0.0
    y = x.reshape(1, -1).to(torch.float64, copy=True)
    y.mul_(y)
    return float(_pairwise(y, torch.Tensor.add_)[0])


#: Elements whose error statistics are taken at once (a row of :func:`_rows`): the sums see
#: these fixed pieces, so the figures are the same whatever the device, workers or ranks.
STATS_CHUNK = 1 << 20

#: Rows taken at once on a GPU: a decode piece's worth (its float64 squares: 32 MiB of device memory).
GPU_ROWS = 4

_local = threading.local()


#: Rows of the top levels of the pairwise tree taken a column block at a time on the CPU
#: (:func:`_np_row`), and the float64 elements of one such block: small enough that a block's
#: squares, error and adds stay in a core's cache instead of streaming 8 MiB rows through memory.
_TOP_ROWS = 1 << 5
_BLOCK_ELEMENTS = 1 << 17


def _np_buffers() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This thread's reused block buffers (float64 squares, float32 error, equal-bits mask) of
    :data:`_BLOCK_ELEMENTS` each: no fresh blocks per chunk."""
    bufs = getattr(_local, "blocks", None)
    if bufs is None:
        bufs = _local.blocks = (np.empty(_BLOCK_ELEMENTS, np.float64), np.empty(_BLOCK_ELEMENTS, np.float32),
                                np.empty(_BLOCK_ELEMENTS, np.bool_))
    return bufs


def _np_add(dst: np.ndarray, src: np.ndarray) -> None:
    np.add(dst, src, out=dst)


def _top_levels(n: int) -> int:
    """Rows of the [rows, n // rows] view whose pairwise halving is the first levels of
    :func:`_pairwise` over ``n`` elements: the largest power of two dividing ``n``, up to :data:`_TOP_ROWS`.

    While the count is even each level adds the second half onto the first, that is row ``r + h``
    of the view onto row ``r``, column by column; so those levels can run a column block at a
    time (:func:`_pairwise` down the block's columns), and the column sums then go through
    :func:`_pairwise` as the rest of the tree."""
    return min(n & -n, _TOP_ROWS)


def _rows(a: torch.Tensor, b: torch.Tensor | None) -> list[tuple[int, float, float, float]]:
    """Per row of ``a`` [k, m] (widened to float32) against ``b`` (None: a bit-identical copy):
    bit-equal elements, Σa², Σ(b−a)², max |b−a|; a sum is ±inf or NaN when its row holds a
    non-finite value (a float64 square of a float32 cannot overflow, nor can 2^20 of them added).

    On a GPU :data:`GPU_ROWS` rows at a time, one copy to the host each; on the CPU a row at a
    time through numpy, whose float32 → float64 widening, bit compare and count run 2-6x faster
    than torch's there."""
    if a.device.type != "cpu":
        out = []
        for i in range(0, a.shape[0], GPU_ROWS):
            x = a[i:i + GPU_ROWS].to(torch.float32)
            sa = _pairwise(x.to(torch.float64).square_(), torch.Tensor.add_)
            if b is None:
                out += [(x.shape[1], v, 0.0, 0.0) for v in sa.tolist()]
                continue
            y = b[i:i + GPU_ROWS].to(torch.float32)
            same = (x.view(torch.int32) == y.view(torch.int32)).sum(-1, dtype=torch.float64)
            e = y - x
            mx = e.abs().amax(-1).to(torch.float64)
            se = _pairwise(e.to(torch.float64).square_(), torch.Tensor.add_)
            out += [(int(c), v, n, m) for c, v, n, m in torch.stack([same, sa, se, mx], 1).tolist()]
        return out
    out = []
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf, overflow: such rows go to _add_nonfinite
        for r in range(a.shape[0]):
            out.append(_np_row(_f32(a[r:r + 1]).numpy(), None if b is None else _f32(b[r:r + 1]).numpy()))
    return out


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32)


def _np_row(x: np.ndarray, y: np.ndarray | None) -> tuple[int, float, float, float]:
    """:func:`_rows`' figures of one float32 row [1, n] on the CPU, the sums by :func:`_pairwise`'s
    tree to the bit: its top levels a column block at a time (:func:`_top_levels`), in cache."""
    n = x.shape[-1]
    if not n:
        return 0, 0.0, 0.0, 0.0
    rows = _top_levels(n)
    cols = n // rows
    xv = x.reshape(rows, cols)
    yv = None if y is None else y.reshape(rows, cols)
    width = max(1, _BLOCK_ELEMENTS // rows)
    sq_buf, e_buf, same_buf = _np_buffers()
    col_a = np.empty((1, cols), np.float64)
    col_e = np.empty((1, cols), np.float64)
    n_same, mx = 0, 0.0
    for c in range(0, cols, width):
        w = min(width, cols - c)
        sq = sq_buf[:rows * w].reshape(rows, w)
        np.square(xv[:, c:c + w], dtype=np.float64, out=sq)  # widened, then squared: exact
        col_a[0, c:c + w] = _pairwise(sq.T, _np_add)
        if yv is None:
            continue
        same = same_buf[:rows * w].reshape(rows, w)
        n_same += int(np.count_nonzero(np.equal(xv[:, c:c + w].view(np.int32), yv[:, c:c + w].view(np.int32), out=same)))
        e = e_buf[:rows * w].reshape(rows, w)
        np.subtract(yv[:, c:c + w], xv[:, c:c + w], out=e)
        mx = max(mx, float(e.max()), -float(e.min()))
        np.square(e, dtype=np.float64, out=sq)
        col_e[0, c:c + w] = _pairwise(sq.T, _np_add)
    sa = float(_pairwise(col_a, _np_add)[0])
    if yv is None:
        return n, sa, 0.0, 0.0
    return n_same, sa, float(_pairwise(col_e, _np_add)[0]), mx


def _chunks(x: torch.Tensor) -> list[torch.Tensor]:
    """A flat tensor as rows of :data:`STATS_CHUNK` ([k, STATS_CHUNK], then the rest as [1, r]), views."""
    x = x.reshape(-1)
    full = x.numel() // STATS_CHUNK * STATS_CHUNK
    parts = [x[:full].reshape(-1, STATS_CHUNK)] if full else []
    if full < x.numel():
        parts.append(x[full:].reshape(1, -1))
    return parts


def exact_stats(a: torch.Tensor) -> Stats:
    """Stats of a tensor compared with a bit-identical copy (only its energy is needed)."""
    s = Stats(tensors=1, bit_exact_tensors=1, elements=a.numel(), exact_elements=a.numel())
    for rows in _chunks(a):
        for r, (_, sa, _, _) in enumerate(_rows(rows, None)):
            if math.isfinite(sa):
                s.signal += sa
            else:  # a NaN or ±inf in the chunk: its finite values' energy
                x = _f32(rows[r])
                s.signal += _sum_sq(x[torch.isfinite(x)])
    return s


def tensor_stats(a: torch.Tensor, b: torch.Tensor) -> Stats:
    """Error of ``b`` against the reference ``a`` (same shape), in float32 with exact float64 sums of squares.

    Taken ``STATS_CHUNK`` elements at a time (each chunk widened to float32 on its own, the sums
    pooled in float64 in chunk order), so memory beyond the two inputs stays a few chunks on the
    CPU; the inputs may be on any device, the figures are the same."""
    if tuple(a.shape) != tuple(b.shape):
        raise CheckpointError(f"shape {list(a.shape)} in A, {list(b.shape)} in B")
    s = Stats(tensors=1, elements=a.numel())
    for ra, rb in zip(_chunks(a), _chunks(b), strict=True):
        for r, (same, sa, se, mx) in enumerate(_rows(ra, rb)):
            if math.isfinite(sa) and math.isfinite(se):
                # An all-equal row adds 0 noise and a 0 maximum: the same sums as its signal alone.
                s.exact_elements += same
                s.signal += sa
                s.noise += se
                s.max_abs = max(s.max_abs, mx)
            else:
                _add_nonfinite(s, _f32(ra[r]), _f32(rb[r]))
    s.bit_exact_tensors = int(s.exact_elements == s.elements)
    return s


def _add_nonfinite(s: Stats, a: torch.Tensor, b: torch.Tensor) -> None:
    """A chunk where a value is NaN or ±inf on one side: the sums over the finite pairs, and a
    differing non-finite value makes the maximum error infinite."""
    same = a.view(torch.int32) == b.view(torch.int32)
    s.exact_elements += int(same.sum())
    finite = torch.isfinite(a) & torch.isfinite(b)
    e = (b - a)[finite]
    s.signal += _sum_sq(a[finite])
    s.noise += _sum_sq(e)
    if e.numel():
        s.max_abs = max(s.max_abs, float(e.abs().max()))
    if not bool((same | finite).all()):
        s.max_abs = math.inf


@dataclass
class Item:
    name: str
    fmt: str
    layer: int | None
    stats: Stats
    rounding: str | None = None  # a ROUNDINGS key when B is exactly A's expected rounding

    @property
    def verdict(self) -> str:
        if self.stats.bit_exact_tensors == self.stats.tensors:
            return EXACT
        return ROUNDING if self.rounding is not None else MISMATCH

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "format": self.fmt, "layer": self.layer, "verdict": self.verdict,
                "rounding": self.rounding, **self.stats.to_json()}


@dataclass
class Comparison:
    a: dict[str, Any]
    b: dict[str, Any]
    items: list[Item] = field(default_factory=list)
    only_a: list[str] = field(default_factory=list)  # vision tensors B does not hold
    only_b: list[str] = field(default_factory=list)
    seconds: float = 0.0
    bytes_read: int = 0  # both sides, all ranks
    ranks: list[dict[str, Any]] = field(default_factory=list)  # what each rank did (RankStats.as_dict)


def _label(fa: str, fb: str) -> str:
    if fa == fb:
        return fa
    if fa in UNQUANTIZED and fb not in UNQUANTIZED:
        return fb
    if fb in UNQUANTIZED and fa not in UNQUANTIZED:
        return fa
    return f"{fa}->{fb}"


def _same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(
        x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))


def _describe(src: Any, path: str | Path) -> dict[str, Any]:
    return {"source": str(path), "layout": src.layout, "variant": src.plan.variant, "precision_plan": str(src.plan)}


#: A unit's result: per piece of a tensor it compared, ``(name, Stats fields, rounding)``;
#: rounding names the ROUNDINGS entry an inexact piece equals exactly, else None. Plain tuples:
#: they travel between ranks.
Entry = tuple[str, tuple[Any, ...], "str | None"]
#: Elements of experts decoded at once per side within a unit (float32: 16 MiB; a real expert's
#: w13 is 21M elements, so it goes a block of rows at a time), whatever the device: a fixed cut,
#: so the sums see the same pieces on the CPU and on a GPU.
DECODE_ELEMENTS = 1 << 22
#: Host bytes a unit's comparison holds on the CPU beside what it reads: a piece decoded to float32
#: per side (``DECODE_ELEMENTS`` each) and the statistics' temporaries (per ``STATS_CHUNK``
#: elements: a BF16 tensor's chunks widened to float32; the squares, error and equal-bits mask were
#: row-sized too when this was measured, and are a column block now, so it is headroom): one
#: worker's units peaked up to 47 MiB over what they read. And
#: half that again for the blocks the workers free between each other's in their one heap: four
#: workers in a node-sized process (~500 MiB at the start, 2-core box, 2-layer wide fixture) peaked
#: at 1040-1136 MiB charged the first part alone, 962-991 MiB (and no slower) charged this.
COMPARE_WORKSPACE_BYTES = (2 * DECODE_ELEMENTS * 4 + 21 * STATS_CHUNK) * 3 // 2


def _narrowed(wide: torch.Tensor, narrow: torch.Tensor) -> bool:
    """Whether ``narrow`` is ``wide`` rounded to its (narrower) dtype, bit for bit."""
    return (wide.dtype.itemsize > narrow.dtype.itemsize and wide.dtype.is_floating_point
            and _same_bytes(wide.to(narrow.dtype), narrow))


def _bf16_decode(sa: ExpertStack, pa: Any, sb: ExpertStack, pb: Any) -> str | None:
    """``bf16-decode-of-nvfp4`` when one side is BF16 and holds exactly the other's NVFP4 decode to BF16;
    ``narrowed`` when both are unquantized and one is the other rounded to its narrower dtype."""
    if sa.fmt in UNQUANTIZED and sb.fmt in UNQUANTIZED:
        return "narrowed" if _narrowed(pa[""], pb[""]) or _narrowed(pb[""], pa[""]) else None
    for (sq, pq), (sp, pp) in (((sa, pa), (sb, pb)), ((sb, pb), (sa, pa))):
        if sq.fmt == "nvfp4" and sp.fmt == "bf16":
            decoded = decode_stacked(sq.fmt, pq, torch.bfloat16, name=sq.name, allow_nonfinite=True)
            return "bf16-decode-of-nvfp4" if _same_bytes(decoded, pp[""]) else None
    return None


def pairs(a: Any, b: Any) -> list[tuple[str, str, int | None]]:
    """(name, format label, layer) of every logical tensor compared, in report order: the non-expert
    tensors both sides hold, then each layer's stacked experts (w13, w2)."""
    only_a, _ = unpaired(a, b)
    out: list[tuple[str, str, int | None]] = [
        (s.name, DENSE, s.layer) for s in a.expected() if s.part is None and s.name not in only_a]
    for layer in range(a.cfg.num_hidden_layers):
        for sa, sb in zip(expert_stacks(a.cfg, a.plan, layer), expert_stacks(b.cfg, b.plan, layer), strict=True):
            out.append((sa.name, _label(sa.fmt, sb.fmt), layer))
    return out


def plan_units(a: Any, b: Any, slice_bytes: int, device_type: str = "cpu") -> list[Unit]:
    """The comparison's units from both sides' headers, in checkpoint order (``pipeline.release_units``).

    ``slice_bytes`` is what one unit reads of both sides together: non-expert tensors batched or
    cut by rows, each layer's experts a slice of experts at a time. A non-expert tensor whose
    shape differs between the sides is an error here, before anything is read. Each unit is
    charged what it reads, and on the CPU (``device_type``) :data:`COMPARE_WORKSPACE_BYTES` more.
    """
    only_a, _ = unpaired(a, b)
    specs = [s for s in a.expected() if s.name not in only_a]
    dense_b = {s.name: s for s in b.expected() if s.part is None}
    for s in specs:
        if s.part is None and tuple(s.shape) != tuple(dense_b[s.name].shape):
            raise CheckpointError(f"{s.name}: shape {list(s.shape)} in A, {list(dense_b[s.name].shape)} in B")
    stacks_a = {st.name: st for st in expert_stacks(a.cfg, a.plan)}
    stacks_b = {st.name: st for st in expert_stacks(b.cfg, b.plan)}
    read = {n: st.stored_bytes + stacks_b[n].stored_bytes for n, st in stacks_a.items()}
    units = release_units(specs, stacks_a, max(1, slice_bytes // 2), a.cfg.num_hidden_layers, stack_read_bytes=read,
                          row_reads=getattr(a, "row_reads", True) and getattr(b, "row_reads", True),
                          read_bytes=lambda s: s.nbytes + dense_b[s.name].nbytes)
    # Verify writes nothing; a unit holds what it reads (a piece at a time where both sides read
    # rows inside an expert) and, on the CPU, its comparison's temporaries.
    extra = COMPARE_WORKSPACE_BYTES if device_type == "cpu" else 0
    pieces = reads_pieces(a) and reads_pieces(b)

    def held(u: Unit) -> int:
        sl = expert_slice(u)
        if not pieces or sl is None:
            return u.read_bytes
        st, first, last = sl
        _, rows, cols = st.shape
        most = largest_piece(last - first, rows, cols, DECODE_ELEMENTS)
        return min(u.read_bytes, -(-u.read_bytes * most // ((last - first) * rows * cols)))  # the largest piece's share

    return [replace(u, write_bytes=0, hold_bytes=held(u) + extra) for u in units]


def transform(a: Any, b: Any, ex: Executor) -> Callable[[Unit], list[Entry]]:
    """Read one unit of both sides, decode and compare it on the executor's device: its entries."""
    stacks_b = {st.name: st for st in expert_stacks(b.cfg, b.plan)}

    def run(unit: Unit) -> list[Entry]:
        sl = expert_slice(unit)
        if sl is not None:
            sa, first, last = sl
            return _compare_experts(a, b, sa, stacks_b[sa.name], first, last, ex)
        return [_compare_dense(a, b, piece, ex) for piece in unit.pieces]
    return run


def reads(a: Any, b: Any) -> Callable[[Unit], list[tuple[Any, int, int]]]:
    """What :func:`transform`'s units read of both sides, for the executor's read-ahead (a side
    that cannot say, a sharded folder, reads on its own)."""
    stacks_b = {st.name: st for st in expert_stacks(b.cfg, b.plan)}

    def run(unit: Unit) -> list[tuple[Any, int, int]]:
        sl = expert_slice(unit)
        if sl is not None:
            sa, first, last = sl
            return parts_extents(a, sa, first, last) + parts_extents(b, stacks_b[sa.name], first, last)
        return dense_reads(a, unit.pieces) + dense_reads(b, unit.pieces)
    return run


def _compare_dense(a: Any, b: Any, piece: tuple[str, int, int], ex: Executor) -> Entry:
    name = piece[0]
    ta, tb = (ex.to_device(read_dense(src, [piece])[name]) for src in (a, b))
    if _same_bytes(ta, tb):
        return name, astuple(exact_stats(ta)), None
    if tuple(ta.shape) != tuple(tb.shape):
        raise CheckpointError(f"{name}: shape {list(ta.shape)} in A, {list(tb.shape)} in B")
    stats = tensor_stats(ta, tb)
    rounded = not stats.bit_exact_tensors and (_narrowed(ta, tb) or _narrowed(tb, ta))
    return name, astuple(stats), "narrowed" if rounded else None


def _compare_experts(a: Any, b: Any, sa: ExpertStack, sb: ExpertStack, first: int, last: int,
                     ex: Executor) -> list[Entry]:
    """Experts ``first:last`` of one stacked weight, decoded to float32 ``DECODE_ELEMENTS`` at a time.

    Where both sides read rows inside an expert (HF folders) each piece reads only its own bytes
    (a real w13 expert: ~11 MiB of both sides a piece, not 54 MiB at once); else the slice's parts
    are read once and cut."""
    _, rows, cols = sa.shape
    cut = expert_pieces(range(first, last), rows, cols, DECODE_ELEMENTS)
    if reads_pieces(a) and reads_pieces(b):
        def piece(js: list[int], lo: int, hi: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], bool]:
            qa = read_parts(a, sa, js[0], js[-1] + 1, rows=(lo, hi), device=ex.device)
            qb = read_parts(b, sb, js[0], js[-1] + 1, rows=(lo, hi), device=ex.device)
            return qa, qb, sa.fmt == sb.fmt and all(_same_bytes(qa[k], qb[k]) for k in qa)
    else:
        pa = read_parts(a, sa, first, last, device=ex.device)
        pb = read_parts(b, sb, first, last, device=ex.device)
        same = sa.fmt == sb.fmt and all(_same_bytes(pa[k], pb[k]) for k in pa)

        def piece(js: list[int], lo: int, hi: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], bool]:
            at = [j - first for j in js]
            return cut_piece(pa, at, lo, hi), cut_piece(pb, at, lo, hi), same
    out: list[Entry] = []
    # each side's pieces decode into one buffer of its own (PieceBuffer), where they are on the host
    bufs = (PieceBuffer(), PieceBuffer()) if ex.device.type == "cpu" else None
    for js, lo, hi in cut:
        qa, qb, same_piece = piece(js, lo, hi)
        shape = (len(js), hi - lo, cols)
        da = decode_stacked(sa.fmt, qa, torch.float32, name=sa.name, allow_nonfinite=True,
                            out=None if bufs is None else bufs[0].take(*shape))
        if same_piece:  # equal bytes: the figures of a bit-identical copy
            out.append((sa.name, astuple(exact_stats(da)), None))
            continue
        stats = tensor_stats(da, decode_stacked(sb.fmt, qb, torch.float32, name=sb.name, allow_nonfinite=True,
                                                out=None if bufs is None else bufs[1].take(*shape)))
        del da
        out.append((sa.name, astuple(stats), None if stats.bit_exact_tensors else _bf16_decode(sa, qa, sb, qb)))
    return out


def unpaired(a: Any, b: Any) -> tuple[list[str], list[str]]:
    """Non-expert tensors only A holds, only B holds: vision tensors may be (a torch_dist side has none).

    Raises CheckpointError for any other tensor one side lacks.
    """
    names_a = {s.name for s in a.expected() if s.part is None}
    names_b = {s.name for s in b.expected() if s.part is None}
    for side, extra in (("A", names_a - names_b), ("B", names_b - names_a)):
        text = sorted(n for n in extra if not is_vision(n))
        if text:
            more = f" (and {len(text) - 1} more)" if len(text) > 1 else ""
            raise CheckpointError(f"{text[0]}{more} is in {side} but not in {'B' if side == 'A' else 'A'}")
    return sorted(names_a - names_b), sorted(names_b - names_a)


def open_pair(path_a: str | Path, path_b: str | Path, *, config: Any = None) -> tuple[Any, Any]:
    """Open both sides; a torch_dist side that keeps no config takes ``config``, else the other side's."""
    kinds = [detect_layout(path_a), detect_layout(path_b)]
    if config is not None and TORCH_DIST not in kinds:
        raise ConfigError("--config is for a torch_dist side; neither checkpoint is one (each carries its config.json)")
    from ..layouts.torch_dist_release import MissingConfigError

    opened: list[Any] = [None, None]
    # Sides that carry a config first; a torch_dist side that keeps none waits for the other
    # side (whatever its layout) and borrows its config.
    order = sorted((0, 1), key=lambda i: kinds[i] == TORCH_DIST)
    deferred: set[int] = set()
    try:
        while order:
            i = order.pop(0)
            other = opened[1 - i]
            try:
                opened[i] = _open((path_a, path_b)[i], config=config if kinds[i] == TORCH_DIST else None,
                                  layout=kinds[i], default_config=other.config if other is not None else None,
                                  verify_checksums=True)
            except MissingConfigError:
                if other is not None or i in deferred or not order:
                    raise  # nothing left to borrow from
                deferred.add(i)
                order.append(i)  # after the other side
    except BaseException:
        for src in opened:
            if src is not None:
                src.close()
        raise
    return opened[0], opened[1]


def compare(path_a: str | Path, path_b: str | Path, *, progress: bool = True, config: Any = None,
            options: Options | None = None) -> Comparison:
    """Decode and compare every tensor of two checkpoints of the same model (any layouts, see ``layouts.detect``).

    ``config``: the model config of a torch_dist side that keeps none (default: the other side's).
    ``options``: device, slice budget and workers (default ``--device auto``). The units run on the
    shared executor; under torchrun the ranks split them and every rank ends with the whole
    comparison (the same on every rank, and the same as one process).
    """
    t0 = time.perf_counter()
    a, b = open_pair(path_a, path_b, config=config)
    try:
        if a.cfg != b.cfg:
            diff = [k for k in a.cfg.__dataclass_fields__ if getattr(a.cfg, k) != getattr(b.cfg, k)]
            raise CheckpointError(f"{path_a} and {path_b} are not the same model: their configs differ in {', '.join(diff)}")
        out = Comparison(_describe(a, path_a), _describe(b, path_b))
        out.only_a, out.only_b = unpaired(a, b)
        # On a GPU verify reads two slices per unit, and its statistics still copy their figures to
        # the host: 8 workers (the GPU default) took 21.4-25.4 s at 1047-1056 MiB peak RSS on the H200
        # machine (8-layer wide fixture, held back by the resident-size check 154-185 times), 4 took
        # 12.9 s at 987 MiB.
        ex = Executor(options or Options(progress=progress), desc="verify", gpu_workers=MAX_DEFAULT_WORKERS)
        units = read_on_device(plan_units(a, b, ex.slice_bytes, ex.device.type), ex.device.type, [a, b])
        owner = assign({u.key: u.read_bytes for u in units}, ex.world.size)
        mine = [u for u in units if owner[u.key] == ex.world.rank]
        done: dict[str, list[Entry]] = {}
        err: Exception | None = None
        try:
            ex.run(mine, transform(a, b, ex), lambda u, entries: done.__setitem__(u.key, entries), read_only=True,
                   extents=reads(a, b))
        except Exception as e:  # every rank raises it (all_ok), so every rank exits the same way
            err = e
        all_ok(err, ex.world)
        ranks = ex.finish()
        if ex.world.distributed:
            for part in gather(done, ex.world):
                done.update(part)
        out.items = _fold(pairs(a, b), units, done)
        out.ranks = [s.as_dict() for s in ranks]
        out.bytes_read = sum(s.bytes_read for s in ranks)
        out.seconds = time.perf_counter() - t0
    finally:
        for src in (a, b):
            src.close()
    return out


def _fold(tensors: list[tuple[str, str, int | None]], units: list[Unit], done: dict[str, list[Entry]]) -> list[Item]:
    """Every unit's entries pooled per tensor in plan order (so the sums never depend on who computed
    what, or when), one :class:`Item` per tensor in report order."""
    acc: dict[str, tuple[Stats, set[str | None]]] = {}
    for u in units:
        for name, fields, rounding in done[u.key]:
            piece = Stats(*fields)
            stats, reasons = acc.setdefault(name, (Stats(), set()))
            if not piece.bit_exact_tensors:
                reasons.add(rounding)  # of the pieces that are not bit-exact
            stats.add(piece)
    items = []
    for name, fmt, layer in tensors:
        stats, reasons = acc[name]
        # one tensor however many pieces it was compared in
        stats.bit_exact_tensors = int(stats.bit_exact_tensors == stats.tensors)
        stats.tensors = 1
        why = reasons.pop() if len(reasons) == 1 else None  # every inexact piece: the same expected rounding
        stats.rounding_tensors = int(not stats.bit_exact_tensors and why is not None)
        items.append(Item(name, fmt, layer, stats, why if stats.rounding_tensors else None))
    return items


def open_checkpoint(path: str | Path, *, config: Any = None) -> Any:
    """Any checkpoint layout the toolkit writes (:func:`inkling_ckpt.layouts.detect.open_checkpoint`)."""
    return _open(path, config=config)


def _worst_key(item: Item) -> tuple[float, float]:
    return (item.stats.sqnr_db, -item.stats.max_abs)


def build_report(cmp: Comparison, *, min_sqnr: float | None = None, exact: bool = False) -> dict[str, Any]:
    """The JSON report (schema in the module docstring), with the threshold verdict."""
    total = Stats()
    by_fmt: dict[str, Stats] = {}
    by_layer: dict[tuple[int, str], Stats] = {}
    for it in cmp.items:
        total.add(it.stats)
        by_fmt.setdefault(it.fmt, Stats()).add(it.stats)
        if it.fmt != DENSE and it.layer is not None:
            by_layer.setdefault((it.layer, it.fmt), Stats()).add(it.stats)
    items = sorted(cmp.items, key=_worst_key)
    failures = []
    rounding: dict[str, dict[str, Any]] = {}
    for it in items:
        if it.rounding is not None:
            rounding.setdefault(it.rounding, {"tensors": 0, "why": ROUNDINGS[it.rounding]})["tensors"] += 1
        if exact and it.verdict == MISMATCH:
            failures.append(f"{it.name} is not bit-exact, nor the expected rounding of A")
        elif min_sqnr is not None and it.stats.sqnr_db < min_sqnr:
            failures.append(f"{it.name} at {it.stats.sqnr_db:.2f} dB")
    worst = min((it.stats.sqnr_db for it in items), default=math.inf)
    return {
        "schema": SCHEMA,
        "a": cmp.a,
        "b": cmp.b,
        "summary": {"tensors": total.tensors, "bit_exact_tensors": total.bit_exact_tensors,
                    "rounding_tensors": total.rounding_tensors,
                    "mismatch_tensors": sum(1 for it in items if it.verdict == MISMATCH),
                    "elements": total.elements, "exact_elements": total.exact_elements,
                    "exact_fraction": total.exact_elements / total.elements if total.elements else 1.0,
                    "min_sqnr_db": _finite(worst), "max_abs": total.max_abs},
        "formats": {k: v.to_json() for k, v in sorted(by_fmt.items())},
        "layers": [{"layer": layer, "format": fmt, **s.to_json()} for (layer, fmt), s in sorted(by_layer.items())],
        "tensors": [it.to_json() for it in items],
        "thresholds": {"min_sqnr_db": min_sqnr, "exact": exact, "passed": not failures, "failures": len(failures),
                       "first_failures": failures[:10]},
        "not_compared": {"only_a": list(cmp.only_a), "only_b": list(cmp.only_b)},
        "rounding": rounding,
        "seconds": round(cmp.seconds, 3),
        "bytes_read": cmp.bytes_read,
        "ranks": {"count": len(cmp.ranks), "each": list(cmp.ranks)},
    }


def _db(x: float | None) -> str:
    return "exact" if x is None else f"{x:.2f}"


def _run_line(rep: dict[str, Any]) -> list[str]:
    """How the comparison ran: bytes read, time, rate, ranks, device (absent from an older report)."""
    if "seconds" not in rep:
        return []
    secs, read = rep["seconds"], rep["bytes_read"]
    line = f"read {fmt_bytes(read)} in {secs:.1f} s ({read / secs / 1e6 if secs > 0 else 0.0:.0f} MB/s"
    return [line + ranks_phrase(rep.get("ranks", {}).get("each") or []) + ")"]


def render_report(rep: dict[str, Any], top: int = 15) -> str:
    """Tables for people: summary, per format, per layer, worst tensors."""
    s = rep["summary"]
    def side(d: dict[str, Any]) -> str:
        layout = d.get("layout", HF)
        return f"{d['source']} ({d['variant']}{'' if layout == HF else ', ' + layout})"

    lines = [
        f"A {side(rep['a'])}  vs  B {side(rep['b'])}",
        f"{s['tensors']} tensors: {s['bit_exact_tensors']} bit-exact, {s['rounding_tensors']} expected rounding, "
        f"{s['mismatch_tensors']} mismatch; {s['exact_elements']}/{s['elements']} elements "
        f"bit-exact ({100 * s['exact_fraction']:.2f}%); worst SQNR {_db(s['min_sqnr_db'])} dB",
        *_run_line(rep),
        "",
        f"{'format':<14} {'tensors':>8} {'bit-exact':>10} {'rounding':>9} {'mismatch':>9} {'SQNR dB':>9} "
        f"{'rel RMSE':>10} {'max abs':>10}",
    ]
    for fmt, f in rep["formats"].items():
        rr = "0" if f["rel_rmse"] == 0 else f"{f['rel_rmse']:.4g}"
        bad = f["tensors"] - f["bit_exact_tensors"] - f["rounding_tensors"]
        lines.append(f"{fmt:<14} {f['tensors']:>8} {f['bit_exact_tensors']:>10} {f['rounding_tensors']:>9} {bad:>9} "
                     f"{_db(f['sqnr_db']):>9} {rr:>10} {f['max_abs']:>10.4g}")
    if rep["layers"]:
        lines += ["", f"{'layer':>5} {'format':<14} {'tensors':>8} {'bit-exact':>10} {'rounding':>9} {'mismatch':>9} "
                      f"{'SQNR dB':>9} {'max abs':>10}"]
        for row in rep["layers"]:
            bad = row["tensors"] - row["bit_exact_tensors"] - row["rounding_tensors"]
            lines.append(f"{row['layer']:>5} {row['format']:<14} {row['tensors']:>8} {row['bit_exact_tensors']:>10} "
                         f"{row['rounding_tensors']:>9} {bad:>9} {_db(row['sqnr_db']):>9} {row['max_abs']:>10.4g}")
    for key, r in rep.get("rounding", {}).items():
        lines += ["", f"expected rounding ({key}), {r['tensors']} tensors: {r['why']}"]
    nc = rep.get("not_compared", {})
    for which, other in (("a", "b"), ("b", "a")):
        names = nc.get(f"only_{which}") or []
        if names:
            why = " (a torch_dist checkpoint holds no vision tower)" if rep[other].get("layout") == TORCH_DIST else ""
            lines += ["", f"not compared: {len(names)} vision tensors only in {which.upper()}{why}"]
    worst = [t for t in rep["tensors"] if t["bit_exact_tensors"] != 1][:top]
    if worst:
        lines += ["", f"worst {len(worst)} tensors:", f"{'SQNR dB':>9} {'rel RMSE':>10} {'max abs':>10} {'verdict':>9}  name"]
        for t in worst:
            lines.append(f"{_db(t['sqnr_db']):>9} {t['rel_rmse']:>10.4g} {t['max_abs']:>10.4g} {t['verdict']:>9}  "
                         f"{t['name']} [{t['format']}]")
    th = rep["thresholds"]
    if th["min_sqnr_db"] is not None or th["exact"]:
        want = "bit-exact" if th["exact"] else f"SQNR >= {th['min_sqnr_db']} dB"
        rounded = rep["summary"].get("rounding_tensors", 0)
        also = f" ({rounded} tensors are exactly the expected rounding, above)" if th["exact"] and rounded else ""
        lines += ["", f"threshold {want}: " + ("passed" + also if th["passed"] else
                                               f"FAILED for {th['failures']} tensors (first: {th['first_failures'][0]})")]
    return "\n".join(lines)


def plot_report(rep: dict[str, Any], path: str | Path) -> int:
    """SQNR per layer, one line per expert format, to a PNG. Returns the number of lines drawn."""
    try:
        import matplotlib
    except ImportError:
        from ..errors import InklingError

        raise InklingError("--plot needs matplotlib: pip install 'inkling-ckpt[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    series: dict[str, list[tuple[int, float]]] = {}
    for row in rep["layers"]:
        if row["sqnr_db"] is not None:
            series.setdefault(row["format"], []).append((row["layer"], row["sqnr_db"]))
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for fmt, pts in sorted(series.items()):
        xs, ys = zip(*sorted(pts), strict=True)
        ax.plot(xs, ys, marker="o", label=fmt)
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_xlabel("decoder layer")
    ax.set_ylabel("SQNR (dB)")
    ax.set_title(f"routed experts: {Path(rep['b']['source']).name} vs {Path(rep['a']['source']).name}")
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend(title="format")
    else:
        ax.text(0.5, 0.5, "every routed expert is bit-exact", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    from ..layouts.staging import publish_file

    fmt = Path(path).suffix.lstrip(".").lower() or "png"
    try:
        publish_file(path, lambda f: fig.savefig(f, format=fmt))  # a fresh file, renamed into place
    except OSError as e:
        from ..errors import OutputError

        raise OutputError(f"cannot write {path}: {e.strerror}") from None
    finally:
        plt.close(fig)
    return len(series)
