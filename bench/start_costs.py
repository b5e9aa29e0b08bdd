"""Where a command's fixed cost goes: the imports and first calls every process pays once.

    python bench/start_costs.py

Prints the seconds of each step in order, in a fresh process: importing torch and the CLI, the
CUDA context and Triton (when a GPU is there), ``torch.distributed.checkpoint`` (hf-to-megatron
imports it to write ``.metadata``), and the first and second NVFP4 / MXFP8 calls (kernels loaded
from Triton's cache on the first). Run it twice: the first run may also fill that cache.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_t = time.perf_counter()


def lap(what: str) -> None:
    global _t
    now = time.perf_counter()
    print(f"{what:45s} {now - _t:6.2f} s", flush=True)
    _t = now


def main() -> None:
    import torch

    lap("import torch")
    import inkling_ckpt.cli  # noqa: F401

    lap("import inkling_ckpt.cli")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.empty(1, device=device)
        lap("CUDA context (first tensor)")
        from inkling_ckpt.formats.gpu import kernels_available

        kernels_available()
        lap("Triton (kernels_available)")
    import torch.distributed.checkpoint  # noqa: F401

    lap("import torch.distributed.checkpoint")
    from inkling_ckpt.formats.stacked import decode_stacked, encode_stacked

    w = torch.randn(2, 4608, 2304, device=device).to(torch.bfloat16)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    lap(f"random input on {device}")
    for n in ("first", "second"):
        p = encode_stacked("nvfp4", w)
        decode_stacked("nvfp4", p)
        sync()
        lap(f"{n} NVFP4 encode + decode ({device})")
        p = encode_stacked("mxfp8", w)
        decode_stacked("mxfp8", p)
        sync()
        lap(f"{n} MXFP8 encode + decode ({device})")


if __name__ == "__main__":
    main()
