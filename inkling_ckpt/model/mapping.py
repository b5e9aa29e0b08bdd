"""Inkling 2 HF ⇄ Megatron-Core ``torch_dist`` names and tensor transforms, as typed rules.

The table (:data:`RULES`) is data: each rule names one Megatron checkpoint key pattern and the
HF tensor(s) it is built from, and knows how to go both ways. Patterns use ``{layer}`` (decoder
layer), ``{mtp}`` (MTP layer) and, on the HF side of stacked experts, ``{expert}``; a rule expands
them per layer. Keys follow ``shared/spec/megatron.md``:

* per-layer keys (``decoder.layers.{i}.…``, no ``model.`` prefix, no layer axis), because
  Inkling's layers are not homogeneous (full-attention layers carry K/V convolutions);
* every tensor at its global shape (the loader reshards to any TP/EP/PP);
* ``linear_qkv`` interleaved by query group: ``[q(g0), k(g0), v(g0), q(g1), …]`` with
  ``num_attention_heads / num_key_value_heads`` query heads per group
  (Megatron-LM ``megatron/core/transformer/attention.py`` ``get_query_key_value_tensors``,
  core_v0.16.1: ``view(..., ng, (np/ng + 2) * hn)`` then split ``[np/ng*hn, hn, hn]``);
* ``linear_fc1 = cat([gate, up], 0)`` (``megatron/core/transformer/mlp.py``: the first half of
  fc1's output is activated, i.e. the gate);
* routed experts stacked per layer under ``mlp.experts.experts.linear_fc{1,2}.weight`` with a
  leading expert axis (note the double ``experts``), stored one chunk per (layer, expert).

:class:`InklingMapping` expands the table for one config, checks it both ways (every HF text
tensor consumed by exactly one rule, every rule input present) and is the API the converters
and the weight-sync library use. Experts on the HF side are always *logical* BF16 weights
(``…experts.{e}.gate_proj.weight``); encoding them to a served format is the caller's job.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Callable, Iterable, Mapping, Sequence

import torch

from ..errors import CheckpointError, ConfigError
from .config import InklingConfig
from .inventory import LAYER, MTP, TEXT, Scope, inventory
from .precision import PrecisionPlan

BF16, F32 = torch.bfloat16, torch.float32

GetHF = Callable[[str], torch.Tensor]
Index = Mapping[str, int]

_FIELD = re.compile(r"\{(\w+)\}")
_LOOPS = ("layer", "mtp")


def _fields(pattern: str) -> set[str]:
    return set(_FIELD.findall(pattern))


# ---- rule types -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """One Megatron key pattern and the HF tensors it is made of.

    ``hf`` holds the HF name patterns in the order the transform takes them. ``only`` restricts
    a per-layer rule to full-attention layers (K/V convolutions). Subclasses define the shape
    and the two transforms; none of them modifies its inputs.
    """

    megatron: str
    hf: tuple[str, ...]
    only: str | None = None
    dtype: torch.dtype = BF16

    def __post_init__(self) -> None:
        loops = _fields(self.megatron)
        if not loops <= set(_LOOPS) or len(loops) > 1:
            raise ConfigError(f"mapping rule {self.megatron}: key pattern may use one of {{layer}}/{{mtp}}, got {sorted(loops)}")
        for p in self.hf:
            if _fields(p) != loops | set(self._hf_extra_fields()):
                raise ConfigError(
                    f"mapping rule {self.megatron}: HF pattern {p} has fields {sorted(_fields(p))}, expected "
                    f"{sorted(loops | set(self._hf_extra_fields()))}"
                )

    # The fields a key pattern loops over (none: global).
    @property
    def loop(self) -> str | None:
        loops = _fields(self.megatron)
        return next(iter(loops)) if loops else None

    def _hf_extra_fields(self) -> tuple[str, ...]:
        return ()

    def hf_names(self, cfg: InklingConfig, idx: Index) -> list[str]:
        """Every HF tensor name this rule consumes at ``idx``, in transform order."""
        return [p.format(**idx) for p in self.hf]

    def shape(self, cfg: InklingConfig, vocab_rows: int) -> tuple[int, ...]:
        raise NotImplementedError

    def chunks(self, cfg: InklingConfig, vocab_rows: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """How the tensor is stored: (offsets, sizes) per chunk. One chunk unless stacked."""
        shape = self.shape(cfg, vocab_rows)
        return [((0,) * len(shape), shape)]

    def build(self, cfg: InklingConfig, idx: Index, get_hf: GetHF, offsets: Sequence[int], sizes: Sequence[int],
              vocab_rows: int) -> torch.Tensor:
        """The stored chunk at ``offsets`` (whole-tensor rules have one chunk at 0)."""
        return self.combine(cfg, [get_hf(n) for n in self.hf_names(cfg, idx)], vocab_rows)

    def combine(self, cfg: InklingConfig, hf: Sequence[torch.Tensor], vocab_rows: int) -> torch.Tensor:
        raise NotImplementedError

    def split(self, cfg: InklingConfig, idx: Index, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError


@dataclass(frozen=True)
class Rename(Rule):
    """One HF tensor stored as is under another name."""

    def shape(self, cfg: InklingConfig, vocab_rows: int) -> tuple[int, ...]:
        return _hf_shape(cfg, self.hf[0])

    def combine(self, cfg: InklingConfig, hf: Sequence[torch.Tensor], vocab_rows: int) -> torch.Tensor:
        return hf[0]

    def split(self, cfg: InklingConfig, idx: Index, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        return {self.hf[0].format(**idx): tensor}


@dataclass(frozen=True)
class VocabRows(Rename):
    """Embedding / output layer: rows are the vocabulary, optionally zero-padded for Megatron.

    Megatron loads any stored vocab size for these two (``allow_shape_mismatch``): it truncates or
    zero-pads. Going back, rows beyond the HF ``vocab_size`` are dropped.
    """

    def shape(self, cfg: InklingConfig, vocab_rows: int) -> tuple[int, ...]:
        return (vocab_rows, cfg.hidden_size)

    def combine(self, cfg: InklingConfig, hf: Sequence[torch.Tensor], vocab_rows: int) -> torch.Tensor:
        t = hf[0]
        if vocab_rows == t.shape[0]:
            return t
        pad = t.new_zeros((vocab_rows - t.shape[0], *t.shape[1:]))
        return torch.cat([t, pad], 0)

    def split(self, cfg: InklingConfig, idx: Index, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        if tensor.shape[0] < cfg.vocab_size:
            raise CheckpointError(
                f"{self.megatron}: {tensor.shape[0]} vocabulary rows, the config needs {cfg.vocab_size}"
            )
        return {self.hf[0].format(**idx): tensor[: cfg.vocab_size]}


@dataclass(frozen=True)
class QKVInterleave(Rule):
    """q, k, v fused by query group: ``[q heads of group g, k_g, v_g]`` for g = 0 … ng-1."""

    def shape(self, cfg: InklingConfig, vocab_rows: int) -> tuple[int, ...]:
        return (cfg.q_dim + 2 * cfg.kv_dim, cfg.hidden_size)

    def combine(self, cfg: InklingConfig, hf: Sequence[torch.Tensor], vocab_rows: int) -> torch.Tensor:
        q, k, v = hf
        ng, d = cfg.num_key_value_heads, cfg.head_dim
        per = cfg.num_attention_heads // ng
        h = q.shape[-1]
        return torch.cat([q.reshape(ng, per * d, h), k.reshape(ng, d, h), v.reshape(ng, d, h)], 1).reshape(-1, h)

    def split(self, cfg: InklingConfig, idx: Index, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        ng, d = cfg.num_key_value_heads, cfg.head_dim
        per = cfg.num_attention_heads // ng
        h = tensor.shape[-1]
        q, k, v = tensor.reshape(ng, (per + 2) * d, h).split([per * d, d, d], 1)
        names = self.hf_names(cfg, idx)
        return {names[0]: q.reshape(-1, h).contiguous(), names[1]: k.reshape(-1, h).contiguous(),
                names[2]: v.reshape(-1, h).contiguous()}


@dataclass(frozen=True)
class GateUpConcat(Rule):
    """A dense SwiGLU ``linear_fc1``: ``cat([gate, up], 0)``."""

    def shape(self, cfg: InklingConfig, vocab_rows: int) -> tuple[int, ...]:
        g = _hf_shape(cfg, self.hf[0])
        return (2 * g[0], *g[1:])

    def combine(self, cfg: InklingConfig, hf: Sequence[torch.Tensor], vocab_rows: int) -> torch.Tensor:
        return torch.cat([hf[0], hf[1]], 0)

    def split(self, cfg: InklingConfig, idx: Index, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        gate, up = tensor.chunk(2, 0)
        names = self.hf_names(cfg, idx)
        return {names[0]: gate.contiguous(), names[1]: up.contiguous()}


@dataclass(frozen=True)
class StackedExperts(Rule):
    """A layer's routed experts as one ``[E, out, in]`` tensor, stored one chunk per expert.

    With two HF patterns (gate, up) each expert's slice is ``cat([gate, up], 0)`` (fc1); with one
    (down) it is the weight itself (fc2). HF names are the logical BF16 weights.
    """

    def _hf_extra_fields(self) -> tuple[str, ...]:
        return ("expert",)

    def hf_names(self, cfg: InklingConfig, idx: Index) -> list[str]:
        return [p.format(**idx, expert=e) for e in range(cfg.n_routed_experts) for p in self.hf]

    def expert_names(self, idx: Index, expert: int) -> list[str]:
        return [p.format(**idx, expert=expert) for p in self.hf]

    def shape(self, cfg: InklingConfig, vocab_rows: int) -> tuple[int, ...]:
        one = _hf_shape(cfg, self.hf[0])
        return (cfg.n_routed_experts, len(self.hf) * one[0], one[1])

    def chunks(self, cfg: InklingConfig, vocab_rows: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        _, rows, cols = self.shape(cfg, vocab_rows)
        return [((e, 0, 0), (1, rows, cols)) for e in range(cfg.n_routed_experts)]

    def build(self, cfg: InklingConfig, idx: Index, get_hf: GetHF, offsets: Sequence[int], sizes: Sequence[int],
              vocab_rows: int) -> torch.Tensor:
        first, count = offsets[0], sizes[0]
        out: torch.Tensor | None = None
        for j, e in enumerate(range(first, first + count)):
            row = 0
            for name in self.expert_names(idx, e):  # copied straight into place: one copy per weight
                w = get_hf(name)
                if out is None:
                    out = w.new_empty((count, len(self.hf) * w.shape[0], w.shape[1]))
                if w.dim() != 2 or row + w.shape[0] > out.shape[1] or w.shape[1] != out.shape[2] or w.dtype != out.dtype:
                    raise CheckpointError(f"{name}: {w.dtype} {list(w.shape)} does not fit {self.megatron.format(**idx)}")
                out[j, row:row + w.shape[0]] = w
                row += w.shape[0]
        if out is None:
            raise CheckpointError(f"{self.megatron.format(**idx)}: empty expert range at {first}")
        return out

    def combine_one(self, hf: Sequence[torch.Tensor]) -> torch.Tensor:
        return hf[0] if len(hf) == 1 else torch.cat(list(hf), 0)

    def combine(self, cfg: InklingConfig, hf: Sequence[torch.Tensor], vocab_rows: int) -> torch.Tensor:
        n = len(self.hf)
        return torch.stack([self.combine_one(hf[i:i + n]) for i in range(0, len(hf), n)], 0)

    def split(self, cfg: InklingConfig, idx: Index, tensor: torch.Tensor, expert_offset: int = 0) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for j in range(tensor.shape[0]):
            names = self.expert_names(idx, expert_offset + j)
            pieces = tensor[j].chunk(len(names), 0) if len(names) > 1 else (tensor[j],)
            for name, piece in zip(names, pieces):
                out[name] = piece.contiguous()
        return out


def _hf_shape(cfg: InklingConfig, pattern: str) -> tuple[int, ...]:
    return _hf_shapes(cfg)[_canonical(pattern)]


def _canonical(pattern: str) -> str:
    return pattern.format(layer=0, mtp=0, expert=0, vblock=0) if _fields(pattern) else pattern


@lru_cache(maxsize=8)
def _hf_shapes(cfg: InklingConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the HF logical tensors, by canonical name (indices 0)."""
    plan = PrecisionPlan.uniform("bf16", cfg.num_hidden_layers)
    shapes: dict[str, tuple[int, ...]] = {}
    for s in inventory(cfg, plan):
        # Every layer's tensor of one row has the same shape (K/V convolutions exist on
        # full-attention layers only, so take the first occurrence of each row).
        name = _canonical(s.row.pattern) + (f".{s.part}" if s.part is not None else "")
        shapes.setdefault(name, s.shape)
    return shapes


