"""Sanity bounds on sizes read from untrusted configs and given on the command line.

A config claiming 10^12 layers or experts would make the tensor table (and every plan built
from it) grow without end before any comparison with the files could fail. Counts are bounded
here, before the model config is built: absolute caps far above any real MoE, and, for a
checkpoint on disk, by what its headers can hold (each layer owns at least one stored tensor).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from ..errors import ConfigError, InklingError, PlanError

# Config keys (any nesting level: text_config, vision_config) that count things, with caps.
COUNT_CAPS: dict[str, int] = {
    "num_hidden_layers": 1024, "num_layers": 1024, "depth": 1024,
    "n_routed_experts": 1 << 16, "num_local_experts": 1 << 16, "num_experts": 1 << 16,
    "num_experts_per_tok": 1 << 16, "n_shared_experts": 1 << 10,
    "num_nextn_predict_layers": 64, "mtp_num_layers": 64,
    "num_attention_heads": 1 << 12, "num_key_value_heads": 1 << 12,
    "swa_num_attention_heads": 1 << 12, "swa_num_key_value_heads": 1 << 12,
}
DIM_CAP = 1 << 24  # any *_size / *_dim field: hidden, intermediate, vocab, head dims
DIM_KEYS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "vocab_size", "unpadded_vocab_size",
            "head_dim", "swa_head_dim", "out_hidden_size", "text_hidden_size", "projection_hidden_dim")
MAX_JSON_DEPTH = 32
MAX_RANKS = 1 << 16  # --tp / --ep
# Layer count x expert count: the number of per-expert entries a plan may enumerate.
MAX_EXPERT_SLOTS = 1 << 20


def check_config_bounds(config: Mapping[str, Any], where: str | Path, tensors: int | None = None) -> None:
    """Refuse absurd counts in a config dict in one line (before any table is built from it)."""
    layers = experts = 1

    def walk(d: Any, prefix: str, depth: int) -> None:
        nonlocal layers, experts
        if depth > MAX_JSON_DEPTH:
            raise ConfigError(f"{where}: nested more than {MAX_JSON_DEPTH} levels deep at {prefix or 'top'}")
        if isinstance(d, list):
            for v in d:
                walk(v, prefix, depth + 1)
            return
        if not isinstance(d, Mapping):
            return
        for key, value in d.items():
            field = f"{prefix}.{key}" if prefix else str(key)
            cap = COUNT_CAPS.get(key, DIM_CAP if key in DIM_KEYS else None)
            if cap is not None and isinstance(value, int) and not isinstance(value, bool) and value > cap:
                raise ConfigError(f"{where}: {field} is {value}, above the limit {cap}; the config is damaged")
            if isinstance(value, int) and not isinstance(value, bool):
                if key in ("num_hidden_layers", "num_layers") and prefix in ("", "text_config"):
                    layers = max(layers, value)
                    if tensors is not None and value > tensors:
                        raise ConfigError(f"{where}: {field} is {value}, but the checkpoint stores only "
                                          f"{tensors} tensors")
                if key in ("n_routed_experts", "num_local_experts", "num_experts"):
                    experts = max(experts, value)
            walk(value, field, depth + 1)

    walk(config, "", 0)
    if layers * experts > MAX_EXPERT_SLOTS:
        raise ConfigError(f"{where}: {layers} layers x {experts} experts exceeds the limit {MAX_EXPERT_SLOTS}; "
                          f"the config is damaged")


def config_from_dict(config: Mapping[str, Any], where: str | Path) -> Any:
    """``InklingConfig.from_dict`` with any type confusion in the JSON reported in one line."""
    from ..model.config import InklingConfig

    try:
        return InklingConfig.from_dict(config)
    except ConfigError as e:  # name the file the user has to fix
        msg = str(e)
        if str(where) in msg:
            raise
        if msg.startswith("config.json: "):
            msg = msg[len("config.json: "):]
        raise ConfigError(f"{where}: {msg}") from None
    except InklingError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError) as e:
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{where}: a field has the wrong type ({first})") from None


def check_count(value: int | None, option: str, cap: int, minimum: int = 1) -> None:
    """A command-line count (``--layers``, ``--tp``) within sane bounds."""
    if value is None:
        return
    if value < minimum or value > cap:
        raise PlanError(f"{option} {value}: must be between {minimum} and {cap}")


__all__ = ["check_config_bounds", "config_from_dict", "check_count", "COUNT_CAPS", "MAX_RANKS"]
