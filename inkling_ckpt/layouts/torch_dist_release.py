"""A Megatron ``torch_dist`` checkpoint read back as release tensors, through the key mapping.

:class:`TorchDistRelease` gives the read interface of :class:`~inkling_ckpt.layouts.hf.HFCheckpoint`
(``cfg``, ``plan``, ``config``, ``tensors``, ``get``, ``read_rows``, ``expected``, ``describe``,
``close``) over a torch_dist folder, so ``inspect``, ``verify`` and ``memory`` treat it like any
other checkpoint:

* every release text tensor under its release name (``model.llm.…``), read from its Megatron key
  by the preset's inverse rule: q/k/v/r from their sub-keys, a padded vocabulary cut back to the
  config's rows, a layer's ``linear_fc1`` experts re-interleaved into the release's ``w13``;
* routed experts are BF16 (what Megatron holds), so the precision plan is all ``bf16``, and
  ``read_rows`` on a stacked expert weight reads only those experts' chunks;
* no vision tower: a Megatron checkpoint holds the text model only.

The model config is the copy ``convert hf-to-megatron`` keeps in ``common.pt``, or ``config``
given by the caller (a ``config.json``, a folder holding one, or a dict) for a folder that keeps
none; given for one that does, it must describe the same model.
The key preset is the one recorded in ``common.pt``, else the one whose keys the folder holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from ..errors import CheckpointError, ConfigError
from ..model.config import InklingConfig, read_json
from ..model.inventory import TensorSpec, inventory, nbytes
from ..model.mapping import (
    PRESETS, Experts, MegatronMapping, Preset, get_preset, layer_count, presets_of_keys, stored_shape_ok,
)
from ..model.precision import PrecisionPlan
from ..model.quant_config import output_config
from .hf import DTYPE_TO_ST
from .megatron import COMMON, INKLING_KEY, TorchDistCheckpoint, read_stored_config


def check_torch_dist(reader: TorchDistCheckpoint, m: MegatronMapping) -> dict[str, torch.dtype]:
    """Every mapped key present at its global shape, experts BF16, no tensor left unused.

    Returns the stored dtype of each non-expert release tensor (written back as stored). The two
    vocabulary tensors may hold more rows than the release (a Megatron-padded vocabulary); the
    extra rows are dropped on the way back.
    """
    where = str(reader.folder)
    m.check_megatron(reader.keys, where)
    dtypes: dict[str, torch.dtype] = {}
    for e in m.entries():
        st = reader.keys[e.key]
        if not stored_shape_ok(e, st.shape):
            shown = f"[>= {e.shape[0]}, {e.shape[1]}]" if e.rule.vocab else str(list(e.shape))
            raise CheckpointError(f"{where}: {e.key} is {list(st.shape)}, the reference config says {shown}")
        if e.stacked:
            if st.dtype != torch.bfloat16:
                raise CheckpointError(f"{where}: {e.key} is {DTYPE_TO_ST.get(st.dtype, st.dtype)}; routed experts "
                                      "must be BF16 (no implicit casts)")
        elif st.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise CheckpointError(f"{where}: {e.key} is {DTYPE_TO_ST.get(st.dtype, st.dtype)}, not a float tensor")
        else:
            dtypes[e.hf] = st.dtype
    return dtypes


def dense_rows(reader: TorchDistCheckpoint, m: MegatronMapping, key: str, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of the HF tensor that non-expert Megatron ``key`` becomes: a rule that maps
    rows to rows reads only those rows (the embeddings), any other reads the tensor whole and cuts it."""
    e = m.entry(key)
    if e.shape and e.rule.by_rows:
        rows = reader.read(e.key, (start, *(0 for _ in e.shape[1:])), (stop - start, *e.shape[1:]))
        return m.rows_to_hf(e.key, rows, start).contiguous()
    t = m.to_hf(e.key, reader.read(e.key)).contiguous()
    return t if (start, stop) == (0, t.shape[0] if t.dim() else 1) else t[start:stop]


