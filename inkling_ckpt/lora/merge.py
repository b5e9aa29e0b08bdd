"""``lora merge``: bake an engine adapter into a release checkpoint, W' = W + (alpha/r) * B @ A.

The output has the base's files, headers and tensor order byte for byte; only adapted tensors
change. Each is decoded to float32 (quantized experts expert by expert), the delta is added in
float32, and the result is re-encoded in the tensor's own format with the base's kept global
scales (NVFP4: the per-expert ``amax`` and denominator stay; MXFP8: fresh block scales; float
tensors: cast back to their dtype). An expert or tensor whose delta is exactly zero keeps its
base bytes, so a zero adapter reproduces the base checkpoint byte for byte.

Runs through :mod:`inkling_ckpt.pipeline`: one unit per slice of experts
(``convert.requantize.expert_slices``), row chunk of a big linear (the unembed) or span of bytes
copied over, so memory is a few units whatever the checkpoint; ``--device`` decodes, adds and
re-encodes experts there, ``--workers`` units at once; under torchrun each rank writes whole
groups of shard files. Output: staged beside the destination, one group of shard files finished
at a time (a rerun resumes from the finished groups), published by rename.
"""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..convert.experts import (PieceBuffer, cut_piece, expert_index, expert_pieces, largest_piece, overflow_at,
                               read_parts)
from ..convert.requantize import ENCODE_WORKSPACE_BYTES, expert_slices
from ..errors import AdapterError, CheckpointError, NonFiniteError
from ..formats.stacked import (AMAX, DENOM, NVFP4_DENOMINATOR, SCALE, WEIGHT, decode_stacked, deinterleave,
                               encode_stacked, format_of_parts)
from ..layouts.hf import INDEX
from ..layouts.lane import Lane
from ..layouts.paths import check_dst, copy_new, inside, open_regular, pass_through
from ..layouts.pread import TensorFile, read_exact, write_from
from ..layouts.sharded import raw_header
from ..model.inventory import FLOAT_DTYPES, ExpertStack
from ..pipeline import Executor, Options, Result, Stage, Unit, assign, gather, run_staged
from ..pipeline.executor import MAX_DEFAULT_WORKERS
from ..pipeline.readahead import Extent
from .io import WEIGHTS_FILE, Adapter, read_json
from .schema import SCHEMA, Excluded, ExpertsDown, ExpertsGateUp, Linear, Schema, Target

SINGLE = "model.safetensors"
ROW_CHUNK_ELEMS = 1 << 22  # a big linear (the unembed) is merged ~4M elements (16 MiB in float32) at a time
COPY_CHUNK = 64 << 20


@dataclass
class MergeResult(Result):
    """What a merge did: the pipeline's figures (``bytes``: the base's file bytes), and the merge's own."""

    files: int = 0  # shard files written by this run (a resume skips the finished ones)
    changed: list[str] = field(default_factory=list)  # base tensors rewritten
    unchanged_experts: int = 0  # experts whose delta was zero (base bytes kept)
    sqnr: dict[str, float] = field(default_factory=dict)  # quantized base tensor -> dB vs float reference


@dataclass
class _Unit:
    """One adapted base tensor: its row, layer, adapter tensor names and the base tensors it writes."""

    target: Target
    layer: int | None
    factors: dict[tuple[int, str], str]  # (engine module index, side) -> adapter name
    base: str
    stack: ExpertStack | None = None  # experts only: the stacked weight, its logical shape and format
    writes: list[str] = field(default_factory=list)  # base tensors rewritten (weight + per-expert parts)


class _Base:
    """The base release checkpoint: weight map (inside the folder), exact headers, lazy handles."""

    def __init__(self, root: Path):
        self.root = root
        wm: dict[str, Any] | None = None
        if (root / INDEX).is_file():
            idx = read_json(root / INDEX, "index")
            wm = idx.get("weight_map") if isinstance(idx, dict) else None
            if not isinstance(wm, dict) or not wm:
                raise CheckpointError(f"{root / INDEX}: no weight_map")
            files = sorted(set(wm.values()))
        elif (root / SINGLE).is_file():
            files = [SINGLE]
        else:
            raise CheckpointError(f"{root}: neither {INDEX} nor {SINGLE}")
        for f in files:
            if not inside(root, f, str(root / INDEX), "shard").is_file():
                raise CheckpointError(f"{root}: shard {f!r} is missing")
        self.files = files
        self.headers = {f: raw_header(root / f) for f in files}
        self.where: dict[str, str] = {}
        for f, h in self.headers.items():
            for n in h.entries:
                if n in self.where:
                    raise CheckpointError(f"{n}: in both {self.where[n]} and {f}")
                self.where[n] = f
        if wm is not None:
            bad = [n for n, f in wm.items() if self.where.get(n) != f]
            if bad:
                raise CheckpointError(f"{root / INDEX}: {bad[0]} is not in {wm[bad[0]]}")
        self.meta = {n: (self.headers[f].entries[n][0], self.headers[f].entries[n][1]) for n, f in self.where.items()}
        self._files: dict[str, TensorFile] = {}
        self._lock = threading.Lock()  # the executor's workers open files lazily

    def _file(self, name: str) -> TensorFile:
        f = self.where[name]
        with self._lock:
            if f not in self._files:
                self._files[f] = TensorFile(self.root / f)
            return self._files[f]

    #: ``read_parts`` may read expert slices straight onto a GPU (through small pinned buffers).
    reads_to_device = True

    def get(self, name: str, *, device: torch.device | None = None) -> torch.Tensor:
        return self._file(name).read(name, device=device)

    def read_rows(self, name: str, lo: int, hi: int, *, device: torch.device | None = None) -> torch.Tensor:
        return self._file(name).read(name, lo, hi, device=device)

    def close(self) -> None:
        for tf in self._files.values():
            tf.close()

    def span(self, name: str) -> tuple[str, int, int]:
        """(file, absolute start, absolute stop) of a tensor's bytes."""
        f = self.where[name]
        h = self.headers[f]
        _, _, a, b = h.entries[name]
        return f, h.data_start + a, h.data_start + b


