"""The complete Inkling 2 tensor inventory, held as data.

Each row of the tables below is one HF tensor pattern with a symbolic shape, a dtype, the
memory category it counts towards and, where it applies, a condition (K/V convolutions exist on
full-attention layers only). :func:`inventory` expands the tables for a config and a precision
plan into every tensor a checkpoint must hold; :func:`match_name` maps any name back to its row.
Adapting to a different real checkpoint means editing these tables, not the pipeline.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from typing import Iterator

import torch

from ..errors import CheckpointError
from ..formats import get_format
from .config import InklingConfig
from .precision import PrecisionPlan

BF16, F32 = torch.bfloat16, torch.float32

TEXT = "model.language_model"
LAYER = f"{TEXT}.layers.{{layer}}"
MTP = "mtp.layers.{mtp}"
EXPERT = f"{LAYER}.mlp.experts.{{expert}}"
VISUAL = "model.visual"


class Category(str, Enum):
    """What a tensor counts towards in memory reports."""

    EXPERTS = "routed_experts"
    ATTENTION = "attention"
    EMBEDDINGS = "embeddings_head"
    ROUTER_NORMS = "router_norms"
    MTP = "mtp_head"
    VISION = "vision_tower"


class Scope(str, Enum):
    """How many times a row repeats."""

    GLOBAL = "global"  # once
    LAYER = "layer"  # per decoder layer
    EXPERT = "expert"  # per (decoder layer, routed expert); a quantizable linear
    MTP = "mtp"  # per MTP layer
    VISION_BLOCK = "vision_block"  # per vision transformer block


FULL_ONLY = "full_attention"


@dataclass(frozen=True)
class Row:
    """One tensor pattern of the inventory."""

    pattern: str
    shape: tuple[str, ...]
    dtype: torch.dtype
    scope: Scope
    category: Category
    only: str | None = None  # a layer condition; FULL_ONLY = full-attention layers


def _attention(prefix: str, scope: Scope, category: Category, convs: str | None) -> list[Row]:
    """The attention block shared by decoder layers and the MTP layer."""
    a = f"{prefix}.self_attn"
    rows = [
        Row(f"{prefix}.input_layernorm.weight", ("H",), BF16, scope, Category.ROUTER_NORMS if category is Category.ATTENTION else category),
        Row(f"{a}.q_proj.weight", ("Q", "H"), BF16, scope, category),
        Row(f"{a}.k_proj.weight", ("KV", "H"), BF16, scope, category),
        Row(f"{a}.v_proj.weight", ("KV", "H"), BF16, scope, category),
        Row(f"{a}.g_proj.weight", ("Q", "H"), BF16, scope, category),
        Row(f"{a}.o_proj.weight", ("H", "Q"), BF16, scope, category),
        Row(f"{a}.sink_proj.weight", ("NH", "H"), BF16, scope, category),
        Row(f"{a}.rel_bias.weight", ("NH", "NB"), BF16, scope, category),
        Row(f"{a}.k_conv.weight", ("KV", "1", "CK"), BF16, scope, category, convs),
        Row(f"{a}.v_conv.weight", ("KV", "1", "CK"), BF16, scope, category, convs),
    ]
    return rows


_NORMS = Category.ROUTER_NORMS

TEXT_ROWS: tuple[Row, ...] = (
    Row(f"{TEXT}.embed_tokens.weight", ("V", "H"), BF16, Scope.GLOBAL, Category.EMBEDDINGS),
    *_attention(LAYER, Scope.LAYER, Category.ATTENTION, FULL_ONLY),
    Row(f"{LAYER}.attn_residual.query", ("H",), BF16, Scope.LAYER, _NORMS),
    Row(f"{LAYER}.attn_residual.norm.weight", ("H",), BF16, Scope.LAYER, _NORMS),
    Row(f"{LAYER}.mlp_residual.query", ("H",), BF16, Scope.LAYER, _NORMS),
    Row(f"{LAYER}.mlp_residual.norm.weight", ("H",), BF16, Scope.LAYER, _NORMS),
    Row(f"{LAYER}.post_attention_layernorm.weight", ("H",), BF16, Scope.LAYER, _NORMS),
    Row(f"{LAYER}.mlp.gate.weight", ("E", "H"), BF16, Scope.LAYER, _NORMS),
    Row(f"{LAYER}.mlp.gate.e_score_correction_bias", ("E",), F32, Scope.LAYER, _NORMS),
    Row(f"{TEXT}.norm.weight", ("H",), BF16, Scope.GLOBAL, _NORMS),
    Row("lm_head.weight", ("V", "H"), BF16, Scope.GLOBAL, Category.EMBEDDINGS),
    # The MTP draft head: dense, BF16; its attention is a full-attention layer's.
    Row(f"{MTP}.enorm.weight", ("H",), BF16, Scope.MTP, Category.MTP),
    Row(f"{MTP}.hnorm.weight", ("H",), BF16, Scope.MTP, Category.MTP),
    Row(f"{MTP}.eh_proj.weight", ("H", "2H"), BF16, Scope.MTP, Category.MTP),
    *_attention(MTP, Scope.MTP, Category.MTP, None),
    Row(f"{MTP}.post_attention_layernorm.weight", ("H",), BF16, Scope.MTP, Category.MTP),
    Row(f"{MTP}.mlp.gate_proj.weight", ("MI", "H"), BF16, Scope.MTP, Category.MTP),
    Row(f"{MTP}.mlp.up_proj.weight", ("MI", "H"), BF16, Scope.MTP, Category.MTP),
    Row(f"{MTP}.mlp.down_proj.weight", ("H", "MI"), BF16, Scope.MTP, Category.MTP),
    Row(f"{MTP}.final_layernorm.weight", ("H",), BF16, Scope.MTP, Category.MTP),
)

_VB = f"{VISUAL}.blocks.{{vblock}}"
_VIS = Category.VISION
VISION_ROWS: tuple[Row, ...] = (
    Row(f"{VISUAL}.patch_embed.proj.weight", ("VH", "VC", "VT", "VP", "VP"), BF16, Scope.GLOBAL, _VIS),
    Row(f"{_VB}.norm1.weight", ("VH",), BF16, Scope.VISION_BLOCK, _VIS),
    Row(f"{_VB}.attn.qkv.weight", ("V3H", "VH"), BF16, Scope.VISION_BLOCK, _VIS),
    Row(f"{_VB}.attn.qkv.bias", ("V3H",), BF16, Scope.VISION_BLOCK, _VIS),
    Row(f"{_VB}.attn.proj.weight", ("VH", "VH"), BF16, Scope.VISION_BLOCK, _VIS),
    Row(f"{_VB}.attn.proj.bias", ("VH",), BF16, Scope.VISION_BLOCK, _VIS),
    Row(f"{_VB}.norm2.weight", ("VH",), BF16, Scope.VISION_BLOCK, _VIS),
    Row(f"{_VB}.mlp.fc1.weight", ("VI", "VH"), BF16, Scope.VISION_BLOCK, _VIS),
    Row(f"{_VB}.mlp.fc1.bias", ("VI",), BF16, Scope.VISION_BLOCK, _VIS),
    Row(f"{_VB}.mlp.fc2.weight", ("VH", "VI"), BF16, Scope.VISION_BLOCK, _VIS),
    Row(f"{_VB}.mlp.fc2.bias", ("VH",), BF16, Scope.VISION_BLOCK, _VIS),
    Row(f"{VISUAL}.merger.ln_q.weight", ("VH",), BF16, Scope.GLOBAL, _VIS),
    Row(f"{VISUAL}.merger.mlp.0.weight", ("VM", "VM"), BF16, Scope.GLOBAL, _VIS),
    Row(f"{VISUAL}.merger.mlp.0.bias", ("VM",), BF16, Scope.GLOBAL, _VIS),
    Row(f"{VISUAL}.merger.mlp.2.weight", ("VO", "VM"), BF16, Scope.GLOBAL, _VIS),
    Row(f"{VISUAL}.merger.mlp.2.bias", ("VO",), BF16, Scope.GLOBAL, _VIS),
)

# Routed experts: logical [out, in] shapes; the stored parts depend on the layer's format.
# Keyed by projection, in on-disk order; gate/up form one fused group (shared NVFP4 scale).
EXPERT_ROWS: dict[str, Row] = {
    "gate_proj": Row(f"{EXPERT}.gate_proj", ("I", "H"), BF16, Scope.EXPERT, Category.EXPERTS),
    "up_proj": Row(f"{EXPERT}.up_proj", ("I", "H"), BF16, Scope.EXPERT, Category.EXPERTS),
    "down_proj": Row(f"{EXPERT}.down_proj", ("H", "I"), BF16, Scope.EXPERT, Category.EXPERTS),
}
EXPERT_PROJS = tuple(EXPERT_ROWS)
FUSED_GROUP = ("gate_proj", "up_proj")

ROWS: tuple[Row, ...] = TEXT_ROWS + tuple(EXPERT_ROWS.values()) + VISION_ROWS


@dataclass(frozen=True)
class TensorSpec:
    """One tensor a checkpoint must hold."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    category: Category
    row: Row
    layer: int | None = None
    expert: int | None = None
    mtp: int | None = None
    fmt: str | None = None  # routed experts only: the layer's format
    part: str | None = None  # routed experts only: weight / weight_scale / ...

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)

    @property
    def module(self) -> str | None:
        """The quantizable linear a routed-expert part belongs to (``…experts.3.up_proj``)."""
        if self.part is None:
            return None
        return self.name[: -len(self.part) - 1]


