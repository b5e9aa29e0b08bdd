"""Compare two checkpoints of one model tensor by tensor, after decoding.

``A`` is the reference, ``B`` the candidate; either may be an HF checkpoint (BF16, mixed,
MXFP8, NVFP4), a sharded folder (``inkling-ckpt shard``) or a Megatron torch_dist folder (read
back as release tensors through the key mapping, experts BF16: ``layouts.detect``). Routed
experts are compared per stacked tensor (a layer's ``…mlp.experts.w13_weight`` / ``w2_weight``),
each side decoded from its stored format to float32 a few experts at a time; every other tensor
is compared as stored (BF16/F32, widened to float32). A torch_dist folder holds no vision tower:
vision tensors only one side holds are listed under ``not_compared``, never silently dropped;
any other tensor missing on one side is an error.

Per compared tensor, with ``a``, ``b`` the float32 values and ``e = b − a``:

* ``exact``: elements whose float32 bits are equal (so -0.0 ≠ +0.0 and NaN = NaN at the same place);
* ``max_abs``: max ``|e|``;  ``rel_rmse``: ``sqrt(Σe² / Σa²)``;
* ``sqnr_db``: ``10·log10(Σa² / Σe²)`` (``null`` in JSON when ``e`` is all zero: exact).

Non-finite elements that differ count as inexact and are left out of the sums.

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
     "not_compared": {"only_a": [NAME, ...], "only_b": [NAME, ...]}}   # vision tensors one side lacks
    STATS = {"tensors", "bit_exact_tensors", "rounding_tensors", "elements", "exact_elements", "max_abs",
             "rel_rmse", "sqnr_db"}                   # per tensor: "tensors" == 1

``FORMAT`` is the expert format being measured: the quantized side's format when the other
side is BF16, the shared format when both agree, ``"x->y"`` when both are quantized
differently; ``"dense"`` is everything that is not a routed expert. Layer and format figures
pool the sums of their tensors (so their SQNR is energy-weighted, not a mean of dBs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..errors import CheckpointError, ConfigError
from ..convert.experts import read_parts
from ..convert.requantize import expert_slices
from ..formats.stacked import UNQUANTIZED, decode_stacked
from ..layouts.detect import HF, TORCH_DIST, detect_layout
from ..layouts.detect import open_checkpoint as _open
from ..model.inventory import ExpertStack, expert_stacks, is_vision
from ..progress import ByteProgress

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


def _energy(x: torch.Tensor) -> float:
    """Σx² of a flat float32 tensor (a BLAS dot: float32 products, blocked float32 sums)."""
    return float(torch.dot(x, x)) if x.numel() else 0.0


#: Elements whose error statistics are taken at once: the float32 temporaries (difference,
#: masks) stay a few 16 MiB blocks however large the slice compared.
STATS_CHUNK = 1 << 22


def exact_stats(a: torch.Tensor) -> Stats:
    """Stats of a tensor compared with a bit-identical copy (only its energy is needed)."""
    a = a.to(torch.float32).reshape(-1)
    s = Stats(tensors=1, bit_exact_tensors=1, elements=a.numel(), exact_elements=a.numel())
    for i in range(0, a.numel(), STATS_CHUNK):
        x = a[i:i + STATS_CHUNK]
        fin = torch.isfinite(x)
        s.signal += _energy(x) if bool(fin.all()) else _energy(x[fin])
    return s


def tensor_stats(a: torch.Tensor, b: torch.Tensor) -> Stats:
    """Error of ``b`` against the reference ``a`` (same shape), in float32 with float32 dot products.

    Taken ``STATS_CHUNK`` elements at a time (the sums pooled in float64), so memory beyond the
    two inputs stays a few chunks."""
    a = a.to(torch.float32).reshape(-1)
    b = b.to(torch.float32).reshape(-1)
    s = Stats(tensors=1, elements=a.numel())
    for i in range(0, a.numel(), STATS_CHUNK):
        _add_chunk(s, a[i:i + STATS_CHUNK], b[i:i + STATS_CHUNK])
    s.bit_exact_tensors = int(s.exact_elements == s.elements)
    return s


def _add_chunk(s: Stats, a: torch.Tensor, b: torch.Tensor) -> None:
    same = a.view(torch.int32) == b.view(torch.int32)
    exact = int(same.sum())
    s.exact_elements += exact
    if exact == a.numel():
        fin = torch.isfinite(a)
        s.signal += _energy(a) if bool(fin.all()) else _energy(a[fin])
        return
    e = b - a
    if bool(torch.isfinite(e).all()):
        s.signal += _energy(a)
        s.noise += _energy(e)
        s.max_abs = max(s.max_abs, float(e.abs().max()))
        return
    # Some value is NaN or ±Inf on one side: sum over the finite pairs, and a differing
    # non-finite value makes the maximum error infinite.
    finite = torch.isfinite(a) & torch.isfinite(b)
    ef = e[finite]
    s.signal += _energy(a[finite])
    s.noise += _energy(ef)
    if ef.numel():
        s.max_abs = max(s.max_abs, float(ef.abs().max()))
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


#: A pair's loader yields (A, B, rounding) chunks as float32; B is None where the stored bytes are
#: identical; rounding names the ROUNDINGS entry B equals exactly, else None.
Chunk = tuple[torch.Tensor, "torch.Tensor | None", "str | None"]
Loader = Callable[[], Iterator[Chunk]]
#: BF16 bytes of experts decoded at once per side (float32 doubles it).
SLICE_BYTES = 32 * 2**20


def _narrowed(wide: torch.Tensor, narrow: torch.Tensor) -> bool:
    """Whether ``narrow`` is ``wide`` rounded to its (narrower) dtype, bit for bit."""
    return (wide.dtype.itemsize > narrow.dtype.itemsize and wide.dtype.is_floating_point
            and _same_bytes(wide.to(narrow.dtype), narrow))


def _dense(a: Any, b: Any, name: str, shape: tuple[int, ...], shape_b: tuple[int, ...], nbytes: int,
           ) -> Iterator[Chunk]:
    """A non-expert tensor in row slices of about ``SLICE_BYTES`` (an embedding is GBs at full size)."""
    if tuple(shape) != tuple(shape_b):
        raise CheckpointError(f"{name}: shape {list(shape)} in A, {list(shape_b)} in B")
    ranges: list[tuple[int, int] | None]
    if not shape or nbytes <= SLICE_BYTES:
        ranges = [None]
    else:
        step = max(1, shape[0] * SLICE_BYTES // max(1, nbytes))
        ranges = [(lo, min(shape[0], lo + step)) for lo in range(0, shape[0], step)]
    for r in ranges:
        ta, tb = (a.get(name), b.get(name)) if r is None else (a.read_rows(name, *r), b.read_rows(name, *r))
        if _same_bytes(ta, tb):
            yield ta.float(), None, None
        else:
            rounded = _narrowed(ta, tb) or _narrowed(tb, ta)
            yield ta.float(), tb.float(), "narrowed" if rounded else None


def _experts(a: Any, b: Any, sa: ExpertStack, sb: ExpertStack) -> Iterator[Chunk]:
    for first, last in expert_slices(sa, SLICE_BYTES):
        pa, pb = read_parts(a, sa, first, last), read_parts(b, sb, first, last)
        da = decode_stacked(sa.fmt, pa, torch.float32, name=sa.name, allow_nonfinite=True)
        if sa.fmt == sb.fmt and all(_same_bytes(pa[k], pb[k]) for k in pa):
            yield da, None, None
            continue
        db = decode_stacked(sb.fmt, pb, torch.float32, name=sb.name, allow_nonfinite=True)
        yield da, db, _bf16_decode(sa, pa, sb, pb)


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


def iter_pairs(a: Any, b: Any) -> Iterator[tuple[str, str, int | None, int, Loader]]:
    """(name, format label, layer, bytes of A, loader) for every logical tensor, in checkpoint order.

    Routed experts are compared per stacked tensor (a layer's w13 or w2), decoded a few experts
    at a time; everything else as stored, widened to float32.
    """
    cfg = a.cfg
    only_a, only_b = unpaired(a, b)
    shapes_b = {sp.name: tuple(sp.shape) for sp in b.expected() if sp.part is None}
    for spec in a.expected():
        if spec.part is None and spec.name not in only_a:
            yield spec.name, DENSE, spec.layer, spec.nbytes, partial(
                _dense, a, b, spec.name, tuple(spec.shape), shapes_b[spec.name], spec.nbytes)
    for layer in range(cfg.num_hidden_layers):
        for sa, sb in zip(expert_stacks(cfg, a.plan, layer), expert_stacks(cfg, b.plan, layer), strict=True):
            nbytes = sum(p.nbytes for p in sa.parts())
            yield (sa.name, _label(sa.fmt, sb.fmt), layer, nbytes, partial(_experts, a, b, sa, sb))


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


def compare(path_a: str | Path, path_b: str | Path, *, progress: bool = True, config: Any = None) -> Comparison:
    """Decode and compare every tensor of two checkpoints of the same model (any layouts, see ``layouts.detect``).

    ``config``: the model config of a torch_dist side that keeps none (default: the other side's).
    """
    a, b = open_pair(path_a, path_b, config=config)
    try:
        if a.cfg != b.cfg:
            diff = [k for k in a.cfg.__dataclass_fields__ if getattr(a.cfg, k) != getattr(b.cfg, k)]
            raise CheckpointError(f"{path_a} and {path_b} are not the same model: their configs differ in {', '.join(diff)}")
        out = Comparison(_describe(a, path_a), _describe(b, path_b))
        out.only_a, out.only_b = unpaired(a, b)
        pairs = list(iter_pairs(a, b))
        with ByteProgress(sum(p[3] for p in pairs), desc="verify", enabled=progress) as bar:
            for name, fmt, layer, nbytes, load in pairs:
                stats = Stats()
                reasons: set[str | None] = set()  # of the chunks that are not bit-exact
                for ta, tb, rounding in load():
                    if tb is None:  # stored bytes identical: no need to decode B
                        stats.add(exact_stats(ta))
                    elif tuple(ta.shape) != tuple(tb.shape):
                        raise CheckpointError(f"{name}: shape {list(ta.shape)} in A, {list(tb.shape)} in B")
                    else:
                        chunk = tensor_stats(ta, tb)
                        if not chunk.bit_exact_tensors:
                            reasons.add(rounding)
                        stats.add(chunk)
                # one tensor however many slices it was compared in
                stats.bit_exact_tensors = int(stats.bit_exact_tensors == stats.tensors)
                stats.tensors = 1
                why = reasons.pop() if len(reasons) == 1 else None  # every inexact chunk: the same expected rounding
                stats.rounding_tensors = int(not stats.bit_exact_tensors and why is not None)
                out.items.append(Item(name, fmt, layer, stats, why if stats.rounding_tensors else None))
                bar.advance(nbytes)
    finally:
        for src in (a, b):
            src.close()
    return out


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
    }


def _db(x: float | None) -> str:
    return "exact" if x is None else f"{x:.2f}"


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