def plan_units(base: _Base, adapter: Adapter, schema: Schema = SCHEMA) -> list[_Unit]:
    """Match every adapter tensor to its row and base tensor and check all shapes (no data read)."""
    found: dict[tuple[str, int | None], _Unit] = {}
    for name in adapter.tensors:
        m = schema.engine(name)
        if m is None:
            raise AdapterError(f"{adapter.tensors[name].stored}: not an adapter tensor of the schema")
        if isinstance(m.target.rule, Excluded):
            raise AdapterError(f"{adapter.tensors[name].stored}: {m.target.rule.why}; the schema excludes this module")
        key = (m.target.key, m.layer)
        u = found.get(key)
        if u is None:
            u = found[key] = _Unit(m.target, m.layer, {}, schema.fill(m.target.base, m.layer))
        u.factors[(m.module, m.side)] = name
    r = adapter.rank
    units = []
    for u in found.values():
        want = {(i, s) for i in range(len(u.target.engine)) for s in ("A", "B")}
        if set(u.factors) != want:
            have = next(iter(u.factors.values()))
            miss = [schema.engine_names(u.target, u.layer)[2 * i + (s == "B")][0] for i, s in sorted(want - set(u.factors))]
            raise AdapterError(f"{adapter.tensors[have].stored}: its pair is incomplete (missing {', '.join(miss)})")
        if u.base not in base.meta:
            raise AdapterError(f"{next(iter(u.factors.values()))}: the base checkpoint has no {u.base} to merge into")
        _check_shapes(u, base, adapter, r)
        units.append(u)
    return units


def _check_shapes(u: _Unit, base: _Base, adapter: Adapter, r: int) -> None:
    shp = {k: adapter.tensors[n].shape for k, n in u.factors.items()}
    for n in u.factors.values():
        if adapter.tensors[n].dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise AdapterError(f"{n}: dtype {adapter.tensors[n].dtype} is not a float factor")
    rule = u.target.rule

    def need(k: tuple[int, str], shape: tuple[int, ...]) -> None:
        got = shp[k]
        if tuple(got) != tuple(shape):
            raise AdapterError(f"{u.factors[k]}: shape {list(got)}, needs {list(shape)} (rank {r}, base {u.base})")

    wshape, wdtype = base.meta[u.base]
    if isinstance(rule, Linear):
        if len(wshape) != 2 or wdtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise AdapterError(f"{u.base}: {wdtype} {list(wshape)} is not a float linear to merge into")
        out, inp = wshape
        need((0, "A"), (r, inp))
        rows = shp[(0, "B")][0]
        if rule.trim_out is None or not 0 < rows <= out:
            need((0, "B"), (out, r))
        need((0, "B"), (rows, r))
        u.writes = [u.base]
        return
    stack = _expert_stack(u, base)
    E, rows, cols = stack.shape
    if isinstance(rule, ExpertsGateUp):
        F, H = rows // 2, cols
        for i in (0, 1):
            a = shp[(i, "A")][0]
            need((i, "A"), (a if a in (1, E) else 1, r, H))
            b = shp[(i, "B")][0]
            need((i, "B"), (b if b in (1, E) else E, F, r))
    elif isinstance(rule, ExpertsDown):
        H, F = rows, cols
        a = shp[(0, "A")][0]
        need((0, "A"), (a if a in (1, E) else E, r, F))
        b = shp[(0, "B")][0]
        need((0, "B"), (b if b in (1, E) else 1, H, r))
    u.stack = stack
    # rewritten expert by expert: the weight and its block scales; NVFP4's amax and denominator stay
    u.writes = [u.base + s for s in (WEIGHT, SCALE) if u.base + s in base.meta]


#: Parts that may sit beside a stacked expert weight (the union over the formats).
_EXPERT_PARTS = (SCALE, AMAX, DENOM)


