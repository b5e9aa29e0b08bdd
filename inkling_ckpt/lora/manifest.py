"""The LoRA sync check (spec/lora.md): a sha256 per adapter tensor as sent, keyed by engine name.

The digest is of ``t.detach().cpu().contiguous().flatten().view(torch.uint8)`` (the tensor's raw
bytes in its own dtype), exactly what SGLang's ``expected_checksums`` recomputes on the engine.
The manifest JSON is that ``{name: hex}`` map, so it can be passed to the engine as is.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import IntegrityError
from .buckets import pairs as _pairs

MANIFEST_FILE = "adapter_sha256.json"

__all__ = ["MANIFEST_FILE", "ManifestReport", "build_manifest", "check_manifest", "read_manifest",
           "tensor_sha256", "verify_manifest", "write_manifest"]


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of ``t.detach().cpu().contiguous().flatten().view(torch.uint8)`` (the engine's
    expression), hashed from the tensor's own buffer without a bytes copy."""
    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def build_manifest(emitted) -> dict[str, str]:
    """``{engine_name: sha256}`` of what is sent (buckets, load groups or ``(name, tensor)`` pairs)."""
    out: dict[str, str] = {}
    for name, t in _pairs(emitted):
        if name in out:
            raise IntegrityError(f"{name}: sent twice")
        out[name] = tensor_sha256(t)
    return out


@dataclass
class ManifestReport:
    """What the receiving side found: ``ok`` when every name matches and none is missing or extra."""

    matched: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # in the manifest, not received
    extra: list[str] = field(default_factory=list)  # received, not in the manifest

    @property
    def ok(self) -> bool:
        return not (self.changed or self.missing or self.extra)

    def summary(self) -> str:
        parts = [f"{len(self.matched)} match"]
        for what, names in (("changed", self.changed), ("missing", self.missing), ("extra", self.extra)):
            if names:
                shown = ", ".join(names[:3]) + (f" (+{len(names) - 3})" if len(names) > 3 else "")
                parts.append(f"{len(names)} {what}: {shown}")
        return "; ".join(parts)


def verify_manifest(manifest: Mapping[str, str], received) -> ManifestReport:
    """Recompute the digests of what was received (a ``{name: tensor}`` map, buckets, groups or
    pairs) and compare them with ``manifest``, name by name."""
    items = received.items() if isinstance(received, Mapping) else _pairs(received)
    rep = ManifestReport()
    seen: set[str] = set()
    for name, t in items:
        if name in seen:
            raise IntegrityError(f"{name}: received twice")
        seen.add(name)
        want = manifest.get(name)
        if want is None:
            rep.extra.append(name)
        elif tensor_sha256(t) != want:
            rep.changed.append(name)
        else:
            rep.matched.append(name)
    rep.missing = [n for n in manifest if n not in seen]
    return rep


def check_manifest(manifest: Mapping[str, str], received) -> ManifestReport:
    """:func:`verify_manifest`, raising :class:`IntegrityError` (one line, names the tensors) unless ok."""
    rep = verify_manifest(manifest, received)
    if not rep.ok:
        raise IntegrityError(f"LoRA sync check failed: {rep.summary()}")
    return rep


def write_manifest(path: str | Path, manifest: Mapping[str, str]) -> None:
    Path(path).write_text(json.dumps(dict(manifest), indent=1, sort_keys=True) + "\n")


def read_manifest(path: str | Path) -> dict[str, str]:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise IntegrityError(f"{p}: not a readable JSON manifest ({e.__class__.__name__})") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) and len(v) == 64
                                             for k, v in data.items()):
        raise IntegrityError(f"{p}: expected a JSON object {{tensor name: sha256 hex}}")
    return data
