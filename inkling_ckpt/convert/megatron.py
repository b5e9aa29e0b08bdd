"""HF ⇄ Megatron ``torch_dist``: ``convert hf-to-megatron`` and ``convert megatron-to-hf``.

hf-to-megatron streams: every stored chunk (a layer tensor, or one expert's ``linear_fc1`` /
``linear_fc2`` slice) is built from the HF tensors it needs only when the storage writer asks
for it — routed experts decoded from their layer's format to BF16 on the way — so memory stays
at a few tensors. Under ``torchrun`` each rank takes a share of the conversion units (global
tensors, each decoder layer, each MTP layer) and the ranks write one checkpoint collectively;
file names depend on the unit, not the rank, so the result is the one-process result.

megatron-to-hf reads chunk by chunk, undoes the mapping, re-encodes each expert in its layer's
format (plan and, with ``--scales keep``, NVFP4 scales from the reference) and takes the vision
tower and the configs from the reference HF checkpoint.

Both publish atomically (``layouts.staging``), skip a finished job unless forced and resume an
interrupted one; in the torch_dist folder ``metadata.json`` is written last.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from .. import __version__
from ..errors import CheckpointError, InklingError, PlanError
from ..layouts.hf import HFWriter
from ..layouts.megatron import (
    RELEASE, ChunkItem, ObjectItem, TorchDistCheckpoint, common_state, empty_extra_state, finish_iteration_dir,
    write_dcp, write_tracker,
)
from ..layouts.staging import Staging
from ..model.inventory import EXPERT_PROJS, ExpertLinear, expert_linears, inventory, module_layer
from ..model.mapping import InklingMapping, StackedExperts, unit_of_key
from ..model.precision import PrecisionPlan
from ..progress import ByteProgress
from .experts import ExpertEncoder, ScalePolicy, expert_module
from .requantize import Result, TensorSource, decode_linear, output_config, write_hf_checkpoint

log = logging.getLogger(__name__)


# ---- distributed helpers ------------------------------------------------------------------------


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @property
    def distributed(self) -> bool:
        return self.size > 1


def current_world() -> World:
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size())
    return World()


def _broadcast(obj: Any, world: World) -> Any:
    if not world.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_ok(err: BaseException | None, world: World) -> None:
    """Collective: raise on every rank when any rank failed (the first failing rank's message)."""
    if not world.distributed:
        if err is not None:
            raise err
        return
    msgs: list[Any] = [None] * world.size
    dist.all_gather_object(msgs, None if err is None else (type(err).__name__, str(err), isinstance(err, InklingError)))
    if err is not None:
        raise err
    for m in msgs:
        if m is not None:
            raise CheckpointError(f"another rank failed: {m[1]}") if m[2] else RuntimeError(f"another rank failed: {m[0]}: {m[1]}")


def assign_units(sizes: dict[str, int], world: World) -> dict[str, int]:
    """Unit → rank: largest first onto the least-loaded rank (deterministic)."""
    load = [0] * world.size
    owner: dict[str, int] = {}
    for unit, n in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])):
        r = min(range(world.size), key=lambda i: (load[i], i))
        owner[unit] = r
        load[r] += n
    return owner


# ---- hf-to-megatron -----------------------------------------------------------------------------


def logical_getter(src: TensorSource) -> Callable[[str], torch.Tensor]:
    """``get_hf`` over a source: routed experts decoded to their logical BF16 weight."""
    def get(name: str) -> torch.Tensor:
        if name.endswith(".weight"):
            hit = module_layer(name[: -len(".weight")])
            if hit is not None:
                layer, expert, proj = hit
                fmt = src.plan.format_of(layer)
                if fmt != "bf16":
                    cfg = src.cfg
                    I, H = cfg.moe_intermediate_size, cfg.hidden_size
                    shape = (H, I) if proj == "down_proj" else (I, H)
                    return decode_linear(src, ExpertLinear(name[: -len(".weight")], layer, expert, proj, shape, fmt))
        return src.get(name)
    return get


def logical_names(src: TensorSource) -> list[str]:
    """The source's text tensors as logical names (expert parts → ``<module>.weight``)."""
    out: dict[str, None] = {}
    for name in src.tensors:  # type: ignore[attr-defined]
        if name.startswith("model.visual."):
            continue
        module, _, _ = name.rpartition(".")
        if module_layer(module) is not None:
            out[module + ".weight"] = None
        else:
            out[name] = None
    return list(out)