def _expert_stack(u: _Unit, base: _Base) -> ExpertStack:
    """The stacked expert weight ``u.base`` of the base: format from its stored parts, shapes checked.

    A float weight of another dtype than BF16 (F16, F32) with no side parts merges as a float
    stack in its own dtype (``fmt`` "bf16", the unquantized release format)."""
    name = u.base
    wshape, wdtype = base.meta[name]
    dtypes = {s: base.meta[name + s][1] for s in (WEIGHT, *_EXPERT_PARTS) if name + s in base.meta}
    fmt = "bf16" if set(dtypes) == {WEIGHT} and wdtype in FLOAT_DTYPES else format_of_parts(dtypes)
    if fmt is None or len(wshape) != 3:
        listed = ", ".join(f"{name}{k} {v}".replace("torch.", "") for k, v in dtypes.items())
        raise CheckpointError(f"{name}: {listed} is no known expert format (BF16; F8_E4M3 + _scale (MXFP8); "
                              "U8 + _scale + _amax + _outer_scale_denominator (NVFP4))")
    pack = 2 if fmt == "nvfp4" else 1
    E, rows, stored_cols = wshape
    stack = ExpertStack(name, u.layer if u.layer is not None else -1, "w13" if isinstance(u.target.rule, ExpertsGateUp)
                        else "w2", (E, rows, stored_cols * pack), fmt, isinstance(u.target.rule, ExpertsGateUp))
    for spec in stack.parts():
        got = base.meta[spec.name][0]
        # the denominator: a scalar is written, [1] or [E] accepted on read (spec/inkling2.md)
        ok = tuple(got) == spec.shape or (spec.part == DENOM and tuple(got) in ((1,), (E,)))
        if not ok:
            raise CheckpointError(f"{spec.name}: shape {list(got)}, the {fmt} layout of {name} "
                                  f"{list(wshape)} needs {list(spec.shape)}")
    if fmt == "nvfp4":
        # merged experts are encoded with the kept amax over the release's denominator 2688
        den = base.get(name + DENOM)
        if not bool((den == NVFP4_DENOMINATOR).all()):
            raise CheckpointError(f"{name}{DENOM}: {den.reshape(-1)[0].item()}, not the release's "
                                  f"{NVFP4_DENOMINATOR:g}; merging keeps each expert's amax over that denominator")
    return stack


# ---- writing --------------------------------------------------------------------------------


class _Out:
    """Partial output files of one file group, opened with the base's exact header and size."""

    def __init__(self, st: Stage, base: _Base, files: list[str]):
        self.fh: dict[str, Any] = {}
        for f in files:
            h = base.headers[f]
            size = (base.root / f).stat().st_size
            fh = open(st.partial(f), "wb")
            fh.write(h.blob)
            fh.truncate(size)
            self.fh[f] = fh

    def write(self, f: str, pos: int, data: bytes | memoryview | torch.Tensor) -> None:
        fh = self.fh[f]
        fh.seek(pos)
        if isinstance(data, torch.Tensor):
            write_from(fh, data)  # a GPU tensor comes down through small pinned buffers
        else:
            fh.write(data)

    def close(self) -> None:
        for fh in self.fh.values():
            fh.close()


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # numpy types ndarray as a Buffer on 3.12+ only


@dataclass(frozen=True)
class _Step:
    """What one executor unit of the merge does (its ``data``).

    ``open`` starts a file group (the sink opens its partial files with the base's headers);
    ``copy`` carries bytes ``lo:hi`` of ``file`` over; ``linear`` merges rows ``lo:hi`` of a float
    linear; ``experts`` merges experts ``lo:hi`` of a stacked weight. ``last``: the tensor's last step.
    """

    kind: str
    group: int
    file: str = ""
    lo: int = 0
    hi: int = 0
    unit: _Unit | None = None
    last: bool = False


@dataclass
class _Got:
    """What a step produced: positioned writes, and what the result reports of it."""

    writes: list[tuple[str, int, memoryview | bytes | torch.Tensor]] = field(default_factory=list)
    changed: bool = False
    unchanged: int = 0
    measured: list[tuple[float, float]] = field(default_factory=list)  # per merged expert: signal, error (float64)


def _plan_steps(b: _Base, units: list[_Unit], groups: list[list[str]], slice_bytes: int, *,
                device_type: str = "cpu", measure: bool = False) -> list[Unit]:
    """Every group's steps in file order: an ``open``, then copies (contiguous spans up to
    ``COPY_CHUNK``) and merges (row chunks of a linear, expert slices of about ``slice_bytes`` of
    BF16 of a stack: ``--slice-mb``), each charged what it holds on the host (``_merge_steps``)."""
    unit_of = {n: u for u in units for n in u.writes}
    out: list[Unit] = []
    for g, files in enumerate(groups):
        out.append(Unit(f"open:{g}", "", 0, 0, (), _Step("open", g)))
        span: list[Any] = []  # [file, start, stop] of bytes to copy
        done: set[int] = set()
        names = sorted((n for f in files for n in b.headers[f].entries), key=lambda n: (b.where[n], b.span(n)[1]))
        for n in names:
            u = unit_of.get(n)
            if u is None:
                f, a, z = b.span(n)
                if span and span[0] == f and span[2] == a and span[2] - span[1] < COPY_CHUNK:
                    span[2] = z
                else:
                    out += _copy_steps(span, g)
                    span = [f, a, z]
                continue
            if id(u) in done:
                continue
            done.add(id(u))
            out += _copy_steps(span, g)
            span = []
            out += _merge_steps(b, u, g, slice_bytes, device_type=device_type, measure=measure)
        out += _copy_steps(span, g)
    return out


