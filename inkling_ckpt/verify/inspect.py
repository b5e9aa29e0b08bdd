"""What a checkpoint holds: variant, plan, tensors per layer and format, bytes (headers only).

Any layout :func:`~inkling_ckpt.layouts.detect.open_checkpoint` opens: an HF folder, a sharded
folder, or a Megatron torch_dist folder read back as release tensors (experts BF16, no vision
tower). ``storage`` says how the folder holds them.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from ..layouts.detect import Checkpoint
from ..layouts.hf import DTYPE_TO_ST
from ..model.inventory import parameter_count
from ..units import fmt_bytes


def inspect_checkpoint(ckpt: Checkpoint) -> dict[str, Any]:
    """A JSON-ready summary; the checkpoint has already been validated against the model table."""
    specs = ckpt.expected()
    by_cat: Counter[str] = Counter()
    by_dtype: Counter[str] = Counter()
    layers: dict[int, dict[str, Any]] = defaultdict(lambda: {"tensors": 0, "bytes": 0, "expert_tensors": 0, "expert_bytes": 0})
    by_format: dict[str, dict[str, int]] = defaultdict(lambda: {"layers": 0, "tensors": 0, "bytes": 0})
    for s in specs:
        by_cat[s.category.value] += s.nbytes
        by_dtype[DTYPE_TO_ST[s.dtype]] += s.nbytes
        if s.layer is not None:
            row = layers[s.layer]
            row["tensors"] += 1
            row["bytes"] += s.nbytes
            if s.fmt is not None:
                row["expert_tensors"] += 1
                row["expert_bytes"] += s.nbytes
                by_format[s.fmt]["tensors"] += 1
                by_format[s.fmt]["bytes"] += s.nbytes
    for i in range(ckpt.cfg.num_hidden_layers):
        layers[i]["format"] = ckpt.plan.format_of(i)
        layers[i]["attention"] = ckpt.cfg.layer_kind(i)
        by_format[ckpt.plan.format_of(i)]["layers"] += 1
    cfg = ckpt.cfg
    storage = ckpt.storage()
    return {
        "source": str(ckpt.root),
        "layout": storage["layout"],
        "variant": ckpt.plan.variant,
        "precision_plan": str(ckpt.plan),
        "model": {"hidden_size": cfg.hidden_size, "layers": cfg.num_hidden_layers, "experts": cfg.n_routed_experts,
                  "moe_intermediate_size": cfg.moe_intermediate_size, "vocab_size": cfg.vocab_size,
                  "vision": cfg.vision is not None, "vision_stored": bool(ckpt.vision_specs())},
        "tensors": len(specs),
        "parameters": parameter_count(specs, cfg),
        "files": storage["files"],
        "storage": storage,
        "bytes": sum(s.nbytes for s in specs),
        "bytes_by_category": dict(sorted(by_cat.items())),
        "bytes_by_dtype": dict(sorted(by_dtype.items())),
        "formats": dict(sorted(by_format.items())),
        "layers": [dict(layers[i], layer=i) for i in range(cfg.num_hidden_layers)],
    }


def _layout(st: dict[str, Any]) -> str:
    if st["layout"] == "torch_dist":
        src = f", converted from {st['source_plan']}" if st.get("source_plan") else ""
        return (f"Megatron torch_dist (preset {st['preset']}, {st['keys']} keys; routed experts BF16{src}); "
                f"config from {st['config']}")
    if st["layout"] == "sharded":
        return f"sharded for --tp {st['tp']} --ep {st['ep']} ({st['ranks']} rank folders)"
    return "Hugging Face safetensors"


def render_inspect(info: dict[str, Any]) -> str:
    """The summary as a table for people."""
    m = info["model"]
    vision = "yes" if m["vision"] and m["vision_stored"] else "in config, not stored" if m["vision"] else "no"
    lines = [
        f"{info['source']}",
        f"  layout  {_layout(info['storage'])}",
        f"  variant {info['variant']}   precision plan {info['precision_plan']}",
        f"  model   hidden {m['hidden_size']}, {m['layers']} layers, {m['experts']} experts x {m['moe_intermediate_size']}, "
        f"vocab {m['vocab_size']}, vision {vision}",
        f"  {info['tensors']} tensors in {info['files']} files, {fmt_bytes(info['bytes'])}; "
        f"{info['parameters']:,} parameters",
        "",
        "  by format      layers  tensors        bytes",
    ]
    for fmt, d in info["formats"].items():
        lines.append(f"  {fmt:<13} {d['layers']:>7} {d['tensors']:>8} {fmt_bytes(d['bytes']):>12}")
    lines += ["", "  by category"]
    for cat, b in info["bytes_by_category"].items():
        lines.append(f"  {cat:<18} {fmt_bytes(b):>12}")
    lines += ["", "  layer  attention          format   tensors  expert bytes     layer bytes"]
    for row in info["layers"]:
        lines.append(f"  {row['layer']:>5}  {row['attention']:<18} {row['format']:<8} {row['tensors']:>7} "
                     f"{fmt_bytes(row['expert_bytes']):>13} {fmt_bytes(row['bytes']):>15}")
    return "\n".join(lines)
