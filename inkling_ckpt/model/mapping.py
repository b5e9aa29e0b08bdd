"""Inkling 2 release tensors ⇄ Megatron-Core ``torch_dist`` keys, as preset tables of typed rules.

A :class:`Preset` is data: a list of rules, each naming one Megatron key pattern and the release
tensor (an inventory row, :data:`~inkling_ckpt.model.inventory.TEXT_ROWS`) it holds, plus where
a decoder layer's parts sit among Megatron's layers (``sites``) and which TE modules carry an
``_extra_state`` object. Key patterns use ``{L}``: the Megatron layer prefix
(``decoder.layers.{n}``) of the rule's site, ``n = stride·i + offset`` for decoder layer ``i``.

Two rule types cover the release (``shared/spec/megatron.md``):

* :class:`Copy`: one tensor stored as is under another name. The inventory row decides the
  layers it exists on (sliding / full) and carries the ``attn_res`` index shift, so
  ``decoder.layers.{i}.attn_res_query`` ← ``model.llm.attn_res.attn_queries.{i-1}`` needs no code.
  q/k/v/r are four such rules (sub-keys ``.q/.k/.v/.r`` of ``linear_qkv.weight``, as Miles saves
  its fused q‖k‖v‖r), so nothing depends on how a model fuses them in memory.
* :class:`Experts`: a layer's stacked routed experts, BF16 in Megatron, one chunk per expert.
  Fused (w13) experts are de-interleaved per expert, ``cat(w13[e, 0::2], w13[e, 1::2])``: gate
  rows then up rows, Megatron's ``linear_fc1`` order. Quantized release experts are decoded to
  BF16 before this (by the caller, ``formats.stacked.decode_stacked``).

:class:`MegatronMapping` expands a preset for one config and checks it both ways at
construction: every release text tensor maps to exactly one key, every key to exactly one
release tensor. :data:`PRESETS` holds ``miles`` (default) and ``bridge`` (Megatron-Core
HybridModel: attention of layer i at ``decoder.layers.{2i}``, its MoE at ``{2i+1}``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import ClassVar, Iterable, Mapping, Sequence

import torch

from ..errors import CheckpointError, ConfigError
from .config import InklingConfig
from .inventory import (
    EXPERTS, LAYER, FULL, BOTH, TEXT, TEXT_ROWS, Row, Scope, inventory, is_vision, match_name, nbytes,
)
from .precision import PrecisionPlan

BF16 = torch.bfloat16
_ROW_BY_PATTERN: dict[str, Row] = {r.pattern: r for r in TEXT_ROWS}

#: Megatron keys a reader skips without complaint: training state, not weights.
SKIPPED_PREFIXES = ("optimizer.", "rng_state", "common_state")

#: The largest chunk a global tensor is stored in (torch_dist layout): bigger ones, whose rule maps
#: rows to rows, are stored as row ranges of at most this many bytes, so no step holds a whole
#: embedding (201024 x 4608 BF16 = 1.85 GB). Layer tensors keep the spec's one chunk each (57 MB
#: at most in BF16). A fixed layout, not an option: the bytes written depend on the source alone.
#: Equal to the default slice budget.
DENSE_CHUNK_BYTES = 64 * 2**20


# ---- rule types ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Copy:
    """One release tensor (inventory row ``hf``) stored as is under ``key``.

    ``site`` picks the Megatron layer of a per-layer tensor (``"attn"`` or ``"mlp"``); global
    tensors ignore it. ``vocab``: the rows are the vocabulary, and a Megatron source may hold
    more of them (its padded size); the extra rows are dropped on the way back.
    """

    key: str
    hf: str
    site: str = "attn"
    vocab: bool = False

    #: Rows ``a:b`` of one side map to rows ``a:b`` of the other: a tensor may move in row slices.
    by_rows: ClassVar[bool] = True

    @property
    def row(self) -> Row:
        row = _ROW_BY_PATTERN.get(self.hf)
        if row is None:
            raise ConfigError(f"mapping rule {self.key}: {self.hf} is not a row of the release inventory")
        return row

    def to_megatron(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def to_hf(self, t: torch.Tensor) -> torch.Tensor:
        return t


@dataclass(frozen=True)
class Experts(Copy):
    """A layer's stacked routed experts [E, R, C], BF16 in Megatron, one chunk per expert.

    Fused rows (w13: gate/up interleaved on disk) become ``[gate rows; up rows]`` per expert.
    Works on any leading slice of experts.
    """

    site: str = "mlp"

    def to_megatron(self, t: torch.Tensor) -> torch.Tensor:
        if not self.row.fused:
            return t
        return torch.cat([t[:, 0::2], t[:, 1::2]], 1)

    def to_hf(self, t: torch.Tensor) -> torch.Tensor:
        if not self.row.fused:
            return t
        e, r, c = t.shape
        gate, up = t[:, : r // 2], t[:, r // 2:]
        return torch.stack([gate, up], dim=2).reshape(e, r, c)


@dataclass(frozen=True)
class ExtraState:
    """A TE module whose ``_extra_state`` object Megatron's default load requires.

    ``kinds``: layer kinds it exists on; ``per_expert``: one object per routed expert
    (``shard_{e}_{E}``), else one (``shard_0_1``).
    """

    module: str
    site: str | None = "attn"  # None: a global module
    kinds: frozenset[str] = BOTH
    per_expert: bool = False


@dataclass(frozen=True)
class Preset:
    """A Megatron key layout: rules, layer sites and ``_extra_state`` modules."""

    name: str
    rules: tuple[Copy, ...]
    extra_state: tuple[ExtraState, ...]
    sites: Mapping[str, tuple[int, int]] = field(default_factory=lambda: {"attn": (1, 0), "mlp": (1, 0)})
    layer_prefix: str = "decoder.layers.{n}"

    def layer_prefix_of(self, site: str, layer: int) -> str:
        if site not in self.sites:
            raise ConfigError(f"preset {self.name}: unknown site {site!r} (known: {', '.join(self.sites)})")
        stride, offset = self.sites[site]
        return self.layer_prefix.format(n=stride * layer + offset)

    def renamed(self, name: str, keys: Mapping[str, str], sites: Mapping[str, tuple[int, int]] | None = None) -> "Preset":
        """Another preset: these keys renamed (whole patterns), optionally other sites."""
        unknown = set(keys) - {r.key for r in self.rules}
        if unknown:
            raise ConfigError(f"preset {name}: renames unknown keys {sorted(unknown)}")
        rules = tuple(replace(r, key=keys.get(r.key, r.key)) for r in self.rules)
        return Preset(name, rules, self.extra_state, dict(sites or self.sites), self.layer_prefix)


# ---- the ``miles`` table (shared/spec/megatron.md) ----------------------------------------------

_R = LAYER  # model.llm.layers.{layer}
_A = f"{LAYER}.attn"
_SA = "{L}.self_attention"


def _qkvr() -> tuple[Copy, ...]:
    # Miles saves its fused q‖k‖v‖r linear as four sub-keys: no per-group interleave to undo.
    return tuple(Copy(f"{_SA}.linear_qkv.weight.{p}", f"{_A}.{hf}.weight")
                 for p, hf in (("q", "wq_du"), ("k", "wk_dv"), ("v", "wv_dv"), ("r", "wr_du")))


MILES_RULES: tuple[Copy, ...] = (
    Copy("embedding.word_embeddings.weight", f"{TEXT}.embed.weight", vocab=True),
    Copy("embedding.embed_norm.weight", f"{TEXT}.embed_norm.weight"),
    Copy("{L}.attn_res_query", f"{TEXT}.attn_res.attn_queries.{{layer}}"),  # the row carries the index shift
    Copy("{L}.mlp_res_query", f"{TEXT}.attn_res.mlp_queries.{{layer}}", site="mlp"),
    Copy(f"{_SA}.linear_qkv.layer_norm_weight", f"{_R}.attn_norm.weight"),
    *(Copy(f"{_SA}.{p}_input_norm.weight", f"{_R}.{p}_input_norm.weight") for p in "qkv"),
    *_qkvr(),
    Copy(f"{_SA}.linear_gate.weight", f"{_A}.gate_attn.weight"),
    Copy(f"{_SA}.sink_proj.weight", f"{_A}.attn_sink_proj.weight"),
    Copy(f"{_SA}.linear_proj.weight", f"{_A}.wo_ud.weight"),
    Copy(f"{_SA}.q_scale", f"{_A}.q_l2_clip.scale"),
    Copy(f"{_SA}.rel_scale", f"{_A}.rel_l2_clip.scale"),
    Copy(f"{_SA}.rel_proj", f"{_A}.rel_logits_proj.proj"),
    *(Copy(f"{_SA}.{p}_sconv.weight", f"{_A}.{p}_sconv.weight") for p in "kv"),
    *(Copy(f"{_SA}.{p}_sconv.static_weight", f"{_A}.{p}_sconv.static_w") for p in "kv"),
    *(Copy(f"{_SA}.{p}_sconv.weight_proj.weight", f"{_A}.{p}_sconv.weight_proj") for p in "kv"),
    Copy(f"{_SA}.attn_sconv.weight", f"{_R}.attn_sconv.weight"),
    Copy("{L}.pre_mlp_layernorm.weight", f"{_R}.mlp_norm.weight", site="mlp"),
    Copy("{L}.mlp.router.weight", f"{_R}.mlp.gate.weight", site="mlp"),
    Copy("{L}.mlp.router.expert_bias", f"{_R}.mlp.gate.bias", site="mlp"),
    Copy("{L}.mlp.mlp_sconv.weight", f"{_R}.mlp_sconv.weight", site="mlp"),
    Experts("{L}.mlp.experts.experts.linear_fc1.weight", f"{EXPERTS}.w13_weight"),
    Experts("{L}.mlp.experts.experts.linear_fc2.weight", f"{EXPERTS}.w2_weight"),
    Copy("decoder.final_layernorm.weight", f"{TEXT}.norm.weight"),
    Copy("decoder.output_res_query", f"{TEXT}.attn_res.output_query"),
    Copy("output_layer.weight", f"{TEXT}.unembed.weight", vocab=True),
)

_FULL_ONLY = frozenset({FULL})

#: TE modules with ``_extra_state`` (linears, attention, norms). A superset is harmless: Megatron
#: ignores stored objects nobody requests, while a missing one fails its default load
#: (shared/reference/megatron.md §2.6).
MILES_EXTRA_STATE: tuple[ExtraState, ...] = (
    ExtraState("embedding.embed_norm", site=None),
    ExtraState("decoder.final_layernorm", site=None),
    ExtraState(f"{_SA}.linear_qkv"),
    ExtraState(f"{_SA}.linear_gate"),
    ExtraState(f"{_SA}.linear_proj"),
    ExtraState(f"{_SA}.core_attention"),
    *(ExtraState(f"{_SA}.{p}_input_norm", kinds=_FULL_ONLY) for p in "qkv"),
    ExtraState("{L}.pre_mlp_layernorm", site="mlp"),
    ExtraState("{L}.mlp.experts.experts.linear_fc1", site="mlp", per_expert=True),
    ExtraState("{L}.mlp.experts.experts.linear_fc2", site="mlp", per_expert=True),
)

MILES = Preset("miles", MILES_RULES, MILES_EXTRA_STATE)

#: Megatron-Core HybridModel (Megatron-Bridge's documented Inkling 2 shape): decoder block i is
#: hybrid layer 2i (attention, with its residual query) and 2i+1 (MoE, with the MLP's residual
#: query and pre-MLP norm); the stack's final norm is MambaStack's ``final_norm``. Attention
#: sub-names are not public yet, so Miles' are kept (INFERRED, reference megatron-inkling2.md §8).
BRIDGE = MILES.renamed("bridge", {"decoder.final_layernorm.weight": "decoder.final_norm.weight"},
                       sites={"attn": (2, 0), "mlp": (2, 1)})
BRIDGE = replace(BRIDGE, extra_state=tuple(
    replace(x, module="decoder.final_norm") if x.module == "decoder.final_layernorm" else x for x in BRIDGE.extra_state))

PRESETS: dict[str, Preset] = {p.name: p for p in (MILES, BRIDGE)}
DEFAULT_PRESET = "miles"


def get_preset(name: str | Preset) -> Preset:
    if isinstance(name, Preset):
        return name
    p = PRESETS.get(name)
    if p is None:
        raise ConfigError(f"unknown Megatron key preset {name!r}; known: {', '.join(PRESETS)}")
    return p


# ---- the expanded mapping -----------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One Megatron tensor key of a config and the release tensor it holds."""

    key: str
    hf: str  # the release tensor (stacked experts: the logical weight, ``…w13_weight``)
    rule: Copy
    layer: int | None  # the decoder layer (None: global)
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def stacked(self) -> bool:
        return isinstance(self.rule, Experts)

    @property
    def unit(self) -> str:
        """The conversion unit: ``global`` or ``layer.N`` (N the decoder layer)."""
        return "global" if self.layer is None else f"layer.{self.layer}"

    def chunks(self, dense_bytes: int | None = None) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """How the tensor is stored: (offsets, sizes) per chunk; one per expert when stacked, row
        ranges of at most ``dense_bytes`` (default :data:`DENSE_CHUNK_BYTES`) for a bigger global
        tensor whose rule moves rows apart, else one."""
        if self.stacked:
            e, r, c = self.shape
            return [((i, 0, 0), (1, r, c)) for i in range(e)]
        if not self.shape:
            return [((), ())]
        return [((a, *(0 for _ in self.shape[1:])), (b - a, *self.shape[1:])) for a, b in self.row_ranges(dense_bytes)]

    def row_ranges(self, dense_bytes: int | None = None) -> list[tuple[int, int]]:
        """The stored row ranges of a non-expert tensor (see :meth:`chunks`); ``[(0, 1)]`` for a scalar."""
        limit = DENSE_CHUNK_BYTES if dense_bytes is None else dense_bytes
        rows = self.shape[0] if self.shape else 1
        row_bytes = nbytes(self.shape[1:], self.dtype)
        if self.layer is not None or len(self.shape) < 2 or not self.rule.by_rows or rows * row_bytes <= limit:
            return [(0, rows)]
        step = max(1, limit // max(1, row_bytes))
        return [(a, min(rows, a + step)) for a in range(0, rows, step)]


@dataclass(frozen=True)
class ObjectEntry:
    """One ``_extra_state`` object (Megatron ``ShardedObject.unique_key``) and its unit."""

    key: str
    unit: str


@dataclass(frozen=True)
class Coverage:
    """Names no rule uses (``unused``) and names the rules need that are absent (``missing``)."""

    unused: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.unused and not self.missing

    def raise_for(self, where: str, what: str, hint: str = "") -> None:
        """CheckpointError naming the first unused / missing name (and how many more), then ``hint``."""
        for names, why in ((self.unused, f"no {what} rule uses"), (self.missing, "missing")):
            if names:
                more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
                raise CheckpointError(f"{where}: {why} {names[0]}{more}{'; ' + hint if hint else ''}")


class MegatronMapping:
    """The release ⇄ torch_dist mapping of one config under one preset.

    Args:
        cfg: the text model config.
        preset: a :class:`Preset` or its name (default ``miles``).
        dtypes: stored dtypes of non-expert release tensors, by name (a source's own, kept as
            they are); others use the inventory's. Routed experts are always BF16.

    Raises:
        ConfigError: when the table and the release inventory disagree either way.
    """

    def __init__(self, cfg: InklingConfig, preset: str | Preset = DEFAULT_PRESET,
                 dtypes: Mapping[str, torch.dtype] | None = None):
        self.cfg = cfg
        self.preset = get_preset(preset)
        dt = dict(dtypes or {})
        entries: dict[str, Entry] = {}
        by_hf: dict[str, str] = {}
        for rule in self.preset.rules:
            row = rule.row
            if isinstance(rule, Experts) != (row.scope is Scope.EXPERTS):
                raise ConfigError(f"preset {self.preset.name}: {rule.key} maps {row.pattern} with the wrong rule type")
            if row.scope is Scope.GLOBAL:
                if "{L}" in rule.key:
                    raise ConfigError(f"preset {self.preset.name}: global tensor {row.pattern} under a layer key {rule.key}")
                places: list[int | None] = [None]
            else:
                if "{L}" not in rule.key:
                    raise ConfigError(f"preset {self.preset.name}: per-layer tensor {row.pattern} under a global key {rule.key}")
                places = [i for i in range(cfg.num_hidden_layers) if row.exists_on(cfg, i)]
            for layer in places:
                key = rule.key if layer is None else rule.key.replace("{L}", self.preset.layer_prefix_of(rule.site, layer))
                hf = row.name(layer)
                if key in entries:
                    raise ConfigError(f"preset {self.preset.name}: {key} is produced twice ({entries[key].hf}, {hf})")
                if hf in by_hf:
                    raise ConfigError(f"preset {self.preset.name}: {hf} maps to {by_hf[hf]} and {key}")
                shape = row.shape_on(cfg, layer)
                dtype = BF16 if isinstance(rule, Experts) else dt.get(hf, row.dtype)
                entries[key] = Entry(key, hf, rule, layer, shape, dtype)
                by_hf[hf] = key
        # Unit-major order (globals, layer 0, layer 1, …), table order within a unit.
        order = {k: (-1 if e.layer is None else e.layer, i) for i, (k, e) in enumerate(entries.items())}
        self._entries = dict(sorted(entries.items(), key=lambda kv: order[kv[0]]))
        self._by_hf = by_hf
        cov = self.hf_coverage(self.release_names())
        if not cov.ok:
            what = (f"no rule maps release tensor {cov.unused[0]}" if cov.unused
                    else f"a rule maps {cov.missing[0]}, which the release inventory does not hold")
            raise ConfigError(f"preset {self.preset.name} disagrees with the Inkling 2 inventory: {what}")

    # ---- names, shapes, chunks

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def keys(self) -> list[str]:
        """Every tensor key of the checkpoint in unit order (``_extra_state`` objects excluded)."""
        return list(self._entries)

    def entry(self, key: str) -> Entry:
        e = self._entries.get(key)
        if e is None:
            raise CheckpointError(f"{key} is not a Megatron key of Inkling 2 under preset {self.preset.name}")
        return e

    def entry_for_hf(self, name: str) -> Entry:
        """The entry holding release tensor ``name`` (stacked experts: the logical weight name)."""
        key = self._by_hf.get(name)
        if key is None:
            raise CheckpointError(f"{name}: no Megatron rule of preset {self.preset.name} maps this tensor")
        return self._entries[key]

    @cached_property
    def units(self) -> list[str]:
        """Conversion units in order: ``global``, ``layer.0``, …"""
        return ["global"] + [f"layer.{i}" for i in range(self.cfg.num_hidden_layers)]

    def extra_state(self) -> list[ObjectEntry]:
        """Every ``_extra_state`` object (unique key form ``<module>._extra_state/shard_<off>_<shape>``)."""
        out: list[ObjectEntry] = []
        E = self.cfg.n_routed_experts
        for x in self.preset.extra_state:
            if x.site is None:
                out.append(ObjectEntry(f"{x.module}._extra_state/shard_0_1", "global"))
                continue
            for i in range(self.cfg.num_hidden_layers):
                if self.cfg.layer_kind(i) not in x.kinds:
                    continue
                module = x.module.replace("{L}", self.preset.layer_prefix_of(x.site, i))
                shards = [f"shard_{e}_{E}" for e in range(E)] if x.per_expert else ["shard_0_1"]
                out.extend(ObjectEntry(f"{module}._extra_state/{s}", f"layer.{i}") for s in shards)
        return out

    # ---- coverage, both directions

    def release_names(self) -> list[str]:
        """The release text tensors of the config (stacked experts by their weight's name)."""
        plan = PrecisionPlan.uniform("bf16", self.cfg.num_hidden_layers)
        return [s.name for s in inventory(self.cfg, plan, vision=[])]

    def hf_coverage(self, names: Iterable[str]) -> Coverage:
        """Stored release names (expert parts, vision allowed) against the rules' release tensors."""
        logical: dict[str, None] = {}
        for n in names:
            if is_vision(n):
                continue  # passed through by prefix; not in the Megatron checkpoint
            m = match_name(n)
            logical[n[: len(n) - len(m.part)] if m is not None and m.part else n] = None
        unused = sorted(n for n in logical if n not in self._by_hf)
        missing = [n for n in self._by_hf if n not in logical]
        return Coverage(unused, missing)

    def megatron_coverage(self, keys: Iterable[str]) -> Coverage:
        """Stored torch_dist tensor keys against the rules' keys (training state skipped)."""
        have = {k for k in keys if not k.startswith(SKIPPED_PREFIXES)}
        return Coverage(sorted(have - set(self._entries)), [k for k in self._entries if k not in have])

    def check_hf(self, names: Iterable[str], where: str) -> None:
        self.hf_coverage(names).raise_for(where, "Megatron")

    def check_megatron(self, keys: Iterable[str], where: str) -> None:
        """CheckpointError naming the first key this preset leaves unexplained, and the preset the keys fit instead."""
        keys = list(keys)
        cov = self.megatron_coverage(keys)
        if cov.ok:
            return
        others = [p for p in presets_of_keys(keys) if p != self.preset.name]
        hint = f"its keys follow preset {others[0]} (pass --preset {others[0]}, or leave --preset out)" if others else ""
        cov.raise_for(where, f"preset {self.preset.name}", hint)

    # ---- transforms

    def to_megatron(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """A release tensor (experts: BF16, any leading slice) → its Megatron form."""
        e = self.entry(key)
        want = e.shape if not e.stacked else (t.shape[0], *e.shape[1:])
        if tuple(t.shape) != tuple(want) or t.dtype != e.dtype:
            raise CheckpointError(f"{e.hf}: {t.dtype} {list(t.shape)} does not fit {key} ({e.dtype} {list(want)})")
        return e.rule.to_megatron(t)

    def to_hf(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """A Megatron tensor (experts: any leading slice) → the release tensor (before encoding)."""
        e = self.entry(key)
        if e.rule.vocab and t.dim() == 2 and t.shape[1] == e.shape[1] and t.shape[0] > e.shape[0]:
            t = t[: e.shape[0]]  # a Megatron-padded vocabulary: rows past the release's are dropped
        want = e.shape if not e.stacked else (t.shape[0], *e.shape[1:])
        if tuple(t.shape) != tuple(want):
            raise CheckpointError(f"{key}: {list(t.shape)}, the reference config says {list(want)}")
        return e.rule.to_hf(t)

    def rows_to_megatron(self, key: str, t: torch.Tensor, start: int) -> torch.Tensor:
        """Rows ``start:start+len(t)`` of a non-expert release tensor → the same rows of its Megatron form."""
        e = self._rows_entry(key, t, start)
        if t.dtype != e.dtype:
            raise CheckpointError(f"{e.hf}: {t.dtype} does not fit {key} ({e.dtype})")
        return e.rule.to_megatron(t)

    def rows_to_hf(self, key: str, t: torch.Tensor, start: int) -> torch.Tensor:
        """Rows ``start:start+len(t)`` of a non-expert Megatron tensor → the same rows of the release tensor
        (rows of a padded vocabulary past the release's must not be asked for)."""
        return self._rows_entry(key, t, start).rule.to_hf(t)

    def _rows_entry(self, key: str, t: torch.Tensor, start: int) -> Entry:
        e = self.entry(key)
        if e.stacked or not e.rule.by_rows or len(e.shape) < 1:
            raise CheckpointError(f"{key}: not a tensor that moves in row slices")
        if t.dim() != len(e.shape) or tuple(t.shape[1:]) != tuple(e.shape[1:]) \
                or not 0 <= start <= start + t.shape[0] <= e.shape[0]:
            raise CheckpointError(f"{key}: rows {start}:{start + (t.shape[0] if t.dim() else 0)} "
                                  f"{list(t.shape)} do not fit {list(e.shape)}")
        return e


# ---- which preset a folder's keys follow ---------------------------------------------------------


def global_keys(preset: Preset) -> frozenset[str]:
    """The preset's keys outside decoder layers: the same for every config of the model."""
    return frozenset(r.key for r in preset.rules if "{L}" not in r.key)


def presets_of_keys(keys: Iterable[str]) -> list[str]:
    """Names of the presets whose global keys a torch_dist folder holds (no config needed).

    The tables decide: a preset fits when every one of its global keys is stored (``miles`` keeps
    ``decoder.final_layernorm``, ``bridge`` ``decoder.final_norm``).
    """
    have = set(keys)
    return [name for name, p in PRESETS.items() if global_keys(p) <= have]


def layer_count(preset: Preset, keys: Iterable[str]) -> int | None:
    """Decoder layers a torch_dist folder holds under ``preset``, from its per-layer key prefixes."""
    head, _, tail = preset.layer_prefix.partition("{n}")
    prefix = re.compile(re.escape(head) + r"(\d+)" + re.escape(tail) + r"\.")
    numbers = {int(m.group(1)) for m in map(prefix.match, keys) if m is not None}
    if not numbers:
        return None
    stride = max(s for s, _ in preset.sites.values())
    return -(-(max(numbers) + 1) // stride)


def stored_shape_ok(e: Entry, shape: Sequence[int]) -> bool:
    """Whether a stored Megatron tensor of ``shape`` fits ``e`` (vocabulary keys may be padded)."""
    shape = tuple(shape)
    if e.rule.vocab:
        return len(shape) == 2 and shape[1] == e.shape[1] and shape[0] >= e.shape[0]
    return shape == e.shape


__all__ = [
    "Copy", "Experts", "ExtraState", "Preset", "MILES", "BRIDGE", "PRESETS", "DEFAULT_PRESET", "DENSE_CHUNK_BYTES", "get_preset",
    "MegatronMapping", "Entry", "ObjectEntry", "Coverage", "SKIPPED_PREFIXES", "stored_shape_ok", "global_keys",
    "presets_of_keys", "layer_count",
]