def plan_megatron(m: InklingMapping) -> tuple[list[ChunkItem], list[ObjectItem], dict[str, int]]:
    """Every chunk and object of the output, each tagged with its unit number."""
    unit_no = {u: i for i, u in enumerate(m.units)}
    ranked: list[tuple[tuple[int, int, int, int], ChunkItem]] = []
    for pos, e in enumerate(m.entries()):
        for off, size in m.chunks(e.key):
            # Within a unit: the layer's tensors, then expert by expert (fc1 then fc2 of expert 0,
            # of expert 1, …) — the order an HF checkpoint stores gate/up/down, so reads run forward.
            rank = (unit_no[e.unit], 1, off[0], pos) if e.stacked else (unit_no[e.unit], 0, pos, 0)
            ranked.append((rank, ChunkItem(e.key, off, size, e.shape, e.rule.dtype, unit_no[e.unit])))
    chunks = [c for _, c in sorted(ranked, key=lambda rc: rc[0])]
    payload = empty_extra_state()
    objects = [ObjectItem(k, unit_no[unit_of_key(k)], payload) for k in m.extra_state_keys()]
    return chunks, objects, unit_no


def _validated_plan(src: TensorSource, pad_vocab_to_multiple: int | None):
    """Check the source against the mapping and plan its chunks; also the bytes of each unit.

    Shared by ``hf_to_megatron`` and its ``--dry-run`` so both validate and size alike.
    """
    m = InklingMapping(src.cfg, pad_vocab_to_multiple=pad_vocab_to_multiple)
    m.check_source(logical_names(src), str(getattr(src, "root", "source")))
    chunks, objects, unit_no = plan_megatron(m)
    sizes: dict[str, int] = {}
    for c in chunks:
        sizes[m.units[c.unit]] = sizes.get(m.units[c.unit], 0) + c.nbytes
    return m, chunks, objects, unit_no, sizes


def describe_hf_to_megatron(src: TensorSource, *, pad_vocab_to_multiple: int | None = None, ranks: int = 1) -> dict[str, Any]:
    """What ``hf-to-megatron`` would write, after validating the source (no output is touched)."""
    m, chunks, objects, _, sizes = _validated_plan(src, pad_vocab_to_multiple)
    owner = assign_units(sizes, World(0, ranks))
    return {
        "source": str(getattr(src, "root", "source")), "source_plan": str(src.plan),
        "tensors": len(m.megatron_keys()), "chunks": len(chunks), "extra_state_objects": len(objects),
        "bytes": sum(c.nbytes for c in chunks), "vocab_rows": m.vocab_rows,
        "largest_chunk_bytes": max(c.nbytes for c in chunks),
        "units": {u: {"bytes": n, "rank": owner[u]} for u, n in sizes.items()},
    }


def hf_to_megatron(src: TensorSource, dst: str | Path, *, pad_vocab_to_multiple: int | None = None,
                   force: bool = False, progress: bool = True) -> Result:
    """Write ``src`` as a Megatron-Core torch_dist checkpoint at ``dst`` (collective under torchrun)."""
    world = current_world()
    m, chunks, objects, unit_no, sizes = _validated_plan(src, pad_vocab_to_multiple)
    owner = assign_units(sizes, world)
    mine = {unit_no[u] for u, r in owner.items() if r == world.rank}
    my_chunks = [c for c in chunks if c.unit in mine]
    my_objects = [o for o in objects if o.unit in mine]
    job = {"command": "hf-to-megatron", "source": src.describe(), "vocab_rows": m.vocab_rows}
    result = Result(Path(dst))
    get_hf = logical_getter(src)

    def produce(item: ChunkItem) -> torch.Tensor:
        return m.build_chunk(item.key, item.offsets, item.sizes, get_hf)

    total = sum(c.nbytes for c in my_chunks)
    order = list(dict.fromkeys([c.key for c in chunks] + [o.key for o in objects]))
    # Collective points, in the same order on every rank: broadcast(status), all_ok(written),
    # all_ok(published). Rank 0 owns the staging folder and publishes.
    if world.rank == 0:
        written = False
        try:
            with ExitStack() as stack:
                try:
                    st = stack.enter_context(Staging(dst, job, force=force))
                except BaseException as e:
                    _broadcast({"error": str(e)}, world)
                    raise
                _broadcast({"done": st.done, "path": str(st.path)}, world)
                if st.done:
                    result.skipped = True
                else:
                    result.resumed = st.resumed
                    err = _write_share(Path(st.path) / RELEASE, my_chunks, my_objects, produce, total, progress, order)
                    _all_ok(err, world)  # every rank has written; .metadata is there
                    written = True
                    finish_iteration_dir(Path(st.path) / RELEASE, common_state(
                        inkling={"version": __version__, "vocab_size": src.cfg.vocab_size, "vocab_rows": m.vocab_rows,
                                 "source_plan": str(src.plan)}))
                    write_tracker(Path(st.path))
        except BaseException as e:
            if written:
                _all_ok(e, world)  # tell the others, who wait for the publish; re-raises here
            raise
        _all_ok(None, world)
    else:
        status = _broadcast(None, world)
        if "error" in status:
            raise CheckpointError(f"rank 0 could not start: {status['error']}")
        if status["done"]:
            result.skipped = True
        else:
            err = _write_share(Path(status["path"]) / RELEASE, my_chunks, my_objects, produce, total, False, order)
            _all_ok(err, world)
        _all_ok(None, world)
    if result.skipped:
        return result
    result.tensors = len(m.megatron_keys())
    result.bytes = sum(c.nbytes for c in chunks)
    return result


