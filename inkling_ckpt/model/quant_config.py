"""The quantization config a checkpoint carries, in NVIDIA ModelOpt's form.

Two files state it: ``hf_quant_config.json`` (ModelOpt's own) and ``config.json`` →
``quantization_config`` (the flat form vLLM and SGLang read). A mixed plan is written as
``MIXED_PRECISION`` with one ``quantized_layers`` entry per routed-expert linear; a single-format
plan as ``NVFP4``/``MXFP8`` with ``group_size`` and ``exclude_modules``. Both read back to a
:class:`PrecisionPlan`.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Mapping

from .. import __version__
from ..errors import CheckpointError
from ..formats import get_format
from .config import InklingConfig
from .inventory import expert_linears, module_layer
from .precision import PrecisionPlan

PRODUCER = {"name": "modelopt", "version": "0.47.0"}
# Modules that are never quantized, whatever the plan (ModelOpt writes them as wildcards).
ALWAYS_EXCLUDED = [
    "lm_head",
    "model.language_model.embed_tokens",
    "model.language_model.layers.*.self_attn*",
    "model.language_model.layers.*.mlp.gate",
    "mtp*",
    "model.visual*",
]

_ALGO_TO_FORMAT = {"NVFP4": "nvfp4", "MXFP8": "mxfp8"}


def _algo_entry(fmt: str) -> dict[str, Any]:
    f = get_format(fmt)
    return {"quant_algo": f.quant_algo, "group_size": f.block}


def _group(fmt: str) -> dict[str, Any]:
    f = get_format(fmt)
    bits = 4 if fmt == "nvfp4" else 8
    spec = {"dynamic": fmt != "nvfp4", "num_bits": bits, "type": "float", "group_size": f.block}
    return {"input_activations": dict(spec), "weights": {**spec, "dynamic": False}}


def build_quant_configs(cfg: InklingConfig, plan: PrecisionPlan) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(``hf_quant_config.json`` content, ``config.json`` ``quantization_config``) for a plan.

    A BF16 plan has neither: both are None.
    """
    used = [f for f in plan.used_formats() if f != "bf16"]
    if not used:
        return None, None
    bf16_layers = [i for i in range(len(plan)) if plan.format_of(i) == "bf16"]
    exclude = ALWAYS_EXCLUDED + [f"model.language_model.layers.{i}.mlp.experts*" for i in bf16_layers]
    if len(used) == 1:
        fmt = used[0]
        quant = {"quant_algo": get_format(fmt).quant_algo, "kv_cache_quant_algo": None,
                 "group_size": get_format(fmt).block, "exclude_modules": exclude}
        flat: dict[str, Any] = {"quant_algo": quant["quant_algo"], "kv_cache_scheme": None,
                                "ignore": exclude, "group_size": quant["group_size"]}
        if fmt == "nvfp4":
            flat["config_groups"] = {"group_0": {**_group(fmt), "targets": ["Linear"]}}
    else:
        layers = {lin.module: _algo_entry(lin.fmt) for lin in expert_linears(cfg, plan) if lin.fmt != "bf16"}
        quant = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
                 "exclude_modules": exclude, "quantized_layers": layers}
        groups = {}
        for n, fmt in enumerate(used):
            targets = sorted(m for m, e in layers.items() if e["quant_algo"] == get_format(fmt).quant_algo)
            groups[f"group_{n}"] = {**_group(fmt), "targets": targets}
        flat = {"quant_algo": "MIXED_PRECISION", "kv_cache_scheme": None, "ignore": exclude,
                "config_groups": groups, "quantized_layers": layers}
    hf_quant = {"producer": dict(PRODUCER), "quantization": quant,
                "inkling_ckpt": {"version": __version__, "plan": str(plan)}}
    flat = {**flat, "producer": dict(PRODUCER), "quant_method": "modelopt"}
    return hf_quant, flat


def plan_from_quant_config(cfg: InklingConfig, hf_quant: Mapping[str, Any] | None,
                           quantization_config: Mapping[str, Any] | None) -> PrecisionPlan:
    """Read a checkpoint's precision plan back from whichever of its quantization configs exists."""
    n = cfg.num_hidden_layers
    if hf_quant is not None:
        q = hf_quant.get("quantization")
        if not isinstance(q, Mapping):
            raise CheckpointError("hf_quant_config.json has no 'quantization' object")
        where = "hf_quant_config.json"
    elif quantization_config is not None:
        q = quantization_config
        where = "config.json quantization_config"
    else:
        return PrecisionPlan.uniform("bf16", n)
    algo = q.get("quant_algo")
    if algo == "MIXED_PRECISION":
        layers = q.get("quantized_layers")
        if not isinstance(layers, Mapping):
            raise CheckpointError(f"{where}: MIXED_PRECISION without quantized_layers")
        per_layer: list[set[str]] = [set() for _ in range(n)]
        counts = [0] * n
        for module, entry in layers.items():
            hit = module_layer(module)
            if hit is None:
                raise CheckpointError(f"{where}: quantized layer {module!r} is not a routed-expert linear of Inkling 2")
            layer = hit[0]
            if layer >= n:
                raise CheckpointError(f"{where}: quantized layer {module!r} names layer {layer}; the model has {n}")
            per_layer[layer].add(_format_of_algo(entry.get("quant_algo") if isinstance(entry, Mapping) else None, where, module))
            counts[layer] += 1
        formats = []
        want = 3 * cfg.n_routed_experts
        for i, fs in enumerate(per_layer):
            if len(fs) > 1:
                raise CheckpointError(f"{where}: layer {i} mixes expert formats {sorted(fs)}")
            if fs and counts[i] != want:
                raise CheckpointError(f"{where}: layer {i} lists {counts[i]} quantized expert linears, expected {want}")
            formats.append(fs.pop() if fs else "bf16")
        return PrecisionPlan(tuple(formats))
    fmt = _format_of_algo(algo, where, "quant_algo")
    exclude = q.get("exclude_modules", q.get("ignore", [])) or []
    formats = []
    for i in range(n):
        probe = f"model.language_model.layers.{i}.mlp.experts.0.gate_proj"
        excluded = any(fnmatch.fnmatchcase(probe, pat) for pat in exclude)
        formats.append("bf16" if excluded else fmt)
    return PrecisionPlan(tuple(formats))


def _format_of_algo(algo: Any, where: str, what: str) -> str:
    if algo not in _ALGO_TO_FORMAT:
        raise CheckpointError(
            f"{where}: {what} uses quant_algo {algo!r}; inkling-ckpt reads {sorted(_ALGO_TO_FORMAT)}"
        )
    return _ALGO_TO_FORMAT[algo]
