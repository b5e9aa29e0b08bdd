"""Deterministic synthetic BF16 weights shaped like a trained Inkling 2 checkpoint.

Each tensor is generated from a seed derived from its name alone, so any tensor can be produced
on demand, in any order, on any machine, with the same bytes. Linear weights are scaled normals
with a few outlier columns per row (what trained weights look like to a quantizer: heavy
tails, per-row spread); norms sit around 1; the router bias is small FP32.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import torch

from .config import InklingConfig
from .inventory import Category, TensorSpec, inventory
from .precision import PrecisionPlan
from .presets import preset_config

SEED = 20261129
GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "temperature": 0.7, "top_p": 0.95}


def synth_tensor(spec: TensorSpec, seed: int = SEED) -> torch.Tensor:
    """The synthetic value of one inventory tensor (always its logical BF16/F32 form)."""
    g = torch.Generator().manual_seed((zlib.crc32(spec.name.encode()) ^ seed) & 0x7FFFFFFF)
    shape = spec.shape if spec.part is None else None
    if shape is None:  # a routed-expert part: synthesise the logical weight instead
        raise ValueError("synth_tensor takes logical tensors; use synth_linear for expert linears")
    leaf = spec.name.rsplit(".", 1)[-1]
    if spec.dtype == torch.float32:  # router score-correction bias
        return (torch.randn(shape, generator=g) * 0.01).to(spec.dtype)
    if len(shape) == 1:
        if leaf == "query":
            return (torch.randn(shape, generator=g) * 0.02).to(spec.dtype)
        if leaf == "bias":
            return (torch.randn(shape, generator=g) * 0.01).to(spec.dtype)
        return (1.0 + 0.05 * torch.randn(shape, generator=g)).to(spec.dtype)
    return _weight(shape, g).to(spec.dtype)


def synth_linear(module: str, shape: tuple[int, int], seed: int = SEED) -> torch.Tensor:
    """The synthetic BF16 weight of one routed-expert linear."""
    g = torch.Generator().manual_seed((zlib.crc32(module.encode()) ^ seed) & 0x7FFFFFFF)
    return _weight(shape, g).to(torch.bfloat16)


def _weight(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    fan_in = 1
    for s in shape[1:]:
        fan_in *= s
    w = torch.randn(shape, generator=g).mul_(fan_in ** -0.5)
    rows = w.reshape(shape[0], -1)
    # Per-row spread (some rows hotter than others) and two outlier columns per row.
    rows.mul_(torch.empty(shape[0], 1).uniform_(0.5, 2.0, generator=g))
    cols = torch.randint(0, rows.shape[1], (shape[0], 2), generator=g)
    boost = torch.empty(shape[0], 2).uniform_(4.0, 16.0, generator=g)
    rows.scatter_(1, cols, rows.gather(1, cols) * boost)
    return w


class SynthSource:
    """A BF16 checkpoint of a preset size that exists only as a generator (a tensor source)."""

    def __init__(self, size: str, *, layers: int | None = None, experts: int | None = None, seed: int = SEED):
        self.config = preset_config(size, layers=layers, experts=experts)
        self.cfg = InklingConfig.from_dict(self.config)
        self.plan = PrecisionPlan.uniform("bf16", self.cfg.num_hidden_layers)
        self.seed = seed
        self.size = size
        self.root = f"<synthetic {size}>"
        self._specs = {s.name: s for s in inventory(self.cfg, self.plan)}

    @property
    def tensors(self) -> dict[str, TensorSpec]:
        return self._specs

    def get(self, name: str) -> torch.Tensor:
        spec = self._specs[name]
        if spec.part is not None:
            return synth_linear(spec.module, spec.shape, self.seed)  # type: ignore[arg-type]
        return synth_tensor(spec, self.seed)

    def extra_files(self) -> dict[str, bytes]:
        return {
            "generation_config.json": (json.dumps(GENERATION_CONFIG, indent=2) + "\n").encode(),
        }

    def describe(self) -> dict[str, Any]:
        return {"synthetic": self.size, "seed": self.seed, "layers": self.cfg.num_hidden_layers,
                "experts": self.cfg.n_routed_experts}


__all__ = ["SynthSource", "synth_linear", "synth_tensor", "Category"]
