"""The Inkling 2 release tensor inventory (spec/inkling2.md), held as data.

Each :class:`Row` is one on-disk tensor pattern with a symbolic shape, the layer kinds it
exists on (sliding / full attention), an index shift (the ``attn_res`` attention-input
queries are numbered ``layer - 1``), the memory category it counts towards and the dtype a
freshly made checkpoint uses. Routed experts are two stacked rows per layer (``w13_weight``
[E, 2F, H], gate/up rows interleaved, and ``w2_weight`` [E, H, F]); their stored parts depend
on the layer's format (:mod:`inkling_ckpt.formats.stacked`). The vision tower is passed
through by prefix: from a checkpoint its tensors are taken from the headers as they are;
:data:`VISION_ROWS` only lists them for bare-config estimates and synthetic fixtures.

:func:`inventory` expands the tables for a config and a precision plan; :func:`match_name`
maps any name back to its row. Adapting to another real checkpoint means editing these
tables, not the pipeline.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from typing import Iterator, Mapping, Sequence

import torch

from ..errors import CheckpointError
from ..formats.stacked import stacked_parts
from .config import InklingConfig
from .precision import PrecisionPlan

BF16, F32 = torch.bfloat16, torch.float32

TEXT = "model.llm"
LAYER = f"{TEXT}.layers.{{layer}}"
EXPERTS = f"{LAYER}.mlp.experts"
VISUAL = "model.visual"

SLIDING, FULL = "sliding", "full"
BOTH = frozenset({SLIDING, FULL})


class Category(str, Enum):
    """What a tensor counts towards in memory reports."""

    EXPERTS = "routed_experts"
    ATTENTION = "attention"
    EMBEDDINGS = "embeddings_head"
    ROUTER_NORMS = "router_norms"
    VISION = "vision_tower"


class Scope(str, Enum):
    """How many times a row repeats."""

    GLOBAL = "global"  # once
    LAYER = "layer"  # per decoder layer
    EXPERTS = "experts"  # per decoder layer, stacked over the routed experts; stored per format
    VISION_LAYER = "vision_layer"  # per vision encoder layer


@dataclass(frozen=True)
class Row:
    """One tensor pattern of the inventory."""

    pattern: str
    shape: tuple[str, ...]
    category: Category
    scope: Scope = Scope.LAYER
    kinds: frozenset[str] = BOTH  # layer kinds the tensor exists on
    full_shape: tuple[str, ...] | None = None  # shape on full-attention layers, when it differs
    index_shift: int = 0  # the pattern's {layer} is layer + index_shift
    dtype: torch.dtype = BF16  # dtype of a freshly made checkpoint (sources keep their own)
    fused: bool = False  # routed experts: gate and up rows interleaved, one NVFP4 global factor
    parameter: bool = True  # False: a buffer in transformers' model (not counted as a parameter)

    def shape_on(self, cfg: InklingConfig, layer: int | None) -> tuple[int, ...]:
        dims = cfg.dims(layer)
        sym = self.full_shape if (self.full_shape is not None and layer is not None and not cfg.is_sliding(layer)) else self.shape
        return tuple(dims[s] for s in sym)

    def exists_on(self, cfg: InklingConfig, layer: int) -> bool:
        return cfg.layer_kind(layer) in self.kinds and 0 <= layer + self.index_shift

    def name(self, layer: int | None = None, vlayer: int | None = None) -> str:
        if self.scope is Scope.VISION_LAYER:
            return self.pattern.format(vlayer=vlayer)
        return self.pattern.format(layer=None if layer is None else layer + self.index_shift)


_A = Category.ATTENTION
_N = Category.ROUTER_NORMS
_S = frozenset({SLIDING})
_F = frozenset({FULL})
_ATT = f"{LAYER}.attn"

#: The text model. Per-layer rows in on-disk order within a layer; the attn_res queries of a layer
#: are listed with it (streaming readers then touch one layer at a time).
TEXT_ROWS: tuple[Row, ...] = (
    Row(f"{TEXT}.embed.weight", ("V", "H"), Category.EMBEDDINGS, Scope.GLOBAL),
    Row(f"{TEXT}.embed_norm.weight", ("H",), _N, Scope.GLOBAL),
    # Block attention residuals: layer i >= 1 has attn_queries.{i-1}: [H] sliding, [3, H] full (q, k, v).
    Row(f"{TEXT}.attn_res.attn_queries.{{layer}}", ("H",), _N, full_shape=("3", "H"), index_shift=-1, dtype=F32),
    Row(f"{TEXT}.attn_res.mlp_queries.{{layer}}", ("H",), _N, dtype=F32),
    Row(f"{_ATT}.wq_du.weight", ("Q", "H"), _A),
    Row(f"{_ATT}.wk_dv.weight", ("KVD", "H"), _A),
    Row(f"{_ATT}.wv_dv.weight", ("KVD", "H"), _A),
    Row(f"{_ATT}.wr_du.weight", ("R", "H"), _A),
    Row(f"{_ATT}.wo_ud.weight", ("H", "Q"), _A),
    Row(f"{_ATT}.gate_attn.weight", ("Q", "H"), _A),
    Row(f"{_ATT}.attn_sink_proj.weight", ("NH", "H"), _A),
    Row(f"{_ATT}.q_l2_clip.scale", ("NH", "HD"), _A),
    Row(f"{_ATT}.rel_l2_clip.scale", ("NH", "DR"), _A),
    Row(f"{_ATT}.rel_logits_proj.proj", ("DR", "EXT"), _A),
    Row(f"{_ATT}.k_sconv.weight", ("KVD", "1", "K"), _A, kinds=_S, dtype=F32),
    Row(f"{_ATT}.v_sconv.weight", ("KVD", "1", "K"), _A, kinds=_S, dtype=F32),
    Row(f"{_ATT}.k_sconv.static_w", ("K", "KVD"), _A, kinds=_F),
    Row(f"{_ATT}.k_sconv.weight_proj", ("KVK", "H"), _A, kinds=_F),
    Row(f"{_ATT}.v_sconv.static_w", ("K", "KVD"), _A, kinds=_F),
    Row(f"{_ATT}.v_sconv.weight_proj", ("KVK", "H"), _A, kinds=_F),
    Row(f"{LAYER}.attn_norm.weight", ("H",), _N, kinds=_S),
    Row(f"{LAYER}.q_input_norm.weight", ("H",), _N, kinds=_F),
    Row(f"{LAYER}.k_input_norm.weight", ("H",), _N, kinds=_F),
    Row(f"{LAYER}.v_input_norm.weight", ("H",), _N, kinds=_F),
    Row(f"{LAYER}.attn_sconv.weight", ("H", "1", "K"), _N, dtype=F32),
    Row(f"{LAYER}.mlp_sconv.weight", ("H", "1", "K"), _N, dtype=F32),
    Row(f"{LAYER}.mlp_norm.weight", ("H",), _N),
    Row(f"{LAYER}.mlp.gate.weight", ("E", "H"), _N, dtype=F32),
    Row(f"{LAYER}.mlp.gate.bias", ("E",), _N, dtype=F32, parameter=False),  # score correction: a buffer
    Row(f"{EXPERTS}.w13_weight", ("E", "2F", "H"), Category.EXPERTS, Scope.EXPERTS, fused=True),
    Row(f"{EXPERTS}.w2_weight", ("E", "H", "F"), Category.EXPERTS, Scope.EXPERTS),
    Row(f"{TEXT}.norm.weight", ("H",), _N, Scope.GLOBAL),
    Row(f"{TEXT}.attn_res.output_query", ("H",), _N, Scope.GLOBAL, dtype=F32),
    Row(f"{TEXT}.unembed.weight", ("V", "H"), Category.EMBEDDINGS, Scope.GLOBAL),  # rows >= unpadded_vocab_size zero
)

_VL = f"{VISUAL}.backbone.layers.{{vlayer}}"
_V = Category.VISION


def _vl(suffix: str, shape: tuple[str, ...]) -> Row:
    return Row(f"{_VL}.{suffix}", shape, _V, Scope.VISION_LAYER)


def _vg(suffix: str, shape: tuple[str, ...]) -> Row:
    return Row(f"{VISUAL}.{suffix}", shape, _V, Scope.GLOBAL)


#: The vision tower as transformers saves it (only for bare-config estimates and synthetic
#: fixtures; checkpoints pass every ``model.visual.*`` tensor through as stored).
VISION_ROWS: tuple[Row, ...] = (
    _vg("backbone.embeddings.class_embedding", ("VH",)),
    _vg("backbone.embeddings.cls_position_embedding", ("VH",)),
    _vg("backbone.embeddings.patch_embedding.weight", ("VH", "VPATCH")),
    _vg("backbone.embeddings.position_embedding", ("VPOS", "VH")),
    _vg("backbone.ln_pre.bias", ("VH",)),
    _vg("backbone.ln_pre.weight", ("VH",)),
    *(_vl(f"{ln}.{p}", ("VH",)) for ln in ("ln_1", "ln_2") for p in ("bias", "weight")),
    _vl("ls_1.gamma", ("VH",)),
    _vl("ls_2.gamma", ("VH",)),
    _vl("mlp.c_fc.bias", ("VI",)),
    _vl("mlp.c_fc.weight", ("VI", "VH")),
    _vl("mlp.c_proj.bias", ("VH",)),
    _vl("mlp.c_proj.weight", ("VH", "VI")),
    *(r for p in ("k", "out", "q", "v") for r in (_vl(f"self_attn.{p}_proj.bias", ("VH",)),
                                                 _vl(f"self_attn.{p}_proj.weight", ("VH", "VH")))),
    _vg("proj_in.weight", ("VPD", "VM")),
    _vg("proj_out.weight", ("H", "VPD")),
)
VISION_PREFIX = f"{VISUAL}."

ROWS: tuple[Row, ...] = TEXT_ROWS + VISION_ROWS
EXPERT_ROWS: tuple[Row, ...] = tuple(r for r in TEXT_ROWS if r.scope is Scope.EXPERTS)
#: Projection key of each stacked expert row ("w13", "w2").
EXPERT_KEYS: dict[str, Row] = {r.pattern.rsplit(".", 1)[-1].removesuffix("_weight"): r for r in EXPERT_ROWS}
_KEY_OF: dict[str, str] = {r.pattern: k for k, r in EXPERT_KEYS.items()}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor a checkpoint holds."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    category: Category
    row: Row | None  # None: a vision tensor passed through by prefix
    layer: int | None = None
    fmt: str | None = None  # routed experts only: the layer's format
    part: str | None = None  # routed experts only: "" (the weight), "_scale", "_amax", ...

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)

    @property
    def base(self) -> str | None:
        """The stacked expert weight a part belongs to (``…mlp.experts.w13_weight``)."""
        if self.part is None:
            return None
        return self.name[: len(self.name) - len(self.part)]


@dataclass(frozen=True)
class ExpertStack:
    """One layer's stacked routed-expert weight (logical [E, rows, cols]) and its format."""

    name: str  # …mlp.experts.w13_weight
    layer: int
    key: str  # "w13" or "w2"
    shape: tuple[int, int, int]
    fmt: str
    fused: bool

    def parts(self) -> list[TensorSpec]:
        return [TensorSpec(self.name + suffix, shp, dt, Category.EXPERTS, EXPERT_KEYS[self.key], layer=self.layer,
                           fmt=self.fmt, part=suffix)
                for suffix, (shp, dt) in stacked_parts(self.fmt, self.shape).items()]

    @property
    def stored_bytes(self) -> int:
        """Bytes of all its stored parts (weight, scales, per-expert factors)."""
        return sum(p.nbytes for p in self.parts())


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a dense tensor of this shape and dtype."""
    return math.prod(shape) * dtype.itemsize


def expert_stacks(cfg: InklingConfig, plan: PrecisionPlan, layer: int | None = None) -> Iterator[ExpertStack]:
    """Every layer's stacked expert weights (w13, then w2), of one layer or all."""
    layers = range(cfg.num_hidden_layers) if layer is None else [layer]
    for i in layers:
        for row in EXPERT_ROWS:
            yield _stack(row, cfg, plan, i)