def _copy_steps(span: list[Any], g: int) -> list[Unit]:
    """Steps copying bytes ``start:stop`` of a file (``span``; empty: none), ``COPY_CHUNK`` at a time."""
    if not span:
        return []
    f, a, z = span
    return [Unit(f"copy:{f}:{lo}", f, min(z, lo + COPY_CHUNK) - lo, min(z, lo + COPY_CHUNK) - lo, (),
                 _Step("copy", g, f, lo, min(z, lo + COPY_CHUNK)), hold_bytes=max(1, min(z, lo + COPY_CHUNK) - lo))
            for lo in range(a, z, COPY_CHUNK)]  # the bytes read are what it writes


def _merge_steps(b: _Base, u: _Unit, g: int, slice_bytes: int, *, device_type: str = "cpu",
                 measure: bool = False) -> list[Unit]:
    """A tensor's merge steps, each charged (``hold_bytes``) what :class:`_Merger` holds of it on the host
    at once. A linear's rows: read, widened to float32 with the float32 delta beside them, written. An
    expert slice: its stored parts (read once, rewritten in place), and a piece at a time (``_pieces``)
    its stored parts twice (taken, encoded), one float32 delta (formed on the CPU), the codecs' chunk
    temporaries and the piece in float32 (with ``measure``, which decodes the result again and sums
    its error in float64, four times); on a GPU, where the parts are read and written, only the
    delta. A node-sized process (~500 MiB at the start) merging real-size NVFP4 experts with four
    workers peaked at 1.5 GiB while the slices were charged their stored bytes, and at 1.1 GiB with
    the whole slice decoded at once (charged 184 MiB a w13 expert, measured 182); a piece at a
    time ~70 MiB."""
    f = b.where[u.base]
    if u.stack is None:  # a float linear, a row chunk at a time
        (rows, cols), dtype = b.meta[u.base]
        row_bytes = cols * torch.empty((), dtype=dtype).element_size()
        step = max(1, ROW_CHUNK_ELEMS // max(1, cols))
        cuts = [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)] or [(0, 0)]
        return [Unit(f"{u.base}[{lo}:{hi}]", f, (hi - lo) * row_bytes, (hi - lo) * row_bytes, (),
                     _Step("linear", g, f, lo, hi, u, i == len(cuts) - 1),
                     hold_bytes=max(1, 2 * (hi - lo) * (row_bytes + cols * 4)))
                for i, (lo, hi) in enumerate(cuts)]
    E, rows, cols = u.stack.shape
    per = sum(b.span(n)[2] - b.span(n)[1] for n in u.writes) // max(1, E)

    def hold(n: int) -> int:
        piece = largest_piece(n, rows, cols, ROW_CHUNK_ELEMS, row_multiple=2)  # _pieces' largest
        delta = piece * 4 // (2 if isinstance(u.target.rule, ExpertsGateUp) else 1)  # one product B @ A
        if device_type != "cpu":  # parts, pieces and codecs on the GPU: the delta is formed on the host
            return delta
        widened = piece * 4 * (4 if measure else 1)
        return per * n + 2 * per * piece // (rows * cols) + delta + widened + ENCODE_WORKSPACE_BYTES
    cuts = expert_slices(u.stack, slice_bytes)
    return [Unit(f"{u.base}[{lo}:{hi}]", f, per * (hi - lo), per * (hi - lo), (),
                 _Step("experts", g, f, lo, hi, u, i == len(cuts) - 1), hold_bytes=hold(hi - lo))
            for i, (lo, hi) in enumerate(cuts)]


