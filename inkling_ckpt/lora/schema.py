"""The LoRA target table (spec/lora.md): trainer module -> engine adapter module -> base tensor.

One row per adapted (or explicitly excluded) module. Names are patterns with ``{layer}``; the
rule says how the factors are shaped on each side. Everything name-related lives here, so a
schema change (new target, renamed module) is a one-row edit.

Trainer side (Megatron-Bridge): ``<adapter>.linear_in.weight`` is A, ``<adapter>.linear_out.weight``
is B. The four separate q/k/v/r adapters of the fused ``linear_qkv`` follow Bridge's CanonicalLoRA
naming (``linear_qkv.adapter.adapter_q`` …, plus ``adapter_r`` for Inkling's relative states);
no public code pins Inkling 2's trainer names yet (reference/lora.md), so they live only here. Engine side (PEFT): ``<module>.lora_A.weight`` / ``<module>.lora_B.weight``. Base side: the
release checkpoint tensor the merge adds ``(alpha/r) * B @ A`` to (spec/inkling2.md).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Union

from ..errors import ConfigError

#: Trainer factor suffix -> side. A ("linear_in") maps the input to rank r, B ("linear_out") back.
TRAINER_SIDES = {"linear_in.weight": "A", "linear_out.weight": "B"}
#: Engine factor suffix -> side.
ENGINE_SIDES = {"lora_A.weight": "A", "lora_B.weight": "B"}
#: Prefixes in front of trainer names (DDP / Float16Module wrappers) and engine names (PEFT save).
TRAINER_WRAPPERS = ("module.",)
ENGINE_WRAPPERS = ("base_model.model.",)


@dataclass(frozen=True)
class Linear:
    """A 2-D linear ``W [out, in]``: A ``[r, in]``, B ``[out, r]``, the same on both sides.

    ``trim_out``: B may arrive with more rows (padded vocabulary); rows past this dimension are
    dropped on export, and the merge touches only those rows of the base.
    """

    out: str
    inp: str
    trim_out: str | None = None


@dataclass(frozen=True)
class ExpertsGateUp:
    """Shared-outer routed-expert fc1 (``w13``, gate/up interleaved on disk).

    Trainer: A ``[r, H]`` shared by every expert (or ``[n, r, H]``, all n equal); B
    ``[E_local, 2F, r]`` per expert, gate rows then up rows. Engine: ``w1`` (gate) and ``w3`` (up),
    each A ``[1, r, H]`` (the shared A, emitted once per projection) and B ``[E, F, r]``.
    """


@dataclass(frozen=True)
class ExpertsDown:
    """Shared-outer routed-expert fc2 (``w2``). Trainer: A ``[E_local, r, F]`` per expert, B ``[H, r]``
    shared (or ``[n, H, r]``, all n equal). Engine: A ``[E, r, F]``, B ``[1, H, r]``."""


@dataclass(frozen=True)
class Excluded:
    """A module the schema gives no adapter; an adapter on it is an error."""

    why: str


Rule = Union[Linear, ExpertsGateUp, ExpertsDown, Excluded]


@dataclass(frozen=True)
class Target:
    """One row: trainer adapter prefix, engine module(s), base tensor, rule."""

    key: str
    trainer: str
    engine: tuple[str, ...] = ()
    base: str = ""
    rule: Rule = Excluded("")


_L = "decoder.layers.{layer}."
_E = "language_model.layers.{layer}."
_B = "model.llm.layers.{layer}."

#: The table. Order = emission order within a layer.
TARGETS: tuple[Target, ...] = (
    Target("q", _L + "self_attention.linear_qkv.adapter.adapter_q", (_E + "attn.wq_du",), _B + "attn.wq_du.weight", Linear("q_out", "H")),
    Target("k", _L + "self_attention.linear_qkv.adapter.adapter_k", (_E + "attn.wk_dv",), _B + "attn.wk_dv.weight", Linear("kv_out", "H")),
    Target("v", _L + "self_attention.linear_qkv.adapter.adapter_v", (_E + "attn.wv_dv",), _B + "attn.wv_dv.weight", Linear("kv_out", "H")),
    Target("r", _L + "self_attention.linear_qkv.adapter.adapter_r", (_E + "attn.wr_du",), _B + "attn.wr_du.weight", Linear("r_out", "H")),
    Target("o", _L + "self_attention.linear_proj.adapter", (_E + "attn.wo_ud",), _B + "attn.wo_ud.weight", Linear("H", "o_in")),
    Target("gate", _L + "self_attention.linear_gate.adapter", (_E + "attn.gate_attn",), _B + "attn.gate_attn.weight", Linear("q_out", "H")),
    Target("fc1", _L + "mlp.experts.linear_fc1.adapter", (_E + "mlp.experts.w1", _E + "mlp.experts.w3"),
           _B + "mlp.experts.w13_weight", ExpertsGateUp()),
    Target("fc2", _L + "mlp.experts.linear_fc2.adapter", (_E + "mlp.experts.w2",), _B + "mlp.experts.w2_weight", ExpertsDown()),
    Target("lm_head", "output_layer.adapter", ("language_model.lm_head",), "model.llm.unembed.weight", Linear("Vu", "H", trim_out="Vu")),
    # no adapter, ever (spec/lora.md "never")
    Target("sink", _L + "self_attention.sink_proj.adapter", (_E + "attn.attn_sink_proj",),
           rule=Excluded("the attention sink projection gets no adapter")),
    Target("router", _L + "mlp.router.adapter", (_E + "mlp.gate",), rule=Excluded("the router gets no adapter")),
    Target("rel_proj", _L + "self_attention.rel_proj.adapter", (_E + "attn.rel_logits_proj",),
           rule=Excluded("rel_logits_proj gets no adapter")),
    Target("k_sconv", _L + "self_attention.k_sconv.weight_proj.adapter", (_E + "attn.k_sconv.weight_proj",),
           rule=Excluded("short convolutions get no adapter")),
    Target("v_sconv", _L + "self_attention.v_sconv.weight_proj.adapter", (_E + "attn.v_sconv.weight_proj",),
           rule=Excluded("short convolutions get no adapter")),
    Target("embed", "embedding.word_embeddings.adapter", ("language_model.embed_tokens",),
           rule=Excluded("the embedding gets no adapter")),
)


def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile(re.escape(pattern).replace(re.escape("{layer}"), r"(?P<layer>\d+)"))


@dataclass(frozen=True)
class Match:
    """A name resolved through the table: which row, which layer (None for model-level), which side."""

    target: Target
    layer: int | None
    side: str  # "A" | "B"
    module: int = 0  # index into target.engine (engine names only)


class Schema:
    """Compiled lookups over :data:`TARGETS` (exact regexes, no substring guessing)."""

    def __init__(self, targets: tuple[Target, ...] = TARGETS):
        self.targets = targets
        self._trainer = [(t, _regex(t.trainer)) for t in targets]
        self._engine = [(t, i, _regex(e)) for t in targets for i, e in enumerate(t.engine)]

    @staticmethod
    def _strip(name: str, wrappers: tuple[str, ...]) -> str:
        changed = True
        while changed:
            changed = False
            for w in wrappers:
                if name.startswith(w):
                    name, changed = name[len(w):], True
        return name

    @staticmethod
    def _split(name: str, sides: Mapping[str, str]) -> tuple[str, str] | None:
        for suffix, side in sides.items():
            if name.endswith("." + suffix):
                return name[: -len(suffix) - 1], side
        return None

    def trainer(self, name: str) -> Match | None:
        """The row of a trainer adapter factor name, or None when ``name`` is no adapter factor."""
        split = self._split(self._strip(name, TRAINER_WRAPPERS), TRAINER_SIDES)
        if split is None:
            return None
        module, side = split
        for t, rx in self._trainer:
            m = rx.fullmatch(module)
            if m:
                layer = m.groupdict().get("layer")
                return Match(t, None if layer is None else int(layer), side)
        return None

    def is_adapter_name(self, name: str) -> bool:
        """Whether a trainer name looks like a LoRA factor (``….adapter….linear_in/out.weight``)."""
        split = self._split(self._strip(name, TRAINER_WRAPPERS), TRAINER_SIDES)
        return split is not None and ".adapter" in "." + split[0]

    def engine(self, name: str) -> Match | None:
        """The row of an engine adapter tensor name (``base_model.model.`` accepted), or None."""
        split = self._split(self._strip(name, ENGINE_WRAPPERS), ENGINE_SIDES)
        if split is None:
            return None
        module, side = split
        for t, i, rx in self._engine:
            m = rx.fullmatch(module)
            if m:
                layer = m.groupdict().get("layer")
                return Match(t, None if layer is None else int(layer), side, i)
        return None

    @staticmethod
    def fill(pattern: str, layer: int | None) -> str:
        return pattern if layer is None else pattern.replace("{layer}", str(layer))

    def engine_names(self, target: Target, layer: int | None) -> list[tuple[str, str]]:
        """``(engine name, side)`` of every tensor a row emits, in emission order."""
        out = []
        for mod in target.engine:
            m = self.fill(mod, layer)
            out += [(f"{m}.{suffix}", side) for suffix, side in ENGINE_SIDES.items()]
        return out


SCHEMA = Schema()


# ---- model dimensions ------------------------------------------------------------------------

def positive_number(v: object) -> bool:
    """Whether ``v`` is a usable ``lora_alpha`` or rank: an int or float (not a bool), finite, above
    zero (Python's JSON reads NaN and Infinity, which would merge into garbage)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


#: text_config aliases transformers accepts (spec/inkling2.md), alias -> canonical field.
_ALIASES = {"num_local_experts": "n_routed_experts", "sliding_window": "sliding_window_size"}
_REQUIRED = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "num_key_value_heads",
             "head_dim", "d_rel", "n_routed_experts", "moe_intermediate_size")


