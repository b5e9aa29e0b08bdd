"""Reading trainer adapter dumps and engine adapter folders; writing adapter folders atomically."""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ..errors import AdapterError, CheckpointError, ConfigError
from ..layouts.hf import DTYPE_TO_ST, read_header
from ..layouts.pread import TensorFile
from ..layouts.staging import Staging
from .manifest import MANIFEST_FILE, write_manifest
from .schema import ENGINE_WRAPPERS, SCHEMA, ModelDims, Schema, positive_number

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * torch.empty((), dtype=dtype).element_size()


def read_json(path: Path, what: str) -> Any:
    from ..layouts.paths import open_regular  # never a FIFO or a device: refused, not read

    try:
        with open_regular(path, limit=1 << 30) as f:
            return json.loads(f.read())
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read {what} ({e.strerror})") from None
    except ValueError:
        raise CheckpointError(f"{path}: {what} is not valid JSON") from None


def load_dims(path: str | Path) -> ModelDims:
    """Model dimensions from a release checkpoint folder or a ``config.json``."""
    p = Path(path)
    cfg = p / "config.json" if p.is_dir() else p
    if not cfg.is_file():
        raise ConfigError(f"{p}: no config.json")
    data = read_json(cfg, "config")
    if not isinstance(data, dict):
        raise ConfigError(f"{cfg}: expected a JSON object")
    return ModelDims.from_config(data)


# ---- trainer side ---------------------------------------------------------------------------


