"""LoRA adapters (spec/lora.md): trainer -> engine export, the sha256 sync check, and merge.

    from inkling_ckpt.lora import LoraExport, ModelDims, build_manifest, check_manifest

    conv = LoraExport(alpha=32, dims=ModelDims.from_config(config_json))
    buckets = list(conv.buckets(trainer_lora_named_tensors()))   # engine names, BF16, [1|E, ...]
    manifest = build_manifest(buckets)                           # {engine name: sha256}
    check_manifest(manifest, received_on_engine)                 # IntegrityError names the tensor

Files: :func:`export_adapter` (torch_dist / safetensors dump -> PEFT folder), :func:`merge`
(release checkpoint + adapter -> release checkpoint), :func:`inspect_adapter`.
"""

from .buckets import Bucket
from .export import AdapterGroup, ExportResult, LoraExport, adapter_config, export_adapter, plan
from .inspect import inspect_adapter, is_adapter_folder, render_adapter
from .io import Adapter, TrainerSource, load_dims
from .manifest import (MANIFEST_FILE, ManifestReport, build_manifest, check_manifest, read_manifest,
                       verify_manifest, write_manifest)
from .merge import MergeResult, merge
from .schema import SCHEMA, TARGETS, ModelDims, Schema, Target

__all__ = [
    "Adapter", "AdapterGroup", "Bucket", "ExportResult", "LoraExport", "MANIFEST_FILE", "ManifestReport", "MergeResult",
    "ModelDims", "SCHEMA", "Schema", "TARGETS", "Target", "TrainerSource", "adapter_config", "build_manifest",
    "check_manifest", "export_adapter", "inspect_adapter", "is_adapter_folder", "load_dims", "merge", "plan", "read_manifest",
    "render_adapter", "verify_manifest", "write_manifest",
]