@dataclass(frozen=True)
class ModelDims:
    """The shape-deciding fields of an Inkling 2 ``text_config`` (spec/inkling2.md)."""

    text: Mapping[str, Any]

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "ModelDims":
        """From a full ``config.json`` (with ``text_config``) or a bare text config."""
        text = dict(config.get("text_config", config))
        for alias, field in _ALIASES.items():
            if alias in text and field not in text:
                text[field] = text[alias]
        missing = [k for k in _REQUIRED if not isinstance(text.get(k), int)]
        if missing:
            raise ConfigError(f"text_config lacks integer fields {missing}")
        n = text["num_hidden_layers"]
        types = text.get("layer_types") or ["hybrid" if (i + 1) % 6 == 0 else "hybrid_sliding" for i in range(n)]
        if len(types) != n:
            raise ConfigError(f"text_config.layer_types has {len(types)} entries for {n} layers")
        text["layer_types"] = list(types)
        text.setdefault("unpadded_vocab_size", text["vocab_size"])
        for k in ("swa_num_attention_heads", "swa_num_key_value_heads", "swa_head_dim"):
            text.setdefault(k, text[k[4:]])
        return cls(text)

    @property
    def num_layers(self) -> int:
        return int(self.text["num_hidden_layers"])

    @property
    def num_experts(self) -> int:
        return int(self.text["n_routed_experts"])

    def dims(self, layer: int | None) -> dict[str, int]:
        """Named dimensions of one layer (or of the model-level modules when ``layer`` is None)."""
        t = self.text
        d = {"H": t["hidden_size"], "E": t["n_routed_experts"], "F": t["moe_intermediate_size"],
             "V": t["vocab_size"], "Vu": t["unpadded_vocab_size"]}
        if layer is not None:
            if not 0 <= layer < self.num_layers:
                raise ConfigError(f"layer {layer} is outside 0..{self.num_layers - 1}")
            swa = "swa_" if t["layer_types"][layer] == "hybrid_sliding" else ""
            nh, kv, hd = t[swa + "num_attention_heads"], t[swa + "num_key_value_heads"], t[swa + "head_dim"]
            d.update(q_out=nh * hd, kv_out=kv * hd, r_out=nh * t["d_rel"], o_in=nh * hd)
        return d
