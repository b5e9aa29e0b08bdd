"""Release HF ⇄ Megatron ``torch_dist``: ``convert hf-to-megatron`` and ``convert megatron-to-hf``.

The key layout is a preset table (:mod:`inkling_ckpt.model.mapping`, default ``miles``).

hf-to-megatron streams: every stored chunk (one layer tensor, a row range of a big global one —
the embeddings —, or one expert of a layer's ``linear_fc1`` / ``linear_fc2``) is built only when
the storage writer asks for it, from the bytes it needs — an expert is read, decoded from its layer's format to BF16 and de-interleaved on
its own — so memory stays at a few chunks. Non-expert tensors keep their stored dtype. Under
``torchrun`` each rank takes a share of the conversion units (global tensors, each decoder layer)
and the ranks write one checkpoint collectively; file names depend on the unit, not the rank, so
the result is the one-process result.

megatron-to-hf reads chunk by chunk, undoes the mapping, re-encodes each layer's experts a few at
a time in the layer's format (plan and, with ``--scales keep``, NVFP4 amax and unchanged blocks
from the reference) and takes the vision tower and the configs from the reference HF checkpoint.

``common.pt`` keeps the source ``config.json`` (``inkling.config``) beside the preset and the source
plan, so the read-only commands open the folder with no ``--config`` (``layouts.torch_dist_release``).

Both run through :mod:`inkling_ckpt.pipeline` (``--device``, worker threads, ranks under
torchrun: hf-to-megatron's ranks split the conversion units, megatron-to-hf's own whole output
shards), publish atomically, skip a finished job unless forced and resume an interrupted one; in
the torch_dist folder ``metadata.json`` is written last.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .. import __version__
from ..errors import CheckpointError, PlanError
from ..layouts.megatron import (
    CONFIG_KEY, RELEASE, ChunkItem, ObjectItem, TorchDistCheckpoint, check_reference_config, common_state,
    empty_extra_state, finish_iteration_dir, stored_config, write_tracker,
)
from ..formats.stacked import UNQUANTIZED
from ..layouts.hf import DEFAULT_MAX_SHARD, reference_sharding
from ..layouts.torch_dist_release import check_same_model, check_torch_dist, dense_extents, dense_rows, mapping_for
from ..model.inventory import TensorSpec, expert_stacks, inventory, is_vision
from ..model.mapping import DEFAULT_PRESET, MegatronMapping, Preset, SKIPPED_PREFIXES
from ..model.precision import PrecisionPlan, dense_as
from ..model.quant_config import output_config
from ..pipeline import (
    Executor, Options, Result, Stage, Unit, World, assign, current_world, device_kind, estimate, expert_slice,
    read_on_device, release_units, run_staged, write_hf,
)
from ..pipeline.readahead import Extent
from .experts import ExpertEncoder, ScalePolicy, decode_slice, parts_extents
from .requantize import TensorSource, dense_reads, read_dense

log = logging.getLogger(__name__)


def assign_units(sizes: dict[str, int], world: World) -> dict[str, int]:
    """Unit → rank: largest first onto the least-loaded rank (deterministic)."""
    return assign(sizes, world.size)


# ---- hf-to-megatron -----------------------------------------------------------------------------


def plan_megatron(m: MegatronMapping) -> tuple[list[ChunkItem], list[ObjectItem], dict[str, int]]:
    """Every chunk and object of the output, each tagged with its unit number."""
    unit_no = {u: i for i, u in enumerate(m.units)}
    ranked: list[tuple[tuple[int, int, int, int], ChunkItem]] = []
    for pos, e in enumerate(m.entries()):
        for off, size in e.chunks():
            # Within a unit: the layer's tensors, then each expert stack expert by expert — the
            # order the release stores them, so reads run forward through the file.
            rank = (unit_no[e.unit], 1 if e.stacked else 0, pos, off[0] if off else 0)
            ranked.append((rank, ChunkItem(e.key, off, size, e.shape, e.dtype, unit_no[e.unit])))
    chunks = [c for _, c in sorted(ranked, key=lambda rc: rc[0])]
    payload = empty_extra_state()
    objects = [ObjectItem(o.key, unit_no[o.unit], payload) for o in m.extra_state()]
    return chunks, objects, unit_no


def source_mapping(src: TensorSource, preset: str | Preset = DEFAULT_PRESET) -> MegatronMapping:
    """The mapping of a release source (its own non-expert dtypes), checked against its tensors."""
    m = MegatronMapping(src.cfg, preset, dtypes=src.dtypes())
    m.check_hf(src.tensors, str(getattr(src, "root", "source")))
    return m


def check_expert_dtype(src: TensorSource, dtype: str | None) -> None:
    """Megatron holds routed experts in BF16: a source storing them unquantized in another dtype
    (F32, F16) needs ``dtype="bf16"`` (--dtype bf16), the explicit permission to round them."""
    if dtype not in (None, "bf16"):
        raise PlanError(f"--dtype {dtype}: a Megatron checkpoint holds routed experts in BF16; only --dtype bf16 "
                        "applies")
    wide = [i for i, f in enumerate(src.plan.formats) if f in UNQUANTIZED and f != "bf16"]
    if wide and dtype is None:
        raise PlanError(f"layer {wide[0]}'s routed experts are {src.plan.format_of(wide[0]).upper()}; a Megatron "
                        "checkpoint holds them in BF16, which rounds them (no silent casts): pass --dtype bf16")


def _validated_plan(src: TensorSource, preset: str | Preset, dtype: str | None = None):
    """Check the source against the mapping and plan its chunks; also the bytes of each unit.

    Shared by ``hf_to_megatron`` and its ``--dry-run`` so both validate and size alike.
    """
    check_expert_dtype(src, dtype)
    m = source_mapping(src, preset)
    chunks, objects, unit_no = plan_megatron(m)
    sizes: dict[str, int] = {}
    for c in chunks:
        sizes[m.units[c.unit]] = sizes.get(m.units[c.unit], 0) + c.nbytes
    return m, chunks, objects, unit_no, sizes


def chunk_producer(src: TensorSource, m: MegatronMapping, *, allow_nonfinite: bool = False,
                   device: torch.device | None = None) -> Callable[[ChunkItem], torch.Tensor]:
    """Builds one stored chunk from the source: a tensor as stored, or experts decoded to BF16 (on ``device``)."""
    stacks = {st.name: st for st in expert_stacks(src.cfg, src.plan)}

    def produce(item: ChunkItem) -> torch.Tensor:
        e = m.entry(item.key)
        if e.stacked:
            a = item.offsets[0]
            # BF16: a wider unquantized source was allowed to round by check_expert_dtype
            w = decode_slice(src, stacks[e.hf], a, a + item.sizes[0], allow_nonfinite=allow_nonfinite,
                             dtype=torch.bfloat16, device=device)
            return m.to_megatron(e.key, w)  # on a GPU written from there (megatron_writer)
        if tuple(item.sizes) == tuple(e.shape):
            return m.to_megatron(e.key, src.get(e.hf))
        a = item.offsets[0]  # a row range of a big tensor (the embeddings): only its rows are read
        return m.rows_to_megatron(e.key, src.read_rows(e.hf, a, a + item.sizes[0]), a)
    return produce


def describe_hf_to_megatron(src: TensorSource, *, preset: str | Preset = DEFAULT_PRESET, ranks: int = 1,
                            device: str = "auto", dtype: str | None = None) -> dict[str, Any]:
    """What ``hf-to-megatron`` would write, after validating the source (no output is touched),
    and how long it should take here (``estimate``: the bytes at this machine's measured rate)."""
    m, chunks, objects, _, sizes = _validated_plan(src, preset, dtype)
    owner = assign(sizes, ranks)
    read = sum(_unit_read_bytes(src, m).values())
    return {
        "estimate": estimate("hf-to-megatron", read, sum(c.nbytes for c in chunks), device_kind(device), ranks),
        "source": str(getattr(src, "root", "source")), "source_precision_plan": str(src.plan), "preset": m.preset.name,
        "tensors": len(m.keys()), "chunks": len(chunks), "extra_state_objects": len(objects),
        "bytes": sum(c.nbytes for c in chunks), "largest_chunk_bytes": max(c.nbytes for c in chunks),
        "vision_tensors_left_out": sum(1 for n in src.tensors if is_vision(n)),
        "units": {u: {"bytes": n, "rank": owner[u]} for u, n in sizes.items()},
    }


def _unit_read_bytes(src: TensorSource, m: MegatronMapping) -> dict[int, int]:
    """Source bytes each conversion unit reads (stacked experts: their stored parts)."""
    in_bytes = {st.name: st.stored_bytes for st in expert_stacks(src.cfg, src.plan)}
    tensors = getattr(src, "tensors", {})
    unit_no = {u: i for i, u in enumerate(m.units)}
    out: dict[int, int] = {}
    for e in m.entries():
        n = in_bytes[e.hf] if e.stacked else (tensors[e.hf].nbytes if e.hf in tensors else 0)
        out[unit_no[e.unit]] = out.get(unit_no[e.unit], 0) + n
    return out


def chunk_reads(src: TensorSource, m: MegatronMapping) -> Callable[[Any], list[Extent]]:
    """What :func:`chunk_producer` reads of ``src`` for an item (an object: nothing), for the executor's read-ahead."""
    stacks = {st.name: st for st in expert_stacks(src.cfg, src.plan)}

    def reads(item: Any) -> list[Extent]:
        if not isinstance(item, ChunkItem):
            return []
        e = m.entry(item.key)
        a = item.offsets[0] if item.offsets else 0
        if e.stacked:
            return parts_extents(src, stacks[e.hf], a, a + item.sizes[0])
        if tuple(item.sizes) == tuple(e.shape):
            return dense_reads(src, [(e.hf, 0, e.shape[0] if e.shape else 1)])
        return dense_reads(src, [(e.hf, a, a + item.sizes[0])])
    return reads


def hf_to_megatron(src: TensorSource, dst: str | Path, *, preset: str | Preset = DEFAULT_PRESET,
                   allow_nonfinite: bool = False, force: bool = False, progress: bool = True,
                   dtype: str | None = None, options: Options | None = None) -> Result:
    """Write ``src`` as a Megatron-Core torch_dist checkpoint at ``dst`` (collective under torchrun).

    ``dtype="bf16"``: round routed experts the source stores in F32/F16 to BF16 (else refused).
    """
    t0 = time.perf_counter()
    world = current_world()
    ex = Executor(options or Options(progress=progress), desc="hf-to-megatron", world=world)
    m, chunks, objects, unit_no, sizes = _validated_plan(src, preset, dtype)
    owner = assign(sizes, world.size)
    mine = {unit_no[u] for u, r in owner.items() if r == world.rank}
    my_chunks = [c for c in chunks if c.unit in mine]
    my_objects = [o for o in objects if o.unit in mine]
    read_of = _unit_read_bytes(src, m)
    unit_bytes = {unit_no[u]: n for u, n in sizes.items()}
    job = {"command": "hf-to-megatron", "source": src.describe(), "preset": m.preset.name, "dtype": dtype}
    produce = chunk_producer(src, m, allow_nonfinite=allow_nonfinite, device=ex.device)
    reads = chunk_reads(src, m)
    blob_bytes, blob_done = _blob_costs(src, m, ex.device.type)
    order = list(dict.fromkeys([c.key for c in chunks] + [o.key for o in objects]))
    layers = src.cfg.num_hidden_layers
    where = {unit_no[u]: _unit_where(m, u, layers) for u in m.units}

    def work(stage: Stage) -> None:
        from ..layouts.megatron_writer import write_dcp  # it imports DCP (seconds): only this command needs it

        folder = Path(stage.path) / RELEASE
        folder.mkdir(parents=True, exist_ok=True)
        total = sum(c.nbytes for c in my_chunks)
        seen: set[int] = set()
        with ex.progress(total) as bar:
            def written(n: int, unit: int, reused: bool) -> None:
                bar.advance(n, where[unit])
                if unit not in seen:  # a unit's read bytes once, when it starts
                    seen.add(unit)
                    if reused:
                        ex.stats.units_reused += 1
                        ex.stats.bytes_reused += unit_bytes[unit]
                    else:
                        ex.stats.units += 1
                        ex.stats.bytes_read += read_of.get(unit, 0)
                if not reused:
                    ex.stats.bytes_written += n
                    ex.stats.where = [ex.stats.where[0] if ex.stats.where else where[unit], where[unit]]
            write_dcp(folder, my_chunks, my_objects, produce, on_written=written, save_id=f"inkling-{__version__}",
                      key_order=order, map_items=lambda items, build: ex.map(items, build, cost=blob_bytes,
                                                                     done_cost=blob_done, extents=reads))

    def finish(stage: Stage, _: None) -> None:
        finish_iteration_dir(Path(stage.path) / RELEASE, common_state(
            inkling={"version": __version__, "preset": m.preset.name, "vocab_size": src.cfg.vocab_size,
                     "source_plan": str(src.plan), CONFIG_KEY: stored_config(src.config)}))
        write_tracker(Path(stage.path))

    outcome = run_staged(dst, job, world, work, finish, force=force)
    result = Result(Path(dst), skipped=outcome.skipped)
    if outcome.skipped:
        return result
    result.add_ranks(ex.finish(), seconds=time.perf_counter() - t0)
    result.tensors = len(m.keys())
    result.bytes = sum(c.nbytes for c in chunks)
    return result


Cost = Callable[[ChunkItem | ObjectItem], int]


def _blob_costs(src: TensorSource, m: MegatronMapping, device_type: str = "cpu") -> tuple[Cost, Cost]:
    """Host bytes a chunk or object holds in flight, for the executor's memory budget: while it is
    built, and once built, waiting for the writer.

    On the CPU an expert chunk holds its BF16 tensor (the serialized blob is a view of it) and,
    while built, the stored parts it is decoded from (a quarter to a half more: counting only the
    tensor left the H200 runs ~170 MiB over the budget). On a GPU the parts are read straight onto
    it and the chunk stays there until the writer brings it down through small pinned buffers: 1
    byte. A dense chunk holds its tensor; an object nothing.
    """
    on_host = device_type == "cpu"
    stored = {st.name: st.stored_bytes // max(1, st.shape[0]) for st in expert_stacks(src.cfg, src.plan)}
    per_expert = {e.key: stored[e.hf] for e in m.entries() if e.stacked}

    def cost(item: ChunkItem | ObjectItem) -> int:
        if not isinstance(item, ChunkItem):
            return 0
        if item.key not in per_expert:
            return item.nbytes
        return item.nbytes + per_expert[item.key] * item.sizes[0] if on_host else 1

    def done(item: ChunkItem | ObjectItem) -> int:
        if not isinstance(item, ChunkItem):
            return 0
        return item.nbytes if on_host or item.key not in per_expert else 1
    return cost, done


def _unit_where(m: MegatronMapping, unit: str, layers: int) -> str:
    layer = next((e.layer for e in m.entries() if e.unit == unit and e.layer is not None), None)
    return f"layer {layer + 1} of {layers}" if layer is not None else "embeddings and head"


# ---- megatron-to-hf -----------------------------------------------------------------------------


def _open_megatron(src: str | Path, reference: TensorSource, plan: PrecisionPlan | None, preset: str | Preset | None,
                   dtype: str | None = None):
    reader = TorchDistCheckpoint.open(src)
    cfg = reference.cfg
    reader.unstack_layers(cfg.num_hidden_layers)
    # the model size first, field by field; then any other config difference from the kept copy
    check_same_model(reader, cfg, str(reader.folder), "reference", str(getattr(reference, "root", "")))
    check_reference_config(reader.common, reference.config, str(reader.folder))
    plan = plan or reference.plan
    if len(plan) != cfg.num_hidden_layers:
        raise PlanError(f"the precision plan covers {len(plan)} layers, but the reference has {cfg.num_hidden_layers}")
    plan = dense_as(plan, PrecisionPlan.uniform("bf16", cfg.num_hidden_layers), dtype)  # Megatron experts: BF16
    m = mapping_for(reader, cfg, str(reader.folder), preset)  # None: the recorded or detected preset
    dtypes = check_torch_dist(reader, m)
    vision = reference.vision_specs() if hasattr(reference, "vision_specs") else []
    specs = inventory(cfg, plan, dtypes=dtypes, vision=vision)
    return reader, plan, m, specs


def describe_megatron_to_hf(src: str | Path, reference: TensorSource, *, plan: PrecisionPlan | None = None,
                            preset: str | Preset | None = None, ranks: int = 1, device: str = "auto",
                            dtype: str | None = None) -> dict[str, Any]:
    """What ``megatron-to-hf`` would write, after validating the checkpoint against the reference,
    and how long it should take here (``estimate``)."""
    reader, plan, m, specs = _open_megatron(src, reference, plan, preset, dtype)
    skipped = sorted(k for k in reader.keys if k.startswith(SKIPPED_PREFIXES))
    return {
        "estimate": estimate("megatron-to-hf", reader.data_bytes(), sum(s.nbytes for s in specs), device_kind(device),
                             ranks),
        "source": str(reader.folder), "preset": m.preset.name, "tensors_read": len(m.keys()),
        "skipped_keys": len(skipped), "objects_ignored": len(reader.objects), "precision_plan": str(plan),
        "output_tensors": len(specs), "output_bytes": sum(s.nbytes for s in specs),
        "vision_tensors_from_reference": sum(1 for s in specs if is_vision(s.name)),
    }


def megatron_to_hf(src: str | Path, dst: str | Path, reference: TensorSource, *, plan: PrecisionPlan | None = None,
                   scales: ScalePolicy = "keep", preset: str | Preset | None = None,
                   max_shard_size: int | str | None = None, allow_nonfinite: bool = False, force: bool = False,
                   progress: bool = True, dtype: str | None = None, options: Options | None = None) -> Result:
    """Write the torch_dist checkpoint ``src`` as a release checkpoint at ``dst`` in ``plan``'s formats.

    ``reference`` (the release the weights came from) gives the configs, the vision tower, the
    default plan and, with ``scales="keep"``, the NVFP4 amax and the bytes of unchanged blocks.
    ``preset``: the Megatron key layout; None reads it from ``common.pt`` or detects it from the keys.
    ``max_shard_size`` None: the reference's files and index when the output holds exactly its
    tensors (an untouched checkpoint comes back file for file), else 5GB shards. ``dtype``: the
    dtype of the layers the plan leaves unquantized (default the plan's; a rounding cast is refused).
    Under torchrun the ranks split the output shards and publish one checkpoint.
    """
    reader, plan, m, specs = _open_megatron(src, reference, plan, preset, dtype)
    cfg = reference.cfg
    encoder = ExpertEncoder(plan, scales=scales, reference=reference if scales == "keep" else None,
                            allow_nonfinite=allow_nonfinite)
    config = output_config(reference.config, cfg, plan)
    files = reference_sharding(reference, specs) if max_shard_size is None else None
    job = {"command": "megatron-to-hf", "source": reader.describe(), "reference": reference.describe(),
           "plan": str(plan), "scales": scales, "preset": m.preset.name, "dtype": dtype,
           "max_shard_size": "reference" if files is not None else str(max_shard_size or DEFAULT_MAX_SHARD),
           "allow_nonfinite": allow_nonfinite}
    ex = Executor(options or Options(progress=progress), desc="megatron-to-hf")
    units = _plan_to_hf(m, specs, plan, ex.slice_bytes, device_type=ex.device.type, reference_read=scales == "keep",
                        sources=[reader, reference] if scales == "keep" else [reader])
    return write_hf(ex, dst, job, specs, config, reference.extra_files(), units,
                    _to_hf_transform(reader, m, reference, encoder, ex), max_shard_size=max_shard_size or DEFAULT_MAX_SHARD,
                    files=files, force=force, extents=_to_hf_reads(reader, m, reference, encoder))


def _plan_to_hf(m: MegatronMapping, specs: list[TensorSpec], plan: PrecisionPlan, slice_bytes: int, *,
                device_type: str = "cpu", reference_read: bool = False, sources: Sequence[Any] = ()) -> list[Unit]:
    """Units in output order: dense tensors batched or cut in row slices of about ``slice_bytes`` (their
    rules map rows to rows; a slice reads only its rows), experts by slice (each reading its BF16
    torch_dist chunks).

    An expert slice's ``hold_bytes`` for the memory budget: on the CPU the stored slice
    twice (held while reordered to the HF layout, then its copy) and what it writes, with
    ``reference_read`` (``--scales keep``) the reference's stored slice too, the size of what it
    writes; on a GPU, where both are read straight onto it and the result is written from there,
    nothing (``read_on_device``, given the ``sources`` read).
    """
    stacks = {st.name: st for st in expert_stacks(m.cfg, plan)}
    bf16 = {e.hf: e.shape[0] * e.shape[1] * e.shape[2] * 2 for e in m.entries() if e.stacked}
    units = release_units(specs, stacks, slice_bytes, m.cfg.num_hidden_layers, stack_read_bytes=bf16)

    if device_type != "cpu":
        return read_on_device(units, device_type, sources)

    def hold(u: Unit) -> int:
        return 2 * u.read_bytes + (2 if reference_read else 1) * u.write_bytes
    return [dataclasses.replace(u, hold_bytes=hold(u)) if expert_slice(u) is not None else u for u in units]


def _to_hf_transform(reader: TorchDistCheckpoint, m: MegatronMapping, reference: TensorSource, encoder: ExpertEncoder,
                     ex: Executor) -> Callable[[Unit], dict[str, torch.Tensor]]:
    by_hf = {e.hf: e for e in m.entries()}

    def run(unit: Unit) -> dict[str, torch.Tensor]:
        sl = expert_slice(unit)
        if sl is not None:
            stack, a, b = sl
            e = by_hf[stack.name]
            # One expression: the stored slice is freed once reordered to the HF layout (a copy).
            # On a GPU the chunks go straight onto it (small pinned buffers, no host copy of the slice).
            w = m.to_hf(e.key, reader.read(e.key, (a, 0, 0), (b - a, *e.shape[1:]), device=ex.device))
            got = encoder.encode(stack, a, w)  # on a GPU written from there (read_on_device)
            return {stack.name + k: v for k, v in got.items()}
        out: dict[str, torch.Tensor] = {}
        for name, a, b in unit.pieces:
            if name in by_hf:
                out[name] = dense_rows(reader, m, by_hf[name].key, a, b)
            elif is_vision(name):  # the vision tower: from the reference, bit for bit
                out.update(read_dense(reference, [(name, a, b)]))
            else:
                raise CheckpointError(f"megatron-to-hf: nothing produces {name}")
        return out
    return run


def _to_hf_reads(reader: TorchDistCheckpoint, m: MegatronMapping, reference: TensorSource,
                 encoder: ExpertEncoder) -> Callable[[Unit], list[Extent]]:
    """What :func:`_to_hf_transform`'s units read (the torch_dist blobs, the kept reference parts, the
    vision tower), for the executor's read-ahead."""
    by_hf = {e.hf: e for e in m.entries()}

    def reads(unit: Unit) -> list[Extent]:
        sl = expert_slice(unit)
        if sl is not None:
            stack, a, b = sl
            e = by_hf[stack.name]
            return reader.extents(e.key, (a, 0, 0), (b - a, *e.shape[1:])) + encoder.reads(stack, a, b)
        out: list[Extent] = []
        for name, a, b in unit.pieces:
            if name in by_hf:
                out += dense_extents(reader, m, by_hf[name].key, a, b)
            else:  # the vision tower, from the reference
                out += dense_reads(reference, [(name, a, b)])
        return out
    return reads


__all__ = ["hf_to_megatron", "megatron_to_hf", "describe_hf_to_megatron", "describe_megatron_to_hf", "plan_megatron",
           "chunk_producer", "source_mapping", "check_torch_dist", "assign_units"]