def dense_extents(reader: TorchDistCheckpoint, m: MegatronMapping, key: str, start: int,
                  stop: int) -> list[tuple[Path, int, int]]:
    """The stored blobs :func:`dense_rows` reads for the same rows (for the executor's read-ahead)."""
    e = m.entry(key)
    if e.shape and e.rule.by_rows:
        return reader.extents(e.key, (start, *(0 for _ in e.shape[1:])), (stop - start, *e.shape[1:]))
    return reader.extents(e.key)


class MissingConfigError(ConfigError):
    """A torch_dist folder that keeps no config.json, opened without one."""


@dataclass(frozen=True)
class ReleaseTensor:
    """A release tensor as a torch_dist folder holds it: shape and dtype after the mapping, and its key."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    key: str  # the Megatron key it is read from

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)


def load_config(config: "str | Path | Mapping[str, Any]") -> dict[str, Any]:
    """A config dict from a dict, a ``config.json`` or a folder holding one."""
    if isinstance(config, Mapping):
        return dict(config)
    p = Path(config)
    if p.is_dir():
        p = p / "config.json"
    return read_json(p)


class TorchDistRelease:
    """A torch_dist checkpoint presented as release-named BF16 tensors. Use :meth:`open`."""

    layout = "torch_dist"

    def __init__(self, root: Path, reader: TorchDistCheckpoint, config: dict[str, Any], config_source: str,
                 mapping: MegatronMapping, dtypes: dict[str, torch.dtype]):
        self.root = root
        self.reader = reader
        self.cfg = mapping.cfg
        self.mapping = mapping
        self.plan = PrecisionPlan.uniform("bf16", self.cfg.num_hidden_layers)
        # The config of a BF16 release of these weights: a quantized source's quantization_config dropped.
        self.config = output_config(config, self.cfg, self.plan)
        self.config_source = config_source
        self.tensors: dict[str, ReleaseTensor] = {}
        for e in mapping.entries():
            dtype = torch.bfloat16 if e.stacked else dtypes[e.hf]
            self.tensors[e.hf] = ReleaseTensor(e.hf, e.shape, dtype, e.key)

    @classmethod
    def open(cls, path: str | Path, *, config: Any = None, default_config: Any = None) -> "TorchDistRelease":
        """Read the metadata and ``common.pt``, pick the config and preset, check every key (no tensor data).

        ``default_config`` is used only when ``config`` is not given and the folder keeps none
        (``verify`` passes the other checkpoint's).
        """
        root = Path(path)
        reader = TorchDistCheckpoint.open(root)
        stored = read_stored_config(reader.common)
        if config is None and stored is None and default_config is not None:
            config = default_config
        if config is not None:
            cfg_dict = load_config(config)
            source = str(config) if not isinstance(config, Mapping) else "the other checkpoint's config.json"
        else:
            if stored is None:
                raise MissingConfigError(
                    f"{root}: a torch_dist checkpoint holds no config.json and its {COMMON} keeps no copy (it was not "
                    "written by `inkling-ckpt convert hf-to-megatron`): pass --config with the model's config.json "
                    "(or the HF checkpoint folder it came from)")
            cfg_dict, source = stored, f"{reader.folder / COMMON}"
        cfg = InklingConfig.from_dict(cfg_dict)
        if config is not None and stored is not None:
            kept = InklingConfig.from_dict(stored)
            diff = [k for k in cfg.__dataclass_fields__ if getattr(cfg, k) != getattr(kept, k)]
            if diff:
                raise ConfigError(f"{root}: the config given describes another model than the one kept in its "
                                  f"{COMMON} (they differ in {', '.join(diff)}); drop --config to use the kept one")
        reader.unstack_layers(cfg.num_hidden_layers)
        if stored is None:
            check_same_model(reader, cfg, str(root), "config", str(config) if not isinstance(config, Mapping) else "")
        mapping = mapping_for(reader, cfg, str(root))
        dtypes = check_torch_dist(reader, mapping)
        return cls(root, reader, cfg_dict, source, mapping, dtypes)

    # ---- the read interface shared with HFCheckpoint

    def expected(self) -> list[TensorSpec]:
        """The release inventory this folder holds: BF16 experts, its own non-expert dtypes, no vision tower."""
        return inventory(self.cfg, self.plan, dtypes=self.dtypes(), vision=[])

    def dtypes(self) -> dict[str, torch.dtype]:
        return {n: t.dtype for n, t in self.tensors.items() if not self.mapping.entry(t.key).stacked}

    def vision_specs(self) -> list[TensorSpec]:
        """None: a Megatron checkpoint holds the text model only."""
        return []

    #: read_rows and get take ``device=`` (expert chunks go straight onto a GPU).
    reads_to_device = True

    def get(self, name: str, *, device: torch.device | str | None = None) -> torch.Tensor:
        """One whole release tensor (a stacked expert weight: every expert, interleaved as released)."""
        t = self._tensor(name)
        e = self.mapping.entry(t.key)
        if e.stacked:
            return self.read_rows(name, 0, t.shape[0], device=device)
        out = self.mapping.to_hf(e.key, self.reader.read(e.key)).contiguous()
        return out if device is None else out.to(device)

    def read_rows(self, name: str, start: int, stop: int, *, device: torch.device | str | None = None) -> torch.Tensor:
        """Rows ``start:stop`` (experts, for a stacked weight: only their chunks are read), on ``device``."""
        t = self._tensor(name)
        if not 0 <= start <= stop <= t.shape[0]:
            raise CheckpointError(f"{self.root}: rows {start}:{stop} of {name} are outside {list(t.shape)}")
        e = self.mapping.entry(t.key)
        if not e.stacked:
            out = dense_rows(self.reader, self.mapping, e.key, start, stop)
            return out if device is None else out.to(device)
        mg = self.reader.read(e.key, (start, 0, 0), (stop - start, *e.shape[1:]), device=device)
        return self.mapping.to_hf(e.key, mg).contiguous()

    def extents(self, name: str, start: int, stop: int) -> list[tuple[Path, int, int]]:
        """The stored blobs :meth:`read_rows` of the same rows reads (for the executor's read-ahead)."""
        t = self.tensors.get(name)
        if t is None:
            return []
        e = self.mapping.entry(t.key)
        if not e.stacked:
            return dense_extents(self.reader, self.mapping, e.key, start, stop)
        return self.reader.extents(e.key, (start, 0, 0), (stop - start, *e.shape[1:]))

    def _tensor(self, name: str) -> ReleaseTensor:
        t = self.tensors.get(name)
        if t is None:
            raise CheckpointError(f"{self.root}: no tensor {name} (a torch_dist checkpoint holds the text model, "
                                  "routed experts as BF16)")
        return t

    def storage(self) -> dict[str, Any]:
        """How the folder stores the tensors (for ``inspect``)."""
        files = {si.relative_path for si in self.reader.metadata.storage_data.values()}
        ours = self.reader.common.get(INKLING_KEY)
        return {"layout": self.layout, "files": len(files), "preset": self.mapping.preset.name,
                "iteration_dir": str(self.reader.folder), "config": self.config_source,
                "keys": len(self.reader.keys), "objects": len(self.reader.objects),
                "source_plan": ours.get("source_plan") if isinstance(ours, Mapping) else None}

    def extra_files(self) -> dict[str, bytes]:
        return {}

    def describe(self) -> dict[str, Any]:
        return {**self.reader.describe(), "plan": str(self.plan), "preset": self.mapping.preset.name}

    def close(self) -> None:
        self.reader._cache = None  # the last chunk read


def mapping_for(reader: TorchDistCheckpoint, cfg: InklingConfig, where: str,
                preset: str | Preset | None = None) -> MegatronMapping:
    """The key mapping of a torch_dist folder: ``preset`` when given, else the one recorded in
    ``common.pt``, else the one whose keys the folder holds (the preset tables decide)."""
    if preset is not None:
        m = MegatronMapping(cfg, preset)
        m.check_megatron(reader.keys, where)
        return m
    ours = reader.common.get(INKLING_KEY)
    recorded = ours.get("preset") if isinstance(ours, Mapping) else None
    if isinstance(recorded, str) and recorded in PRESETS:
        return MegatronMapping(cfg, get_preset(recorded))
    mappings = [MegatronMapping(cfg, p) for p in PRESETS.values()]
    for m in mappings:
        if m.megatron_coverage(reader.keys).ok:
            return m
    fitting = presets_of_keys(reader.keys)
    if fitting:  # the global keys name the preset: report against it
        best = MegatronMapping(cfg, fitting[0])
    else:  # none fits: report against the preset that leaves the fewest keys unexplained
        best = min(mappings, key=lambda m: (lambda c: len(c.unused) + len(c.missing))(m.megatron_coverage(reader.keys)))
    best.check_megatron(reader.keys, f"{where} (no key preset fits; nearest: {best.preset.name})")
    return best  # not reached: check_megatron raised


#: How a model-size mismatch is reported: config field -> how its value reads (others: "field value").
SIZE_LABELS: dict[str, str] = {
    "num_hidden_layers": "{} layers", "hidden_size": "hidden {}", "n_routed_experts": "{} experts",
    "moe_intermediate_size": "expert width {}", "vocab_size": "vocabulary {}",
}


def stored_dims(reader: TorchDistCheckpoint) -> dict[str, Any]:
    """The model size a torch_dist folder holds: its kept config, else what its keys show
    (layers from the layer prefixes, hidden size from the embedding, experts from layer 0's stack)."""
    kept = read_stored_config(reader.common)
    if kept is not None:
        cfg = InklingConfig.from_dict(kept)
        return {f: getattr(cfg, f) for f in cfg.__dataclass_fields__ if f != "vision"}
    dims: dict[str, Any] = {}
    for name in presets_of_keys(reader.keys)[:1]:
        preset = get_preset(name)
        layers = layer_count(preset, reader.keys)
        if layers is not None:
            dims["num_hidden_layers"] = layers
        for rule in preset.rules:
            if rule.vocab and "{L}" not in rule.key and rule.key in reader.keys:
                dims["hidden_size"] = reader.keys[rule.key].shape[-1]
            if isinstance(rule, Experts) and "n_routed_experts" not in dims:
                key = rule.key.replace("{L}", preset.layer_prefix_of(rule.site, 0))
                if key in reader.keys:
                    dims["n_routed_experts"] = reader.keys[key].shape[0]
    return dims


def check_same_model(reader: TorchDistCheckpoint, cfg: InklingConfig, where: str, what: str = "reference",
                     source: str = "") -> None:
    """ConfigError naming the fields in which ``cfg`` (the reference's) and the folder's model differ.

    Run before any key check, so a reference of another size says so instead of failing on keys.
    """
    have = stored_dims(reader)
    diff = [f for f, v in have.items() if getattr(cfg, f) != v]
    if not diff:
        return
    if "num_hidden_layers" in diff and "layer_types" in diff:
        diff.remove("layer_types")  # follows from the layer count
    diff.sort(key=lambda f: (list(SIZE_LABELS).index(f) if f in SIZE_LABELS else len(SIZE_LABELS), f))

    def show(values: Mapping[str, Any], fields: list[str]) -> str:
        def one(f: str) -> str:
            v = values[f]
            text = "[" + ", ".join(map(str, v)) + "]" if isinstance(v, (tuple, list)) else str(v)
            return SIZE_LABELS.get(f, f + " {}").format(text)
        return ", ".join(one(f) for f in fields)

    shown = [f for f in diff if f in SIZE_LABELS] or diff[:3]
    rest = [f for f in diff if f not in shown]
    also = f" (also {', '.join(rest[:4])}{f' and {len(rest) - 4} more' if len(rest) > 4 else ''})" if rest else ""
    given = f"the {what} {source}".rstrip()
    raise ConfigError(f"{where}: {given} describes another model than this checkpoint: {what}: "
                      f"{show({f: getattr(cfg, f) for f in shown}, shown)}; checkpoint: {show(have, shown)}{also}")


__all__ = ["TorchDistRelease", "dense_rows", "ReleaseTensor", "MissingConfigError", "load_config", "mapping_for", "check_same_model",
           "stored_dims", "check_torch_dist"]