class _Merger:
    """The merge's transform: runs on the executor's worker threads, reads and returns, never writes.

    Decoding, adding and re-encoding experts run on ``device``; the deltas ``B @ A`` are formed on
    the CPU (a float32 matmul sums in a device-specific order, and the bytes must not depend on the
    device), and float linears are merged on the CPU (a cast, no codec)."""

    def __init__(self, base: _Base, adapter: Adapter, device: torch.device, measure: bool, passthrough_zero: bool):
        self.base, self.adapter, self.device = base, adapter, device
        self.measure, self.passthrough_zero = measure, passthrough_zero
        self.s = adapter.scale
        #: decode, add into and re-encode a slice's live experts in one piece (a GPU's way; the
        #: products still a piece at a time), else a piece at a time (the CPU's way: less memory)
        self.whole_slices = device.type != "cpu"

    def __call__(self, unit: Unit) -> _Got:
        s: _Step = unit.data
        if s.kind == "open":
            return _Got()
        if s.kind == "copy":
            return _Got([(s.file, s.lo, self._read(s.file, s.lo, s.hi))])
        if s.unit is None:
            raise ValueError(f"lora merge: step {unit.key} has no tensor")  # a planning bug, not bad input
        return self.linear(s.unit, s.lo, s.hi) if s.kind == "linear" else self.experts(s.unit, s.lo, s.hi)

    def _read(self, f: str, a: int, b: int) -> memoryview:
        # positioned reads (read_exact), as for the tensors: no buffered copy
        with open_regular(self.base.root / f, buffering=0) as src:
            return _bytes(read_exact(src.fileno(), a, b - a, f"{self.base.root / f}: truncated"))

    def factor(self, u: _Unit, k: tuple[int, str], first: int | None = None, last: int | None = None) -> torch.Tensor:
        """An adapter factor (or rows ``first:last`` of one) in float32; non-finite values refused."""
        n = u.factors[k]
        t = (self.adapter.get(n) if first is None or last is None else self.adapter.get_rows(n, first, last)).to(torch.float32)
        if not bool(torch.isfinite(t).all()):
            raise AdapterError(f"{self.adapter.tensors[n].stored}: holds NaN or Inf")
        return t

    def linear(self, u: _Unit, r0: int, r1: int) -> _Got:
        """Rows ``r0:r1`` of a merged float linear (B's rows beyond its own count add nothing)."""
        A = self.factor(u, (0, "A"))
        b_rows = self.adapter.tensors[u.factors[(0, "B")]].shape[0]
        b0, b1 = min(r0, b_rows), min(r1, b_rows)
        B = self.factor(u, (0, "B"), b0, b1) if b1 > b0 else None
        f, start, _ = self.base.span(u.base)
        (_, cols), dtype = self.base.meta[u.base]
        row_bytes = cols * torch.empty((), dtype=dtype).element_size()
        # finite factors: B @ A is exactly zero when either factor is (no need to form it)
        live = B is not None and not (self.passthrough_zero and (not bool(A.any()) or not bool(B.any())))
        w = self.base.read_rows(u.base, r0, r1)
        if live and B is not None:
            delta = B @ A
            delta.mul_(self.s)  # W + s * (B @ A), rounded in that order
            m = w.to(torch.float32)
            m[: b1 - b0] += delta
            merged = m.to(dtype)
            self.check_finite(merged, w, f"{u.base} rows {r0}:{r1}")
            w = merged
        return _Got([(f, start + r0 * row_bytes, _bytes(w))], changed=live)

    def check_finite(self, merged: torch.Tensor, base: torch.Tensor, where: str) -> None:
        """AdapterError where the merge made a finite base value infinite (the factors are finite:
        the product or the cast to the stored dtype overflowed)."""
        if overflow_at(merged, lambda: base) is not None:
            raise AdapterError(f"{where}: W + (alpha/r) * B @ A overflows {str(merged.dtype).removeprefix('torch.')} "
                               f"(alpha/r = {self.s:g}); the adapter's scale or factors are too large")

    def experts(self, u: _Unit, first: int, last: int) -> _Got:
        """Experts ``first:last`` of a merged stacked weight, a piece (``_pieces``) at a time (on a
        GPU, ``whole_slices``: the slice's live experts at once, the products still a piece at a time).

        The new parts are written over the slice's stored parts as each piece is done (a piece
        reads only its own rows, and an expert with a zero delta keeps its base bytes), so the
        slice's parts are held once, and its float32 only a piece at a time: ~16 MiB whatever the
        expert's size, where the whole slice in float32 was 4x its BF16 (a real-size w13 expert:
        84 MiB, with its 42 MiB delta beside it)."""
        stack = u.stack or _expert_stack(u, self.base)
        fmt, (_, rows, cols) = stack.fmt, stack.shape
        wdtype = self.base.meta[u.base][1]
        gate_up = isinstance(u.target.rule, ExpertsGateUp)
        shared = {k: self.factor(u, k)[0] for k, n in u.factors.items() if self.adapter.tensors[n].shape[0] == 1}
        pairs = [(0, "B", 0, "A"), (1, "B", 1, "A")] if gate_up else [(0, "B", 0, "A")]
        spans = {n[len(u.base):]: self.base.span(n) for n in u.writes}  # weight, block scales
        per = {s: (b - a) // stack.shape[0] for s, (_, a, b) in spans.items()}
        got = _Got()
        fac = {k: self.factor(u, k, first, last) for k in u.factors if k not in shared}
        dev = self.device
        # on a GPU the parts are read straight onto it and written from it: the host holds none of them
        parts = _read_parts(self.base, stack, first, last, None if dev.type == "cpu" else dev)
        live: dict[int, list[tuple[int, str, int, str]]] = {}  # slice index -> its non-zero products
        for j in range(last - first):
            f_j = {k: shared[k] if k in shared else fac[k][j] for k in u.factors}
            # which products are non-zero (finite factors: zero iff a factor is all zero)
            lp = [p for p in pairs if not self.passthrough_zero or (bool(f_j[p[:2]].any()) and bool(f_j[p[2:]].any()))]
            if lp:
                live[j] = lp
            else:
                got.unchanged += 1
        measured: dict[int, list[float]] = {j: [0.0, 0.0] for j in live}
        cuts = _pieces(list(live), rows, cols)
        # The products B @ A are formed on the CPU piece by piece (`cuts`), the same calls on every
        # device; with whole_slices (a GPU) the slice's live experts are decoded, added into and
        # re-encoded in one piece (the slice is bounded by --slice-mb): a fifth of the launches and
        # host checks of a piece at a time (a real w13 expert is five pieces), the same bytes (the
        # codecs work block by block).
        whole = self.whole_slices and bool(live)
        # host pieces decode into one buffer, and the products form in another (PieceBuffer)
        decoded = PieceBuffer() if dev.type == "cpu" else None
        products = PieceBuffer()
        for js, r0, r1 in [(list(live), 0, rows)] if whole else cuts:
            piece = {k: t.contiguous() for k, t in cut_piece(parts, js, r0, r1).items()}
            x = _decode(fmt, piece, u.base, None if decoded is None else decoded.take(len(js), r1 - r0, cols))
            # w13 rows are gate/up interleaved on disk: gate rows 0::2 (w1), up rows 1::2 (w3); a
            # piece starts on an even row, so its gate rows are B's rows r0/2:r1/2
            halves = deinterleave(x) if gate_up else None
            at = {j: i_x for i_x, j in enumerate(js)}
            for cjs, c0, c1 in cuts if whole else [(js, r0, r1)]:
                b0, b1 = (c0 // 2, c1 // 2) if gate_up else (c0, c1)  # B's rows
                o0, o1 = (b0 - r0 // 2, b1 - r0 // 2) if gate_up else (b0 - r0, b1 - r0)  # the same rows of x
                for j in cjs:
                    f_j = {k: shared[k] if k in shared else fac[k][j] for k in u.factors}
                    for i, bs, jj, as_ in live[j]:
                        a_j = f_j[(jj, as_)]
                        d = torch.matmul(f_j[(i, bs)][b0:b1], a_j, out=products.take(b1 - b0, a_j.shape[1]))
                        d.mul_(self.s)  # W + s * (B @ A), rounded in that order
                        rows_of = x[at[j]] if halves is None else halves[i][at[j]]
                        rows_of[o0:o1].add_(d if dev.type == "cpu" else d.to(dev))
                    del d
            where = f"{u.base} experts {[first + j for j in js][:4]}"
            try:
                enc = _encode(fmt, x, piece, wdtype, u.base)
            except NonFiniteError:
                # the base's own non-finite blocks, or the merge's overflow: the base piece tells
                self.check_finite(x, _decode(fmt, piece, u.base), where)
                raise CheckpointError(f"{u.base}: the base holds non-finite values where the adapter changes it; "
                                      "lora merge re-encodes only finite weights") from None
            if fmt == "bf16":
                self.check_finite(enc[WEIGHT], piece[WEIGHT], where)
            if self.measure and fmt != "bf16":
                back = _decode(fmt, {**piece, **{s: enc[s] for s in spans}}, u.base)
                for i_x, j in enumerate(js):
                    measured[j][0] += float(x[i_x].double().square().sum())
                    measured[j][1] += float((back[i_x] - x[i_x]).double().square().sum())
                del back
            del x, halves, piece
            for s in spans:
                _put(parts[s], js, r0, r1, enc[s])
            got.changed = True
        got.measured = [(sig, err) for sig, err in measured.values()]
        for s in spans:
            f, a, _ = spans[s]
            got.writes.append((f, a + first * per[s], parts[s]))  # on a GPU: written from it
        return got


def _extents(base: _Base, unit: Unit) -> list[Extent]:
    """The base's byte ranges a step reads (its copy span, a linear's rows, an expert slice's
    stored parts), for the executor's read-ahead; the adapter's factors are left to the step."""
    s: _Step = unit.data
    if s.kind == "copy":
        return [(base.root / s.file, s.lo, s.hi - s.lo)]
    if s.unit is None:
        return []
    if s.kind == "linear":
        f, start, stop = base.span(s.unit.base)
        rows = base.meta[s.unit.base][0][0]
        row = (stop - start) // max(1, rows)
        return [(base.root / f, start + s.lo * row, (s.hi - s.lo) * row)]
    out: list[Extent] = []
    stack = s.unit.stack
    if stack is None:
        return out
    for p in stack.parts():
        f, a, z = base.span(p.name)
        shape = base.meta[p.name][0]
        if shape and shape[0] == stack.shape[0]:  # one block of bytes per expert
            per = (z - a) // shape[0]
            a, z = a + s.lo * per, a + s.hi * per
        out.append((base.root / f, a, z - a))
    return out


def _pieces(live: list[int], rows: int, cols: int) -> list[tuple[list[int], int, int]]:
    """The merge's pieces of a slice's live experts (slice indices) of about ``ROW_CHUNK_ELEMS``
    elements each (``convert.experts.expert_pieces``; an expert's rows in gate/up pairs)."""
    return expert_pieces(live, rows, cols, ROW_CHUNK_ELEMS, row_multiple=2)



def _put(t: torch.Tensor, js: list[int], r0: int, r1: int, value: torch.Tensor) -> None:
    """Write ``value`` over rows ``r0:r1`` of experts ``js`` of the stored part ``t`` (in place)."""
    t[expert_index(js), r0:r1] = value


def _read_parts(base: _Base, stack: ExpertStack, first: int, last: int,
                device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """Experts ``first:last`` of a stacked weight's stored parts (an [E] denominator sliced too), on ``device``."""
    parts = read_parts(base, stack, first, last, device=device)  # type: ignore[arg-type]
    den = parts.get(DENOM)
    if den is not None and den.numel() > 1:
        parts[DENOM] = den.reshape(-1)[first:last]
    return parts


def _decode(fmt: str, parts: dict[str, torch.Tensor], name: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [n, rows, cols] of stored experts (exact for every format; float stacks in any dtype),
    into ``out`` when given."""
    if fmt == "bf16":
        return parts[WEIGHT].to(torch.float32) if out is None else out.copy_(parts[WEIGHT])
    return decode_stacked(fmt, parts, torch.float32, name=name, out=out)


def _encode(fmt: str, x: torch.Tensor, kept: dict[str, torch.Tensor], wdtype: torch.dtype,
            name: str) -> dict[str, torch.Tensor]:
    """Stored parts of merged float32 experts: float stacks cast back to their dtype, MXFP8 with
    fresh block scales, NVFP4 with each expert's kept amax (the denominator is 2688, checked)."""
    if fmt == "bf16":
        return {WEIGHT: x.to(wdtype)}
    if fmt == "mxfp8":
        return encode_stacked(fmt, x, name=name)
    enc = encode_stacked(fmt, x, name=name, amax=kept[AMAX])
    if not torch.equal(enc[AMAX], kept[AMAX]):  # a subnormal amax would be encoded as 1.0
        i = int(torch.nonzero(enc[AMAX] != kept[AMAX])[0])
        raise CheckpointError(f"{name}{AMAX}: {float(kept[AMAX][i])} cannot be kept (below 2^-126)")
    return enc


def _file_groups(base: _Base, units: list[_Unit]) -> list[list[str]]:
    """Shard files that must be finished together (a unit writing into several shards joins them)."""
    parent = {f: f for f in base.files}

    def find(f: str) -> str:
        while parent[f] != f:
            parent[f] = parent[parent[f]]
            f = parent[f]
        return f

    for u in units:
        fs = [base.where[n] for n in u.writes]
        for f in fs[1:]:
            parent[find(f)] = find(fs[0])
    groups: dict[str, list[str]] = defaultdict(list)
    for f in base.files:
        groups[find(f)].append(f)
    return list(groups.values())


def _identity(path: Path) -> list[Any]:
    """What the job fingerprint knows of an input: its files' names, sizes and mtimes."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return [[str(p.relative_to(path) if p != path else p.name), p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def plan_merge(base: str | Path, adapter: str | Path) -> tuple[list[dict[str, Any]], int, int]:
    """What a merge would do, from headers only: per adapted base tensor, its row, layer, format
    and the tensors rewritten; and the bytes of the base's shard files (what a merge writes again)
    and of the adapter's weights. Raises the same errors the merge would, before any writing."""
    b = _Base(Path(base))
    ad = Adapter.open(Path(adapter))
    try:
        units = plan_units(b, ad)
    finally:
        b.close()
        ad.close()
    rows = [{"base": u.base, "module": u.target.key, "layer": u.layer,
             "format": u.stack.fmt if u.stack else DTYPE_NAMES.get(b.meta[u.base][1], str(b.meta[u.base][1])),
             "rewrites": u.writes, "bytes": sum(b.span(n)[2] - b.span(n)[1] for n in u.writes)} for u in units]
    return rows, _files_bytes(b.root, b.files), _files_bytes(ad.root, [WEIGHTS_FILE])


def _files_bytes(root: Path, files: list[str]) -> int:
    """Bytes of ``files`` in ``root`` (sizes only)."""
    return sum((root / f).stat().st_size for f in files)


DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


def merge(base: str | Path, adapter: str | Path, dst: str | Path, *, force: bool = False, progress: bool = True,
          measure: bool = False, passthrough_zero: bool = True, options: Options | None = None) -> MergeResult:
    """Write ``dst``: the base release checkpoint with the adapter merged (see the module docstring).

    ``measure``: report the SQNR of every merged quantized expert tensor against its float32
    merged value. ``passthrough_zero=False`` re-encodes experts even when their delta is zero
    (for testing the codec round trip). ``options``: device, slice budget and workers (default
    ``--device auto``); under torchrun the ranks split the base's file groups and publish one checkpoint.
    """
    base_p, ad_p, dst_p = Path(base), Path(adapter), Path(dst)
    check_dst(dst_p, [base_p, ad_p])
    b = _Base(base_p)
    ad = Adapter.open(ad_p)
    try:
        units = plan_units(b, ad)
        job = {"what": "lora-merge", "base": str(base_p.resolve()), "base_files": _identity(base_p),
               "adapter": str(ad_p.resolve()), "adapter_files": _identity(ad_p), "passthrough_zero": passthrough_zero}
        # On a GPU a merge still copies, merges float linears and forms deltas on the host: 8 workers
        # (the GPU default) ran it in 14.3-18.7 s at 1083-1116 MiB peak RSS on the H200 machine
        # (8-layer wide fixture), 4 in 12.8 s at 1000 MiB.
        ex = Executor(options or Options(progress=progress), desc="lora merge", gpu_workers=MAX_DEFAULT_WORKERS,
                      host_math=True)
        return _merge_into(b, ad, units, dst_p, job, force, measure, passthrough_zero, ex)
    finally:
        b.close()
        ad.close()


def _merge_into(b: _Base, ad: Adapter, units: list[_Unit], dst_p: Path, job: dict, force: bool, measure: bool,
                passthrough_zero: bool, ex: Executor) -> MergeResult:
    t0 = time.perf_counter()
    groups = _file_groups(b, units)
    steps = _plan_steps(b, units, groups, ex.slice_bytes, device_type=ex.device.type, measure=measure)
    sizes = [_files_bytes(b.root, files) for files in groups]
    owner = assign(dict(enumerate(sizes)), ex.world.size)
    order = {id(u): i for i, u in enumerate(steps)}
    transform = _Merger(b, ad, ex.device, measure, passthrough_zero)

    def work(stage: Stage) -> dict[str, Any]:
        mine = [u for u in steps if owner[u.data.group] == stage.rank]
        finished = {g for g in set(owner) if owner[g] == stage.rank and all(stage.is_finished(f) for f in groups[g])}
        todo = [u for u in mine if u.data.group not in finished]
        reused = [u for u in mine if u.data.group in finished]
        local: dict[str, Any] = {"changed": [], "sqnr": [], "unchanged": 0, "files": 0}
        acc: dict[str, list[Any]] = {}  # tensor -> [changed, signal, error]
        cur: list[Any] = []  # [group, _Out] being written
        lane = Lane("inkling-fsync")  # finished groups made durable and renamed while the next is written

        def close_group() -> None:
            if cur:
                g, out = cur
                out.close()
                cur.clear()
                for f in groups[g]:
                    lane.submit(stage.finish, f)
                local["files"] += len(groups[g])

        def sink(unit: Unit, got: _Got) -> None:
            s: _Step = unit.data
            if s.kind == "open":
                close_group()
                cur.extend([s.group, _Out(stage, b, groups[s.group])])
                return
            out = cur[1]
            for f, pos, data in got.writes:
                out.write(f, pos, data)
            if s.unit is None:
                return
            local["unchanged"] += got.unchanged
            a = acc.setdefault(s.unit.base, [False, 0.0, 0.0])
            a[0] = a[0] or got.changed
            for sig, sq in got.measured:  # summed expert by expert, in order
                a[1] += sig
                a[2] += sq
            if s.last:
                changed, sig, sq = acc.pop(s.unit.base)
                if changed:
                    local["changed"].append((order[id(unit)], s.unit.writes))
                    if measure and s.unit.stack is not None and s.unit.stack.fmt != "bf16":
                        local["sqnr"].append((order[id(unit)], s.unit.base,
                                              math.inf if sq == 0 else 10 * math.log10(sig / sq)))

        try:
            ex.run(todo, transform, sink, reused=reused, extents=lambda u: _extents(b, u))
            close_group()
            lane.settle()
        except BaseException:
            if cur:  # an interruption keeps the groups finished so far for a resume
                cur[1].close()
            raise
        finally:
            lane.close()  # the groups handed over before an interruption are finished too
        return local

    def finish(stage: Stage, _: Any) -> None:
        # config, index, tokenizer, subfolders, …: carried verbatim by the one pass-through rule
        # (shards, in a subfolder too, were written by the ranks)
        shards = set(b.files)
        for rel, p in pass_through(b.root, skip=shards.__contains__, subfolders=True).items():
            copy_new(p, stage.path / rel)

    outcome = run_staged(dst_p, job, ex.world, work, finish, force=force, inputs=[b.root, ad.root])
    res = MergeResult(dst_p, skipped=outcome.skipped)
    if outcome.skipped:
        return res
    every = gather(outcome.value, ex.world)
    stats = ex.finish()
    res.add_ranks(stats, seconds=time.perf_counter() - t0)
    for _, names in sorted(c for r in every for c in r["changed"]):
        res.changed.extend(names)
    res.sqnr = {name: db for _, name, db in sorted(c for r in every for c in r["sqnr"])}
    res.unchanged_experts = sum(r["unchanged"] for r in every)
    res.files = sum(r["files"] for r in every)
    res.tensors = len(b.where)
    res.bytes = sum(sizes)
    return res


__all__ = ["MergeResult", "merge", "plan_merge", "plan_units"]