def _write_share(folder: Path, chunks: list[ChunkItem], objects: list[ObjectItem], produce: Callable[[ChunkItem], torch.Tensor],
                 total: int, progress: bool, order: list[str]) -> BaseException | None:
    """This rank's part of the collective DCP save; returns the error instead of raising it."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        with ByteProgress(total, desc="hf-to-megatron", enabled=progress) as bar:
            write_dcp(folder, chunks, objects, produce, on_written=bar.advance, save_id=f"inkling-{__version__}",
                      key_order=order)
    except (InklingError, OSError) as e:
        return e
    return None


# ---- megatron-to-hf -----------------------------------------------------------------------------


_SKIP_PREFIXES = ("optimizer.", "rng_state", "common_state")
_VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def check_torch_dist(reader: TorchDistCheckpoint, m: InklingMapping) -> None:
    """Every mapped key present at its global shape and dtype; no tensor left unconsumed.

    The two vocabulary tensors may carry any padding (Megatron pads the vocabulary); rows
    beyond the config's ``vocab_size`` are dropped on the way back.
    """
    where = str(reader.folder)
    keys = m.megatron_keys()
    for key in keys:
        st = reader.keys.get(key)
        if st is None:
            raise CheckpointError(f"{where}: missing tensor {key}")
        want = m.megatron_shape(key)
        if key in _VOCAB_KEYS:
            ok = len(st.shape) == 2 and st.shape[1] == want[1] and st.shape[0] >= m.cfg.vocab_size
            shown = f"[>= {m.cfg.vocab_size}, {want[1]}]"
        else:
            ok, shown = st.shape == want, str(list(want))
        if not ok:
            raise CheckpointError(f"{where}: {key} is {list(st.shape)}, the reference config says {shown}")
        if st.dtype != m.megatron_dtype(key):
            raise CheckpointError(f"{where}: {key} is {st.dtype}, expected {m.megatron_dtype(key)} (no implicit casts)")
    known = set(keys)
    extra = sorted(k for k in reader.keys if k not in known and not k.startswith(_SKIP_PREFIXES))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(f"{where}: no rule consumes tensor {extra[0]}{more}")


def describe_megatron_to_hf(src: str | Path, reference: TensorSource, *, plan: PrecisionPlan | None = None) -> dict[str, Any]:
    """What ``megatron-to-hf`` would write, after validating the checkpoint against the reference."""
    reader = TorchDistCheckpoint.open(src)
    reader.unstack_layers(reference.cfg.num_hidden_layers)
    plan = plan or reference.plan
    if len(plan) != reference.cfg.num_hidden_layers:
        raise PlanError(f"the precision plan covers {len(plan)} layers, but the reference has {reference.cfg.num_hidden_layers}")
    m = InklingMapping(reference.cfg)
    check_torch_dist(reader, m)
    specs = inventory(reference.cfg, plan)
    skipped = sorted(k for k in reader.keys if k.startswith(_SKIP_PREFIXES))
    return {
        "source": str(reader.folder), "tensors_read": len(m.megatron_keys()), "skipped_keys": len(skipped),
        "objects_ignored": len(reader.objects), "plan": str(plan), "output_tensors": len(specs),
        "output_bytes": sum(s.nbytes for s in specs),
        "vision_tensors_from_reference": sum(1 for s in specs if s.name.startswith("model.visual.")),
    }


def megatron_to_hf(src: str | Path, dst: str | Path, reference: TensorSource, *, plan: PrecisionPlan | None = None,
                   scales: ScalePolicy = "keep", max_shard_size: int | str = "5GB", allow_nonfinite: bool = False,
                   force: bool = False, progress: bool = True) -> Result:
    """Write the torch_dist checkpoint ``src`` as an HF checkpoint at ``dst`` in ``plan``'s precision."""
    if current_world().distributed:
        raise PlanError("megatron-to-hf runs in one process; run it without torchrun")
    reader = TorchDistCheckpoint.open(src)
    cfg = reference.cfg
    reader.unstack_layers(cfg.num_hidden_layers)
    plan = plan or reference.plan
    if len(plan) != cfg.num_hidden_layers:
        raise PlanError(f"the precision plan covers {len(plan)} layers, but the reference has {cfg.num_hidden_layers}")
    m = InklingMapping(cfg)
    check_torch_dist(reader, m)
    encoder = ExpertEncoder(plan, scales=scales, reference=reference if scales == "keep" or reference.plan.variant != "bf16" else None,
                            allow_nonfinite=allow_nonfinite)
    specs = inventory(cfg, plan)
    config, hf_quant = output_config(reference.config, cfg, plan)
    job = {"command": "megatron-to-hf", "source": reader.describe(), "reference": reference.describe(),
           "plan": str(plan), "scales": scales, "max_shard_size": str(max_shard_size), "allow_nonfinite": allow_nonfinite}
    sizes = {s.name: s.nbytes for s in specs}
    return write_hf_checkpoint(
        dst, job, specs, config, hf_quant, reference.extra_files(),
        lambda writer, advance: _stream_to_hf(reader, m, reference, writer, encoder, sizes, advance),
        encoder=encoder, plan=plan, max_shard_size=max_shard_size, force=force, progress=progress,
        desc="megatron-to-hf",
    )


