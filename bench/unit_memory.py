"""What a command's units really hold on the host, against what the memory budget charges them.

Runs one ``inkling-ckpt`` command line in this process with one worker (``--workers 1``: units one
at a time on the calling thread), and around each unit's transform resets the process's peak RSS
(``/proc/self/clear_refs``) and reads it back (``VmHWM``): the unit's peak over the size it started
at, beside its charge (``Unit.memory``: what the executor's budget counts while it runs). Linux only.

    python bench/unit_memory.py quantize BF16 OUT --plan nvfp4
    python bench/unit_memory.py convert megatron-to-hf MG OUT --reference MIXED

Prints, per kind of unit (dense tensors; expert slices by their stack's output format), how many
ran, the charge, the measured peak (the largest, and the median after the first unit of the kind,
which also grows the heap once), and the largest excess of peak over charge. A charge under the
peak is memory the budget does not see: with ``workers`` units in flight it adds up that many
times. The executor's own figure is the whole run's peak RSS; this is the per-unit split of it.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from inkling_ckpt.cli import app as cli_app  # noqa: E402
from inkling_ckpt.pipeline import executor as executor_module  # noqa: E402
from inkling_ckpt.pipeline.memory import resident_bytes  # noqa: E402
from inkling_ckpt.pipeline.units import expert_slice  # noqa: E402

MiB = 2**20


def _peak() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def _kind(unit: object) -> str:
    sl = expert_slice(unit) if isinstance(unit, executor_module.Unit) else None
    if sl is not None:
        return f"experts -> {sl[0].fmt}"
    step = getattr(getattr(unit, "data", None), "kind", None)  # lora merge: its own step kinds
    if isinstance(step, str):
        return f"merge {step}"
    return "dense" if isinstance(unit, executor_module.Unit) else type(unit).__name__


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return
    rows: list[tuple[str, int, int]] = []  # (kind, charge, peak over start)
    plain_map = executor_module.Executor.map

    def measured_map(self, units, transform, **kw):  # type: ignore[no-untyped-def]
        cost = kw.get("cost") or executor_module._memory

        def measured(unit):  # type: ignore[no-untyped-def]
            _reset_peak()
            before = resident_bytes()
            out = transform(unit)
            rows.append((_kind(unit), int(cost(unit)), _peak() - before))
            return out
        return plain_map(self, units, measured, **kw)

    executor_module.Executor.map = measured_map  # type: ignore[method-assign]
    args = list(argv) + (["--workers", "1"] if "--workers" not in argv else [])
    cli_app._huge_pages()
    cli_app._register()
    cli_app.app(args=args, standalone_mode=False)
    kinds: dict[str, list[tuple[int, int]]] = {}
    for kind, charge, peak in rows:
        kinds.setdefault(kind, []).append((charge, peak))
    print(f"{'units':24s} {'n':>5s} {'charge MiB':>11s} {'peak MiB':>9s} {'median':>7s} {'most over':>10s}")
    for kind, got in kinds.items():
        later = [p for _, p in got[1:]] or [got[0][1]]
        over = max(p - c for c, p in got)
        print(f"{kind:24s} {len(got):5d} {max(c for c, _ in got) / MiB:11.1f} {max(p for _, p in got) / MiB:9.1f} "
              f"{statistics.median(later) / MiB:7.1f} {over / MiB:10.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