# ---- the Inkling 2 table --------------------------------------------------------------------

_FULL = "full_attention"


def _attention(hf: str, mg: str, convs_only: str | None) -> list[Rule]:
    """Attention of a decoder layer (``hf``/``mg`` prefixes) or of the MTP layer.

    K/V convolutions exist on full-attention decoder layers (``convs_only``) and on the MTP
    layer, whose attention is a full-attention layer's.
    """
    a, s = f"{hf}.self_attn", f"{mg}.self_attention"
    rules: list[Rule] = [
        Rename(f"{s}.linear_qkv.layer_norm_weight", (f"{hf}.input_layernorm.weight",)),
        QKVInterleave(f"{s}.linear_qkv.weight", (f"{a}.q_proj.weight", f"{a}.k_proj.weight", f"{a}.v_proj.weight")),
        Rename(f"{s}.linear_gate.weight", (f"{a}.g_proj.weight",)),
        Rename(f"{s}.linear_proj.weight", (f"{a}.o_proj.weight",)),
        Rename(f"{s}.sink_proj.weight", (f"{a}.sink_proj.weight",)),
        Rename(f"{s}.relative_bias.weight", (f"{a}.rel_bias.weight",)),
    ]
    rules += [
        Rename(f"{s}.k_conv.weight", (f"{a}.k_conv.weight",), only=convs_only),
        Rename(f"{s}.v_conv.weight", (f"{a}.v_conv.weight",), only=convs_only),
    ]
    return rules


