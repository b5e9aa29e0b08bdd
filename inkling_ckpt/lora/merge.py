"""``lora merge``: bake an engine adapter into a release checkpoint, W' = W + (alpha/r) * B @ A.

The output has the base's files, headers and tensor order byte for byte; only adapted tensors
change. Each is decoded to float32 (quantized experts expert by expert), the delta is added in
float32, and the result is re-encoded in the tensor's own format with the base's kept global
scales (NVFP4: the per-expert ``amax`` and denominator stay; MXFP8: fresh block scales; float
tensors: cast back to their dtype). An expert or tensor whose delta is exactly zero keeps its
base bytes, so a zero adapter reproduces the base checkpoint byte for byte.

Memory: one expert (or one row chunk of the unembed) at a time. Output: staged beside the
destination, one group of shard files finished at a time (resumable), published by rename.
"""

from __future__ import annotations

import math
import shutil
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import AdapterError, CheckpointError, OutputError
from ..layouts.hf import INDEX
from ..layouts.sharded import raw_header
from ..layouts.staging import Staging
from ..progress import ByteProgress
from . import _stacked
from .io import Adapter, TensorFile, read_json
from .schema import SCHEMA, Excluded, ExpertsDown, ExpertsGateUp, Linear, Schema, Target

SINGLE = "model.safetensors"
ROW_CHUNK_ELEMS = 1 << 22  # a big linear (the unembed) is merged ~4M elements (16 MiB in float32) at a time
COPY_CHUNK = 64 << 20


@dataclass
class MergeResult:
    dst: Path
    skipped: bool = False
    resumed: bool = False
    files: int = 0
    changed: list[str] = field(default_factory=list)  # base tensors rewritten
    unchanged_experts: int = 0  # experts whose delta was zero (base bytes kept)
    bytes: int = 0
    sqnr: dict[str, float] = field(default_factory=dict)  # quantized base tensor -> dB vs float reference


@dataclass
class _Unit:
    """One adapted base tensor: its row, layer, adapter tensor names and the base tensors it writes."""

    target: Target
    layer: int | None
    factors: dict[tuple[int, str], str]  # (engine module index, side) -> adapter name
    base: str
    fmt: _stacked.StackedFormat | None = None  # experts only
    writes: list[str] = field(default_factory=list)  # base tensors rewritten (weight + per-expert parts)


class _Base:
    """The base release checkpoint: weight map (inside the folder), exact headers, lazy handles."""

    def __init__(self, root: Path):
        self.root = root
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
        rr = root.resolve()
        for f in files:
            p = (root / str(f)).resolve()
            if rr not in p.parents or not p.is_file():
                raise CheckpointError(f"{root}: shard {f!r} is missing or outside the folder")
        self.files = files
        self.headers = {f: raw_header(root / f) for f in files}
        self.where: dict[str, str] = {}
        for f, h in self.headers.items():
            for n in h.entries:
                if n in self.where:
                    raise CheckpointError(f"{n}: in both {self.where[n]} and {f}")
                self.where[n] = f
        if (root / INDEX).is_file():
            bad = [n for n, f in wm.items() if self.where.get(n) != f]
            if bad:
                raise CheckpointError(f"{root / INDEX}: {bad[0]} is not in {wm[bad[0]]}")
        self.meta = {n: (self.headers[f].entries[n][0], self.headers[f].entries[n][1]) for n, f in self.where.items()}
        self._files: dict[str, TensorFile] = {}

    def _file(self, name: str) -> TensorFile:
        f = self.where[name]
        if f not in self._files:
            self._files[f] = TensorFile(self.root / f)
        return self._files[f]

    def get(self, name: str) -> torch.Tensor:
        return self._file(name).read(name)

    def rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        return self._file(name).read(name, lo, hi)

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
    for k, n in u.factors.items():
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
    fmt = _stacked.detect(u.base, base.meta)
    E, rows, cols = _stacked.logical_shape(fmt, wshape)
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
    u.fmt = fmt
    u.writes = [u.base] + [u.base + s for s in fmt.per_expert]


# ---- writing --------------------------------------------------------------------------------


class _Out:
    """Partial output files of one file group, opened with the base's exact header and size."""

    def __init__(self, st: Staging, base: _Base, files: list[str]):
        self.fh: dict[str, Any] = {}
        for f in files:
            h = base.headers[f]
            size = (base.root / f).stat().st_size
            fh = open(st.partial(f), "wb")
            fh.write(h.blob)
            fh.truncate(size)
            self.fh[f] = fh

    def write(self, f: str, pos: int, data: bytes | memoryview) -> None:
        fh = self.fh[f]
        fh.seek(pos)
        fh.write(data)

    def close(self) -> None:
        for fh in self.fh.values():
            fh.close()


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


