"""Time finding the stored chunks one read of a torch_dist tensor meets, at the release's size.

A torch_dist expert weight holds one chunk per expert: 384 for a per-layer key, 48 x 384 for a
key saved with stacked ("homogeneous") layers. megatron-to-hf, verify and lora merge read it
expert by expert, so every read looks its chunks up. Printed per read: the reader's bisecting
index (:class:`inkling_ckpt.layouts.megatron._ChunkIndex`, its one-off build shown apart) beside
the baseline, a plain scan of every chunk, measured in the same run; and the check at open that
the key's chunks tile it (through the same index).

    python bench/chunk_index.py [--layers 48] [--experts 384]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from inkling_ckpt.layouts.megatron import StoredKey, _check_tiling, _overlapping  # noqa: E402


def _scan(key: StoredKey, off: tuple[int, ...], size: tuple[int, ...]) -> list:
    return [c for c in key.chunks
            if all(a < b + y and b < a + x for a, x, b, y in zip(off, size, c[0], c[1], strict=True))]


def _per_read(fn, regions) -> float:
    t = time.perf_counter()
    for off, size in regions:
        if not fn(off, size):
            raise SystemExit(f"no chunk found for {off}+{size}")
    return (time.perf_counter() - t) / len(regions)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=384)
    args = ap.parse_args()
    L, E, R, C = args.layers, args.experts, 4608, 2304
    cases = {
        "per-layer key": ((E, R, C), [((e, 0, 0), (1, R, C)) for e in range(E)]),
        "stacked key": ((L, E, R, C), [((i, e, 0, 0), (1, 1, R, C)) for i in range(L) for e in range(E)]),
    }
    for name, (shape, chunks) in cases.items():
        t = time.perf_counter()
        _check_tiling(Path("bench"), StoredKey("k", shape, torch.bfloat16, tuple(chunks)))  # at open, index built
        tiling = time.perf_counter() - t
        key = StoredKey("k", shape, torch.bfloat16, tuple((c, s) for c, s in chunks))
        regions = chunks[:: max(1, len(chunks) // 2000)]
        t = time.perf_counter()
        key.index  # noqa: B018  (built once per key, on its first read)
        build = time.perf_counter() - t
        idx = _per_read(lambda o, s, k=key: list(_overlapping(k, o, s)), regions)
        base = _per_read(lambda o, s, k=key: _scan(k, o, s), regions)
        print(f"{name} ({len(chunks)} chunks): index {idx * 1e6:.1f} us/read (built once in {build * 1e3:.0f} ms), "
              f"plain scan {base * 1e6:.0f} us/read: {base / idx:.0f}x; "
              f"{len(chunks)} reads: {idx * len(chunks):.2f} s vs {base * len(chunks):.1f} s; "
              f"tiling check at open {tiling * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
