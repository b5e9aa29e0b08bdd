"""The Inkling 2 architecture as read from ``config.json`` (spec/inkling2.md, transformers 5.24's schema).

Only the fields that decide tensor shapes are required; aliases transformers accepts are read
(``sliding_window`` → ``sliding_window_size``, ``intermediate_size`` → ``moe_intermediate_size``,
…); every other key is ignored here and kept verbatim by writers (they copy the raw dict).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..errors import CheckpointError, ConfigError

MAX_JSON_BYTES = 1 << 30  # configs, indexes, manifests: far above any real one

FULL = "hybrid"
SLIDING = "hybrid_sliding"

#: transformers' ``attribute_map`` of ``Inkling2TextConfig``: alias → canonical field.
TEXT_ALIASES = {
    "sliding_window": "sliding_window_size",
    "num_local_experts": "n_routed_experts",
    "sconv_kernel_size": "conv_kernel_size",
    "model_max_length": "max_position_embeddings",
    "intermediate_size": "moe_intermediate_size",
    "routed_scaling_factor": "route_scale",
}
VISION_ALIASES = {"native_patch_size": "patch_size", "adapter_merge_size": "spatial_merge_size"}

#: Fields that decide tensor shapes: a config without them cannot be planned.
TEXT_REQUIRED = (
    "hidden_size", "num_hidden_layers", "vocab_size", "unpadded_vocab_size",
    "num_attention_heads", "num_key_value_heads", "head_dim",
    "swa_num_attention_heads", "swa_num_key_value_heads", "swa_head_dim",
    "sliding_window_size", "rel_extent", "d_rel", "conv_kernel_size",
    "n_routed_experts", "moe_intermediate_size",
)
#: Optional fields read with transformers' defaults (no tensor shape depends on them).
TEXT_OPTIONAL = {"num_experts_per_tok": 8, "n_layers_per_attn_res_block": 6, "max_position_embeddings": 1048576}

VISION_DEFAULTS = {
    "hidden_size": 1024, "num_hidden_layers": 23, "num_attention_heads": 16, "num_channels": 3,
    "patch_size": 20, "posemb_grid_size": 32, "spatial_merge_size": 2, "projection_hidden_dim": 4096,
}

# Bounds that keep a hostile or mistyped config from planning absurd allocations: far above the
# released model (48 layers, 384 experts, hidden 4608), far below what would exhaust memory.
MAX_LAYERS = 4096
MAX_EXPERTS = 1 << 16
MAX_DIM = 1 << 24
MAX_ELEMENTS = 1 << 50


def _canonical(d: Mapping[str, Any], aliases: Mapping[str, str], where: str) -> dict[str, Any]:
    out = dict(d)
    for alias, name in aliases.items():
        if alias in out:
            value = out.pop(alias)
            if name in out and out[name] != value:
                raise ConfigError(f"config.json: {where} sets both {name}={out[name]!r} and its alias {alias}={value!r}")
            out.setdefault(name, value)
    return out


def _int(d: Mapping[str, Any], name: str, where: str, limit: int = MAX_DIM) -> int:
    value = d[name]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"config.json: {where}.{name} must be a positive integer, got {value!r}")
    if value > limit:
        raise ConfigError(f"config.json: {where}.{name} = {value} exceeds the supported maximum {limit}")
    return value


@dataclass(frozen=True)
class VisionConfig:
    """The vision tower's shape: only needed to estimate memory from a bare config."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    num_channels: int
    patch_size: int
    posemb_grid_size: int
    spatial_merge_size: int
    projection_hidden_dim: int
    projector_bias: bool

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "VisionConfig":
        if not isinstance(d, Mapping):
            raise ConfigError("config.json: vision_config is not an object")
        d = _canonical(d, VISION_ALIASES, "vision_config")
        full = {**VISION_DEFAULTS, **{k: v for k, v in d.items() if k in VISION_DEFAULTS}}
        vals = {k: _int(full, k, "vision_config", MAX_LAYERS if k == "num_hidden_layers" else MAX_DIM) for k in VISION_DEFAULTS}
        ratio = d.get("mlp_ratio", 4.0)
        inter = d.get("intermediate_size")
        if inter is None:
            if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0 < ratio < 1e4:
                raise ConfigError(f"config.json: vision_config.mlp_ratio must be a positive number, got {ratio!r}")
            inter = int(vals["hidden_size"] * ratio)
        vals["intermediate_size"] = _int({"intermediate_size": inter}, "intermediate_size", "vision_config")
        bias = d.get("projector_bias", False)
        if not isinstance(bias, bool):
            raise ConfigError(f"config.json: vision_config.projector_bias must be true or false, got {bias!r}")
        return cls(projector_bias=bias, **vals)


@dataclass(frozen=True)
class LayerDims:
    """The attention sizes of one decoder layer (sliding layers use the ``swa_*`` fields)."""

    sliding: bool
    heads: int
    kv_heads: int
    head_dim: int
    extent: int