def _stack(row: Row, cfg: InklingConfig, plan: PrecisionPlan, layer: int) -> ExpertStack:
    e, r, c = row.shape_on(cfg, layer)
    return ExpertStack(row.name(layer), layer, _KEY_OF[row.pattern], (e, r, c), plan.format_of(layer), row.fused)


def layer_specs(cfg: InklingConfig, plan: PrecisionPlan, layer: int, dtypes: dict[str, torch.dtype] | None = None) -> list[TensorSpec]:
    """The tensors of decoder layer ``layer`` (its attn_res queries included), in table order."""
    out: list[TensorSpec] = []
    for row in TEXT_ROWS:
        if row.scope is Scope.LAYER and row.exists_on(cfg, layer):
            name = row.name(layer)
            dt = (dtypes or {}).get(name, row.dtype)
            out.append(TensorSpec(name, row.shape_on(cfg, layer), dt, row.category, row, layer=layer))
        elif row.scope is Scope.EXPERTS:
            out.extend(_stack(row, cfg, plan, layer).parts())
    return out


def inventory(cfg: InklingConfig, plan: PrecisionPlan, *, dtypes: dict[str, torch.dtype] | None = None,
              vision: Sequence[TensorSpec] | None = None) -> list[TensorSpec]:
    """Every tensor a checkpoint of ``cfg`` stored under ``plan`` holds, in a stable order.

    Order: embed, embed_norm, each layer (its queries, attention, norms, router, experts), final
    norm, output query, unembed, then the vision tower. ``dtypes`` overrides the dtype of
    non-expert tensors (a source's own dtypes are kept); ``vision`` gives the vision tensors of a
    real checkpoint (else they come from ``cfg.vision``, or there are none).
    """
    if len(plan) != cfg.num_hidden_layers:
        raise CheckpointError(f"precision plan covers {len(plan)} layers, the model has {cfg.num_hidden_layers}")
    dt = dtypes or {}
    out: list[TensorSpec] = []
    globals_ = [r for r in TEXT_ROWS if r.scope is Scope.GLOBAL]
    head, tail = globals_[:2], globals_[2:]
    for row in head:
        out.append(TensorSpec(row.name(), row.shape_on(cfg, None), dt.get(row.name(), row.dtype), row.category, row))
    for i in range(cfg.num_hidden_layers):
        out.extend(layer_specs(cfg, plan, i, dt))
    for row in tail:
        out.append(TensorSpec(row.name(), row.shape_on(cfg, None), dt.get(row.name(), row.dtype), row.category, row))
    if vision is not None:
        out.extend(vision)
    elif cfg.vision is not None:
        out.extend(vision_specs(cfg))
    return out