class TrainerSource:
    """A trainer's adapter parameters on disk: names, shapes and dtypes from headers, data lazily."""

    path: Path
    metadata: dict[str, str]

    def entries(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        raise NotImplementedError

    def read(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        return None

    @staticmethod
    def open(path: str | Path, num_layers: int | None = None) -> "TrainerSource":
        """A torch_dist checkpoint folder, a ``.safetensors`` file, or a folder of them.

        ``num_layers``: a torch_dist checkpoint saved with homogeneous (stacked) layers presents
        ``decoder.layers.<name>`` ``[L, …]`` as per-layer keys."""
        p = Path(path)
        if not p.exists():
            raise CheckpointError(f"{p}: no such file or folder")
        if p.is_file():
            return SafetensorsSource([p])
        from ..layouts.paths import inside

        files = [inside(p, f.name, str(p)) for f in sorted(p.glob("*.safetensors"))]
        if files:
            return SafetensorsSource(files)
        return TorchDistSource(p, num_layers)


class SafetensorsSource(TrainerSource):
    def __init__(self, files: list[Path]):
        self.path = files[0] if len(files) == 1 else files[0].parent
        self._where: dict[str, TensorFile] = {}
        self._entries: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        self.metadata = {}
        for f in files:
            tf = TensorFile(f)
            for name, (shape, dtype, _) in tf.entries.items():
                if name in self._where:
                    raise CheckpointError(f"{name}: in both {self._where[name].path.name} and {f.name}")
                self._where[name] = tf
                self._entries.append((name, shape, dtype))
            try:
                with safe_open(str(f), "pt") as h:  # header metadata only
                    self.metadata.update(h.metadata() or {})
            except SafetensorError as e:
                raise CheckpointError(f"{f}: not a safetensors file ({e})") from None

    def entries(self):
        return list(self._entries)

    def read(self, name: str) -> torch.Tensor:
        return self._where[name].read(name)

    def close(self) -> None:
        for tf in set(self._where.values()):
            tf.close()


class TorchDistSource(TrainerSource):
    def __init__(self, path: Path, num_layers: int | None = None):
        from ..layouts.megatron import TorchDistCheckpoint

        self.path = path
        self.ckpt = TorchDistCheckpoint.open(path)
        if num_layers is not None:
            self.ckpt.unstack_layers(num_layers)
        self.metadata = {}
        args = self.ckpt.common.get("args") if isinstance(self.ckpt.common, dict) else None
        alpha = getattr(args, "lora_alpha", None) if args is not None else None
        if isinstance(alpha, (int, float)):
            self.metadata["lora_alpha"] = str(alpha)

    def entries(self):
        return [(k, st.shape, st.dtype) for k, st in self.ckpt.keys.items()]

    def read(self, name: str) -> torch.Tensor:
        return self.ckpt.read(name)


# ---- engine side ----------------------------------------------------------------------------


def _st_header(entries: Sequence[tuple[str, tuple[int, ...], torch.dtype]], metadata: Mapping[str, str]):
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offsets: dict[str, int] = {}
    pos = 0
    for name, shape, dtype in entries:
        n = _nbytes(shape, dtype)
        header[name] = {"dtype": DTYPE_TO_ST[dtype], "shape": list(shape), "data_offsets": [pos, pos + n]}
        offsets[name] = pos
        pos += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob, offsets, pos


def write_adapter(st: Staging, config: Mapping[str, Any], planned: Sequence[tuple[str, tuple[int, ...], torch.dtype]],
                  tensors: Iterable[tuple[str, torch.Tensor]], *, on_written=None) -> dict[str, str]:
    """Write ``adapter_model.safetensors`` (planned names in order; data streamed tensor by tensor),
    the sha256 manifest and ``adapter_config.json`` into a staging folder. Returns the manifest."""
    from .manifest import tensor_sha256

    header, offsets, total = _st_header(planned, {"format": "pt"})
    spec = {n: (tuple(s), d) for n, s, d in planned}
    digests: dict[str, str] = {}
    path = st.partial(WEIGHTS_FILE)
    with open(path, "wb") as fh:
        fh.write(header)
        fh.truncate(len(header) + total)
        for name, t in tensors:
            want = spec.get(name)
            if want is None or name in digests:
                raise AdapterError(f"{name}: not planned, or produced twice")
            if (tuple(t.shape), t.dtype) != want:
                raise AdapterError(f"{name}: produced {t.dtype} {list(t.shape)}, planned {want[1]} {list(want[0])}")
            data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            fh.seek(len(header) + offsets[name])
            fh.write(memoryview(data))  # type: ignore[arg-type]  # numpy types ndarray as a Buffer on 3.12+ only
            digests[name] = tensor_sha256(t)
            if on_written is not None:
                on_written(len(data))
    left = [n for n in spec if n not in digests]
    if left:
        raise AdapterError(f"{left[0]}: planned but never produced ({len(left)} such)")
    st.finish(WEIGHTS_FILE)
    write_manifest(st.path / MANIFEST_FILE, digests)
    (st.path / CONFIG_FILE).write_text(json.dumps(dict(config), indent=2) + "\n")
    return digests


@dataclass(frozen=True)
class AdapterTensor:
    name: str  # canonical engine name (wrapper prefix stripped)
    stored: str  # the name in the file
    shape: tuple[int, ...]
    dtype: torch.dtype


class Adapter:
    """An engine adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``), read lazily."""

    def __init__(self, root: Path, config: dict[str, Any], tensors: dict[str, AdapterTensor], schema: Schema = SCHEMA):
        self.root = root
        self.config = config
        self.tensors = tensors
        self.schema = schema
        self._h: TensorFile | None = None
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: str | Path) -> "Adapter":
        from ..layouts.paths import inside

        root = Path(path)
        # inside the folder (no link out), regular files (a FIFO would block): refused in one line
        cfg_path, weights = inside(root, CONFIG_FILE, str(root)), inside(root, WEIGHTS_FILE, str(root))
        if not cfg_path.is_file() or not weights.is_file():
            raise CheckpointError(f"{root}: not an adapter folder (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
        config = read_json(cfg_path, "adapter config")
        if not isinstance(config, dict) or str(config.get("peft_type", "")).upper() != "LORA":
            raise AdapterError(f"{cfg_path}: peft_type is {config.get('peft_type') if isinstance(config, dict) else None!r}, expected LORA")
        for k in ("r", "lora_alpha"):
            v = config.get(k)
            if not positive_number(v):
                raise AdapterError(f"{cfg_path}: {k} must be a positive finite number, got {v!r}")
        if not isinstance(config["r"], int):
            raise AdapterError(f"{cfg_path}: r must be an integer, got {config['r']!r}")
        if config.get("use_dora"):
            raise AdapterError(f"{cfg_path}: DoRA adapters are not supported")
        tensors: dict[str, AdapterTensor] = {}
        for stored, (shape, dtype, _) in read_header(weights).items():
            name = Schema._strip(stored, ENGINE_WRAPPERS)
            if name in tensors:
                raise AdapterError(f"{stored}: the same tensor as {tensors[name].stored}")
            tensors[name] = AdapterTensor(name, stored, shape, dtype)
        return cls(root, config, tensors)

    @property
    def rank(self) -> int:
        return int(self.config["r"])

    @property
    def scale(self) -> float:
        return float(self.config["lora_alpha"]) / self.rank

    def get(self, name: str) -> torch.Tensor:
        return self._file().read(self.tensors[name].stored)

    def get_rows(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo:hi`` of the first dimension (one expert of a stacked factor)."""
        return self._file().read(self.tensors[name].stored, lo, hi)

    def close(self) -> None:
        if self._h is not None:
            self._h.close()
            self._h = None

    def _file(self) -> TensorFile:
        with self._lock:  # the merge's workers read factors from several threads
            if self._h is None:
                self._h = TensorFile(self.root / WEIGHTS_FILE)
            return self._h

    def nbytes(self) -> int:
        return sum(_nbytes(t.shape, t.dtype) for t in self.tensors.values())