@dataclass(frozen=True)
class InklingConfig:
    """The text model's shape-deciding fields (``config.json`` → ``text_config``)."""

    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    unpadded_vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    swa_num_attention_heads: int
    swa_num_key_value_heads: int
    swa_head_dim: int
    sliding_window_size: int
    rel_extent: int
    d_rel: int
    conv_kernel_size: int
    n_routed_experts: int
    moe_intermediate_size: int
    layer_types: tuple[str, ...]
    num_experts_per_tok: int = 8
    n_layers_per_attn_res_block: int = 6
    max_position_embeddings: int = 1048576
    vision: VisionConfig | None = field(default=None)

    # -- per-layer geometry -----------------------------------------------------------------
    def is_sliding(self, layer: int) -> bool:
        """Sliding-window layer? (transformers: anything but ``"hybrid_sliding"`` is full attention)."""
        return self.layer_types[layer] == SLIDING

    def layer_kind(self, layer: int) -> str:
        return "sliding" if self.is_sliding(layer) else "full"

    def layer_dims(self, layer: int) -> LayerDims:
        if self.is_sliding(layer):
            return LayerDims(True, self.swa_num_attention_heads, self.swa_num_key_value_heads, self.swa_head_dim,
                             self.sliding_window_size)
        return LayerDims(False, self.num_attention_heads, self.num_key_value_heads, self.head_dim, self.rel_extent)

    def full_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if not self.is_sliding(i)]

    def dims(self, layer: int | None = None) -> dict[str, int]:
        """Symbolic sizes the tensor inventory's shapes refer to (per-layer ones when ``layer`` is given)."""
        d = {
            "1": 1, "3": 3, "H": self.hidden_size, "V": self.vocab_size, "E": self.n_routed_experts,
            "F": self.moe_intermediate_size, "2F": 2 * self.moe_intermediate_size, "K": self.conv_kernel_size,
            "DR": self.d_rel,
        }
        if layer is not None:
            ld = self.layer_dims(layer)
            d.update({
                "NH": ld.heads, "Q": ld.heads * ld.head_dim, "HD": ld.head_dim, "KVD": ld.kv_heads * ld.head_dim,
                "KVK": ld.kv_heads * self.conv_kernel_size, "R": ld.heads * self.d_rel, "EXT": ld.extent,
            })
        if self.vision is not None:
            v = self.vision
            d.update({
                "VH": v.hidden_size, "VI": v.intermediate_size, "VPATCH": v.num_channels * v.patch_size ** 2,
                "VPOS": v.posemb_grid_size ** 2, "VPD": v.projection_hidden_dim,
                "VM": v.hidden_size * v.spatial_merge_size ** 2,
            })
        return d

    # -- reading ------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "InklingConfig":
        """Build from a whole ``config.json`` (with ``text_config``) or a bare text config."""
        if not isinstance(config, Mapping):
            raise ConfigError("config.json: expected a JSON object")
        text = config.get("text_config", config)
        if not isinstance(text, Mapping):
            raise ConfigError("config.json: text_config is not an object")
        text = _canonical(text, TEXT_ALIASES, "text_config")
        for name in TEXT_REQUIRED:
            if name not in text:
                raise ConfigError(f"config.json: text_config is missing required field {name!r}")
        vals: dict[str, Any] = {}
        for name in TEXT_REQUIRED:
            limit = MAX_LAYERS if name == "num_hidden_layers" else MAX_EXPERTS if name == "n_routed_experts" else MAX_DIM
            vals[name] = _int(text, name, "text_config", limit)
        for name, default in TEXT_OPTIONAL.items():
            vals[name] = _int({name: text.get(name, default)}, name, "text_config",
                              1 << 40 if name == "max_position_embeddings" else MAX_DIM)
        layers = vals["num_hidden_layers"]
        lt = text.get("layer_types")
        if lt is None:  # transformers' default: every sixth layer is full attention
            lt = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(layers)]
        if not isinstance(lt, (list, tuple)) or not all(isinstance(t, str) for t in lt):
            raise ConfigError("config.json: text_config.layer_types must be a list of strings")
        if len(lt) != layers:
            raise ConfigError(f"config.json: text_config.layer_types has {len(lt)} entries for {layers} layers")
        vals["layer_types"] = tuple(lt)
        vision = config.get("vision_config") if "text_config" in config else None
        vals["vision"] = VisionConfig.from_dict(vision) if vision is not None else None
        cfg = cls(**vals)
        cfg._check()
        return cfg

    def _check(self) -> None:
        if self.unpadded_vocab_size > self.vocab_size:
            raise ConfigError(f"config.json: text_config.unpadded_vocab_size {self.unpadded_vocab_size} exceeds "
                              f"vocab_size {self.vocab_size}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(f"config.json: text_config.num_experts_per_tok is {self.num_experts_per_tok}, more than "
                              f"text_config.n_routed_experts ({self.n_routed_experts})")
        if self.vision is not None and self.vision.spatial_merge_size > MAX_DIM:
            raise ConfigError(f"config.json: vision_config.spatial_merge_size is {self.vision.spatial_merge_size}, more "
                              f"than the supported maximum {MAX_DIM}")
        expert_elems = self.num_hidden_layers * self.n_routed_experts * 3 * self.moe_intermediate_size * self.hidden_size
        if expert_elems > MAX_ELEMENTS or self.vocab_size * self.hidden_size > MAX_ELEMENTS:
            raise ConfigError(f"config.json: the model this config describes ({expert_elems:.3g} expert elements) is "
                              "beyond any checkpoint the toolkit can plan")

    @classmethod
    def from_file(cls, path: str | Path) -> "InklingConfig":
        return cls.from_dict(read_json(path))

    @property
    def padded_vocab_rows(self) -> int:
        """Zero rows of the on-disk ``unembed`` (vocab_size − unpadded_vocab_size)."""
        return self.vocab_size - self.unpadded_vocab_size


def read_json(path: str | Path) -> dict[str, Any]:
    """Read a JSON object, turning every failure into a one-line ConfigError naming the file."""
    from ..layouts.paths import open_regular  # a FIFO or device named *.json is refused, never read

    p = Path(path)
    try:
        with open_regular(p, limit=MAX_JSON_BYTES) as f:
            data = json.loads(f.read())
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    except FileNotFoundError:
        raise ConfigError(f"{p}: not found") from None
    except RecursionError:
        raise ConfigError(f"{p}: JSON nested too deeply") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{p}: cannot read JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a JSON object")
    return data