def vision_specs(cfg: InklingConfig) -> list[TensorSpec]:
    """The vision tower's tensors for ``cfg.vision`` (BF16), for estimates and synthetic fixtures."""
    if cfg.vision is None:
        return []
    dims = cfg.dims()
    out = []
    for row in VISION_ROWS:
        shape = tuple(dims[s] for s in row.shape)
        for j in (range(cfg.vision.num_hidden_layers) if row.scope is Scope.VISION_LAYER else [None]):
            out.append(TensorSpec(row.name(vlayer=j), shape, row.dtype, row.category, row))
    return sorted(out, key=lambda s: s.name)  # the order a checkpoint's vision tensors are read back in


def parameter_count(specs: Sequence[TensorSpec], cfg: InklingConfig) -> int:
    """The model's parameters (as transformers counts them) from a BF16-expert inventory.

    Stored elements minus the zero padding rows of ``unembed`` (transformers' head has
    ``unpadded_vocab_size`` rows) and the router's score-correction bias (a buffer there).
    Quantized experts count their logical elements.
    """
    total = 0
    for s in specs:
        if s.row is not None and not s.row.parameter:
            continue
        if s.part is None:
            total += math.prod(s.shape)
        elif s.part == "":
            total += math.prod(s.row.shape_on(cfg, s.layer)) if s.row is not None else 0
    return total - cfg.padded_vocab_rows * cfg.hidden_size


