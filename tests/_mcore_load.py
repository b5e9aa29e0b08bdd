"""Load one of our torch_dist checkpoints with real Megatron-Core and compare every value.

Run as a script (one process, or under torchrun for an expert-parallel view):
``python tests/_mcore_load.py load CKPT HF_SOURCE``; ``save`` instead has Megatron-Core write
CKPT itself from the same sharded state dict filled with the HF values (for testing our reader). It builds the sharded state dict the way
Megatron-Core's modules do for these keys (per-layer keys, ``ShardedTensor.from_rank_offsets``;
routed experts one ShardedTensor per expert with a prepended expert axis, ``linear_fc1`` split
into its gate and up halves as ``apply_swiglu_sharded_factory`` does; ``_extra_state`` as
``ShardedObject``\\ s), loads with ``dist_checkpointing.load`` under the default strictness and
checks each loaded tensor against the HF source computed here independently of our mapping
(experts decoded to BF16). Prints ``OK <n>`` on success.
"""

from __future__ import annotations

import os
import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main(mode: str, ckpt: str, hf: str) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    from inkling_ckpt.convert.megatron import logical_getter
    from inkling_ckpt.layouts.hf import HFCheckpoint
    from inkling_ckpt.model.mapping import InklingMapping, QKVInterleave, StackedExperts

    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:  # one process: an in-memory store, no port
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        else:  # torchrun
            dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    src = HFCheckpoint.open(hf)
    cfg = src.cfg
    get = logical_getter(src)
    m = InklingMapping(cfg)
    E = cfg.n_routed_experts
    per_rank = E // world  # expert parallel: this rank owns experts [rank*per_rank, (rank+1)*per_rank)
    sd: dict[str, object] = {}

    def data(want: torch.Tensor) -> torch.Tensor:
        """save: the values; load: an empty target of the Megatron dtype (the loader fills it)."""
        return want.clone() if mode == "save" else torch.zeros(want.shape, dtype=dtype)

    expected: dict[str, torch.Tensor] = {}
    for key in m.megatron_keys():
        rule = m.rule_for(key)
        dtype = m.megatron_dtype(key)
        if isinstance(rule, StackedExperts):
            for local in range(per_rank):
                e = rank * per_rank + local
                names = [p.format(layer=m.entry(key).idx["layer"], expert=e) for p in rule.hf]
                if len(names) == 2:  # fc1: gate rows then up rows, as the swiglu factory shards it
                    for half, name in enumerate(names):
                        sk = f"{key}#{e}.{half}"
                        expected[sk] = get(name)
                        sd[sk] = ShardedTensor.from_rank_offsets(key, data(expected[sk]), (0, e, E), (1, half, 2),
                                                                 replica_id=0, prepend_axis_num=1)
                else:
                    sk = f"{key}#{e}"
                    expected[sk] = get(names[0])
                    sd[sk] = ShardedTensor.from_rank_offsets(key, data(expected[sk]), (0, e, E),
                                                             replica_id=0, prepend_axis_num=1)
            continue
        vocab = key in ("embedding.word_embeddings.weight", "output_layer.weight")
        names = m.hf_inputs(key)
        if isinstance(rule, QKVInterleave):
            q, k, v = (get(n) for n in names)
            ng, d = cfg.num_key_value_heads, cfg.head_dim
            per = cfg.num_attention_heads // ng
            blocks = []
            for g in range(ng):  # [q heads of group g, k_g, v_g] for each query group
                blocks += [q[g * per * d:(g + 1) * per * d], k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]]
            expected[key] = torch.cat(blocks)
        elif len(names) == 2:  # dense fc1
            expected[key] = torch.cat([get(names[0]), get(names[1])])
        else:
            expected[key] = get(names[0])
        t = ShardedTensor.from_rank_offsets(key, data(expected[key]), replica_id=(0, 0, rank))
        if vocab:
            t.allow_shape_mismatch = True
        sd[key] = t
    for uk in m.extra_state_keys():
        base, shard = uk.split("/shard_")
        off, shp = shard.split("_")
        offsets, shape = tuple(int(x) for x in off.split(".")), tuple(int(x) for x in shp.split("."))
        expert_obj = ".experts.experts." in base
        if expert_obj and not (rank * per_rank <= offsets[0] < (rank + 1) * per_rank):
            continue  # another EP rank's expert
        payload = torch.empty(0, dtype=torch.uint8) if mode == "save" else None  # what TE's get_extra_state gives
        sd[uk] = ShardedObject(base, payload, shape, offsets, replica_id=0 if expert_obj else (0, 0, rank))
    if mode == "save":  # Megatron-Core writes the checkpoint itself (its save path needs a CUDA shim on CPU)
        if not torch.cuda.is_available():
            torch.cuda.synchronize = lambda *a, **k: None
            torch.cuda.current_device = lambda: "cpu"
        dist_checkpointing.save(sd, ckpt)
        print(f"SAVED rank {rank}/{world}")
        dist.destroy_process_group()
        return
    loaded = dist_checkpointing.load(sd, ckpt)
    bad = []
    for k, want in expected.items():
        got = loaded[k]
        if not torch.equal(got, want):
            bad.append(k)
    objs = [k for k in sd if "_extra_state" in k]
    for k in objs:
        v = loaded[k]
        if not (isinstance(v, torch.Tensor) and v.numel() == 0):
            bad.append(f"{k}={type(v).__name__}")
    content = dist_checkpointing.load_content_metadata(ckpt) if hasattr(dist_checkpointing, "load_content_metadata") else None
    if content is not None and not content.get("non_homogeneous_layers"):
        bad.append(f"content_metadata={content}")
    if bad:
        print(f"MISMATCH rank {rank}: {len(bad)} keys, first {bad[:5]}")
        sys.exit(1)
    print(f"OK {len(expected)} tensors {len(objs)} objects rank {rank}/{world}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
