"""``verify --forward``: run two checkpoints through the real model, one layer at a time, and compare.

The model is transformers' own ``Inkling2ForConditionalGeneration`` (optional extra ``forward``):
it is built once on the meta device, exactly as ``from_pretrained`` builds it (same init context,
same dtype plan, same weight-conversion table), and each unit (embedding, decoder layer ``i``,
head) is materialised from the checkpoint just before it runs and returned to meta right after.
So at most one layer's weights of one checkpoint are in memory, plus the token batch's
activations: the hidden state and the block attention-residual sources of each side. A decoder
layer's routed experts are not materialised whole (a full-size layer's are 24 GB at BF16): they
run a slice of experts at a time (``--slice-mb``), each slice read and decoded just before it is
used, through a replica of transformers' grouped_mm experts forward that gives the same output
bit for bit (:func:`_sliced_experts_forward`; both sides run the same code). The
driver below calls the model's own modules in the order ``Inkling2TextModel.forward`` does, so
on a BF16 checkpoint the logits equal ``from_pretrained(...)(input_ids).logits`` bit for bit
(same dtype, same device).

Routed experts stored quantized (MXFP8, or NVFP4 in the release's ``amax / denominator`` form)
are decoded to the run dtype on the run device by ``formats.stacked.decode_stacked`` (the order
of transformers' own dequantizer) before the layer is loaded; BF16 experts load as stored. The
layer's expert format is read from the tensors present, as transformers does.

Report (``--json``), schema ``inkling-ckpt/verify-forward/1``::

    {"schema": "inkling-ckpt/verify-forward/1",
     "a": {"source", "expert_formats": {FORMAT: n_layers}}, "b": {...},
     "run": {"device", "dtype", "batch", "seq_len", "tokens": "random"|FILE, "seed", "seconds",
             "expert_slice_bytes"},          # routed experts run this many BF16 bytes at a time (null: whole layer)
     "config_differences": [KEY, ...],      # text_config fields that differ between A and B
     "logits": {"kl_mean", "kl_max", "top1_agreement", "max_abs_diff", "positions",
                "first_diverging_layer"},      # first layer whose hidden state differs, or null
     "layers": [{"layer", "kind": "sliding"|"full", "format_a", "format_b",
                 "rel_error", "max_abs_diff"}],      # hidden state after each decoder layer
     "thresholds": {"max_kl", "passed"}}

Figures that come out NaN or infinite (a checkpoint whose outputs are not finite) are ``null``.
``kl_*`` is KL(A‖B) of the next-token distributions (nats, from float32 logits, summed in
float64), per position, then mean and max over the batch's positions; ``top1_agreement`` the
fraction of positions whose argmax agree; ``rel_error`` is ``‖h_B − h_A‖ / ‖h_A‖`` over the
whole batch (float64 sums), ``h`` the hidden state each side computes from its own previous
layers (so the error accumulates, and its first jump shows where the divergence starts).
"""

from __future__ import annotations

import functools
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from ..errors import CheckpointError, ConfigError, FormatError, InklingError, NonFiniteError
from ..formats.stacked import AMAX, DENOM, SCALE, WEIGHT, decode_stacked, format_of_parts, stacked_parts
from ..layouts.pread import TensorFile
from ..pipeline.executor import DEFAULT_SLICE_BYTES

SCHEMA = "inkling-ckpt/verify-forward/1"
INSTALL_HINT = "pip install 'inkling-ckpt[forward]' (transformers==5.24.0)"
TRANSFORMERS_VERSION = "5.24.0"

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
#: Bytes of rows read at a time into a tensor bound for a GPU (host memory holds one such block).
BLOCK_BYTES = 64 * 2**20


class MissingDependency(InklingError):
    """An optional extra that this mode needs is not installed."""


# ------------------------------------------------------------------------------------------
# transformers, imported only here and only on demand
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _TF:
    """The pieces of transformers 5.24 this module drives."""

    Config: Any
    Model: Any
    ContextManagers: Any
    get_model_conversion_mapping: Callable
    rename_source_key: Callable
    WeightRenaming: Any
    WeightConverter: Any
    build_glob_alternation: Callable
    create_causal_mask: Callable
    create_sliding_window_causal_mask: Callable
    create_recurrent_attention_mask: Callable
    get_relative_distance: Callable
    grouped_linear: Callable


def load_transformers() -> _TF:
    """Import what the forward needs from transformers; MissingDependency (one line) without it."""
    try:
        import transformers
        from transformers import Inkling2Config, Inkling2ForConditionalGeneration
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            build_glob_alternation,
            rename_source_key,
        )
        from transformers.masking_utils import (
            create_causal_mask,
            create_recurrent_attention_mask,
            create_sliding_window_causal_mask,
        )
        from transformers.integrations.moe import _grouped_linear
        from transformers.models.inkling2.modeling_inkling2 import get_relative_distance
        from transformers.utils.generic import ContextManagers
    except ImportError as e:
        raise MissingDependency(
            f"verify --forward needs transformers with the Inkling 2 model ({e.name or e}); {INSTALL_HINT}"
        ) from None
    version = getattr(transformers, "__version__", "?")
    if version.split("+")[0] != TRANSFORMERS_VERSION:
        raise MissingDependency(
            f"verify --forward is pinned to transformers {TRANSFORMERS_VERSION} (its internal loader "
            f"is driven directly), found {version}; {INSTALL_HINT}"
        )
    return _TF(
        Config=Inkling2Config,
        Model=Inkling2ForConditionalGeneration,
        ContextManagers=ContextManagers,
        get_model_conversion_mapping=get_model_conversion_mapping,
        rename_source_key=rename_source_key,
        WeightRenaming=WeightRenaming,
        WeightConverter=WeightConverter,
        build_glob_alternation=build_glob_alternation,
        create_causal_mask=create_causal_mask,
        create_sliding_window_causal_mask=create_sliding_window_causal_mask,
        create_recurrent_attention_mask=create_recurrent_attention_mask,
        get_relative_distance=get_relative_distance,
        grouped_linear=_grouped_linear,
    )