# ---- names back to rows -------------------------------------------------------------------

def _pattern_regex(pattern: str) -> str:
    """A row pattern as a regex: each {field} becomes a named group of a canonical integer."""
    return re.sub(r"\\\{(\w+)\\\}", lambda m: f"(?P<{m.group(1)}>0|[1-9][0-9]*)", re.escape(pattern))


@dataclass(frozen=True)
class NameMatch:
    row: Row
    layer: int | None  # the decoder layer (index shift undone)
    vlayer: int | None
    part: str | None  # routed experts: the stored part suffix


@lru_cache(maxsize=None)
def _compiled() -> list[tuple[re.Pattern[str], Row]]:
    out = []
    for row in ROWS:
        rx = _pattern_regex(row.pattern)
        if row.scope is Scope.EXPERTS:
            rx += r"(?P<part>(?:_[a-z0-9_]+)?)"
        out.append((re.compile(rx + r"\Z"), row))
    return out


def match_name(name: str) -> NameMatch | None:
    """The inventory row a tensor name belongs to, with its layer; None for unknown names."""
    for rx, row in _compiled():
        m = rx.match(name)
        if m:
            d = m.groupdict()
            layer = int(d["layer"]) - row.index_shift if d.get("layer") is not None else None
            vlayer = int(d["vlayer"]) if d.get("vlayer") is not None else None
            return NameMatch(row, layer, vlayer, d.get("part"))
    return None