def _stream_to_hf(reader: TorchDistCheckpoint, m: InklingMapping, reference: TensorSource, writer: HFWriter,
                  encoder: ExpertEncoder, sizes: dict[str, int], advance: Callable[[int], None]) -> None:
    def put(name: str, t: torch.Tensor) -> None:
        if writer.needed(name):
            writer.write(name, t)
            advance(sizes[name])

    cfg = m.cfg
    stacked: dict[int, dict[str, str]] = {}
    for e in m.entries():
        if isinstance(e.rule, StackedExperts):
            fc = "fc1" if len(e.rule.hf) == 2 else "fc2"
            stacked.setdefault(e.idx["layer"], {})[fc] = e.key
            continue
        outs = m.hf_inputs(e.key)
        if not any(writer.needed(n) for n in outs):
            continue
        for name, v in m.to_hf(e.key, reader.read(e.key)).items():
            put(name, v.contiguous())
    I, H = cfg.moe_intermediate_size, cfg.hidden_size
    todo: list[tuple[int, int]] = []
    for layer in range(cfg.num_hidden_layers):
        outputs: dict[int, list[str]] = {}
        for lin in expert_linears(cfg, encoder.plan, layer):
            outputs.setdefault(lin.expert, []).extend(s.name for s in lin.parts())
        todo += [(layer, e) for e in range(cfg.n_routed_experts) if any(writer.needed(n) for n in outputs[e])]

    def load(job: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        layer, expert = job
        keys = stacked[layer]
        return (reader.read(keys["fc1"], (expert, 0, 0), (1, 2 * I, H)),
                reader.read(keys["fc2"], (expert, 0, 0), (1, H, I)))

    for (layer, expert), (fc1, fc2) in _read_ahead(todo, load):
        keys = stacked[layer]
        logical = {**m.experts_to_hf(keys["fc1"], fc1, expert), **m.experts_to_hf(keys["fc2"], fc2, expert)}
        weights = {proj: logical[f"{expert_module(layer, expert, proj)}.weight"] for proj in EXPERT_PROJS}
        for name, t in encoder.encode(layer, expert, weights).items():
            put(name, t)
    for name in writer.pending():  # the vision tower: from the reference, bit for bit
        if not name.startswith("model.visual."):
            raise CheckpointError(f"megatron-to-hf: nothing produced {name}")
        put(name, reference.get(name))


def _read_ahead(jobs: list[Any], load: Callable[[Any], Any]) -> Iterator[tuple[Any, Any]]:
    """``(job, load(job))`` in order, loading the next job in a thread while the caller works on this one."""
    if not jobs:
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="inkling-read-ahead") as pool:
        pending = pool.submit(load, jobs[0])
        for i, job in enumerate(jobs):
            data = pending.result()
            if i + 1 < len(jobs):
                pending = pool.submit(load, jobs[i + 1])
            yield job, data
            del data


__all__ = ["hf_to_megatron", "megatron_to_hf", "describe_hf_to_megatron", "describe_megatron_to_hf", "plan_megatron", "logical_getter", "logical_names", "assign_units"]
