"""Every job of the toolkit as one function; the ``inkling-ckpt`` CLI is a thin layer over these.

Each function returns a JSON-ready report (a dict with a versioned ``schema`` key), the same
one the command prints with ``--json``. Writing jobs publish their output atomically, resume
when rerun, skip a finished job unless ``force``, and with ``dry_run=True`` validate the input
and say what they would write without creating anything. Sources may be local folders or hub
repo ids (``org/name`` or ``org/name@REV``; see :func:`hub_access` for a revision and token).

    import inkling_ckpt as ic
    ic.quantize("fixtures/tiny-bf16", "out/q", plan="0-1:nvfp4,2-3:mxfp8")
    ic.inspect("out/q")["precision_plan"]          # '0-1:nvfp4,2-3:mxfp8'

Report keys mean the same everywhere: ``source`` (the input read), ``output`` (the folder
written), ``precision_plan`` (per-layer expert formats), ``parallel_plan`` (tp/ep/moe_tp),
``status`` (``written``, ``resumed``, ``skipped`` or ``dry-run``), byte counts in bytes.
Failures raise :class:`~inkling_ckpt.errors.InklingError` subclasses.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from .errors import PlanError
from .layouts.hub import hub_access

if TYPE_CHECKING:
    from .model.precision import PrecisionPlan

__all__ = [
    "SCHEMA_VERSION", "schema", "hub_access",
    "quantize", "dequantize", "convert_hf_to_hf", "convert_hf_to_megatron", "convert_megatron_to_hf",
    "shard", "merge_shards", "verify_tensors", "verify_forward", "inspect", "memory",
    "lora_export", "lora_merge", "lora_inspect", "make_fixture",
]

SCHEMA_VERSION = 1
log = logging.getLogger(__name__)  # the CLI's -v shows these at INFO


def schema(name: str) -> str:
    """The versioned schema id of a report, e.g. ``inkling-ckpt/inspect/1``."""
    return f"inkling-ckpt/{name}/{SCHEMA_VERSION}"


def _status(result: Any) -> str:
    return "skipped" if result.skipped else "resumed" if getattr(result, "resumed", False) else "written"


def _job(command: str, result: Any, source: Any, **extra: Any) -> dict[str, Any]:
    """The report of a finished (or skipped) writing job."""
    log.info("%s: %s", command, _status(result))
    return {"schema": schema(command), "command": command, "source": _src(source),
            "output": str(result.dst if hasattr(result, "dst") else result.out), "status": _status(result), **extra}


def _src(source: Any) -> Any:
    """An input as reports name it: a path (a checkpoint's root), a list of them, or a synthetic source's description."""
    if isinstance(source, (list, tuple)):
        return [_src(s) for s in source]
    if isinstance(source, dict):
        return source
    return str(getattr(source, "root", source))


def _options(device: str, slice_mb: int, workers: int, progress: bool, memory_mb: int = 0) -> Any:
    """The pipeline options (``--device``, ``--slice-mb``, ``--workers``, ``--memory-mb``) of a rewriting job."""
    from .errors import DeviceError
    from .pipeline import DEVICES, Options

    if device not in DEVICES and not str(device).startswith("cuda:"):
        raise DeviceError(f"--device {device!r}: choose one of {', '.join(DEVICES)}")
    return Options(device=device, slice_bytes=int(slice_mb) * 2**20, workers=workers, progress=progress,
                   memory_bytes=int(memory_mb) * 2**20)


def _figures(result: Any) -> dict[str, Any]:
    """What the pipeline measured: seconds, bytes read/written/reused by a resume, and each rank's share."""
    if getattr(result, "skipped", False) or not hasattr(result, "ranks"):
        return {}
    d = result.as_dict()
    return {k: d[k] for k in ("seconds", "bytes_read", "bytes_written", "bytes_reused", "ranks")}


def _dry(command: str, source: Any, output: str | Path | None, **info: Any) -> dict[str, Any]:
    """The report of a dry run: what would be written, from a validated input; nothing is created."""
    log.info("%s: input validated; dry run, nothing written", command)
    return {"schema": schema(f"{command}-dry-run"), "command": command, "source": _src(source),
            "output": None if output is None else str(output), "status": "dry-run",
            "output_exists": output is not None and Path(output).exists(), **info}


def _plan(text: "str | PrecisionPlan", layers: int) -> "PrecisionPlan":
    from .model.precision import PrecisionPlan

    return text if isinstance(text, PrecisionPlan) else PrecisionPlan.parse(str(text), layers)


def _check_keep(plan: "PrecisionPlan", reference: Any, where: str) -> None:
    """Refuse ``scales="keep"`` when no target layer has scales to keep (a no-op that would look like a choice)."""
    layers = [i for i in range(len(plan)) if plan.format_of(i) != "bf16"
              and reference.plan.format_of(i) == plan.format_of(i)]
    if not layers:
        raise PlanError(f"--scales keep: {where} stores no layer in the format the plan gives it ({plan}; it holds "
                        f"{reference.plan}), so there are no scales to keep; use --scales fresh")


# ---- HF -> HF re-encoding -----------------------------------------------------------------------

def _requantize(command: str, src: Any, dst: str | Path, plan: "str | PrecisionPlan", *, scales: str,
                reference: Any, max_shard_size: int | str | None, allow_nonfinite: bool, force: bool, dry_run: bool,
                progress: bool, check_keep_in: str | None, dtype: str | None = None, device: str = "auto",
                slice_mb: int = 0, workers: int = 0, memory_mb: int = 0) -> dict[str, Any]:
    from .convert.experts import ExpertEncoder
    from .convert.requantize import describe_requantize, requantize
    from .layouts.hf import HFCheckpoint, parse_size
    from .layouts.paths import check_dst
    from .model.inventory import inventory
    from .model.precision import dense_as

    check_dst(dst, [s for s in (src, reference) if isinstance(s, (str, Path))])
    ckpt = src if hasattr(src, "cfg") else HFCheckpoint.open(src)
    ref = HFCheckpoint.open(reference) if isinstance(reference, (str, Path)) else reference
    p = dense_as(_plan(plan, ckpt.cfg.num_hidden_layers), ckpt.plan, dtype)
    log.info("%s: %s (%s) -> %s (%s), scales %s", command, ckpt.root, ckpt.plan, dst, p, scales)
    if scales == "keep" and check_keep_in is not None:
        _check_keep(p, ref if ref is not None else ckpt, check_keep_in if ref is None else str(reference))
    size = parse_size(max_shard_size) if max_shard_size is not None else None
    if dry_run:
        keep_ref = ref if ref is not None else (ckpt if scales == "keep" else None)
        ExpertEncoder(p, scales=scales, reference=keep_ref, allow_nonfinite=allow_nonfinite)  # type: ignore[arg-type]
        specs = inventory(ckpt.cfg, p, dtypes=ckpt.dtypes(), vision=ckpt.vision_specs())
        from .pipeline import launched_ranks

        est = describe_requantize(ckpt, p, command=command, device=device, ranks=launched_ranks())["estimate"]
        return _dry(command, ckpt, dst, source_precision_plan=str(ckpt.plan), precision_plan=str(p), scales=scales,
                    tensors=len(specs), bytes=sum(s.nbytes for s in specs), max_shard_size=size, estimate=est,
                    layers_by_format={f: sum(1 for i in range(len(p)) if p.format_of(i) == f)
                                      for f in p.used_formats()})
    result = requantize(ckpt, dst, p, scales=scales, reference=ref, max_shard_size=size,  # type: ignore[arg-type]
                        allow_nonfinite=allow_nonfinite, force=force, command=command, dtype=dtype,
                        options=_options(device, slice_mb, workers, progress, memory_mb))
    return _job(command, result, ckpt, precision_plan=str(p), tensors=result.tensors, bytes=result.bytes,
                notes=list(result.notes), **_figures(result))


def quantize(src: str | Path, dst: str | Path, plan: "str | PrecisionPlan", *, scales: str = "fresh",
             reference: str | Path | None = None, max_shard_size: int | str | None = None,
             allow_nonfinite: bool = False, force: bool = False, dry_run: bool = False, progress: bool = False,
             dtype: str | None = None, device: str = "auto", slice_mb: int = 0, workers: int = 0, memory_mb: int = 0) -> dict[str, Any]:
    """Quantize routed experts per layer (``plan``: ``0-39:nvfp4,40-47:mxfp8``, ``mxfp8``, …); the rest is copied.

    ``scales="keep"`` takes NVFP4 amax (and unchanged blocks' bytes) from ``reference``, or from
    ``src`` itself when it is quantized.
    """
    return _requantize("quantize", src, dst, plan, scales=scales, reference=reference,
                       max_shard_size=max_shard_size, allow_nonfinite=allow_nonfinite, force=force, dry_run=dry_run,
                       progress=progress, check_keep_in=str(src), dtype=dtype, device=device, slice_mb=slice_mb,
                       workers=workers, memory_mb=memory_mb)


def convert_hf_to_hf(src: str | Path, dst: str | Path, plan: "str | PrecisionPlan", *, scales: str = "fresh",
                     max_shard_size: int | str | None = None, allow_nonfinite: bool = False, force: bool = False,
                     dry_run: bool = False, progress: bool = False, dtype: str | None = None,
                     device: str = "auto", slice_mb: int = 0, workers: int = 0, memory_mb: int = 0) -> dict[str, Any]:
    """Re-encode routed experts under another precision plan (mixed → MXFP8, anything → BF16, …).

    ``scales="keep"`` keeps SRC's own NVFP4 scales for layers that stay in their format.
    """
    return _requantize("hf-to-hf", src, dst, plan, scales=scales, reference=None, max_shard_size=max_shard_size,
                       allow_nonfinite=allow_nonfinite, force=force, dry_run=dry_run, progress=progress,
                       check_keep_in=str(src), dtype=dtype, device=device, slice_mb=slice_mb, workers=workers, memory_mb=memory_mb)


def dequantize(src: str | Path, dst: str | Path, *, max_shard_size: int | str | None = None, force: bool = False,
               dry_run: bool = False, progress: bool = False, dtype: str | None = None,
               device: str = "auto", slice_mb: int = 0, workers: int = 0, memory_mb: int = 0) -> dict[str, Any]:
    """Decode every routed expert to BF16, or ``dtype`` (refused for a source already in it)."""
    from .layouts.hf import HFCheckpoint
    from .layouts.paths import check_dst
    from .model.precision import PrecisionPlan

    check_dst(dst, [src])
    ckpt = HFCheckpoint.open(src)
    target = PrecisionPlan.uniform(dtype or "bf16", ckpt.cfg.num_hidden_layers)
    if target == ckpt.plan:
        raise PlanError(f"{src} is already {ckpt.plan.variant.upper()}")
    return _requantize("dequantize", ckpt, dst, target,
                       scales="fresh", reference=None, max_shard_size=max_shard_size, allow_nonfinite=False,
                       force=force, dry_run=dry_run, progress=progress, check_keep_in=None, dtype=dtype, device=device,
                       slice_mb=slice_mb, workers=workers, memory_mb=memory_mb)


# ---- HF <-> Megatron ----------------------------------------------------------------------------

def convert_hf_to_megatron(src: str | Path, dst: str | Path, *, preset: str = "miles", allow_nonfinite: bool = False,
                           force: bool = False, dry_run: bool = False, progress: bool = False,
                           dtype: str | None = None, device: str = "auto", slice_mb: int = 0, workers: int = 0, memory_mb: int = 0) -> dict[str, Any]:
    """Write SRC as a Megatron-Core torch_dist checkpoint (collective when the caller runs under torchrun)."""
    import os

    from .convert.megatron import describe_hf_to_megatron, hf_to_megatron
    from .layouts.hf import HFCheckpoint
    from .layouts.paths import check_dst
    from .model.mapping import get_preset

    check_dst(dst, [src])
    ckpt = HFCheckpoint.open(src)
    log.info("hf-to-megatron: %s (%s) -> %s, preset %s", ckpt.root, ckpt.plan, dst, preset)
    if dry_run:
        info = describe_hf_to_megatron(ckpt, preset=get_preset(preset), ranks=int(os.environ.get("WORLD_SIZE", "1")),
                                       dtype=dtype, device=device)
        info.pop("source", None)
        return _dry("hf-to-megatron", ckpt, dst, **info)
    result = hf_to_megatron(ckpt, dst, preset=get_preset(preset), allow_nonfinite=allow_nonfinite, force=force,
                            dtype=dtype, options=_options(device, slice_mb, workers, progress, memory_mb))
    return _job("hf-to-megatron", result, ckpt, preset=get_preset(preset).name, tensors=result.tensors,
                bytes=result.bytes, notes=list(result.notes), **_figures(result))


def convert_megatron_to_hf(src: str | Path, dst: str | Path, reference: str | Path, *,
                           plan: "str | PrecisionPlan | None" = None, scales: str = "keep", preset: str | None = None,
                           max_shard_size: int | str | None = None, allow_nonfinite: bool = False, force: bool = False,
                           dry_run: bool = False, progress: bool = False, dtype: str | None = None,
                           device: str = "auto", slice_mb: int = 0, workers: int = 0, memory_mb: int = 0) -> dict[str, Any]:
    """Bring trained torch_dist weights back to the release layout in the served precision.

    ``reference`` (the release the weights came from) gives the configs, the vision tower, the
    default plan and, with ``scales="keep"``, the kept NVFP4 scales: an untouched checkpoint
    comes back byte for byte. With nothing to keep (e.g. a BF16 plan) every layer is encoded fresh.
    """
    from .convert.megatron import describe_megatron_to_hf, megatron_to_hf
    from .layouts.hf import HFCheckpoint, parse_size
    from .layouts.paths import check_dst
    from .model.mapping import get_preset

    check_dst(dst, [src, reference])
    ref = HFCheckpoint.open(reference)
    p = _plan(plan, ref.cfg.num_hidden_layers) if plan is not None else None
    log.info("megatron-to-hf: %s -> %s, reference %s, plan %s, scales %s, preset %s", src, dst, ref.root,
             p or ref.plan, scales, preset)
    notes = []
    if scales == "keep":
        target = p or ref.plan
        if not any(target.format_of(i) != "bf16" and ref.plan.format_of(i) == target.format_of(i)
                   for i in range(len(target))):
            notes.append(f"--scales keep: the reference stores no layer in the plan's format ({target}); "
                         "every layer is encoded fresh")
    if dry_run:
        from .pipeline import launched_ranks

        info = describe_megatron_to_hf(src, ref, plan=p, preset=get_preset(preset) if preset else None, dtype=dtype,
                                       ranks=launched_ranks(), device=device)
        info.pop("source", None)
        return _dry("megatron-to-hf", src, dst, reference=str(ref.root), scales=scales, notes=notes, **info)
    result = megatron_to_hf(src, dst, ref, plan=p, scales=scales,  # type: ignore[arg-type]
                            preset=get_preset(preset) if preset else None,
                            max_shard_size=parse_size(max_shard_size) if max_shard_size is not None else None,
                            allow_nonfinite=allow_nonfinite, force=force, dtype=dtype,
                            options=_options(device, slice_mb, workers, progress, memory_mb))
    return _job("megatron-to-hf", result, src, reference=str(ref.root), precision_plan=str(p or ref.plan),
                tensors=result.tensors, bytes=result.bytes, notes=notes + list(result.notes), **_figures(result))


# ---- TP/EP sharding -----------------------------------------------------------------------------

def shard(src: str | Path, dst: str | Path | None, *, tp: int, ep: int = 1, max_shard_size: int | str = "5GB",
          force: bool = False, dry_run: bool = False, progress: bool = False, variant: str | None = None,
          plan: "str | PrecisionPlan | None" = None, workers: int = 0, memory_mb: int = 0) -> dict[str, Any]:
    """Split an HF checkpoint into one folder per TP rank (experts EP-sliced); ``dry_run`` needs no ``dst``.

    A dry run also plans from a bare ``config.json`` (a folder holding only one, or a hub repo id:
    only its config is fetched) as ``variant`` (default mixed) or ``plan``, non-experts BF16.
    """
    from .layouts import sharded
    from .layouts.hf import HFCheckpoint, parse_size
    from .layouts.limits import MAX_RANKS, check_count
    from .layouts.paths import check_dst
    from .plan.memory import CATEGORIES, rank_memory

    check_count(tp, "--tp", MAX_RANKS)
    check_count(ep, "--ep", MAX_RANKS)
    if dst is not None:
        check_dst(dst, [src])
    if not dry_run and (variant is not None or plan is not None):
        raise PlanError("--variant/--plan plan a bare config.json with --dry-run; a checkpoint is split as it is stored")
    if dry_run:
        from .layouts.hf import fetch_config
        from .layouts.hub import split_repo_id

        where: Any = src
        if not Path(src).exists() and split_repo_id(str(src)) is not None:
            where = fetch_config(str(src))  # planning before a download: the config alone
        if Path(where).is_file() or _holds_weights(Path(where)) is None:
            cfg, prec, specs, _, note = _memory_inputs(where, variant if plan is not None else variant or "mixed",
                                                       plan, None, None)
            note = note.split(";")[0]  # shard has no --embed-dtype
        else:
            if variant is not None or plan is not None:
                raise PlanError(f"{src} holds weights: its precision plan is read from it (drop --variant/--plan)")
            ckpt = HFCheckpoint.open(src)
            cfg, prec, specs, note = ckpt.cfg, ckpt.plan, ckpt.expected(), "as stored (from the headers)"
        splan = sharded.ShardPlan.build(cfg, prec, tp, ep, specs)
        by_cat = dict.fromkeys(CATEGORIES, 0)
        for s in specs:
            by_cat[s.category.value] += s.nbytes
        from .pipeline import estimate, launched_ranks

        ranks = rank_memory(splan)
        est = estimate("shard", sum(by_cat.values()), sum(r["bytes"] for r in ranks), "cpu", launched_ranks())
        return _dry("shard", src, dst, variant=prec.variant, precision_plan=str(prec), dtypes=note,
                    **sharded.describe_plan(splan), ranks=ranks, checkpoint_bytes=sum(by_cat.values()),
                    checkpoint_bytes_by_category=by_cat, estimate=est)
    if dst is None:
        raise PlanError("shard needs DST (or dry_run)")
    res = sharded.shard(src, dst, tp, ep, max_shard_size=parse_size(max_shard_size), force=force, progress=progress,
                        options=_options("cpu", 64, workers, progress, memory_mb))
    return _job("shard", res, src, parallel_plan={"tp": tp, "ep": ep}, tensors=res.tensors,
                source_bytes=res.source_bytes, bytes=res.written_bytes, rank_bytes=list(res.rank_bytes),
                **_figures(res))


def merge_shards(src: str | Path, dst: str | Path, *, force: bool = False, dry_run: bool = False,
                 progress: bool = False, workers: int = 0, memory_mb: int = 0) -> dict[str, Any]:
    """Rebuild the original checkpoint of a sharded folder byte for byte (checksums verified; collective
    under torchrun: the ranks split the source files)."""
    from .layouts import sharded
    from .layouts.paths import check_dst

    check_dst(dst, [src])
    if dry_run:
        from .pipeline import estimate, launched_ranks

        sh = sharded.ShardedCheckpoint.open(src, verify_checksums=False)
        try:
            files = sh.manifest["source"]
            n = sum(int(f["bytes"]) for f in files.values())  # each piece is read once, from one rank
            return _dry("merge-shards", sh.root, dst, parallel_plan=dict(sh.manifest["plan"]), files=len(files),
                        bytes=n, estimate=estimate("shard-merge", n, n, "cpu", launched_ranks()))
        finally:
            sh.close()
    res = sharded.merge(src, dst, force=force, progress=progress, options=_options("cpu", 64, workers, progress, memory_mb))
    return _job("merge-shards", res, src, files=res.files, bytes=res.bytes, **_figures(res))


# ---- read-only reports --------------------------------------------------------------------------

def inspect(path: str | Path, *, config: str | Path | None = None) -> dict[str, Any]:
    """Variant, precision plan, tensors per layer and format, bytes — headers only; any layout."""
    from .layouts.detect import open_checkpoint
    from .verify.inspect import inspect_checkpoint

    src = open_checkpoint(path, config=config)
    try:
        return {"schema": schema("inspect"), **inspect_checkpoint(src)}
    finally:
        src.close()


def verify_tensors(a: str | Path, b: str | Path, *, min_sqnr: float | None = None, exact: bool = False,
                   config: str | Path | None = None, plot: str | Path | None = None, progress: bool = False,
                   device: str = "auto", slice_mb: int = 0, workers: int = 0, memory_mb: int = 0) -> dict[str, Any]:
    """Compare B against the reference A tensor by tensor after decoding (report schema ``verify``).

    Collective when the caller runs under torchrun: the ranks split the units, every rank returns
    the whole report (rank 0 draws ``plot``)."""
    from .pipeline import current_world
    from .verify.compare import build_report, compare, plot_report

    if min_sqnr is not None and not math.isfinite(min_sqnr):
        raise PlanError(f"--min-sqnr {min_sqnr}: must be a finite number of dB")
    options = _options(device, slice_mb, workers, progress, memory_mb)
    rep = build_report(compare(a, b, config=config, options=options), min_sqnr=min_sqnr, exact=exact)
    if plot is not None and current_world().rank == 0:
        plot_report(rep, plot)
    return rep


def verify_forward(a: str | Path, b: str | Path, *, tokens: str | Path | None = None, random: int | None = None,
                   batch: int = 2, seed: int = 0, device: str = "cpu", dtype: str = "auto",
                   max_kl: float | None = None, progress: bool = False, slice_mb: int = 0) -> dict[str, Any]:
    """Run both HF checkpoints through transformers' Inkling 2 model; KL, top-1 agreement, per-layer error.

    Routed experts run ``slice_mb`` MiB (BF16) of experts at a time, not a whole layer at once."""
    from .errors import ConfigError
    from .layouts.detect import HF, TORCH_DIST, detect_layout
    from .pipeline.executor import DEFAULT_SLICE_BYTES

    if tokens is not None and random is not None:
        raise ConfigError("give --tokens FILE or --random N, not both")
    # NaN would fail every run and a negative bound too (KL is never negative), after the whole
    # forward pass; inf is no threshold (leave --max-kl out)
    if max_kl is not None and not (math.isfinite(max_kl) and max_kl >= 0):
        raise ConfigError(f"--max-kl {max_kl}: must be a finite number >= 0 (KL is never negative)")
    for path in (a, b):
        kind = detect_layout(path)
        if kind != HF:
            back = "convert megatron-to-hf" if kind == TORCH_DIST else "shard --merge"
            raise ConfigError(f"{path}: a {kind} folder; --forward runs HF release checkpoints (compare it tensor by "
                              f"tensor without --forward, or make an HF checkpoint of it with {back})")
    from .verify.forward import _load_config, compare_forward, load_transformers, read_tokens

    tf = load_transformers()  # the one-line missing-extra error before anything else
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its load-time notices (e.g. kernel fallbacks) are not this report's
    ids = None
    if tokens is not None:
        ids = read_tokens(Path(tokens), vocab_size=int(_load_config(tf, a).get_text_config().vocab_size))
    elif random is None:
        random = 128
    if int(slice_mb) < 0:
        raise ConfigError(f"--slice-mb {slice_mb}: must be at least 1 (0: the default, 64)")
    return compare_forward(a, b, input_ids=ids, random=random, batch=batch, seed=seed, device=device, dtype=dtype,
                           slice_bytes=int(slice_mb) * 2**20 or DEFAULT_SLICE_BYTES,
                           max_kl=max_kl, progress=progress, tokens_label=str(tokens) if tokens else None)


def memory(source: str | Path, *, tp: int, ep: int = 1, variant: str | None = None,
           plan: "str | PrecisionPlan | None" = None, embed_dtype: str | None = None,
           gpus: Sequence[str] | None = None, gpu_memory: int | str | None = None, mem_fraction: float = 0.9,
           kv_dtype: str = "bf16", context: int | None = None, config: str | Path | None = None) -> dict[str, Any]:
    """Bytes per GPU by category under (tp, ep), whether it fits, and the KV-cache pool.

    ``source``: a checkpoint folder (read from its headers), or a bare ``config.json`` with
    ``variant`` (bf16, mixed, mxfp8, nvfp4) or ``plan``; ``embed_dtype`` ("bf16"/"f32") for a bare config.
    """
    from .layouts.hf import parse_size
    from .layouts.limits import MAX_RANKS, check_count
    from .plan.memory import memory_report

    check_count(tp, "--tp", MAX_RANKS)
    check_count(ep, "--ep", MAX_RANKS)
    cfg, prec, specs, where, note = _memory_inputs(source, variant, plan, embed_dtype, config)
    rep = memory_report(cfg, prec, specs, tp, ep, source=where, dtypes_note=note, gpus=gpus,
                        gpu_bytes=parse_size(gpu_memory) if gpu_memory else None,
                        mem_fraction=mem_fraction, kv_dtype=kv_dtype, context=context)
    return {"schema": schema("memory"), **rep}


_EMBED_DTYPES = ("bf16", "f32")


def _holds_weights(p: Path) -> str | None:
    """The layout of a checkpoint folder with weights (HF, sharded, torch_dist); None for a bare config."""
    from .layouts.detect import HF, detect_layout
    from .layouts.hf import INDEX
    from .layouts.hub import split_repo_id

    if not p.exists() and split_repo_id(str(p)) is not None:
        return HF  # a hub repo id: a release checkpoint
    if not p.is_dir():
        return None
    kind = detect_layout(p)
    if kind == HF and not ((p / INDEX).is_file() or any(p.glob("*.safetensors"))):
        return None  # a folder holding only a config.json
    return kind


def _memory_inputs(source: str | Path, variant: str | None, plan_text: "str | PrecisionPlan | None",
                   embed: str | None, config: str | Path | None) -> tuple[Any, Any, Any, str, str]:
    import torch

    from .errors import ConfigError
    from .layouts.detect import TORCH_DIST, open_checkpoint
    from .layouts.limits import check_config_bounds, config_from_dict
    from .model.config import read_json
    from .model.inventory import inventory, vision_specs
    from .model.presets import preset_plan
    from .plan.memory import bare_config_dtypes

    p = Path(source)
    kind = _holds_weights(p)
    if kind is not None:
        if variant is not None or plan_text is not None or embed is not None:
            raise PlanError(f"{source} holds weights: its precision plan and dtypes are read from it "
                            "(drop --variant/--plan/--embed-dtype)")
        # Validated against the tensor table from headers / metadata only (no tensor data, no checksums).
        ckpt = open_checkpoint(p, config=config, layout=kind)
        try:
            specs, note = ckpt.expected(), "as stored (from the headers)"
            if kind == TORCH_DIST:
                note = "as stored in torch_dist (from its metadata): routed experts BF16"
                if ckpt.cfg.vision is not None:
                    # Served, the model carries its vision tower; Megatron holds the text model only.
                    specs = specs + vision_specs(ckpt.cfg)
                    note += "; vision tower not stored there, counted from the config (BF16)"
            return ckpt.cfg, ckpt.plan, specs, str(ckpt.root), note
        finally:
            ckpt.close()
    if config is not None:
        raise PlanError("--config is for a torch_dist folder that keeps no config; a bare config.json is "
                        "CKPT_OR_CONFIG itself")
    config_path = p / "config.json" if p.is_dir() else p
    if not config_path.is_file():
        raise ConfigError(f"{source} is neither a checkpoint folder nor a config.json")
    raw = read_json(config_path)
    check_config_bounds(raw, config_path)
    cfg = config_from_dict(raw, config_path)
    n = cfg.num_hidden_layers
    if plan_text is not None and variant is not None:
        raise PlanError("give --variant or --plan, not both")
    if plan_text is not None:
        prec = _plan(plan_text, n)
    elif variant is not None:
        prec = _plan(preset_plan("full", variant, n), n)
    else:
        raise PlanError(f"{config_path} has no weights: say which checkpoint with --variant (bf16, mixed, mxfp8, "
                        f"nvfp4) or --plan (e.g. 0-39:nvfp4,40-47:mxfp8)")
    e = embed or "bf16"
    if e not in _EMBED_DTYPES:
        raise PlanError(f"--embed-dtype {e!r}: choose one of {', '.join(_EMBED_DTYPES)}")
    specs = inventory(cfg, prec, dtypes=bare_config_dtypes(inventory(cfg, prec),
                                                           torch.float32 if e == "f32" else torch.bfloat16))
    note = (f"assumed (bare config): every non-expert tensor BF16, embed/unembed {e.upper()}"
            + ("" if e == "f32" else "; --embed-dtype f32 for F32 embed/unembed"))
    return cfg, prec, specs, str(config_path), note


# ---- LoRA ---------------------------------------------------------------------------------------

def lora_export(src: str | Path, dst: str | Path, *, config: str | Path, alpha: float | None = None,
                cast: bool = False, target_modules: Any = "all-linear", force: bool = False, dry_run: bool = False,
                progress: bool = False) -> dict[str, Any]:
    """A trainer's LoRA factors (torch_dist folder or safetensors dump, Megatron-Bridge names) → the
    engine's PEFT adapter folder with its sha256 manifest; ``config`` is the base checkpoint or its config.json."""
    from .lora import export_adapter

    if isinstance(target_modules, str) and target_modules not in ("all-linear", "all"):
        target_modules = [s.strip() for s in target_modules.split(",") if s.strip()]
    if alpha is not None and float(alpha).is_integer():
        alpha = int(alpha)
    res = export_adapter(src, dst, config=config, alpha=alpha, cast=cast, target_modules=target_modules,
                         force=force, progress=progress, dry_run=dry_run)
    info = {"tensors": res.tensors, "bytes": res.bytes, "r": res.rank, "lora_alpha": res.alpha,
            "ignored_tensors": res.ignored}
    if dry_run:
        return _dry("lora-export", src, dst, **info)
    return _job("lora-export", res, src, **info)


def lora_merge(base: str | Path, adapter: str | Path, dst: str | Path, *, sqnr: bool = False, force: bool = False,
               dry_run: bool = False, progress: bool = False, device: str = "auto", slice_mb: int = 0,
               workers: int = 0, memory_mb: int = 0) -> dict[str, Any]:
    """The base release checkpoint with W + (alpha/r)·B·A, re-encoded per layer format with the base's scales
    (collective when the caller runs under torchrun: the ranks split the base's shard files)."""
    from .layouts.paths import check_dst
    from .lora import merge
    from .lora.merge import plan_merge

    if dry_run:
        from .pipeline import device_kind, estimate, launched_ranks

        check_dst(dst, [base, adapter])
        rows, base_bytes, adapter_bytes = plan_merge(base, adapter)
        # It reads the base and the adapter and writes a checkpoint the size of the base.
        est = estimate("lora-merge", base_bytes + adapter_bytes, base_bytes, device_kind(device), launched_ranks())
        return _dry("lora-merge", [base, adapter], dst, tensors=len(rows), bytes=sum(r["bytes"] for r in rows),
                    merged=rows, estimate=est)
    res = merge(base, adapter, dst, force=force, progress=progress, measure=sqnr,
                options=_options(device, slice_mb, workers, progress, memory_mb))
    return _job("lora-merge", res, [base, adapter], files=res.files, changed=list(res.changed),
                unchanged_experts=res.unchanged_experts, bytes=res.bytes, sqnr_db=dict(res.sqnr), **_figures(res))


def lora_inspect(adapter: str | Path, *, verify: bool = False) -> dict[str, Any]:
    """Rank, alpha, modules per layer, bytes, shared-outer layout; ``verify`` rehashes against the manifest."""
    from .lora import inspect_adapter

    return {"schema": schema("lora-inspect"), **inspect_adapter(adapter, verify=verify)}


# ---- fixtures -----------------------------------------------------------------------------------

MAX_FIXTURE_LAYERS = 256  # synthetic checkpoints: far beyond any test, well below a hang
MAX_FIXTURE_EXPERTS = 4096


def make_fixture(dst: str | Path, *, variant: str = "bf16", size: str = "tiny", layers: int | None = None,
                 experts: int | None = None, max_shard_size: int | str = "2MB", lora: bool = False,
                 lora_rank: int = 8, lora_alpha: int = 16, seed: int | None = None, force: bool = False,
                 dry_run: bool = False, progress: bool = False) -> dict[str, Any]:
    """A deterministic Inkling-2-shaped release checkpoint with trained-looking weights.

    The quantized variants are exactly what ``quantize`` makes of the BF16 one. With ``lora``,
    ``dst`` is instead a trainer-side LoRA adapter dump for that fixture (Megatron-Bridge names,
    rank ``lora_rank``, ``lora_alpha`` in its metadata), the input of :func:`lora_export`.
    """
    from .convert.requantize import requantize
    from .layouts.hf import parse_size
    from .layouts.limits import check_count
    from .model.inventory import inventory
    from .model.presets import preset_plan
    from .model.synth import SEED, SynthSource

    check_count(layers, "--layers", MAX_FIXTURE_LAYERS)
    check_count(experts, "--experts", MAX_FIXTURE_EXPERTS)
    src = SynthSource(size, layers=layers, experts=experts, seed=SEED if seed is None else seed)
    if lora:
        from .lora.synth import write_trainer_dump

        res = write_trainer_dump(src.config, dst, rank=lora_rank, alpha=lora_alpha, seed=src.seed, force=force,
                                 dry_run=dry_run)
        if dry_run:
            return _dry("make-fixture", src.describe(), dst, lora=True, **res)
        return {"schema": schema("make-fixture"), "command": "make-fixture", "source": src.describe(),
                "output": str(dst), "lora": True, **res}
    plan = _plan(preset_plan(size, variant, src.cfg.num_hidden_layers), src.cfg.num_hidden_layers)
    if dry_run:
        from .layouts.paths import check_dst

        check_dst(dst, [])
        specs = inventory(src.cfg, plan, dtypes=src.dtypes(), vision=src.vision_specs())
        return _dry("make-fixture", src.describe(), dst, precision_plan=str(plan), tensors=len(specs),
                    bytes=sum(s.nbytes for s in specs))
    result = requantize(src, dst, plan, max_shard_size=parse_size(max_shard_size), force=force, progress=progress,
                        command="make-fixture")
    return _job("make-fixture", result, src.describe(), precision_plan=str(plan), tensors=result.tensors,
                bytes=result.bytes, notes=list(result.notes))

