"""Trainer LoRA factors (Megatron-Bridge names) -> engine adapter tensors (PEFT names), in groups.

    conv = LoraExport(alpha=32, dims=ModelDims.from_config(cfg))
    for bucket in conv.buckets(trainer_named_lora_tensors()):        # (megatron_name, tensor)
        send(bucket.named_tensors)                                   # (engine_name, bf16 tensor)

Input tensors are whole, or an EP rank's slice of the per-expert factors with ``expert_offset``
(feed every rank's slice; the shared factors each rank holds must be identical). A load group is
one adapter module: A and B of a linear, or all of a layer's w1/w3 (or w2) factors, emitted once
both halves and every expert arrived. Errors name the tensor (:class:`AdapterError`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import AdapterError, NonFiniteError, PlanError
from .buckets import DEFAULT_BUCKET_BYTES, AdapterGroup, Bucket, pack
from .schema import SCHEMA, ExpertsDown, ExpertsGateUp, Excluded, Linear, ModelDims, Schema, Target, positive_number

#: The engine dtype (spec/lora.md: every adapter tensor BF16).
ENGINE_DTYPE = torch.bfloat16
DEFAULT_TARGET_MODULES = "all-linear"


def adapter_config(rank: int, alpha: float, target_modules: Any = DEFAULT_TARGET_MODULES) -> dict[str, Any]:
    """The engine's ``adapter_config.json`` (spec/lora.md; read by peft, SGLang, vLLM)."""
    return {"peft_type": "LORA", "r": int(rank), "lora_alpha": alpha, "target_modules": target_modules,
            "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}


@dataclass
class _Pending:
    """Factors of one (row, layer) collected so far."""

    target: Target
    layer: int | None
    shared: dict[str, tuple[torch.Tensor, str]] = field(default_factory=dict)  # side -> (tensor, first name)
    whole: dict[str, tuple[torch.Tensor, str]] = field(default_factory=dict)  # side -> (tensor, name) (Linear)
    experts: dict[str, tuple[torch.Tensor, torch.Tensor, str]] = field(default_factory=dict)  # side -> (buf, covered, name)
    sources: list[str] = field(default_factory=list)


class LoraExport:
    """Rename and reshape trainer LoRA factors into the engine schema, in load groups and buckets.

    Args:
        alpha: ``lora_alpha`` (scaling is ``alpha / r``); only recorded in :meth:`config`.
        rank: the adapter rank; default: taken from the first factor seen (all must agree).
        dims: the model's dimensions (:class:`ModelDims`); when given, every factor's shape is
            checked against the base module and the unembed B is trimmed to the unpadded vocabulary.
        num_experts: routed experts (default: ``dims``; without either, per-expert factors must be
            whole, i.e. start at expert 0).
        bucket_bytes: byte budget per bucket (groups are never split).
        cast: accept float32/float16 trainer factors and round them to BF16 (else an error).
        allow_nonfinite: send factors holding NaN/Inf (else :class:`NonFiniteError`, as the CLI).

    Every factor must hold data (a tensor on the meta device is refused: only :func:`plan` runs
    the conversion on shapes) and finite values unless ``allow_nonfinite``.
    """

    def __init__(self, *, alpha: float, rank: int | None = None, dims: ModelDims | None = None,
                 num_experts: int | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES, cast: bool = False,
                 schema: Schema = SCHEMA, allow_nonfinite: bool = False):
        if int(bucket_bytes) <= 0:
            raise PlanError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if rank is not None and int(rank) <= 0:
            raise PlanError(f"rank must be positive, got {rank}")
        self.alpha = alpha
        self.rank = None if rank is None else int(rank)
        self.dims = dims
        self.num_experts = num_experts if num_experts is not None else (dims.num_experts if dims else None)
        self.bucket_bytes = int(bucket_bytes)
        self.cast = cast
        self.allow_nonfinite = allow_nonfinite
        self._shapes_only = False  # set by plan(): meta tensors stand for the factors' shapes
        self.schema = schema
        self._rank_from: str | None = None
        self.skipped: list[str] = []  # non-adapter names seen (base weights beside the adapters)

    def config(self, target_modules: Any = DEFAULT_TARGET_MODULES) -> dict[str, Any]:
        if self.rank is None:
            raise AdapterError("no adapter factor seen yet: the rank is unknown")
        return adapter_config(self.rank, self.alpha, target_modules)

    # ---- streaming ------------------------------------------------------------------------------

    def groups(self, named_tensors: Iterable[tuple], *, expert_offset: int = 0) -> Iterator[AdapterGroup]:
        """Load groups in input order. Items are ``(name, tensor)`` or ``(name, tensor, expert_offset)``.

        Names that are not LoRA factors (the wrapped base weights ``….to_wrap.weight``, optimizer
        state, …) are skipped and listed in :attr:`skipped`; adapter-looking names outside the
        table are errors. At the end, any module still missing a half or experts is an error.
        """
        pending: dict[tuple[str, int | None], _Pending] = {}
        done: dict[tuple[str, int | None], dict[str, tuple[torch.Tensor, str]]] = {}  # emitted: shared factors
        for item in named_tensors:
            name, tensor = item[0], item[1]
            off = item[2] if len(item) > 2 else expert_offset
            m = self.schema.trainer(name)
            if m is None:
                if self.schema.is_adapter_name(name):
                    raise AdapterError(f"{name}: a LoRA factor on a module the schema does not know "
                                       f"(targets: {', '.join(t.key for t in self.schema.targets if not isinstance(t.rule, Excluded))})")
                self.skipped.append(name)
                continue
            t = m.target
            if isinstance(t.rule, Excluded):
                raise AdapterError(f"{name}: {t.rule.why}; the schema excludes this module")
            if m.layer is not None and self.dims is not None and not 0 <= m.layer < self.dims.num_layers:
                raise AdapterError(f"{name}: layer {m.layer} is outside 0..{self.dims.num_layers - 1}")
            tensor = self._dtype(name, tensor)
            key = (t.key, m.layer)
            if key in done:  # an EP rank's copy of a shared factor after its module was emitted
                self._late_copy(done[key], m.side, name, tensor)
                continue
            p = pending.setdefault(key, _Pending(t, m.layer))
            p.sources.append(name)
            self._add(p, m.side, name, tensor, int(off))
            if self._complete(p):
                del pending[key]
                done[key] = p.shared
                yield self._emit(p)
        if pending:
            p = next(iter(pending.values()))
            raise AdapterError(self._incomplete(p))

    def buckets(self, named_tensors: Iterable[tuple], *, expert_offset: int = 0) -> Iterator[Bucket]:
        """Load groups packed in order into buckets of at most ``bucket_bytes`` (a larger group alone)."""
        yield from pack(self.groups(named_tensors, expert_offset=expert_offset), self.bucket_bytes)

    # ---- internals ------------------------------------------------------------------------------

    def _data(self, name: str, t: Any) -> torch.Tensor:
        """The factor itself, refused in one line when it cannot be sent: not a tensor, no data
        (meta device), or NaN/Inf without ``allow_nonfinite``."""
        if not isinstance(t, torch.Tensor):
            raise AdapterError(f"{name}: a {type(t).__name__}, not a tensor")
        if t.device.type == "meta":
            if self._shapes_only:
                return t
            raise AdapterError(f"{name}: on the meta device (no data to send); materialize the factor first")
        if not self.allow_nonfinite and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise NonFiniteError(f"{name}: holds NaN or Inf; the engine would receive them "
                                 "(pass allow_nonfinite=True to send them anyway)")
        return t

    def _dtype(self, name: str, t: torch.Tensor) -> torch.Tensor:
        t = self._data(name, t)
        if t.dtype == ENGINE_DTYPE:
            return t
        if self.cast and t.dtype in (torch.float32, torch.float16):
            return t.to(ENGINE_DTYPE) if t.device.type != "meta" else torch.empty(t.shape, dtype=ENGINE_DTYPE, device="meta")
        raise AdapterError(f"{name}: dtype {t.dtype}; the engine takes BF16 factors (pass cast=True / --cast "
                           f"to round float32 factors to BF16)")

    def _set_rank(self, name: str, r: int) -> None:
        if self.rank is None:
            self.rank, self._rank_from = r, name
        elif r != self.rank:
            src = f" ({self._rank_from})" if self._rank_from else ""
            raise AdapterError(f"{name}: rank {r}, but the adapter's rank is {self.rank}{src}")

    def _add(self, p: _Pending, side: str, name: str, t: torch.Tensor, off: int) -> None:
        rule = p.target.rule
        per_expert_side = {ExpertsGateUp: "B", ExpertsDown: "A"}.get(type(rule))
        if per_expert_side is None:  # a plain linear: whole factors only
            if side in p.whole:
                raise AdapterError(f"{name}: given twice")
            if t.dim() != 2:
                raise AdapterError(f"{name}: expected a 2-D factor, got shape {list(t.shape)}")
            p.whole[side] = (t, name)
        elif side == per_expert_side:
            self._add_experts(p, side, name, t, off)
        else:
            self._add_shared(p, side, name, t)
        self._check_pair(p)  # A and B of this module first (names both), then the adapter-wide rank
        self._set_rank(name, t.shape[-2] if side == "A" else t.shape[-1])  # A [.., r, in], B [.., out, r]

    def _late_copy(self, shared: dict[str, tuple[torch.Tensor, str]], side: str, name: str, t: torch.Tensor) -> None:
        if side not in shared:
            raise AdapterError(f"{name}: given again after its module was complete")
        p = _Pending(Target("", ""), None, shared={side: shared[side]})
        self._add_shared(p, side, name, t)

    def _add_shared(self, p: _Pending, side: str, name: str, t: torch.Tensor) -> None:
        # a shared factor: [r, H] / [H, r], or with a leading expert axis whose entries must agree
        if t.dim() == 3:
            if t.device.type != "meta":
                for e in range(1, t.shape[0]):
                    if not torch.equal(t[e], t[0]):
                        raise AdapterError(f"{name}: shared factor differs across experts along its expert axis "
                                           f"(entry {e} != entry 0)")
            t = t[0]
        if t.dim() != 2:
            raise AdapterError(f"{name}: expected a shared 2-D factor, got shape {list(t.shape)}")
        prev = p.shared.get(side)
        if prev is None:
            p.shared[side] = (t, name)
            return
        # every EP rank holds a copy of the shared factor: they must be the same tensor
        if prev[0].shape != t.shape or (t.device.type != "meta" and not torch.equal(prev[0], t.to(prev[0].device))):
            raise AdapterError(f"{name}: shared factor differs across expert slices (first given as {prev[1]})")

    def _add_experts(self, p: _Pending, side: str, name: str, t: torch.Tensor, off: int) -> None:
        if t.dim() != 3:
            raise AdapterError(f"{name}: expected a per-expert factor [experts, …], got shape {list(t.shape)}")
        n = t.shape[0]
        E = self.num_experts
        if E is None:
            if off != 0:
                raise AdapterError(f"{name}: expert slice at offset {off} but the number of experts is unknown "
                                   f"(give num_experts or the model config)")
            E = n
        if off < 0 or off + n > E:
            raise AdapterError(f"{name}: experts {off}..{off + n - 1} are outside 0..{E - 1}")
        got = p.experts.get(side)
        if got is None:
            buf = t if (off == 0 and n == E) else torch.empty((E, *t.shape[1:]), dtype=t.dtype, device=t.device)
            covered = torch.zeros(E, dtype=torch.bool)
            got = (buf, covered, name)
            p.experts[side] = got
            if buf is t:
                covered[:] = True
                return
        buf, covered, _ = got
        if tuple(buf.shape[1:]) != tuple(t.shape[1:]):
            raise AdapterError(f"{name}: expert slice {list(t.shape)} does not match the other slices {list(buf.shape)}")
        if bool(covered[off:off + n].any()):
            raise AdapterError(f"{name}: experts {off}..{off + n - 1} given twice")
        if buf.device.type != "meta":
            buf[off:off + n].copy_(t)
        covered[off:off + n] = True

    def _check_pair(self, p: _Pending) -> None:
        """The rank of a module's A and B factors must agree (the error names both)."""
        a = p.whole.get("A") or p.shared.get("A")
        b = p.whole.get("B") or p.shared.get("B")
        ea, eb = p.experts.get("A"), p.experts.get("B")
        ra = a[0].shape[0] if a else (ea[0].shape[1] if ea else None)
        rb = b[0].shape[1] if b else (eb[0].shape[2] if eb else None)
        if ra is not None and rb is not None and ra != rb:
            an, bn = (a or ea)[-1], (b or eb)[-1]  # type: ignore[index]
            raise AdapterError(f"{bn}: rank {rb} differs from its A factor {an} (rank {ra})")

    def _complete(self, p: _Pending) -> bool:
        have = set(p.whole) | set(p.shared) | {s for s, (_, cov, _) in p.experts.items() if bool(cov.all())}
        return have == {"A", "B"}

    def _incomplete(self, p: _Pending) -> str:
        names = {s: v[-1] for s, v in {**p.whole, **p.shared}.items()}
        for s, (_, cov, n) in p.experts.items():
            if not bool(cov.all()):
                missing = [int(i) for i in (~cov).nonzero().flatten()[:4]]
                return f"{n}: experts {missing}{'…' if int((~cov).sum()) > 4 else ''} never arrived"
            names[s] = n
        have = next(iter(names))
        other = "B" if have == "A" else "A"
        suffix = {"A": "linear_in.weight", "B": "linear_out.weight"}[other]
        return (f"{names[have]}: its other half ({self.schema.fill(p.target.trainer, p.layer)}.{suffix}) "
                f"never arrived")

    def _emit(self, p: _Pending) -> AdapterGroup:
        rule = p.target.rule
        names = self.schema.engine_names(p.target, p.layer)
        dims = self.dims.dims(p.layer) if self.dims is not None else None
        src = p.sources[0] if len(p.sources) == 1 else f"{p.sources[0]} (+{len(p.sources) - 1})"
        if isinstance(rule, Linear):
            (a, an), (b, bn) = p.whole["A"], p.whole["B"]
            if dims is not None:
                self._expect(an, a, (self.rank, dims[rule.inp]))
                n_out = dims[rule.out]
                if rule.trim_out is not None and b.shape[0] > n_out:
                    b = b[:n_out]  # padded vocabulary rows: the engine's adapter is unpadded
                self._expect(bn, b, (n_out, self.rank))
            tensors = [a, b]
        elif isinstance(rule, ExpertsGateUp):
            (a, an), (b, _, bn) = p.shared["A"], p.experts["B"]
            if b.shape[1] % 2:
                raise AdapterError(f"{bn}: {b.shape[1]} rows cannot split into gate and up halves")
            F = b.shape[1] // 2
            if dims is not None:
                self._expect(an, a, (self.rank, dims["H"]))
                self._expect(bn, b, (dims["E"], 2 * dims["F"], self.rank))
            a1 = a.unsqueeze(0)
            # w1 = gate = first half of the rows, w3 = up = second half (never interleaved)
            tensors = [a1, b[:, :F], a1.clone() if a.device.type != "meta" else a1, b[:, F:]]
        elif isinstance(rule, ExpertsDown):
            (a, _, an), (b, bn) = p.experts["A"], p.shared["B"]
            if dims is not None:
                self._expect(an, a, (dims["E"], self.rank, dims["F"]))
                self._expect(bn, b, (dims["H"], self.rank))
            tensors = [a, b.unsqueeze(0)]
        else:  # pragma: no cover - excluded rows never get here
            raise AdapterError(f"{src}: no rule")
        out = []
        for (n, _), t in zip(names, tensors, strict=True):
            out.append((n, t if t.device.type == "meta" else t.detach().contiguous()))
        return AdapterGroup(out, src, sources=list(p.sources))

    def _expect(self, name: str, t: torch.Tensor, shape: tuple) -> None:
        if tuple(t.shape) != tuple(shape):
            raise AdapterError(f"{name}: shape {list(t.shape)}, the model's module needs {list(shape)}")


def plan(conv: LoraExport, shapes: Iterable[tuple[str, tuple[int, ...], torch.dtype]]) -> list[AdapterGroup]:
    """Run the whole conversion on shapes only (meta tensors): every structural error surfaces here,
    before any data is read; the groups list the engine names, shapes and the source names."""
    items = [(n, torch.empty(s, dtype=d, device="meta")) for n, s, d in shapes]
    conv._shapes_only = True
    try:
        return list(conv.groups(items))
    finally:
        conv._shapes_only = False


# ---- the export job -------------------------------------------------------------------------


@dataclass
class ExportResult:
    dst: Any
    skipped: bool = False
    resumed: bool = False
    tensors: int = 0
    bytes: int = 0
    rank: int | None = None
    alpha: float | None = None
    ignored: int = 0  # non-adapter tensors in the source (base weights, …)


def export_adapter(src, dst, *, config, alpha: float | None = None, cast: bool = False,
                   target_modules: Any = DEFAULT_TARGET_MODULES, force: bool = False,
                   progress: bool = True, dry_run: bool = False) -> ExportResult:
    """Trainer adapter dump (torch_dist folder, ``.safetensors`` file or folder) -> engine adapter
    folder ``dst`` (``adapter_config.json``, ``adapter_model.safetensors``, sha256 manifest).

    ``config``: the base release checkpoint folder or its ``config.json`` (shapes are checked
    against it, the unembed B trimmed to the unpadded vocabulary). ``alpha``: ``lora_alpha``;
    default: the dump's metadata (``lora_alpha``). Plans from headers first: every structural
    error is raised before anything is written; ``dry_run`` stops there (``skipped`` set).
    """
    from pathlib import Path

    from ..layouts.staging import Staging
    from ..progress import ByteProgress
    from .io import TrainerSource, load_dims, write_adapter
    from ..layouts.paths import check_dst
    from .merge import _identity

    src_p, dst_p = Path(src), Path(dst)
    check_dst(dst_p, [src_p, config])  # --config is an input too: OUT must never be or hold the base
    dims = load_dims(config)
    source = TrainerSource.open(src_p, num_layers=dims.num_layers)
    if alpha is None:
        raw = source.metadata.get("lora_alpha")
        try:
            alpha = float(raw) if raw is not None else None
        except ValueError:
            raise AdapterError(f"{src_p}: metadata lora_alpha {raw!r} is not a number") from None
        if alpha is None:
            raise AdapterError(f"{src_p}: no lora_alpha in the dump's metadata; give --alpha")
        if alpha.is_integer():
            alpha = int(alpha)
    if not positive_number(alpha):
        raise AdapterError(f"lora_alpha must be a positive number, got {alpha!r}")
    conv = LoraExport(alpha=alpha, dims=dims, cast=cast)
    groups = plan(conv, source.entries())
    if not groups:
        raise AdapterError(f"{src_p}: holds no LoRA factors ({len(conv.skipped)} other tensors)")
    planned = [(n, tuple(t.shape), t.dtype) for g in groups for n, t in g.tensors]
    res = ExportResult(dst_p, rank=conv.rank, alpha=alpha, ignored=len(conv.skipped), tensors=len(planned))
    res.bytes = sum(g.nbytes for g in groups)
    if dry_run:  # everything above read headers only
        source.close()
        res.skipped = True
        return res
    job = {"what": "lora-export", "source": str(src_p.resolve()), "source_files": _identity(src_p),
           "config": str(Path(config).resolve()), "config_files": _identity(Path(config)), "alpha": alpha,
           "cast": cast, "target_modules": target_modules}
    real = LoraExport(alpha=alpha, rank=conv.rank, dims=dims, cast=cast)

    def tensors():
        for g in groups:  # read each module's factors together: memory is one module
            for got in real.groups([(n, source.read(n)) for n in g.sources]):
                yield from got.tensors

    with Staging(dst_p, job, force, inputs=[src_p, config]) as st:
        if st.done:
            res.skipped = True
            return res
        res.resumed = st.resumed
        with ByteProgress(res.bytes, desc="lora export", enabled=progress) as bar:
            write_adapter(st, real.config(target_modules), planned, tensors(), on_written=bar.advance)
    source.close()
    return res
