"""One pipeline for every rewriting command: plan units from headers, read → transform → write.

How a command plugs in:

1. Resolve the model side once (config, inventory, precision plan, key mapping) and plan its
   **units** from headers only: :class:`Unit` (``key``, ``where`` for progress, bytes read and
   written, the output ``pieces`` it produces, and the command's own ``data``).
   :func:`release_units` (over :func:`dense_units` / :func:`stack_units`) plans the usual ones for HF outputs.
2. Write a **transform** ``unit -> {tensor name: rows}``: it reads the unit's input (positioned
   reads), decodes / re-encodes / renames / slices on :attr:`Executor.device` and returns its
   tensors (the HF writer takes GPU ones and brings them down piece by piece; a storage writer that
   serializes wants CPU ones). It must not write: it runs on worker threads, ahead of the writes.
3. Hand both to an :class:`Executor` built from :class:`Options` (``--device``, ``--slice-mb``,
   ``--workers``): :func:`write_hf` publishes an HF checkpoint (atomic, resumable per piece,
   ranks owning whole shard files); other outputs call :meth:`Executor.run` (or
   :meth:`Executor.map` for a storage writer that pulls items, as the torch_dist writer does)
   inside :func:`run_staged`, which coordinates the ranks around one staging folder.

The executor owns the device (CUDA streams per worker, a GPU out-of-memory as one line naming
``--slice-mb``), the worker threads (bounded in-flight units, results written in plan order so
the bytes never depend on the schedule), the progress bar (bytes and "layer k of N") and the
per-rank stats behind the closing line and ``--json``'s ``"ranks"`` (:class:`Result`).
"""

from .device import DEVICES, device_kind, oom_as_error, resolve_device
from .estimate import estimate
from .executor import DEFAULT_MEMORY_BYTES, DEFAULT_SLICE_BYTES, Executor, Options, RankStats, Unit, cores, share_cores
from .hf_out import piece_bytes, write_hf
from .publish import Outcome, Stage, run_staged
from .report import Result, gb
from .units import dense_units, expert_slice, expert_slices, read_on_device, release_units, stack_units, where_of
from .world import World, all_ok, assign, broadcast, current_world, gather, launched_ranks, local_ranks, torchrun

__all__ = [
    "DEVICES", "DEFAULT_MEMORY_BYTES", "DEFAULT_SLICE_BYTES", "Executor", "Options", "Outcome", "RankStats", "Result", "Stage", "Unit", "World",
    "all_ok", "assign", "device_kind", "estimate", "broadcast", "cores", "current_world", "dense_units", "expert_slice", "expert_slices", "gather", "gb",
    "launched_ranks", "local_ranks", "oom_as_error", "piece_bytes", "read_on_device", "release_units", "resolve_device", "run_staged", "share_cores", "stack_units",
    "torchrun", "where_of", "write_hf",
]
