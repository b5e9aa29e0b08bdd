"""The ``quantization_config`` of an Inkling 2 release ``config.json`` (spec/inkling2.md).

Only the MXFP8 release carries one, in transformers' FineGrainedFP8 form: without
``weight_block_size``/``scale_fmt`` transformers fails, without ``modules_to_not_convert`` it
turns attention and vision linears into FP8 and finds their scales missing, and a ModelOpt
``quant_method: "modelopt"`` block is skipped so FP8 bytes load as garbage. The mixed and NVFP4
layouts are self-describing (each layer's format is read from the tensors present): no loader
reads a quantization config for them, so none is written. Nothing writes ``hf_quant_config.json``.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from ..errors import CheckpointError
from ..formats.stacked import UNQUANTIZED
from .config import InklingConfig
from .precision import PrecisionPlan

#: Modules never quantized, by checkpoint name (transformers normalises them through its
#: conversion mapping): the output projection, every attention linear (q/k/v/r/o, gate, sink,
#: the dynamic-convolution projections) and the vision tower. Checked against transformers 5.24:
#: with this list a tiny MXFP8 checkpoint loads with no missing or unexpected keys.
NOT_CONVERTED = ["model.llm.unembed", "model.llm.layers.*.attn", "model.visual"]
FP8_QUANT_METHODS = ("fp8", "mxfp8")


def release_quant_config(cfg: InklingConfig, plan: PrecisionPlan) -> dict[str, Any] | None:
    """The FineGrainedFP8 block for a plan of MXFP8 (and BF16) layers; None for any other plan.

    BF16 layers of an MXFP8 checkpoint are listed in ``modules_to_not_convert`` by their experts.
    """
    used = set(plan.used_formats())
    if "mxfp8" not in used or "nvfp4" in used:
        return None
    bf16 = [f"model.llm.layers.{i}.mlp.experts" for i in range(len(plan)) if plan.format_of(i) in UNQUANTIZED]
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [1, 32],
        "scale_fmt": "ue8m0",
        "modules_to_not_convert": NOT_CONVERTED + bf16,
    }


def output_config(source: Mapping[str, Any], cfg: InklingConfig, plan: PrecisionPlan) -> dict[str, Any]:
    """The source ``config.json`` (every key kept verbatim) with the quantization config of ``plan``."""
    out = copy.deepcopy(dict(source))
    out.pop("quantization_config", None)
    qc = release_quant_config(cfg, plan)
    if qc is not None:
        out["quantization_config"] = qc
    return out


def check_quant_config(config: Mapping[str, Any], plan: PrecisionPlan, where: str) -> None:
    """Refuse a ``quantization_config`` that would make transformers misread the stored experts."""
    qc = config.get("quantization_config")
    if qc is None:
        return
    if not isinstance(qc, Mapping):
        raise CheckpointError(f"{where}/config.json: quantization_config is not an object")
    method = qc.get("quant_method")
    if "mxfp8" in plan.used_formats() and method in FP8_QUANT_METHODS:
        if list(qc.get("weight_block_size") or []) != [1, 32] or qc.get("scale_fmt") != "ue8m0":
            raise CheckpointError(
                f"{where}/config.json: quantization_config.weight_block_size is {qc.get('weight_block_size')!r} and "
                f"quantization_config.scale_fmt is {qc.get('scale_fmt')!r}; MXFP8 experts need [1, 32] and 'ue8m0' "
                "(transformers would misread the scales)")