class _Merger:
    def __init__(self, base: _Base, adapter: Adapter, out: _Out, res: MergeResult, advance: Callable[[int], None],
                 measure: bool, passthrough_zero: bool):
        self.base, self.adapter, self.out, self.res = base, adapter, out, res
        self.advance, self.measure, self.passthrough_zero = advance, measure, passthrough_zero
        self.s = adapter.scale

    def copy(self, name: str) -> None:
        f, a, b = self.base.span(name)
        with open(self.base.root / f, "rb") as src:
            src.seek(a)
            pos = a
            while pos < b:
                chunk = src.read(min(COPY_CHUNK, b - pos))
                if not chunk:
                    raise CheckpointError(f"{self.base.root / f}: truncated inside {name}")
                self.out.write(f, pos, chunk)
                pos += len(chunk)
        self.advance(b - a)

    def factor(self, u: _Unit, k: tuple[int, str], e: int | None = None) -> torch.Tensor:
        """An adapter factor (or expert ``e`` of a stacked one) in float32; non-finite values refused."""
        n = u.factors[k]
        t = (self.adapter.get(n) if e is None else self.adapter.get_rows(n, e, e + 1)[0]).to(torch.float32)
        if not bool(torch.isfinite(t).all()):
            raise AdapterError(f"{self.adapter.tensors[n].stored}: holds NaN or Inf")
        return t

    def linear(self, u: _Unit) -> None:
        A = self.factor(u, (0, "A"))
        B = self.factor(u, (0, "B"))
        f, start, _ = self.base.span(u.base)
        shape, dtype = self.base.meta[u.base]
        out_rows, cols = shape
        row_bytes = cols * torch.empty((), dtype=dtype).element_size()
        changed = False
        zero_a = not bool(A.any())
        step = max(1, ROW_CHUNK_ELEMS // max(1, cols))
        for r0 in range(0, out_rows, step):
            r1 = min(out_rows, r0 + step)
            b0, b1 = min(r0, B.shape[0]), min(r1, B.shape[0])
            # finite factors: B @ A is exactly zero when either factor is (no need to form it)
            live = b1 > b0 and not (self.passthrough_zero and (zero_a or not bool(B[b0:b1].any())))
            w = self.base.rows(u.base, r0, r1)
            if live:
                delta = B[b0:b1] @ A
                delta.mul_(self.s)  # W + s * (B @ A), rounded in that order
                m = w.to(torch.float32)
                m[: b1 - b0] += delta
                w = m.to(dtype)
                changed = True
            self.out.write(f, start + r0 * row_bytes, _bytes(w))
            self.advance((r1 - r0) * row_bytes)
        if changed:
            self.res.changed.append(u.base)

    def experts(self, u: _Unit) -> None:
        fmt = u.fmt or _stacked.detect(u.base, self.base.meta)
        shape, wdtype = self.base.meta[u.base]
        E = shape[0]
        kept = {s: self.base.get(u.base + s) for s in fmt.kept}
        gate_up = isinstance(u.target.rule, ExpertsGateUp)
        shared = {}  # factors with expert axis 1, read once
        for k, n in u.factors.items():
            if self.adapter.tensors[n].shape[0] == 1:
                shared[k] = self.factor(u, k)[0]
        pairs = [(0, "B", 0, "A"), (1, "B", 1, "A")] if gate_up else [(0, "B", 0, "A")]
        spans = {s: self.base.span(u.base + s) for s in ["", *fmt.per_expert]}
        per = {s: (b - a) // E for s, (_, a, b) in spans.items()}
        sig = sq = 0.0
        changed = False
        for e in range(E):
            fac = {k: shared[k] if k in shared else self.factor(u, k, e) for k in u.factors}
            # which products are non-zero (finite factors: zero iff a factor is all zero)
            live = [p for p in pairs if not self.passthrough_zero or (bool(fac[p[:2]].any()) and bool(fac[p[2:]].any()))]
            parts = {s: self.base.rows(u.base + s, e, e + 1)[0] for s in ["", *fmt.per_expert]}
            if not live:
                new = parts
                self.res.unchanged_experts += 1
            else:
                x = _stacked.decode_expert(fmt, parts, kept, e)
                # w13 rows are gate/up interleaved on disk: gate rows 0::2 (w1), up rows 1::2 (w3)
                rows = x.view(x.shape[0] // 2, 2, x.shape[1]) if gate_up else None
                for i, bs, j, as_ in live:
                    d = fac[(i, bs)] @ fac[(j, as_)]
                    d.mul_(self.s)  # W + s * (B @ A), rounded in that order
                    if rows is None:
                        x += d
                    else:
                        rows[:, i].add_(d)
                new = _stacked.encode_expert(fmt, x, kept, e, wdtype)
                changed = True
                if self.measure and fmt.name != "bf16":
                    err = _stacked.decode_expert(fmt, new, kept, e) - x
                    sig += float(x.double().square().sum())
                    sq += float(err.double().square().sum())
            for s, t in new.items():
                f, a, _ = spans[s]
                self.out.write(f, a + e * per[s], _bytes(t))
            self.advance(sum(per.values()))
        if changed:
            self.res.changed.extend(u.writes)
        if self.measure and fmt.name != "bf16" and changed:
            self.res.sqnr[u.base] = math.inf if sq == 0 else 10 * math.log10(sig / sq)


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


def check_output_path(dst: Path, *inputs: Path) -> None:
    """Never write into, over or around an input."""
    d = dst.resolve()
    for i in inputs:
        r = i.resolve()
        if d == r or r in d.parents or d in r.parents:
            raise OutputError(f"{dst}: overlaps the input {i}; choose another destination")


def plan_merge(base: str | Path, adapter: str | Path) -> list[dict[str, Any]]:
    """What a merge would do, from headers only: per adapted base tensor, its row, layer, format
    and the tensors rewritten. Raises the same errors the merge would, before any writing."""
    b = _Base(Path(base))
    ad = Adapter.open(Path(adapter))
    try:
        units = plan_units(b, ad)
    finally:
        b.close()
        ad.close()
    return [{"base": u.base, "module": u.target.key, "layer": u.layer,
             "format": u.fmt.name if u.fmt else DTYPE_NAMES.get(b.meta[u.base][1], str(b.meta[u.base][1])),
             "rewrites": u.writes, "bytes": sum(b.span(n)[2] - b.span(n)[1] for n in u.writes)} for u in units]


DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}


def merge(base: str | Path, adapter: str | Path, dst: str | Path, *, force: bool = False, progress: bool = True,
          measure: bool = False, passthrough_zero: bool = True) -> MergeResult:
    """Write ``dst``: the base release checkpoint with the adapter merged (see the module docstring).

    ``measure``: report the SQNR of every merged quantized expert tensor against its float32
    merged value. ``passthrough_zero=False`` re-encodes experts even when their delta is zero
    (for testing the codec round trip).
    """
    base_p, ad_p, dst_p = Path(base), Path(adapter), Path(dst)
    check_output_path(dst_p, base_p, ad_p)
    b = _Base(base_p)
    ad = Adapter.open(ad_p)
    units = plan_units(b, ad)
    job = {"what": "lora-merge", "base": str(base_p.resolve()), "base_files": _identity(base_p),
           "adapter": str(ad_p.resolve()), "adapter_files": _identity(ad_p), "passthrough_zero": passthrough_zero}
    res = MergeResult(dst_p)
    try:
        _merge_into(b, ad, units, dst_p, job, force, progress, measure, passthrough_zero, res)
    finally:
        b.close()
        ad.close()
    return res


def _merge_into(b: _Base, ad: Adapter, units: list[_Unit], dst_p: Path, job: dict, force: bool, progress: bool,
                measure: bool, passthrough_zero: bool, res: MergeResult) -> None:
    unit_of = {n: u for u in units for n in u.writes}
    with Staging(dst_p, job, force) as st:
        if st.done:
            res.skipped = True
            return
        res.resumed = st.resumed
        total = sum((b.root / f).stat().st_size for f in b.files)
        with ByteProgress(total, desc="lora merge", enabled=progress) as bar:
            for files in _file_groups(b, units):
                if all(st.is_finished(f) for f in files):
                    bar.advance(sum((b.root / f).stat().st_size for f in files))
                    continue
                out = _Out(st, b, files)
                try:
                    mg = _Merger(b, ad, out, res, bar.advance, measure, passthrough_zero)
                    done: set[int] = set()
                    names = sorted((n for f in files for n in b.headers[f].entries), key=lambda n: (b.where[n], b.span(n)[1]))
                    for n in names:
                        u = unit_of.get(n)
                        if u is None:
                            mg.copy(n)
                        elif id(u) not in done:
                            done.add(id(u))
                            (mg.linear if isinstance(u.target.rule, Linear) else mg.experts)(u)
                finally:
                    out.close()
                for f in files:
                    st.finish(f)
                res.files += len(files)
            for p in sorted(b.root.iterdir()):  # config, index, tokenizer, …: carried verbatim
                if p.name.startswith(".") or p.name in b.files:
                    continue
                if p.is_dir():  # (shards in a subfolder were written above: not copied over)
                    shards = set(b.files)
                    shutil.copytree(p, st.path / p.name, dirs_exist_ok=True, ignore=lambda d, names: [
                        n for n in names if (Path(d) / n).relative_to(b.root).as_posix() in shards])
                elif p.is_file():
                    shutil.copyfile(p, st.path / p.name)
        res.bytes = total


__all__ = ["MergeResult", "merge", "plan_merge", "plan_units", "check_output_path"]
