"""What an adapter folder holds (headers only; ``verify`` also rehashes against the sha256 manifest)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from ..layouts.hf import DTYPE_TO_ST
from .io import Adapter, _nbytes
from .manifest import MANIFEST_FILE, read_manifest, verify_manifest
from ..units import fmt_bytes
from .schema import SCHEMA, Excluded, ExpertsDown, ExpertsGateUp


def is_adapter_folder(path: str | Path) -> bool:
    """Whether ``path`` looks like an engine adapter folder (for ``inspect`` to dispatch on)."""
    p = Path(path)
    return (p / "adapter_config.json").is_file() and (p / "adapter_model.safetensors").is_file()


def inspect_adapter(path: str | Path, *, verify: bool = False) -> dict[str, Any]:
    """A JSON-ready summary of an engine adapter folder: config, modules per row, layers, bytes,
    shared-outer layout, and (``verify``) the sha256 manifest check."""
    ad = Adapter.open(path)
    rows: dict[str, dict[str, Any]] = {}
    unknown: list[str] = []
    dtypes: dict[str, int] = defaultdict(int)
    layers: set[int] = set()
    shared_outer: bool | None = None
    for name, t in ad.tensors.items():
        nb = _nbytes(t.shape, t.dtype)
        dtypes[DTYPE_TO_ST.get(t.dtype, str(t.dtype))] += nb
        m = SCHEMA.engine(name)
        if m is None or isinstance(m.target.rule, Excluded):
            unknown.append(t.stored)
            continue
        row = rows.setdefault(m.target.key, {"tensors": 0, "bytes": 0, "layers": set()})
        row["tensors"] += 1
        row["bytes"] += nb
        if m.layer is not None:
            row["layers"].add(m.layer)
            layers.add(m.layer)
        shared_side = {ExpertsGateUp: "A", ExpertsDown: "B"}.get(type(m.target.rule))
        if shared_side == m.side and len(t.shape) == 3:
            one = t.shape[0] == 1
            shared_outer = one if shared_outer is None else (shared_outer and one)
    info: dict[str, Any] = {
        "source": str(ad.root),
        "peft_type": ad.config.get("peft_type"),
        "r": ad.rank,
        "lora_alpha": ad.config["lora_alpha"],
        "scaling": ad.scale,
        "target_modules": ad.config.get("target_modules"),
        "tensors": len(ad.tensors),
        "bytes": ad.nbytes(),
        "bytes_by_dtype": dict(sorted(dtypes.items())),
        "layers": sorted(layers),
        "shared_outer_experts": shared_outer,
        "modules": {k: {"tensors": v["tensors"], "bytes": v["bytes"], "layers": sorted(v["layers"])}
                    for k, v in rows.items()},
        "unknown_tensors": unknown,  # outside the schema, or on a module it excludes
        "manifest": None,
    }
    mpath = ad.root / MANIFEST_FILE
    if mpath.is_file():
        man = read_manifest(mpath)
        info["manifest"] = {"file": MANIFEST_FILE, "entries": len(man)}
        if verify:
            rep = verify_manifest(man, ((n, ad.get(n)) for n in sorted(ad.tensors, key=lambda n: ad.tensors[n].stored)))
            info["manifest"].update(ok=rep.ok, changed=rep.changed, missing=rep.missing, extra=rep.extra)
    return info


def render_adapter(info: dict[str, Any]) -> str:
    """The summary for people."""
    lines = [
        info["source"],
        f"  LoRA r={info['r']} alpha={info['lora_alpha']} (scaling {info['scaling']:g}), target_modules {info['target_modules']}",
        f"  {info['tensors']} tensors, {fmt_bytes(info['bytes'])} ({', '.join(f'{k} {fmt_bytes(v)}' for k, v in info['bytes_by_dtype'].items())})",
        f"  layers {_ranges(info['layers']) or '-'}; routed experts shared-outer: "
        f"{ {True: 'yes', False: 'no (per expert)', None: 'n/a'}[info['shared_outer_experts']] }",
        "",
        "  module      tensors        bytes  layers",
    ]
    for k, v in info["modules"].items():
        lines.append(f"  {k:<10} {v['tensors']:>8} {fmt_bytes(v['bytes']):>12}  {_ranges(v['layers']) or 'model'}")
    if info["unknown_tensors"]:
        lines.append(f"  not in the schema or excluded by it: {len(info['unknown_tensors'])} "
                     f"(first: {info['unknown_tensors'][0]})")
    man = info["manifest"]
    if man is None:
        lines.append("  sha256 manifest: none")
    elif "ok" in man:
        lines.append(f"  sha256 manifest: {man['entries']} entries, " + ("all match" if man["ok"] else
                     f"MISMATCH changed {man['changed'][:3]} missing {man['missing'][:3]} extra {man['extra'][:3]}"))
    else:
        lines.append(f"  sha256 manifest: {man['entries']} entries (not checked; --verify)")
    return "\n".join(lines)


def _ranges(xs: list[int]) -> str:
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)