_DL = "decoder.layers.{layer}"
_ML = "mtp.layers.{mtp}"
_MT = f"{_ML}.transformer_layer"
_EXP = f"{LAYER}.mlp.experts.{{expert}}"

RULES: tuple[Rule, ...] = (
    VocabRows("embedding.word_embeddings.weight", (f"{TEXT}.embed_tokens.weight",)),
    *_attention(LAYER, _DL, convs_only=_FULL),
    Rename(f"{_DL}.attn_residual.query", (f"{LAYER}.attn_residual.query",)),
    Rename(f"{_DL}.attn_residual.norm.weight", (f"{LAYER}.attn_residual.norm.weight",)),
    Rename(f"{_DL}.mlp_residual.query", (f"{LAYER}.mlp_residual.query",)),
    Rename(f"{_DL}.mlp_residual.norm.weight", (f"{LAYER}.mlp_residual.norm.weight",)),
    Rename(f"{_DL}.pre_mlp_layernorm.weight", (f"{LAYER}.post_attention_layernorm.weight",)),
    Rename(f"{_DL}.mlp.router.weight", (f"{LAYER}.mlp.gate.weight",)),
    Rename(f"{_DL}.mlp.router.expert_bias", (f"{LAYER}.mlp.gate.e_score_correction_bias",), dtype=F32),
    StackedExperts(f"{_DL}.mlp.experts.experts.linear_fc1.weight", (f"{_EXP}.gate_proj.weight", f"{_EXP}.up_proj.weight")),
    StackedExperts(f"{_DL}.mlp.experts.experts.linear_fc2.weight", (f"{_EXP}.down_proj.weight",)),
    Rename("decoder.final_layernorm.weight", (f"{TEXT}.norm.weight",)),
    VocabRows("output_layer.weight", ("lm_head.weight",)),
    Rename(f"{_ML}.enorm.weight", (f"{MTP}.enorm.weight",)),
    Rename(f"{_ML}.hnorm.weight", (f"{MTP}.hnorm.weight",)),
    Rename(f"{_ML}.eh_proj.weight", (f"{MTP}.eh_proj.weight",)),
    *_attention(MTP, _MT, convs_only=None),
    # The MTP layer's MLP is dense: TE fuses its pre-MLP norm into linear_fc1.
    Rename(f"{_MT}.mlp.linear_fc1.layer_norm_weight", (f"{MTP}.post_attention_layernorm.weight",)),
    GateUpConcat(f"{_MT}.mlp.linear_fc1.weight", (f"{MTP}.mlp.gate_proj.weight", f"{MTP}.mlp.up_proj.weight")),
    Rename(f"{_MT}.mlp.linear_fc2.weight", (f"{MTP}.mlp.down_proj.weight",)),
    Rename(f"{_ML}.final_layernorm.weight", (f"{MTP}.final_layernorm.weight",)),
)

