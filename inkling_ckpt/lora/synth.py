"""A synthetic trainer-side LoRA dump for a fixture, so ``lora export`` / ``lora merge`` can be tried without a trainer.

Names and shapes come from the target table (:data:`~inkling_ckpt.lora.schema.TARGETS`):
Megatron-Bridge names, shared-outer experts (fc1: one A, per-expert B; fc2: per-expert A, one B),
the unembed B padded to the padded vocabulary as a trainer holds it. Values are deterministic
(seeded per tensor name); B is non-zero so a merge visibly changes the weights.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any, Mapping

import torch

from ..errors import ConfigError
from .schema import TARGETS, ExpertsDown, ExpertsGateUp, Linear, ModelDims, Target, positive_number

DUMP_FILE = "lora.safetensors"
#: Scale of the B factors: the merged delta stays small next to the base weights.
B_SCALE = 0.02


def trainer_shapes(dims: ModelDims, rank: int) -> dict[str, tuple[int, ...]]:
    """Trainer factor name -> shape, for every adapted module of every layer (table order)."""
    out: dict[str, tuple[int, ...]] = {}
    layered = [t for t in TARGETS if "{layer}" in t.trainer]
    model_level = [t for t in TARGETS if "{layer}" not in t.trainer]
    for layer in range(dims.num_layers):
        for t in layered:
            out.update(_factors(t, dims.dims(layer), rank, layer))
    for t in model_level:
        out.update(_factors(t, dims.dims(None), rank, None))
    return out


def _factors(t: Target, d: Mapping[str, int], r: int, layer: int | None) -> dict[str, tuple[int, ...]]:
    prefix = t.trainer.format(layer=layer) if layer is not None else t.trainer
    rule = t.rule
    a: tuple[int, ...]
    b: tuple[int, ...]
    if isinstance(rule, Linear):
        rows = d["V"] if rule.trim_out else d[rule.out]  # the trainer's B covers the padded vocabulary
        a, b = (r, d[rule.inp]), (rows, r)
    elif isinstance(rule, ExpertsGateUp):
        a, b = (r, d["H"]), (d["E"], 2 * d["F"], r)
    elif isinstance(rule, ExpertsDown):
        a, b = (d["E"], r, d["F"]), (d["H"], r)
    else:
        return {}  # excluded modules get no adapter
    return {f"{prefix}.linear_in.weight": a, f"{prefix}.linear_out.weight": b}


def trainer_dump(config: Mapping[str, Any], *, rank: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    """The factors of :func:`trainer_shapes` as BF16 tensors (A ~ N(0, 1/in), B ~ N(0, B_SCALE²))."""
    if not 1 <= rank <= 1024:
        raise ConfigError(f"--lora-rank {rank}: must be in 1..1024")
    out = {}
    for name, shape in trainer_shapes(ModelDims.from_config(config), rank).items():
        g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
        x = torch.randn(shape, generator=g)
        x *= B_SCALE if name.endswith("linear_out.weight") else shape[-1] ** -0.5
        out[name] = x.to(torch.bfloat16)
    return out


def write_trainer_dump(config: Mapping[str, Any], dst: str | Path, *, rank: int = 8, alpha: float = 16,
                       seed: int = 0, force: bool = False, dry_run: bool = False) -> dict[str, Any]:
    """Write ``dst/lora.safetensors`` (``lora_alpha`` in its metadata), atomically; the report's fields."""
    from safetensors.torch import save_file

    from ..layouts.paths import check_dst
    from ..layouts.staging import Staging

    check_dst(dst, [])
    # what `lora export` and every adapter reader refuse: a dump they cannot take is not written
    if not positive_number(alpha):
        raise ConfigError(f"--lora-alpha {alpha}: must be a positive number")
    shapes = trainer_shapes(ModelDims.from_config(config), rank)
    nbytes = sum(2 * _numel(s) for s in shapes.values())
    info: dict[str, Any] = {"tensors": len(shapes), "bytes": nbytes, "r": rank, "lora_alpha": alpha,
                            "file": DUMP_FILE}
    if dry_run:
        return info
    job = {"command": "make-fixture-lora", "config": dict(config), "rank": rank, "alpha": alpha, "seed": seed}
    with Staging(dst, job, force=force) as st:
        info["status"] = "skipped" if st.done else "written"
        if not st.done:
            tensors = trainer_dump(config, rank=rank, seed=seed)
            save_file(tensors, str(st.partial(DUMP_FILE)), metadata={"lora_alpha": str(alpha), "lora_rank": str(rank)})
            st.finish(DUMP_FILE)
    return info


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


__all__ = ["trainer_shapes", "trainer_dump", "write_trainer_dump", "DUMP_FILE"]
