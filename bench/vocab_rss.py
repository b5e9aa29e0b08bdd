"""Peak RSS of the rewriting commands on a checkpoint with the real-size vocabulary.

The release's ``embed`` and ``unembed`` are 201024 x 4608 BF16 (1.85 GB each): the largest
non-expert tensors, bigger than the 1 GiB RSS target. This builds a one-layer ``wide``
fixture (real 2304 x 4608 experts, ``--experts`` of them) whose vocabulary is the release's,
then runs each command in its own process from a settled page cache and reports its seconds
and peak RSS (the step's largest process), beside the checkpoint's largest tensor.

Example (a few minutes on 2 cores, ~4 GB per output):

    python bench/vocab_rss.py --work /tmp/vocab-rss
    python bench/vocab_rss.py --work /tmp/vocab-rss --commands hf-to-megatron megatron-to-hf --code /other/checkout
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pipeline as bp  # noqa: E402  (bench/pipeline.py: measured)

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ("hf-to-megatron", "megatron-to-hf", "quantize", "dequantize")
VOCAB, UNPADDED = 201024, 200058  # the release's (shared/spec/inkling2.md)


def make_fixture(dst: Path, experts: int, code: Path) -> None:
    """A ``wide`` BF16 fixture of one layer with the release's vocabulary (one process, unless it exists)."""
    if dst.exists():
        return
    script = (
        "import sys\n"
        "from inkling_ckpt.model import presets\n"
        "text, vision, period, plan = presets.PRESETS['wide']\n"
        f"presets.PRESETS['wide'] = (dict(text, vocab_size={VOCAB}, unpadded_vocab_size={UNPADDED}), vision, period, plan)\n"
        "from inkling_ckpt import api\n"
        f"api.make_fixture({str(dst)!r}, size='wide', layers=1, experts={experts}, max_shard_size='5GB')\n"
    )
    bp.measured([sys.executable, "-c", script], code)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, required=True, help="Scratch folder (fixture + one output at a time).")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--commands", nargs="+", default=list(COMMANDS), choices=COMMANDS)
    ap.add_argument("--code", type=Path, default=ROOT, help="Checkout whose inkling_ckpt runs the steps.")
    ap.add_argument("--json", type=Path, help="Write the figures here too.")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    args.work = args.work.resolve()
    args.code = args.code.resolve()
    bf16, mg, mixed = args.work / "vocab-bf16", args.work / "vocab-megatron", args.work / "vocab-mixed"
    make_fixture(bf16, args.experts, args.code)
    cli = [sys.executable, "-m", "inkling_ckpt"]
    steps = {
        "hf-to-megatron": ([*cli, "convert", "hf-to-megatron", str(bf16), str(mg)], (bf16,)),
        "megatron-to-hf": ([*cli, "convert", "megatron-to-hf", str(mg), str(args.work / "back"), "--reference",
                            str(bf16)], (mg, bf16)),
        "quantize": ([*cli, "quantize", str(bf16), str(mixed), "--plan", "mxfp8"], (bf16,)),
        "dequantize": ([*cli, "dequantize", str(mixed), str(args.work / "deq")], (mixed,)),
    }
    needs = {"megatron-to-hf": "hf-to-megatron", "dequantize": "quantize"}
    order = [c for c in COMMANDS if c in args.commands or any(needs.get(o) == c for o in args.commands)]
    figures = {}
    for name in order:
        cmd, inputs = steps[name]
        out = Path(cmd[cmd.index(str(inputs[0])) + 1])
        shutil.rmtree(out, ignore_errors=True)
        m = bp.measured([*cmd, "-q", "--device", "cpu"], args.code, *inputs)
        if name in args.commands:
            figures[name] = {"seconds": round(m["seconds"], 1), "peak_rss_mib": round(m["peak_rss"] / 2**20)}
            print(f"{name:15s} {m['seconds']:6.1f} s  peak RSS {m['peak_rss'] / 2**20:6.0f} MiB", flush=True)
    for p in (args.work / "back", args.work / "deq"):
        shutil.rmtree(p, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
