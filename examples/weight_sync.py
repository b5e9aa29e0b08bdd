"""Weight sync from a trainer's Megatron-named tensors to a served NVFP4/MXFP8 checkpoint.

    python examples/weight_sync.py [SERVED_HF_DIR] [--scales keep|fresh] [--bucket-mib N] [--ep N]

Stands in for a trainer: builds the Megatron tensors (``decoder.layers.…``) from the served
checkpoint itself through the name mapping (a real trainer has them in memory, gathered over
TP; with expert parallelism each rank holds its local experts and passes its expert offset),
pushes them through the sync API, prints the buckets an engine would receive, and verifies
every emitted tensor against the served checkpoint byte for byte (sha256 per tensor).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from inkling_ckpt.convert.megatron import logical_getter
from inkling_ckpt.layouts.hf import HFCheckpoint
from inkling_ckpt.model.mapping import InklingMapping
from inkling_ckpt.sync import WeightSync, verify

HERE = Path(__file__).resolve().parent


def trainer_tensors(served: HFCheckpoint, ep: int = 1, rank: int = 0):
    """(megatron_name, tensor) as one EP rank of a trainer would hold them (BF16)."""
    m = InklingMapping(served.cfg)
    get = logical_getter(served)  # routed experts decoded to BF16, as a trainer trains them
    E = served.cfg.n_routed_experts
    lo, hi = rank * E // ep, (rank + 1) * E // ep
    for key in m.megatron_keys():
        t = m.to_megatron(key, get)
        if m.entry(key).stacked:
            t = t[lo:hi]  # this rank's local experts
        yield "module.module." + key, t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("served", nargs="?", default=str(HERE.parent / "fixtures" / "tiny-mixed"))
    ap.add_argument("--scales", default="keep", choices=["keep", "fresh"])
    ap.add_argument("--bucket-mib", type=float, default=512)
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel ranks to simulate")
    args = ap.parse_args(argv)

    served = HFCheckpoint.open(args.served)
    sync = WeightSync.from_checkpoint(served, scales=args.scales, bucket_bytes=int(args.bucket_mib * 2**20))
    E = served.cfg.n_routed_experts
    emitted = []
    for rank in range(args.ep):
        offset = rank * E // args.ep
        # non-expert tensors are sent once (rank 0); each rank sends its own experts
        select = "all" if rank == 0 else "experts"
        rank_sync = sync if select == "all" else WeightSync.from_checkpoint(
            served, scales=args.scales, bucket_bytes=sync.bucket_bytes, select="experts")
        for i, bucket in enumerate(rank_sync.buckets(trainer_tensors(served, args.ep, rank), expert_offset=offset)):
            print(f"rank {rank} bucket {i}: {len(bucket)} tensors, {bucket.nbytes / 2**20:.2f} MiB")
            # engine.update_weights_from_tensor(bucket.named_tensors)   <- the transport is the caller's
            emitted.extend(bucket.named_tensors)
    report = verify(emitted, served, expected=sync.expected_names())
    print(f"verify against {args.served}: {report.summary()}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
