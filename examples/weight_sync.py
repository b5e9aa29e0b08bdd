"""Weight sync from a trainer's Megatron-named tensors to a served NVFP4/MXFP8 release checkpoint.

    python examples/weight_sync.py [SERVED_HF_DIR] [--scales keep|fresh] [--bucket-mib N] [--ep N]
                                   [--form stacked|grouped|sequential]

Stands in for a trainer: builds its Megatron tensors (``decoder.layers.…``, routed experts in
BF16) from the served checkpoint through the preset mapping (a real trainer has them in memory,
gathered over TP; with expert parallelism each rank holds its local experts and passes its
expert offset), pushes them through the sync API, prints the buckets an engine would receive
(release names: ``model.llm.layers.{i}.mlp.experts.w13_weight`` and its parts, one load group
per layer slice), and verifies every emitted tensor against the served checkpoint byte for byte
(sha256 per tensor; an EP rank's slice against the matching rows).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from inkling_ckpt.layouts.hf import HFCheckpoint
from inkling_ckpt.sync import EXPERT_NAME_FORMS, WeightSync, trainer_tensors, verify

HERE = Path(__file__).resolve().parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("served", nargs="?", default=str(HERE.parent / "fixtures" / "tiny-mixed"))
    ap.add_argument("--scales", default="keep", choices=["keep", "fresh"])
    ap.add_argument("--bucket-mib", type=float, default=512)
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel ranks to simulate")
    ap.add_argument("--form", default="stacked", choices=list(EXPERT_NAME_FORMS),
                    help="how the trainer names its experts (stacked checkpoint key, TEGroupedMLP, SequentialMLP)")
    args = ap.parse_args(argv)

    served = HFCheckpoint.open(args.served)
    E = served.cfg.n_routed_experts
    ok = True
    for rank in range(args.ep):
        lo, hi = rank * E // args.ep, (rank + 1) * E // args.ep
        # non-expert tensors are sent once (rank 0); each rank sends its own experts
        select = "all" if rank == 0 else "experts"
        sync = WeightSync.from_checkpoint(served, scales=args.scales, bucket_bytes=int(args.bucket_mib * 2**20),
                                          select=select)
        held = (("module.module." + k, t) for k, t in trainer_tensors(served, experts=(lo, hi), form=args.form,
                                                                         select=select))
        buckets = []
        for i, bucket in enumerate(sync.buckets(held, expert_offset=lo, local_experts=hi - lo)):
            print(f"rank {rank} bucket {i}: {len(bucket)} tensors in {len(bucket.groups)} load groups, "
                  f"{bucket.nbytes / 2**20:.2f} MiB")
            # engine.update_weights_from_tensor(bucket.named_tensors)   <- the transport is the caller's
            buckets.append(bucket)
        report = verify(buckets, served, expected=sync.expected_names())
        print(f"rank {rank} (experts {lo}-{hi - 1}) against {args.served}: {report.summary()}")
        ok = ok and report.ok
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