def is_vision(name: str) -> bool:
    """Vision tensors pass through by prefix."""
    return name.startswith(VISION_PREFIX)


FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def detect_plan(cfg: InklingConfig, dtypes: Mapping[str, torch.dtype], where: str) -> PrecisionPlan:
    """Each layer's expert format, read from the stored parts as transformers does (spec/inkling2.md).

    ``dtypes`` maps every stored tensor name to its dtype. CheckpointError names the first layer
    whose w13/w2 parts fit no format or disagree with each other.
    """
    from ..formats.stacked import format_of_parts

    formats = []
    for i in range(cfg.num_hidden_layers):
        found = []
        for row in EXPERT_ROWS:
            base = row.name(i)
            parts = {n[len(base):]: dt for n, dt in _with_prefix(dtypes, base)}
            fmt = format_of_parts(parts)
            if fmt is None:
                got = ", ".join(f"{base}{k} {v}".replace("torch.", "") for k, v in sorted(parts.items())) or "nothing"
                raise CheckpointError(f"{where}: layer {i} experts are in no known format (found {got}); expected "
                                      f"{base} BF16, or F8_E4M3 + _scale (MXFP8), or U8 + _scale + _amax + "
                                      f"_outer_scale_denominator (NVFP4)")
            found.append(fmt)
        if len(set(found)) != 1:
            raise CheckpointError(f"{where}: layer {i} stores w13 as {found[0]} but w2 as {found[1]}")
        formats.append(found[0])
    return PrecisionPlan.from_layer_formats(formats)


def _with_prefix(dtypes: Mapping[str, torch.dtype], base: str) -> list[tuple[str, torch.dtype]]:
    # Expert parts are the weight's name plus a suffix starting with "_" (or nothing).
    return [(n, dt) for n, dt in dtypes.items() if n == base or (n.startswith(base + "_"))]