# TE modules that carry ``_extra_state``: linears, attention, and (TE 2.x op-based) norms. A
# superset is harmless — Megatron ignores checkpoint keys nobody requests — while a missing one
# fails its default load (shared/reference/megatron.md §2.6, §6.3).
EXTRA_STATE_MODULES: tuple[str, ...] = (
    "decoder.final_layernorm",
    f"{_DL}.self_attention.linear_qkv", f"{_DL}.self_attention.linear_gate", f"{_DL}.self_attention.linear_proj",
    f"{_DL}.self_attention.core_attention", f"{_DL}.pre_mlp_layernorm",
    f"{_DL}.attn_residual.norm", f"{_DL}.mlp_residual.norm",
    f"{_MT}.self_attention.linear_qkv", f"{_MT}.self_attention.linear_gate", f"{_MT}.self_attention.linear_proj",
    f"{_MT}.self_attention.core_attention", f"{_MT}.mlp.linear_fc1", f"{_MT}.mlp.linear_fc2",
    f"{_ML}.eh_proj", f"{_ML}.enorm", f"{_ML}.hnorm", f"{_ML}.final_layernorm",
)
EXPERT_EXTRA_STATE_MODULES: tuple[str, ...] = (
    f"{_DL}.mlp.experts.experts.linear_fc1", f"{_DL}.mlp.experts.experts.linear_fc2",
)