@dataclass(frozen=True)
class ExpertLinear:
    """One routed-expert linear (logical [out, in]) and its format."""

    module: str
    layer: int
    expert: int
    proj: str
    shape: tuple[int, int]
    fmt: str

    def parts(self) -> list[TensorSpec]:
        return expert_parts(self)


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a dense tensor of this shape and dtype."""
    return math.prod(shape) * dtype.itemsize


def _shape(row: Row, dims: dict[str, int]) -> tuple[int, ...]:
    return tuple(dims[s] for s in row.shape)


def _layers_for(row: Row, cfg: InklingConfig) -> range | list[int]:
    if row.only == FULL_ONLY:
        return [i for i in range(cfg.num_hidden_layers) if cfg.is_full_attention(i)]
    return range(cfg.num_hidden_layers)


def expert_linears(cfg: InklingConfig, plan: PrecisionPlan, layer: int | None = None) -> Iterator[ExpertLinear]:
    """Every routed-expert linear (of one layer, or all), in checkpoint order."""
    dims = cfg.dims()
    layers = range(cfg.num_hidden_layers) if layer is None else [layer]
    for i in layers:
        for e in range(cfg.n_routed_experts):
            for proj, row in EXPERT_ROWS.items():
                shape = _shape(row, dims)
                yield ExpertLinear(row.pattern.format(layer=i, expert=e), i, e, proj, (shape[0], shape[1]), plan.format_of(i))


def expert_parts(lin: ExpertLinear) -> list[TensorSpec]:
    """The stored tensors of one routed-expert linear in its format."""
    fmt = get_format(lin.fmt)
    row = EXPERT_ROWS[lin.proj]
    return [
        TensorSpec(f"{lin.module}.{part}", shape, dtype, Category.EXPERTS, row,
                   layer=lin.layer, expert=lin.expert, fmt=lin.fmt, part=part)
        for part, (shape, dtype) in fmt.parts(lin.shape).items()
    ]


# Which loop index a row repeats over; consecutive rows with the same loop form one section.
_LOOP = {Scope.GLOBAL: None, Scope.LAYER: "layer", Scope.MTP: "mtp", Scope.VISION_BLOCK: "vblock"}


def _sections(rows: tuple[Row, ...]) -> list[tuple[str | None, list[Row]]]:
    out: list[tuple[str | None, list[Row]]] = []
    for row in rows:
        loop = _LOOP[row.scope]
        if out and out[-1][0] == loop:
            out[-1][1].append(row)
        else:
            out.append((loop, [row]))
    return out


def inventory(cfg: InklingConfig, plan: PrecisionPlan) -> list[TensorSpec]:
    """Every tensor a checkpoint of ``cfg`` stored under ``plan`` holds, in a stable order.

    Order: globals and per-layer rows in table order within each layer, experts by
    (layer, expert, proj), MTP, vision. Writers shard in this order.
    """
    if len(plan) != cfg.num_hidden_layers:
        raise CheckpointError(
            f"precision plan covers {len(plan)} layers, the model has {cfg.num_hidden_layers}"
        )
    dims = cfg.dims()
    counts = {"layer": cfg.num_hidden_layers, "mtp": cfg.num_nextn_predict_layers,
              "vblock": cfg.vision.depth if cfg.vision else 0}
    out: list[TensorSpec] = []
    tables = [TEXT_ROWS] + ([VISION_ROWS] if cfg.vision is not None else [])
    for table in tables:
        for loop, rows in _sections(table):
            for i in range(counts[loop]) if loop else [None]:
                for row in rows:
                    if row.only == FULL_ONLY and not cfg.is_full_attention(i):  # type: ignore[arg-type]
                        continue
                    idx = {loop: i} if loop else {}
                    out.append(TensorSpec(row.pattern.format(**idx), _shape(row, dims), row.dtype,
                                          row.category, row, layer=idx.get("layer"), mtp=idx.get("mtp")))
                if loop == "layer":
                    for lin in expert_linears(cfg, plan, i):
                        out.extend(expert_parts(lin))
    return out


# ---- names back to rows -------------------------------------------------------------------

def _pattern_regex(pattern: str) -> str:
    """A row pattern as a regex: each {field} becomes a named group of a canonical integer."""
    return re.sub(r"\\\{(\w+)\\\}", lambda m: f"(?P<{m.group(1)}>0|[1-9][0-9]*)", re.escape(pattern))


@dataclass(frozen=True)
class NameMatch:
    row: Row
    indices: dict[str, int]  # layer / expert / mtp / vblock
    part: str | None  # routed experts: the stored part suffix


@lru_cache(maxsize=None)
def _compiled() -> list[tuple[re.Pattern[str], Row]]:
    out = []
    for row in ROWS:
        rx = _pattern_regex(row.pattern)
        if row.scope is Scope.EXPERT:
            rx += r"\.(?P<part>[a-z_0-9]+)"
        out.append((re.compile(rx + r"\Z"), row))
    return out


def match_name(name: str) -> NameMatch | None:
    """The inventory row a tensor name belongs to, with its indices; None for unknown names."""
    for rx, row in _compiled():
        m = rx.match(name)
        if m:
            d = m.groupdict()
            part = d.pop("part", None)
            return NameMatch(row, {k: int(v) for k, v in d.items()}, part)
    return None


_MODULE_RX = {
    proj: re.compile(_pattern_regex(row.pattern) + r"\Z")
    for proj, row in EXPERT_ROWS.items()
}


def module_layer(module: str) -> tuple[int, int, str] | None:
    """(layer, expert, proj) for a routed-expert module name, else None."""
    for proj, rx in _MODULE_RX.items():
        m = rx.match(module)
        if m:
            return int(m.group("layer")), int(m.group("expert")), proj
    return None