# ------------------------------------------------------------------------------------------
# reading a release checkpoint lazily
# ------------------------------------------------------------------------------------------


class SafetensorsFolder:
    """Tensors of an HF safetensors checkpoint folder (index or single file), read one at a time.

    Every file named by the index must resolve inside the folder. Headers are read up front
    (no tensor data, offsets checked against the file sizes); ``get`` reads one tensor with
    plain positioned reads, never a memory map: a mapped file's touched pages stay in the
    process's resident set until unmapped, so RSS would grow with the checkpoint (every layer
    read so far) instead of staying at the one unit in memory.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise CheckpointError(f"{self.folder}: not a checkpoint folder")
        root = self.folder.resolve()
        index = self.folder / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: weight_map is not an object")
        elif (self.folder / SINGLE).is_file():
            weight_map = None
        else:
            raise CheckpointError(f"{self.folder}: neither {INDEX} nor {SINGLE}")
        files = sorted(set(map(str, weight_map.values()))) if weight_map is not None else [SINGLE]
        self._files: dict[str, TensorFile] = {}
        for f in files:
            p = (self.folder / f).resolve()
            if not p.is_relative_to(root) or p == root:
                raise CheckpointError(f"{index}: file {f!r} resolves outside {self.folder}")
            if not p.is_file():
                raise CheckpointError(f"{self.folder}: shard {f} is missing")
            self._files[f] = TensorFile(p)  # header only; the file is opened on the first read
        self._where: dict[str, TensorFile] = {}
        self.meta: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for f, tf in self._files.items():
            for name, (shape, dt, _) in tf.entries.items():
                if name in self._where:
                    raise CheckpointError(f"{self.folder}: {name} is in both {self._where[name].path.name} and {f}")
                self.meta[name] = (shape, dt)
                self._where[name] = tf
        if weight_map is not None:
            for name, f in weight_map.items():
                held = self._where.get(name)
                if held is None or held is not self._files.get(str(f)):
                    raise CheckpointError(f"{index}: {name} is not in {f}")

    def get(self, name: str, device: torch.device | str = "cpu") -> torch.Tensor:
        """Read one tensor (as stored) onto ``device``; onto a GPU in blocks of rows (:meth:`read_blocks`)."""
        if torch.device(device).type == "cpu":
            return self._where[name].read(name)
        return self.read_blocks(name, device)

    def rows(self, name: str, lo: int, hi: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Rows ``lo:hi`` of one tensor's first dimension (as stored) on ``device``."""
        return self._where[name].read(name, lo, hi).to(device)

    def read_blocks(self, name: str, device: torch.device | str, block_bytes: int = BLOCK_BYTES) -> torch.Tensor:
        """One tensor onto ``device``, ``block_bytes`` of dim-0 rows at a time (at least one row):
        host memory holds one block, not the tensor (a full-size layer's stacked w13 is 16 GB)."""
        shape, dt = self.meta[name]
        out = torch.empty(shape, dtype=dt, device=device)
        if len(shape) == 0 or out.numel() == 0:
            return out.copy_(self._where[name].read(name)) if len(shape) == 0 else out
        row = max(1, out[0].numel() * dt.itemsize)
        step = max(1, block_bytes // row)
        for lo in range(0, shape[0], step):
            hi = min(shape[0], lo + step)
            out[lo:hi].copy_(self._where[name].read(name, lo, hi))
        return out

    def close(self) -> None:
        for tf in self._files.values():
            tf.close()


# ------------------------------------------------------------------------------------------
# routed experts: BF16, MXFP8 or NVFP4 per layer, read from the parts present
# ------------------------------------------------------------------------------------------

#: A stacked expert linear on disk (``…mlp.experts.w13_weight`` / ``w2_weight``) and its parts
#: (the suffixes of inkling_ckpt.formats.stacked).
_EXPERT_PART = re.compile(r"^(?P<base>.+\.mlp\.experts\.w(?:13|2)_weight)(?P<suffix>"
                          + "|".join(re.escape(x) for x in (SCALE, AMAX, DENOM)) + ")?$")

#: Stored dtypes of unquantized experts other than BF16 that the forward accepts (an F32 or F16
#: checkpoint); they are cast exactly as from_pretrained casts them, and reported by dtype.
_PLAIN_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
QUANTIZED = ("mxfp8", "nvfp4")


def expert_format(base: str, parts: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> tuple[str, tuple[int, ...]]:
    """(format, decoded [E, rows, cols] shape) of one stacked expert linear from its parts' headers.

    The format is read from the parts present and their dtypes (``formats.stacked``); their
    shapes must be the ones that format gives for the weight's.
    """
    if set(parts) == {WEIGHT} and parts[WEIGHT][1] in _PLAIN_NAMES:
        shape = parts[WEIGHT][0]
        if len(shape) != 3:
            raise CheckpointError(f"{base}: expected a stacked [E, rows, cols] tensor, got {list(shape)}")
        return _PLAIN_NAMES[parts[WEIGHT][1]], shape
    fmt = format_of_parts({s: dt for s, (_, dt) in parts.items()})
    if fmt not in QUANTIZED:
        got = ", ".join(f"{base}{s} {str(dt).removeprefix('torch.')}" for s, (_, dt) in sorted(parts.items()))
        raise CheckpointError(f"{base}: parts ({got}) are not a BF16, MXFP8 or NVFP4 expert")
    shape = parts[WEIGHT][0]
    if len(shape) != 3:
        raise CheckpointError(f"{base}: expected a stacked [E, rows, cols] tensor, got {list(shape)}")
    full = (shape[0], shape[1], shape[2] * (2 if fmt == "nvfp4" else 1))
    try:
        want = stacked_parts(fmt, full)
    except FormatError as e:
        raise CheckpointError(f"{base}: {e}") from None
    for s, (shp, _) in want.items():
        ok = tuple(parts[s][0]) == shp or (s == DENOM and tuple(parts[s][0]) in ((1,), (full[0],)))  # [E] accepted on read
        if not ok:
            raise CheckpointError(f"{base}{s}: shape {list(parts[s][0])}, expected {list(shp)} ({fmt}, weight {list(shape)})")
    return fmt, full


# ------------------------------------------------------------------------------------------
# one checkpoint, streamed unit by unit through the meta skeleton
# ------------------------------------------------------------------------------------------


@dataclass
class _Source:
    """One model parameter's source on disk: a plain tensor, or a stacked expert linear's parts."""

    base: str  # on-disk name (for experts: the ``…_weight`` name; parts are base + suffix)
    target: str  # transformers parameter name after the conversion table
    converter: str | None  # source pattern of the WeightConverter that applies, if any
    fmt: str | None = None  # expert format, None for plain tensors
    parts: tuple[str, ...] = ("",)


@dataclass
class _Unit:
    name: str  # "embed", "layer.{i}", "head"
    layer: int | None  # decoder layer index, None for embed and head
    modules: list[tuple[str, torch.nn.Module]]  # (qualified prefix, module)
    sources: list[_Source] = field(default_factory=list)
    # routed experts run a slice at a time: experts module prefix -> {parameter: its source}
    streamed: dict[str, dict[str, _Source]] = field(default_factory=dict)

    def is_streamed(self, src: _Source) -> bool:
        """Whether ``src`` is read a slice at a time when its layer runs (not with the unit)."""
        return any(src is s for params in self.streamed.values() for s in params.values())

    @property
    def expert_format(self) -> str | None:
        fmts = sorted({s.fmt for s in self.sources if s.fmt is not None})
        return "+".join(fmts) if fmts else None


def resolve_dtype(tf: _TF, folder: str | Path, dtype: str | torch.dtype) -> torch.dtype:
    """The run dtype: an explicit one, or ``"auto"``: the config's ``dtype`` (as from_pretrained), else bfloat16."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        cfg = _load_config(tf, folder)
        d = getattr(cfg, "dtype", None) or getattr(cfg.get_text_config(), "dtype", None)
        if isinstance(d, str):
            d = getattr(torch, d, None)
        return d if isinstance(d, torch.dtype) else torch.bfloat16
    d = getattr(torch, str(dtype), None)
    if d not in (torch.bfloat16, torch.float16, torch.float32):
        raise ConfigError(f"--dtype {dtype!r}: expected auto, bfloat16, float16 or float32")
    return d


def _load_config(tf: _TF, folder: str | Path):
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder}: no config.json")
    try:
        cfg = tf.Config.from_pretrained(str(folder))
    except Exception as e:  # transformers raises several types for a bad config
        raise ConfigError(f"{path}: not an Inkling 2 config transformers can read ({type(e).__name__}: {e})") from None
    if getattr(cfg, "model_type", None) != "inkling2":
        raise ConfigError(f"{path}: model_type {getattr(cfg, 'model_type', None)!r}, expected 'inkling2'")
    return cfg


class StreamedModel:
    """One checkpoint as transformers' Inkling 2 text model, materialised one unit at a time.

    ``units`` lists the embedding, each decoder layer and the head with the on-disk tensors
    each needs (validated against the model from the headers at construction, before any work).
    Use ``forward`` for logits, or drive ``load``/``unload`` and the modules yourself.

    ``expert_slice_bytes``: run each decoder layer's routed experts a slice of about that many
    BF16 bytes at a time (at least one expert) instead of materialising the layer's experts whole
    (a full-size layer's are 24 GB): see :func:`_sliced_experts_forward`. The logits are the same
    bit for bit. Without it (or where transformers runs the experts otherwise than grouped_mm)
    the layer is loaded whole.
    """

    def __init__(self, folder: str | Path, *, dtype: torch.dtype, device: torch.device | str = "cpu",
                 tf: _TF | None = None, expert_slice_bytes: int | None = None):
        self.tf = tf = tf or load_transformers()
        self.folder = Path(folder)
        self.dtype = dtype
        self.device = torch.device(device)
        self.config = _load_config(tf, folder)
        if getattr(self.config, "quantization_config", None) is not None:
            # the quantization config is what a loader reads to expect FP8 modules; the skeleton here
            # is the plain model and the experts are decoded, so it must not take effect
            self.config.quantization_config = None
        self.reader = SafetensorsFolder(folder)
        # exactly the construction of from_pretrained: init context (meta device, default dtype),
        # then the dtype plan and the weight-conversion table of the built model
        with tf.ContextManagers(tf.Model.get_init_context(dtype, False, False, False)):
            self.model = tf.Model(self.config)
        self.model.eval()
        self.text = self.model.model.language_model
        self.text_config = self.text.config
        self._dtype_plan = self.model._get_dtype_plan(dtype)
        self._dtype_re = None
        if self._dtype_plan:
            self._dtype_re, self._dtype_group, _ = tf.build_glob_alternation(list(self._dtype_plan))
        mapping = tf.get_model_conversion_mapping(self.model)
        self._renamings = [m for m in mapping if isinstance(m, tf.WeightRenaming)]
        self._converters = [m for m in mapping if isinstance(m, tf.WeightConverter)]
        self._by_pattern = {p: c for c in self._converters for p in c.source_patterns}
        self._meta = self.model.state_dict()
        self.units = self._plan()
        if expert_slice_bytes is not None:
            self._stream_experts(max(1, int(expert_slice_bytes)))

    # -- planning from headers ------------------------------------------------------------
    def _plan(self) -> list[_Unit]:
        m, text = self.model, self.text
        qual = {id(mod): name for name, mod in m.named_modules()}
        units = [_Unit("embed", None, [(qual[id(text.embed_tokens)], text.embed_tokens)])]
        units += [_Unit(f"layer.{i}", i, [(qual[id(layer)], layer)]) for i, layer in enumerate(text.layers)]
        units.append(_Unit("head", None, [(qual[id(mod)], mod) for mod in (text.final_input, text.norm, m.lm_head)]))
        skip = [qual[id(m.model.vision_tower)]]  # the text-only forward never runs the vision tower

        expert_parts: dict[str, dict[str, tuple[tuple[int, ...], torch.dtype]]] = {}
        plain: list[str] = []
        for name, meta in self.reader.meta.items():
            mt = _EXPERT_PART.match(name)
            if mt:
                expert_parts.setdefault(mt["base"], {})[mt["suffix"] or ""] = meta
            else:
                plain.append(name)
        sources: list[tuple[_Source, tuple[int, ...], torch.dtype]] = []
        for name in plain:
            target, conv = self._rename(name)
            shape, dt = self.reader.meta[name]
            sources.append((_Source(name, target, conv), shape, dt))
        for base, parts in expert_parts.items():
            if "" not in parts:
                raise CheckpointError(f"{self.folder}: {base}{sorted(parts)[0]} without {base}")
            fmt, shape = expert_format(base, parts)
            target, conv = self._rename(base)
            dt = self.dtype if fmt in QUANTIZED else parts[""][1]
            sources.append((_Source(base, target, conv, fmt, tuple(sorted(parts))), shape, dt))

        for src, shape, dt in sources:
            if any(src.target.startswith(p + ".") for p in skip):
                continue
            unit = next((u for u in units for p, _ in u.modules if src.target.startswith(p + ".")), None)
            if unit is None or src.target not in self._meta:
                raise CheckpointError(
                    f"{self.folder}: tensor {src.base} is not a parameter of transformers' Inkling 2 model"
                )
            # the conversion table's shape changes (interleave, vocab unpadding) checked on meta tensors
            got = self._convert(src, torch.empty(shape, dtype=dt, device="meta")).shape
            want = self._meta[src.target].shape
            if tuple(got) != tuple(want):
                raise CheckpointError(f"{self.folder}: {src.base}: shape {list(shape)} gives {list(got)} for "
                                      f"{src.target}, the model expects {list(want)}")
            unit.sources.append(src)
        for u in units:
            have = {s.target for s in u.sources}
            need = {p + "." + k for p, mod in u.modules for k in mod.state_dict()}
            if need - have:
                missing = sorted(need - have)
                raise CheckpointError(f"{self.folder}: {len(missing)} tensors of {u.name} missing, "
                                      f"e.g. {missing[0]} (transformers name)")
        return units

    def _stream_experts(self, slice_bytes: int) -> None:
        """Mark each decoder layer's routed experts to run a slice at a time (where they can)."""
        self.expert_slice_bytes = slice_bytes
        for unit in self.units:
            by_module: dict[str, dict[str, _Source]] = {}
            for src in unit.sources:
                if src.fmt is not None:  # a routed expert linear (BF16 ones included)
                    prefix, _, param = src.target.rpartition(".")
                    by_module.setdefault(prefix, {})[param] = src
            for prefix, params in by_module.items():
                if _sliceable(self.model.get_submodule(prefix), params):
                    unit.streamed[prefix] = params

    def _rename(self, name: str) -> tuple[str, str | None]:
        return self.tf.rename_source_key(name, self._renamings, self._converters, self.model.base_model_prefix, self._meta)

    def _target_dtype(self, target: str) -> torch.dtype:
        # from_pretrained's cast: the dtype plan (keep-in-fp32 modules) first, else the skeleton's dtype
        if self._dtype_re is not None:
            hit = self._dtype_re.search(target)
            if hit is not None:
                return self._dtype_plan[self._dtype_group[hit.lastgroup]]
        return self._meta[target].dtype

    def _convert(self, src: _Source, tensor: torch.Tensor) -> torch.Tensor:
        """Cast as from_pretrained does, then apply the conversion table's converter (if any)."""
        tensor = tensor.to(dtype=self._target_dtype(src.target))
        if src.converter is None:
            return tensor
        from copy import deepcopy

        conv = deepcopy(self._by_pattern[src.converter])
        conv.add_tensor(src.target, src.base, src.converter, lambda t=tensor: t)
        out = conv.convert(src.target, model=self.model, config=self.model.config)
        if set(out) != {src.target}:
            raise CheckpointError(f"{src.base}: conversion gave {sorted(out)}, expected {src.target}")
        val = out[src.target]
        return val[0] if isinstance(val, list) else val

    # -- materialising ----------------------------------------------------------------------
    def unit_bytes(self, unit: _Unit) -> int:
        """Bytes stored on disk for ``unit``."""
        total = 0
        for s in unit.sources:
            for p in s.parts:
                shape, dt = self.reader.meta[s.base + p]
                total += math.prod(shape) * dt.itemsize
        return total

    def read(self, unit: _Unit) -> dict[str, torch.Tensor]:
        """The unit's stored tensors (on-disk names, as stored) on the run device; routed experts that
        run a slice at a time are read when they run, not here."""
        return {s.base + p: self.reader.get(s.base + p, self.device) for s in unit.sources if not unit.is_streamed(s)
                for p in s.parts}

    def load(self, unit: _Unit, stored: dict[str, torch.Tensor] | None = None) -> None:
        """Materialise ``unit``'s modules on the run device (from ``stored`` if given, as ``read`` returns;
        it is emptied as the tensors are converted, so a stored tensor and its converted form coexist
        only one tensor at a time)."""
        stored = self.read(unit) if stored is None else stored
        state: dict[str, dict[str, torch.Tensor]] = {p: {} for p, _ in unit.modules}
        later: dict[str, set[str]] = {p: set() for p, _ in unit.modules}  # streamed experts' parameters
        for experts, params in unit.streamed.items():
            prefix = next(p for p, _ in unit.modules if experts.startswith(p + "."))
            later[prefix] |= {f"{experts[len(prefix) + 1:]}.{name}" for name in params}
        for s in unit.sources:
            if unit.is_streamed(s):  # read a slice at a time when the layer runs
                continue
            t = self._convert(s, self._materialise(s, {p: stored.pop(s.base + p) for p in s.parts}))
            prefix = next(p for p, _ in unit.modules if s.target.startswith(p + "."))
            state[prefix][s.target[len(prefix) + 1:]] = t
        for prefix, mod in unit.modules:
            try:
                got = mod.load_state_dict(state[prefix], strict=not later[prefix], assign=True)
            except RuntimeError as e:
                raise CheckpointError(f"{self.folder}: {unit.name}: {str(e).splitlines()[0]}") from None
            if later[prefix] and (set(got.missing_keys) != later[prefix] or got.unexpected_keys):
                raise CheckpointError(f"{self.folder}: {unit.name}: the state does not fit the module "
                                      f"(missing {sorted(got.missing_keys)}, unexpected {sorted(got.unexpected_keys)})")
        for experts, params in unit.streamed.items():
            mod = self.model.get_submodule(experts)
            mod.forward = functools.partial(_sliced_experts_forward, mod, self.tf.grouped_linear,
                                            functools.partial(self._expert_slice, params), self._expert_step(params))

    def _materialise(self, s: _Source, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """One source's stored parts as the tensor from_pretrained would cast: quantized experts decoded
        to the run dtype, the rest as stored; on the run device."""
        if s.fmt not in QUANTIZED:  # cast by _convert exactly as from_pretrained casts it
            return parts[""].to(self.device)
        try:
            return decode_stacked(s.fmt, parts, self.dtype, name=s.base).to(self.device)
        except NonFiniteError as e:  # the writing commands' --allow-nonfinite is no option here
            raise e.with_hint("the model cannot run on it (verify without --forward compares it "
                              "tensor by tensor)") from None

    def _expert_step(self, params: Mapping[str, _Source]) -> int:
        """Experts per slice: about ``expert_slice_bytes`` of BF16 of every streamed linear, at least one."""
        per_expert = sum(2 * math.prod(self._meta[s.target].shape[1:]) for s in params.values())
        return max(1, self.expert_slice_bytes // per_expert)

    def _expert_slice(self, params: Mapping[str, _Source], first: int, last: int) -> dict[str, torch.Tensor]:
        """Experts ``first:last`` of each streamed linear: read, decoded and converted on the run device."""
        out = {}
        for name, s in params.items():
            experts = self.reader.meta[s.base][0][0]
            parts = {p: self.reader.rows(s.base + p, first, last, self.device)
                     if self.reader.meta[s.base + p][0][:1] == (experts,) else self.reader.get(s.base + p, self.device)
                     for p in s.parts}  # per-expert parts by rows; a shared scalar (NVFP4 denominator) whole
            out[name] = self._convert(s, self._materialise(s, parts))
        return out

    def unload(self, unit: _Unit) -> None:
        """Return ``unit``'s modules to the meta device (frees their weights)."""
        for experts in unit.streamed:
            vars(self.model.get_submodule(experts)).pop("forward", None)  # the class's forward again
        for _, mod in unit.modules:
            mod.to("meta")

    # -- the forward, in Inkling2TextModel.forward's order ----------------------------------
    def masks(self, inputs_embeds: torch.Tensor) -> dict[str, Any]:
        """Attention masks, relative distances and position ids for a fresh (no cache) batch."""
        tf, cfg = self.tf, self.text_config
        position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device).unsqueeze(0)
        kw = {"config": cfg, "inputs_embeds": inputs_embeds, "attention_mask": None, "cache": None,
              "position_ids": position_ids}
        return {
            "mask": {"full_attention": tf.create_causal_mask(**kw),
                     "sliding_attention": tf.create_sliding_window_causal_mask(**kw),
                     "linear_attention": tf.create_recurrent_attention_mask(**kw)},
            "rel": {"full_attention": tf.get_relative_distance(inputs_embeds, None, is_sliding=False),
                    "sliding_attention": tf.get_relative_distance(inputs_embeds, None, is_sliding=True)},
            "position_ids": position_ids,
        }

    def embed(self, input_ids: torch.Tensor) -> "_State":
        """Run the (loaded) embedding: the state before layer 0."""
        h = self.text.embed_tokens(input_ids)
        return _State(h, h.new_zeros(*h.shape[:-1], 0, h.shape[-1]), self.masks(h), h.dtype)

    def layer(self, i: int, st: "_State") -> None:
        """Run (loaded) decoder layer ``i`` on ``st`` in place."""
        layer = self.text.layers[i]
        kind = layer.attention_type
        new = layer(st.hidden, st.block_states, attention_mask=st.masks["mask"][kind],
                    relative_distance=st.masks["rel"][kind], conv_mask=st.masks["mask"]["linear_attention"],
                    cache=None, position_ids=st.masks["position_ids"])
        if layer.is_block_boundary:
            st.block_states = torch.cat([st.block_states.to(st.hidden.device), st.hidden.unsqueeze(-2)], dim=-2)
        st.hidden = new

    def head(self, st: "_State") -> torch.Tensor:
        """Run the (loaded) final residual, norm and unembedding: float32 logits [B, T, Vu]."""
        h = self.text.final_input(st.block_states, st.hidden)[0]
        h = self.text.norm(h).to(st.dtype)
        logits = self.model.lm_head(h).float()
        return self.model.logit_softcap(logits)

    def run_unit(self, unit: _Unit, st: "_State | None", input_ids: torch.Tensor):
        """Load ``unit``, run it, unload it. Returns the state (embed, layers) or the logits (head)."""
        self.load(unit)
        try:
            with torch.inference_mode():
                if unit.name == "embed":
                    return self.embed(input_ids.to(self.device))
                if st is None:  # every unit after the embedding runs on its state
                    raise CheckpointError(f"verify --forward: {unit.name} ran before the embedding")
                if unit.layer is None:  # the head (the embedding returned above)
                    return self.head(st)
                self.layer(unit.layer, st)
                return st
        finally:
            self.unload(unit)

    def forward(self, input_ids: torch.Tensor, on_layer: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor:
        """Logits of ``input_ids`` [B, T], streaming every unit; ``on_layer(i, hidden)`` after each layer."""
        st = None
        for unit in self.units:
            out = self.run_unit(unit, st, input_ids)
            if unit.name == "head":
                return out
            st = out
            if on_layer is not None and unit.layer is not None:
                on_layer(unit.layer, st.hidden)
        raise AssertionError("unreachable: the unit list ends with the head")

    def close(self) -> None:
        self.reader.close()


def _sliceable(experts: torch.nn.Module, params: Mapping[str, _Source]) -> bool:
    """Whether a routed-experts module runs as :func:`_sliced_experts_forward` reproduces: transformers'
    grouped_mm implementation (the one it picks for Inkling 2) of gated, bias-free, untransposed
    experts whose two linears both come from the checkpoint."""
    return (set(params) == {"gate_up_proj", "down_proj"}
            and getattr(getattr(experts, "config", None), "_experts_implementation", None) == "grouped_mm"
            and getattr(experts, "has_gate", False) and getattr(experts, "is_concatenated", False)
            and not getattr(experts, "has_bias", True) and not getattr(experts, "is_transposed", True)
            and not getattr(experts, "has_post_expert_norm", True))


def _sliced_experts_forward(experts: Any, grouped_linear: Callable,
                            load_slice: Callable[[int, int], dict[str, torch.Tensor]], step: int,
                            hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' grouped_mm experts forward, ``step`` experts at a time (both sides run this code).

    Per routed (token, expert) pair it does what ``grouped_mm_experts_forward`` does — the pair's
    row through its expert's gate/up projection (``grouped_linear``), the module's own gate, the
    down projection, times its routing weight in float32 — with the slice's weights, read just
    before (``load_slice(first, last)``; a slice no token is routed to is not read). A row's
    product does not depend on the other rows of its group, so every pair's output is the one of
    the whole-layer call, and the pairs are then summed per token exactly as there (float32, over
    the top-k in order): the same output bit for bit, holding one slice of experts at a time.
    """
    tokens, k = top_k_index.shape
    n = int(experts.num_experts)
    weights = top_k_weights.reshape(-1)
    # grouped_mm's own sort: the rows of each expert in the order that call gives them (a GEMM's
    # result for a row may depend on where the row sits in its group)
    ids, perm = torch.sort(top_k_index.reshape(-1))
    ends = torch.cumsum(torch.bincount(ids, minlength=n)[:n], dim=0).tolist()  # one host sync
    out = torch.zeros(ids.numel(), hidden_states.shape[-1], dtype=torch.float32, device=hidden_states.device)
    for first in range(0, n, step):
        last = min(n, first + step)
        lo, hi = ends[first - 1] if first else 0, ends[last - 1]
        if lo == hi:
            continue
        pairs = perm[lo:hi]
        offsets = torch.cumsum(torch.bincount(ids[lo:hi] - first, minlength=last - first), dim=0, dtype=torch.int32)
        w = load_slice(first, last)
        y = grouped_linear(hidden_states[pairs // k], w["gate_up_proj"], offsets)
        y = grouped_linear(experts._apply_gate(y), w["down_proj"], offsets)
        del w
        out[pairs] = y * weights[pairs].unsqueeze(-1)
    return out.view(tokens, k, -1).sum(dim=1).to(hidden_states.dtype)


@dataclass
class _State:
    hidden: torch.Tensor
    block_states: torch.Tensor
    masks: dict[str, Any]
    dtype: torch.dtype


# ------------------------------------------------------------------------------------------
# comparing A and B
# ------------------------------------------------------------------------------------------


def logit_stats(la: torch.Tensor, lb: torch.Tensor) -> dict[str, Any]:
    """KL(A‖B) per position (mean, max), top-1 agreement and max |Δlogit| of float32 logits [..., V]."""
    la = la.float().reshape(-1, la.shape[-1])
    lb = lb.float().reshape(-1, lb.shape[-1])
    lpa = torch.log_softmax(la, dim=-1).double()
    lpb = torch.log_softmax(lb, dim=-1).double()
    kl = (lpa.exp() * (lpa - lpb)).sum(-1)
    return {
        "positions": int(la.shape[0]),
        "kl_mean": _finite(kl.mean()),
        "kl_max": _finite(kl.max()),
        "top1_agreement": float((la.argmax(-1) == lb.argmax(-1)).double().mean()),
        "max_abs_diff": _finite((la - lb).abs().max()),
    }


def _finite(x: torch.Tensor | float) -> float | None:
    """A float for JSON, None where it is NaN or infinite (a checkpoint that yields non-finite outputs)."""
    v = float(x)
    return v if math.isfinite(v) else None


def hidden_stats(ha: torch.Tensor, hb: torch.Tensor) -> dict[str, float | None]:
    """‖h_B − h_A‖ / ‖h_A‖ (float64 sums) and max |h_B − h_A| of two hidden states."""
    a, b = ha.double(), hb.double()
    d = b - a
    den = float(a.square().sum().sqrt())
    num = float(d.square().sum().sqrt())
    return {"rel_error": _finite(num / den) if den > 0 else (0.0 if num == 0 else None),
            "max_abs_diff": _finite(d.abs().max()) if d.numel() else 0.0}


def read_tokens(path: str | Path, vocab_size: int) -> torch.Tensor:
    """Token ids from a file: JSON (a list of ids, or a list of equal-length lists), or text
    with one sequence of whitespace-separated ids per line. Returns int64 [B, T]."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise CheckpointError(f"--tokens {p}: {e.strerror or e}") from None
    try:
        if p.suffix == ".json":
            data = json.loads(text)
            if data and all(isinstance(x, int) for x in data):
                data = [data]
        else:
            data = [[int(x) for x in line.split()] for line in text.splitlines() if line.strip()]
    except ValueError as e:
        raise CheckpointError(f"--tokens {p}: not token ids ({e})") from None
    if not isinstance(data, list) or not data or not all(isinstance(r, list) and r for r in data):
        raise CheckpointError(f"--tokens {p}: expected one or more non-empty sequences of token ids")
    if len({len(r) for r in data}) != 1:
        raise CheckpointError(f"--tokens {p}: sequences differ in length ({sorted({len(r) for r in data})}); "
                              f"give equal lengths (no padding is applied)")
    if not all(isinstance(x, int) and not isinstance(x, bool) for r in data for x in r):
        raise CheckpointError(f"--tokens {p}: token ids must be integers")
    ids = torch.tensor(data, dtype=torch.int64)
    bad = (ids < 0) | (ids >= vocab_size)
    if bool(bad.any()):
        raise CheckpointError(f"--tokens {p}: id {int(ids[bad][0])} outside the vocabulary [0, {vocab_size})")
    return ids


def random_tokens(batch: int, seq_len: int, vocab_size: int, seed: int) -> torch.Tensor:
    """Uniform random ids in [0, vocab_size), int64 [batch, seq_len], reproducible from ``seed``."""
    if batch < 1 or seq_len < 1:
        raise ConfigError(f"--random needs batch >= 1 and length >= 1, got {batch} x {seq_len}")
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq_len), generator=g, dtype=torch.int64)


_ARCH_FIELDS = ("hidden_size", "num_hidden_layers", "unpadded_vocab_size")
_IGNORED_CONFIG_KEYS = {"dtype", "torch_dtype", "transformers_version", "_name_or_path", "architectures",
                        "quantization_config"}


def compare_forward(
    a: str | Path,
    b: str | Path,
    *,
    input_ids: torch.Tensor | None = None,
    random: int | None = None,
    batch: int = 2,
    seed: int = 0,
    device: str = "cpu",
    dtype: str | torch.dtype = "auto",
    max_kl: float | None = None,
    progress: bool = True,
    tokens_label: str | None = None,
    slice_bytes: int | None = DEFAULT_SLICE_BYTES,
) -> dict[str, Any]:
    """Stream A and B layer by layer over one token batch and report (schema ``SCHEMA``).

    Give ``input_ids`` [B, T] or ``random`` (sequence length; ``batch`` sequences from ``seed``).
    Both sides run in the same ``dtype`` (``"auto"``: A's config dtype) on ``device``; at any
    time one unit (the embedding, one decoder layer, or the head) of one side is in memory, a
    decoder layer's routed experts ``slice_bytes`` (BF16) at a time (None: the whole layer).
    """
    tf = load_transformers()
    dev = _device(device)
    run_dtype = resolve_dtype(tf, a, dtype)
    t0 = time.perf_counter()
    sa = StreamedModel(a, dtype=run_dtype, device=dev, tf=tf, expert_slice_bytes=slice_bytes)
    sb = StreamedModel(b, dtype=run_dtype, device=dev, tf=tf, expert_slice_bytes=slice_bytes)
    try:
        ca, cb = sa.text_config, sb.text_config
        for f in _ARCH_FIELDS:
            if getattr(ca, f) != getattr(cb, f):
                raise CheckpointError(f"A and B are different models: text_config.{f} is {getattr(ca, f)} vs {getattr(cb, f)}")
        da, db = ca.to_dict(), cb.to_dict()
        differences = sorted(k for k in set(da) | set(db) if k not in _IGNORED_CONFIG_KEYS and da.get(k) != db.get(k))
        vocab = min(ca.vocab_size, cb.vocab_size)
        if input_ids is None:
            if random is None:
                raise ConfigError("give token ids or --random N")
            input_ids = random_tokens(batch, random, ca.unpadded_vocab_size, seed)
            label = "random"
        else:
            input_ids = input_ids.to(torch.int64)
            if input_ids.dim() == 1:
                input_ids = input_ids.unsqueeze(0)
            if bool(((input_ids < 0) | (input_ids >= vocab)).any()):
                raise CheckpointError(f"token ids outside the vocabulary [0, {vocab})")
            label = tokens_label or "given"
        layers: list[dict[str, Any]] = []
        total = sum(sa.unit_bytes(u) for u in sa.units) + sum(sb.unit_bytes(u) for u in sb.units)
        from ..progress import ByteProgress

        with ByteProgress(total, desc="verify --forward", enabled=progress) as bar:
            st_a = st_b = None
            logits_a = logits_b = None
            for ua, ub in zip(sa.units, sb.units, strict=True):
                out_a = sa.run_unit(ua, st_a, input_ids)
                bar.advance(sa.unit_bytes(ua))
                out_b = sb.run_unit(ub, st_b, input_ids)
                bar.advance(sb.unit_bytes(ub))
                if ua.name == "head":
                    logits_a, logits_b = out_a, out_b
                    break
                st_a, st_b = out_a, out_b
                if ua.layer is not None:
                    i = ua.layer
                    kind = "sliding" if sa.text.layers[i].attention_type == "sliding_attention" else "full"
                    layers.append({"layer": i, "kind": kind, "format_a": ua.expert_format,
                                   "format_b": ub.expert_format, **hidden_stats(st_a.hidden, st_b.hidden)})
        if logits_a is None or logits_b is None:  # the head is always the last unit
            raise CheckpointError("verify --forward: the unembedding did not run")
        stats = logit_stats(logits_a, logits_b)
    finally:
        sa.close()
        sb.close()
    stats["first_diverging_layer"] = next((r["layer"] for r in layers if r["rel_error"] != 0.0), None)
    passed = max_kl is None or (stats["kl_max"] is not None and stats["kl_max"] <= max_kl)
    return {
        "schema": SCHEMA,
        "a": {"source": str(a), "expert_formats": _format_counts(sa)},
        "b": {"source": str(b), "expert_formats": _format_counts(sb)},
        "run": {"device": str(dev), "dtype": str(run_dtype).removeprefix("torch."), "batch": int(input_ids.shape[0]),
                "seq_len": int(input_ids.shape[1]), "tokens": label, "seed": seed if label == "random" else None,
                "seconds": round(time.perf_counter() - t0, 3), "expert_slice_bytes": slice_bytes},
        "config_differences": differences,
        "logits": stats,
        "layers": layers,
        "thresholds": {"max_kl": max_kl, "passed": passed},
    }


def _format_counts(s: StreamedModel) -> dict[str, int]:
    out: dict[str, int] = {}
    for u in s.units:
        if u.expert_format is not None:
            out[u.expert_format] = out.get(u.expert_format, 0) + 1
    return out


def _device(device: str) -> torch.device:
    if device == "auto":  # the CLI's shared --device default: CUDA when present
        from ..pipeline import resolve_device

        return resolve_device("auto")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"--device {device!r}: expected cpu or cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available here")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device!r}: expected cpu or cuda[:N]")
    return dev


def render_forward_report(rep: Mapping[str, Any]) -> str:
    """The report as a human-readable table."""
    lg, run = rep["logits"], rep["run"]
    lines = [
        f"A: {rep['a']['source']}  experts {_fmt_counts(rep['a']['expert_formats'])}",
        f"B: {rep['b']['source']}  experts {_fmt_counts(rep['b']['expert_formats'])}",
        f"tokens: {run['tokens']}  batch {run['batch']} x {run['seq_len']}  dtype {run['dtype']}  "
        f"device {run['device']}  {run['seconds']:.1f} s",
    ]
    if rep["config_differences"]:
        lines.append(f"config fields that differ: {', '.join(rep['config_differences'])}")
    first = lg["first_diverging_layer"]
    lines += [
        "",
        f"KL(A||B) mean {_num(lg['kl_mean'], '.6g')}  max {_num(lg['kl_max'], '.6g')} nats over "
        f"{lg['positions']} positions",
        f"top-1 agreement {lg['top1_agreement']:.4f}   max |dlogit| {_num(lg['max_abs_diff'], '.6g')}",
        "hidden states identical through the last layer" if first is None
        else f"hidden states first differ after layer {first}",
        "",
        f"{'layer':>5}  {'kind':<7}  {'experts A':<9}  {'experts B':<9}  {'rel err':>10}  {'max |dh|':>10}",
    ]
    for r in rep["layers"]:
        lines.append(f"{r['layer']:>5}  {r['kind']:<7}  {r['format_a'] or '-':<9}  {r['format_b'] or '-':<9}  "
                     f"{_num(r['rel_error'], '10.3e')}  {_num(r['max_abs_diff'], '10.3e')}")
    th = rep["thresholds"]
    if th["max_kl"] is not None:
        lines += ["", f"max KL <= {th['max_kl']}: {'pass' if th['passed'] else 'FAIL'}"]
    return "\n".join(lines)


def _num(v: float | None, spec: str) -> str:
    """``v`` formatted by ``spec`` ("10.3e", ".6g"), or "non-finite" at the same width."""
    if v is not None:
        return format(v, spec)
    width = spec.split(".")[0]
    return "non-finite".rjust(int(width)) if width else "non-finite"


def _fmt_counts(c: Mapping[str, int]) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(c.items())) or "-"
