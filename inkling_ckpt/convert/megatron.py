"""Release HF ⇄ Megatron ``torch_dist``: ``convert hf-to-megatron`` and ``convert megatron-to-hf``.

The key layout is a preset table (:mod:`inkling_ckpt.model.mapping`, default ``miles``).

hf-to-megatron streams: every stored chunk (one layer tensor, or one expert of a layer's
``linear_fc1`` / ``linear_fc2``) is built only when the storage writer asks for it, from the
bytes it needs — an expert is read, decoded from its layer's format to BF16 and de-interleaved on
its own — so memory stays at a few chunks. Non-expert tensors keep their stored dtype. Under
``torchrun`` each rank takes a share of the conversion units (global tensors, each decoder layer)
and the ranks write one checkpoint collectively; file names depend on the unit, not the rank, so
the result is the one-process result.

megatron-to-hf reads chunk by chunk, undoes the mapping, re-encodes each layer's experts a few at
a time in the layer's format (plan and, with ``--scales keep``, NVFP4 amax and unchanged blocks
from the reference) and takes the vision tower and the configs from the reference HF checkpoint.

``common.pt`` keeps the source ``config.json`` (``inkling.config``) beside the preset and the source
plan, so the read-only commands open the folder with no ``--config`` (``layouts.torch_dist_release``).

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
from ..layouts.hf import DEFAULT_MAX_SHARD, DTYPE_TO_ST, HFWriter, reference_sharding
from ..layouts.megatron import (
    CONFIG_KEY, RELEASE, ChunkItem, ObjectItem, TorchDistCheckpoint, check_reference_config, common_state,
    empty_extra_state, finish_iteration_dir, stored_config, write_dcp, write_tracker,
)
from ..layouts.staging import Staging
from ..model.inventory import expert_stacks, inventory, is_vision
from ..model.mapping import DEFAULT_PRESET, MegatronMapping, Preset, SKIPPED_PREFIXES, stored_shape_ok
from ..formats.stacked import UNQUANTIZED
from ..model.precision import PrecisionPlan, dense_as
from ..model.quant_config import output_config
from ..progress import ByteProgress
from .experts import ExpertEncoder, ScalePolicy, decode_slice
from .requantize import Result, TensorSource, expert_slices, write_hf_checkpoint, write_slice

log = logging.getLogger(__name__)

#: BF16 expert bytes megatron-to-hf reads and re-encodes at once (at least one expert). A slice
#: is alive about four times over (assembled read, the next read ahead, interleaved, encoded).
SLICE_BYTES = 64 * 2**20

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


def plan_megatron(m: MegatronMapping) -> tuple[list[ChunkItem], list[ObjectItem], dict[str, int]]:
    """Every chunk and object of the output, each tagged with its unit number."""
    unit_no = {u: i for i, u in enumerate(m.units)}
    ranked: list[tuple[tuple[int, int, int, int], ChunkItem]] = []
    for pos, e in enumerate(m.entries()):
        for off, size in e.chunks():
            # Within a unit: the layer's tensors, then each expert stack expert by expert — the
            # order the release stores them, so reads run forward through the file.
            rank = (unit_no[e.unit], 1 if e.stacked else 0, pos, off[0] if e.stacked else 0)
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


def chunk_producer(src: TensorSource, m: MegatronMapping, *, allow_nonfinite: bool = False) -> Callable[[ChunkItem], torch.Tensor]:
    """Builds one stored chunk from the source: a tensor as stored, or experts decoded to BF16."""
    stacks = {st.name: st for st in expert_stacks(src.cfg, src.plan)}

    def produce(item: ChunkItem) -> torch.Tensor:
        e = m.entry(item.key)
        if e.stacked:
            a = item.offsets[0]
            # BF16: a wider unquantized source was allowed to round by check_expert_dtype
            w = decode_slice(src, stacks[e.hf], a, a + item.sizes[0], allow_nonfinite=allow_nonfinite,
                             dtype=torch.bfloat16)
            return m.to_megatron(e.key, w)
        return m.to_megatron(e.key, src.get(e.hf))
    return produce


def describe_hf_to_megatron(src: TensorSource, *, preset: str | Preset = DEFAULT_PRESET, ranks: int = 1,
                            dtype: str | None = None) -> dict[str, Any]:
    """What ``hf-to-megatron`` would write, after validating the source (no output is touched)."""
    m, chunks, objects, _, sizes = _validated_plan(src, preset, dtype)
    owner = assign_units(sizes, World(0, ranks))
    return {
        "source": str(getattr(src, "root", "source")), "source_precision_plan": str(src.plan), "preset": m.preset.name,
        "tensors": len(m.keys()), "chunks": len(chunks), "extra_state_objects": len(objects),
        "bytes": sum(c.nbytes for c in chunks), "largest_chunk_bytes": max(c.nbytes for c in chunks),
        "vision_tensors_left_out": sum(1 for n in src.tensors if is_vision(n)),
        "units": {u: {"bytes": n, "rank": owner[u]} for u, n in sizes.items()},
    }


def hf_to_megatron(src: TensorSource, dst: str | Path, *, preset: str | Preset = DEFAULT_PRESET,
                   allow_nonfinite: bool = False, force: bool = False, progress: bool = True,
                   dtype: str | None = None) -> Result:
    """Write ``src`` as a Megatron-Core torch_dist checkpoint at ``dst`` (collective under torchrun).

    ``dtype="bf16"``: round routed experts the source stores in F32/F16 to BF16 (else refused).
    """
    world = current_world()
    m, chunks, objects, unit_no, sizes = _validated_plan(src, preset, dtype)
    owner = assign_units(sizes, world)
    mine = {unit_no[u] for u, r in owner.items() if r == world.rank}
    my_chunks = [c for c in chunks if c.unit in mine]
    my_objects = [o for o in objects if o.unit in mine]
    job = {"command": "hf-to-megatron", "source": src.describe(), "preset": m.preset.name, "dtype": dtype}
    result = Result(Path(dst))
    produce = chunk_producer(src, m, allow_nonfinite=allow_nonfinite)

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
                        inkling={"version": __version__, "preset": m.preset.name, "vocab_size": src.cfg.vocab_size,
                                 "source_plan": str(src.plan), CONFIG_KEY: stored_config(src.config)}))
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
    result.tensors = len(m.keys())
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


def _open_megatron(src: str | Path, reference: TensorSource, plan: PrecisionPlan | None, preset: str | Preset | None,
                   dtype: str | None = None):
    from ..layouts.torch_dist_release import check_same_model, mapping_for

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
                            preset: str | Preset | None = None, dtype: str | None = None) -> dict[str, Any]:
    """What ``megatron-to-hf`` would write, after validating the checkpoint against the reference."""
    reader, plan, m, specs = _open_megatron(src, reference, plan, preset, dtype)
    skipped = sorted(k for k in reader.keys if k.startswith(SKIPPED_PREFIXES))
    return {
        "source": str(reader.folder), "preset": m.preset.name, "tensors_read": len(m.keys()),
        "skipped_keys": len(skipped), "objects_ignored": len(reader.objects), "precision_plan": str(plan),
        "output_tensors": len(specs), "output_bytes": sum(s.nbytes for s in specs),
        "vision_tensors_from_reference": sum(1 for s in specs if is_vision(s.name)),
    }


def megatron_to_hf(src: str | Path, dst: str | Path, reference: TensorSource, *, plan: PrecisionPlan | None = None,
                   scales: ScalePolicy = "keep", preset: str | Preset | None = None, max_shard_size: int | str | None = None,
                   allow_nonfinite: bool = False, force: bool = False, progress: bool = True,
                   dtype: str | None = None) -> Result:
    """Write the torch_dist checkpoint ``src`` as a release checkpoint at ``dst`` in ``plan``'s formats.

    ``reference`` (the release the weights came from) gives the configs, the vision tower, the
    default plan and, with ``scales="keep"``, the NVFP4 amax and the bytes of unchanged blocks.
    ``preset``: the Megatron key layout; None reads it from ``common.pt`` or detects it from the keys.
    ``max_shard_size`` None: the reference's files and index when the output holds exactly its
    tensors (an untouched checkpoint comes back file for file), else 5GB shards. ``dtype``: the
    dtype of the layers the plan leaves unquantized (default the plan's; a rounding cast is refused).
    """
    if current_world().distributed:
        raise PlanError("megatron-to-hf runs in one process; run it without torchrun")
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
    return write_hf_checkpoint(
        dst, job, specs, config, reference.extra_files(),
        lambda writer, advance: _stream_to_hf(reader, m, reference, writer, encoder, advance),
        max_shard_size=max_shard_size or DEFAULT_MAX_SHARD, force=force, progress=progress, desc="megatron-to-hf",
        files=files,
    )


def _stream_to_hf(reader: TorchDistCheckpoint, m: MegatronMapping, reference: TensorSource, writer: HFWriter,
                  encoder: ExpertEncoder, advance: Callable[[int], None]) -> None:
    for e in m.entries():
        if not e.stacked and writer.needed(e.hf):
            t = m.to_hf(e.key, reader.read(e.key))
            writer.write(e.hf, t.contiguous())
            advance(t.nbytes)
    stacks = {st.name: st for st in expert_stacks(m.cfg, encoder.plan)}
    jobs: list[tuple[Any, Any, int, int]] = []  # (entry, output stack, first expert, last)
    for e in m.entries():
        if not e.stacked:
            continue
        stack = stacks[e.hf]
        if any(writer.needed(p.name) for p in stack.parts()):
            jobs += [(e, stack, a, b) for a, b in expert_slices(stack, SLICE_BYTES)]

    def load(job: tuple[Any, Any, int, int]) -> dict[str, torch.Tensor]:
        # Read, re-interleave and encode in the read-ahead thread: the main thread only writes,
        # so the CPU work of one slice overlaps the I/O of the previous one.
        e, stack, a, b = job
        return encoder.encode(stack, a, m.to_hf(e.key, reader.read(e.key, (a, 0, 0), (b - a, *e.shape[1:]))))

    for (_, stack, a, b), parts in _read_ahead(jobs, load):
        write_slice(writer, stack, a, b, parts, advance)
    for name in writer.pending():  # the vision tower: from the reference, bit for bit
        if not is_vision(name):
            raise CheckpointError(f"megatron-to-hf: nothing produced {name}")
        t = reference.get(name)
        writer.write(name, t)
        advance(t.nbytes)


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


__all__ = ["hf_to_megatron", "megatron_to_hf", "describe_hf_to_megatron", "describe_megatron_to_hf", "plan_megatron",
           "chunk_producer", "source_mapping", "check_torch_dist", "assign_units"]
