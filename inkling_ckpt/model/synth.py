"""Deterministic synthetic BF16 weights shaped like a trained Inkling 2 release checkpoint.

Each tensor (each expert of a stacked expert tensor) is generated from a seed derived from its
name alone, so any tensor or expert slice can be produced on demand, in any order, on any
machine, with the same bytes. Linear weights are scaled normals with a few outlier columns per
row (what trained weights look like to a quantizer: heavy tails, per-row spread); norms sit
around 1; residual queries are small; the padded rows of ``unembed`` are zero, as on disk.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import torch

from ..errors import CheckpointError
from .config import InklingConfig
from .inventory import Category, TensorSpec, inventory, match_name
from .precision import PrecisionPlan
from .presets import preset_config

SEED = 20261129
GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "temperature": 0.7, "top_p": 0.95}
# Tensors whose values sit around zero (residual queries, biases, layer scales) or around one
# (norm weights, L2-clip scales); everything else is a weight matrix.
_NEAR_ZERO = ("query", "attn_queries", "mlp_queries", "bias", "gamma", "class_embedding", "cls_position_embedding")
_NEAR_ONE = ("norm.weight", "ln_pre.weight", "ln_1.weight", "ln_2.weight", "clip.scale")


def _gen(name: str, seed: int) -> torch.Generator:
    return torch.Generator().manual_seed((zlib.crc32(name.encode()) ^ seed) & 0x7FFFFFFF)


def synth_tensor(spec: TensorSpec, seed: int = SEED) -> torch.Tensor:
    """The synthetic value of one non-expert tensor, in float32 (the caller casts)."""
    g = _gen(spec.name, seed)
    base = spec.name.rstrip("0123456789.")
    if any(base.endswith(k) for k in _NEAR_ZERO):
        return torch.randn(spec.shape, generator=g) * 0.02
    if any(spec.name.endswith(k) for k in _NEAR_ONE):
        return 1.0 + 0.05 * torch.randn(spec.shape, generator=g)
    return _weight(spec.shape, g)


def synth_experts(name: str, shape: tuple[int, int, int], first: int, last: int, seed: int = SEED) -> torch.Tensor:
    """Experts ``first:last`` of a stacked BF16 expert weight ([last-first, rows, cols])."""
    _, r, c = shape
    return torch.stack([_weight((r, c), _gen(f"{name}[{e}]", seed)).to(torch.bfloat16) for e in range(first, last)])


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
    """A BF16 release checkpoint of a preset size that exists only as a generator (a tensor source)."""

    row_reads = False  # rows of a dense tensor are cut from the whole generated tensor: read it whole

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

    def dtypes(self) -> dict[str, torch.dtype]:
        return {n: s.dtype for n, s in self._specs.items() if s.part is None}

    def vision_specs(self) -> list[TensorSpec]:
        return [s for s in self._specs.values() if s.category is Category.VISION]

    def _spec(self, name: str) -> TensorSpec:
        spec = self._specs.get(name)
        if spec is None:
            raise CheckpointError(f"{self.root}: no tensor {name}")
        return spec

    def get(self, name: str) -> torch.Tensor:
        spec = self._spec(name)
        if spec.part is not None:
            return self.read_rows(name, 0, spec.shape[0])
        t = synth_tensor(spec, self.seed)
        if name.endswith("unembed.weight"):
            t[self.cfg.unpadded_vocab_size:] = 0  # padded rows are zero on disk
        return t.to(spec.dtype)

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        spec = self._spec(name)
        if spec.part is None:
            return self.get(name)[start:stop]
        hit = match_name(name)
        shape = hit.row.shape_on(self.cfg, hit.layer) if hit is not None else spec.shape
        return synth_experts(name, shape, start, stop, self.seed)  # type: ignore[arg-type]

    def extra_files(self) -> dict[str, bytes]:
        return {"generation_config.json": (json.dumps(GENERATION_CONFIG, indent=2) + "\n").encode()}

    def describe(self) -> dict[str, Any]:
        return {"synthetic": self.size, "seed": self.seed, "layers": self.cfg.num_hidden_layers,
                "experts": self.cfg.n_routed_experts}


__all__ = ["SynthSource", "synth_experts", "synth_tensor", "Category"]
