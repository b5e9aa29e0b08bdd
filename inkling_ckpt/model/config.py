"""The Inkling 2 architecture as read from ``config.json`` (``text_config`` and ``vision_config``)."""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..errors import ConfigError

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower's shape: enough to list its tensors; its weights pass through untouched."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "VisionConfig":
        return cls(**_pick(cls, d, "vision_config"))


@dataclass(frozen=True)
class InklingConfig:
    """The text model's fields that decide tensor names and shapes (``config.json`` → ``text_config``)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    sliding_window: int
    relative_bias_buckets: int
    attn_residual_block_size: int
    conv_kernel_size: int
    num_nextn_predict_layers: int
    max_position_embeddings: int
    swiglu_limit: float = 7.0
    tie_word_embeddings: bool = False
    vision: VisionConfig | None = field(default=None, compare=True)

    def __post_init__(self) -> None:
        ints = [
            "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "n_routed_experts", "num_experts_per_tok",
            "moe_intermediate_size", "intermediate_size", "sliding_window", "relative_bias_buckets",
            "attn_residual_block_size", "conv_kernel_size", "max_position_embeddings",
        ]
        for name in ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"text_config.{name} must be a positive integer, got {value!r}")
        if self.num_nextn_predict_layers < 0:
            raise ConfigError("text_config.num_nextn_predict_layers must be >= 0")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        bad = sorted({t for t in self.layer_types if t not in (FULL_ATTENTION, SLIDING_ATTENTION)})
        if bad:
            raise ConfigError(f"layer_types holds unknown kinds {bad}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError("num_experts_per_tok exceeds n_routed_experts")

    # Derived sizes, named the way the tensor table refers to them.
    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def is_full_attention(self, layer: int) -> bool:
        return self.layer_types[layer] == FULL_ATTENTION

    def dims(self) -> dict[str, int]:
        """Symbolic dimension names used by the tensor inventory."""
        d = {
            "H": self.hidden_size,
            "2H": 2 * self.hidden_size,
            "V": self.vocab_size,
            "Q": self.q_dim,
            "KV": self.kv_dim,
            "NH": self.num_attention_heads,
            "NB": self.relative_bias_buckets,
            "CK": self.conv_kernel_size,
            "E": self.n_routed_experts,
            "I": self.moe_intermediate_size,
            "MI": self.intermediate_size,
            "1": 1,
        }
        if self.vision is not None:
            v = self.vision
            merged = v.hidden_size * v.spatial_merge_size**2
            d.update({
                "VH": v.hidden_size, "V3H": 3 * v.hidden_size, "VI": v.intermediate_size,
                "VC": v.in_channels, "VT": v.temporal_patch_size, "VP": v.patch_size,
                "VM": merged, "VO": v.out_hidden_size,
            })
        return d

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "InklingConfig":
        """Build from a whole ``config.json`` (with ``text_config``) or a bare text config."""
        text = config.get("text_config", config)
        if not isinstance(text, Mapping):
            raise ConfigError("config.json: text_config is not an object")
        fields = _pick(cls, text, "text_config", skip={"vision", "layer_types"})
        if "layer_types" not in text:
            raise ConfigError("config.json: text_config is missing required field 'layer_types'")
        fields["layer_types"] = tuple(text["layer_types"])
        vision = config.get("vision_config")
        fields["vision"] = VisionConfig.from_dict(vision) if vision else None
        return cls(**fields)

    @classmethod
    def from_file(cls, path: str | Path) -> "InklingConfig":
        return cls.from_dict(read_json(path))

    def to_text_config(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("vision")
        d["layer_types"] = list(self.layer_types)
        return d


def read_json(path: str | Path) -> dict[str, Any]:
    """Read a JSON object, turning every failure into a one-line ConfigError naming the file."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{p}: not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{p}: cannot read JSON ({e})") from None
    except (RecursionError, ValueError) as e:  # nested too deeply; integers too long to parse
        raise ConfigError(f"{p}: cannot read JSON ({'nested too deeply' if isinstance(e, RecursionError) else str(e)[:120]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a JSON object")
    return data


def _pick(cls: type, d: Mapping[str, Any], where: str, skip: set[str] = frozenset()) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in cls.__dataclass_fields__.values():  # type: ignore[attr-defined]
        if f.name in skip:
            continue
        if f.name in d:
            out[f.name] = d[f.name]
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ConfigError(f"config.json: {where} is missing required field {f.name!r}")
    return out