# ---- the expanded mapping -------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One Megatron key of a config: its rule and loop index."""

    key: str
    rule: Rule
    idx: Mapping[str, int]
    shape: tuple[int, ...]

    @property
    def unit(self) -> str:
        """The conversion unit the key belongs to: ``layer.N``, ``mtp.N`` or ``global``."""
        if not self.idx:
            return "global"
        (loop, i), = self.idx.items()
        return f"{loop}.{i}"

    @property
    def stacked(self) -> bool:
        return isinstance(self.rule, StackedExperts)


@dataclass(frozen=True)
class Coverage:
    """HF names no rule consumes, and names some rule needs that a source lacks."""

    unconsumed: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.unconsumed and not self.missing


class InklingMapping:
    """The HF ⇄ Megatron mapping of one Inkling 2 config.

    Args:
        cfg: the text model config.
        vocab_rows: rows of the stored embedding / output layer (default ``cfg.vocab_size``).
        pad_vocab_to_multiple: alternatively, pad the vocabulary to a multiple of this.

    Raises:
        ConfigError: when the table and the config's tensor inventory disagree.
    """

    def __init__(self, cfg: InklingConfig, *, vocab_rows: int | None = None, pad_vocab_to_multiple: int | None = None,
                 rules: Sequence[Rule] = RULES):
        self.cfg = cfg
        if pad_vocab_to_multiple is not None:
            if pad_vocab_to_multiple <= 0:
                raise ConfigError(f"--pad-vocab-to-multiple must be positive, got {pad_vocab_to_multiple}")
            m = pad_vocab_to_multiple
            vocab_rows = -(-cfg.vocab_size // m) * m
        self.vocab_rows = cfg.vocab_size if vocab_rows is None else vocab_rows
        if self.vocab_rows < cfg.vocab_size:
            raise ConfigError(f"vocab_rows {self.vocab_rows} is smaller than vocab_size {cfg.vocab_size}")
        self.rules = tuple(rules)
        entries: dict[str, Entry] = {}
        for rule in self.rules:
            for idx in self._indices(rule):
                key = rule.megatron.format(**idx)
                if key in entries:
                    raise ConfigError(f"mapping: two rules produce {key}")
                entries[key] = Entry(key, rule, idx, rule.shape(cfg, self.vocab_rows))
        # Unit-major order (globals, layer 0, layer 1, …, MTP), table order within a unit.
        order = {k: (_unit_order(e.unit), i) for i, (k, e) in enumerate(entries.items())}
        self._entries = dict(sorted(entries.items(), key=lambda kv: order[kv[0]]))
        entries = self._entries
        self._hf_to_key: dict[str, str] = {}
        for key, e in entries.items():
            for name in e.rule.hf_names(cfg, e.idx):
                if name in self._hf_to_key:
                    raise ConfigError(f"mapping: {name} is consumed by {self._hf_to_key[name]} and {key}")
                self._hf_to_key[name] = key
        cov = self.coverage(self.expected_hf_names())
        if not cov.ok:
            what = (f"no rule consumes {cov.unconsumed[0]}" if cov.unconsumed
                    else f"a rule needs {cov.missing[0]}, which the model table does not hold")
            raise ConfigError(f"mapping table disagrees with the Inkling 2 tensor table: {what}")

    def _indices(self, rule: Rule) -> list[dict[str, int]]:
        loop = rule.loop
        if loop is None:
            return [{}]
        if loop == "mtp":
            return [{"mtp": k} for k in range(self.cfg.num_nextn_predict_layers)]
        layers = range(self.cfg.num_hidden_layers)
        if rule.only == _FULL:
            layers = [i for i in layers if self.cfg.is_full_attention(i)]
        return [{"layer": i} for i in layers]

    # ---- names and shapes

    def megatron_keys(self) -> list[str]:
        """Every tensor key of the torch_dist checkpoint, in table order (``_extra_state`` excluded)."""
        return list(self._entries)

    def megatron_shape(self, key: str) -> tuple[int, ...]:
        return self.entry(key).shape

    def megatron_dtype(self, key: str) -> torch.dtype:
        return self.entry(key).rule.dtype

    def entry(self, key: str) -> Entry:
        e = self._entries.get(key)
        if e is None:
            raise CheckpointError(f"{key} is not a Megatron key of Inkling 2 under this config")
        return e

    def rule_for(self, key: str) -> Rule:
        return self.entry(key).rule

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def chunks(self, key: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """(offsets, sizes) of each stored chunk: one per expert for stacked experts, else one."""
        return self.entry(key).rule.chunks(self.cfg, self.vocab_rows)

    def hf_inputs(self, key: str) -> list[str]:
        """The HF (logical) tensor names a key is built from."""
        e = self.entry(key)
        return e.rule.hf_names(self.cfg, e.idx)

    def key_for_hf(self, name: str) -> str:
        """The Megatron key that consumes an HF (logical) tensor name."""
        key = self._hf_to_key.get(name)
        if key is None:
            raise CheckpointError(f"{name}: no Megatron rule consumes this tensor")
        return key

    def extra_state_keys(self) -> list[str]:
        """Unique keys of the ``_extra_state`` objects (Megatron ``ShardedObject.unique_key`` form)."""
        out: list[str] = []
        E = self.cfg.n_routed_experts
        counts = {"layer": self.cfg.num_hidden_layers, "mtp": self.cfg.num_nextn_predict_layers}
        for pat in EXTRA_STATE_MODULES:
            loop = next(iter(_fields(pat)), None)
            for i in range(counts[loop]) if loop else [None]:
                module = pat.format(**{loop: i}) if loop else pat
                out.append(f"{module}._extra_state/shard_0_1")
        for pat in EXPERT_EXTRA_STATE_MODULES:
            for i in range(self.cfg.num_hidden_layers):
                out.extend(f"{pat.format(layer=i)}._extra_state/shard_{e}_{E}" for e in range(E))
        return out

    # ---- coverage

    def expected_hf_names(self) -> list[str]:
        """The logical HF text tensors of the config (experts as ``….weight``, vision excluded)."""
        plan = PrecisionPlan.uniform("bf16", self.cfg.num_hidden_layers)
        return [s.name for s in inventory(self.cfg, plan) if s.row.scope is not Scope.VISION_BLOCK
                and not s.name.startswith("model.visual.")]

    def coverage(self, hf_names: Iterable[str]) -> Coverage:
        """Which of ``hf_names`` no rule consumes, and which rule inputs are not among them."""
        names = set(hf_names)
        unconsumed = sorted(n for n in names if n not in self._hf_to_key)
        missing = [n for n in self._hf_to_key if n not in names]
        return Coverage(unconsumed, missing)

    def check_source(self, hf_names: Iterable[str], where: str) -> None:
        """Raise CheckpointError when a source holds a text tensor no rule consumes, or lacks one."""
        cov = self.coverage(hf_names)
        if cov.unconsumed:
            more = f" (and {len(cov.unconsumed) - 1} more)" if len(cov.unconsumed) > 1 else ""
            raise CheckpointError(f"{where}: no Megatron rule consumes {cov.unconsumed[0]}{more}")
        if cov.missing:
            more = f" (and {len(cov.missing) - 1} more)" if len(cov.missing) > 1 else ""
            raise CheckpointError(f"{where}: missing {cov.missing[0]}{more}")

    # ---- transforms

    def to_megatron(self, key: str, get_hf: GetHF) -> torch.Tensor:
        """Build one whole Megatron tensor from HF logical tensors (``get_hf(name)``)."""
        e = self.entry(key)
        if e.stacked:
            return e.rule.build(self.cfg, e.idx, get_hf, (0, 0, 0), e.shape, self.vocab_rows)
        return self._checked(e, e.rule.build(self.cfg, e.idx, get_hf, (), (), self.vocab_rows), e.shape)

    def build_chunk(self, key: str, offsets: Sequence[int], sizes: Sequence[int], get_hf: GetHF) -> torch.Tensor:
        """Build one stored chunk (one of :meth:`chunks`) of a Megatron tensor."""
        e = self.entry(key)
        t = e.rule.build(self.cfg, e.idx, get_hf, offsets, sizes, self.vocab_rows)
        return self._checked(e, t, tuple(sizes))

    def _checked(self, e: Entry, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{e.key}: built {list(t.shape)}, expected {list(shape)} (HF inputs {self.hf_inputs(e.key)[:3]})")
        if t.dtype != e.rule.dtype:
            raise CheckpointError(f"{e.key}: HF inputs are {t.dtype}, Megatron stores {e.rule.dtype}")
        return t

    def to_hf(self, key: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """A whole Megatron tensor → its HF logical tensors (experts: one ``….weight`` per expert)."""
        e = self.entry(key)
        want = e.shape
        if e.rule.__class__ is VocabRows:
            ok = tensor.dim() == 2 and tensor.shape[1] == want[1]
        else:
            ok = tuple(tensor.shape) == want
        if not ok:
            hint = " (an EP rank's local experts: use experts_to_hf)" if e.stacked else ""
            raise CheckpointError(f"{key}: got {list(tensor.shape)}, expected {list(want)}{hint}")
        return e.rule.split(self.cfg, e.idx, tensor)

    def experts_to_hf(self, key: str, tensor: torch.Tensor, expert_offset: int) -> dict[str, torch.Tensor]:
        """An EP rank's local experts ``[E_local, …]`` (global ids from ``expert_offset``) → HF."""
        e = self.entry(key)
        if not e.stacked:
            raise CheckpointError(f"{key} is not a stacked-experts key")
        n = tensor.shape[0] if tensor.dim() == 3 else -1
        if tensor.dim() != 3 or tuple(tensor.shape[1:]) != e.shape[1:] or expert_offset < 0 \
                or expert_offset + n > e.shape[0]:
            raise CheckpointError(
                f"{key}: local experts {list(tensor.shape)} at offset {expert_offset} do not fit {list(e.shape)}"
            )
        return e.rule.split(self.cfg, e.idx, tensor, expert_offset)  # type: ignore[call-arg]

    @cached_property
    def units(self) -> list[str]:
        """Conversion units in order: ``global``, ``layer.0`` …, ``mtp.0`` …"""
        seen: dict[str, None] = {}
        for e in self._entries.values():
            seen.setdefault(e.unit, None)
        return sorted(seen, key=_unit_order)


def _unit_order(unit: str) -> tuple[int, int]:
    if unit == "global":
        return (0, 0)
    loop, i = unit.split(".")
    return (1 if loop == "layer" else 2, int(i))


def unit_of_key(key: str) -> str:
    """The conversion unit of any key (tensor or ``_extra_state``)."""
    m = re.match(r"(decoder\.layers|mtp\.layers)\.(\d+)\.", key)
    if not m:
        return "global"
    return ("layer." if m.group(1) == "decoder.layers" else "mtp.") + m.group(2)


__all__ = [
    "InklingMapping", "Rule", "Rename", "VocabRows", "QKVInterleave", "GateUpConcat", "StackedExperts",
    "RULES", "Entry", "Coverage", "unit_of_key",
]
