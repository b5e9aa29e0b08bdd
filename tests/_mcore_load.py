"""Load one of our torch_dist checkpoints with real Megatron-Core and compare every value.

Run as a script (one process, or under torchrun for an expert-parallel view):
``python tests/_mcore_load.py load CKPT HF_SOURCE``; ``save`` instead has Megatron-Core write
CKPT itself from the same sharded state dict filled with the HF values (for testing our reader).
It builds the sharded state dict the way Megatron-Core's modules do for these keys (per-layer
keys, ``ShardedTensor.from_rank_offsets``; routed experts one ShardedTensor per expert with a
prepended expert axis, ``linear_fc1`` split into its gate and up halves as
``apply_swiglu_sharded_factory`` does; ``_extra_state`` as ``ShardedObject``\\ s), loads with
``dist_checkpointing.load`` under the default strictness and checks each loaded tensor against
the release source. The expected values come from the spec's ``miles`` table written out below,
not from the toolkit's mapping (experts decoded with the reference codec, then gate = w13[e, 0::2],
up = w13[e, 1::2]). Prints ``OK <n>`` on success.
"""

from __future__ import annotations

import os
import re
import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# shared/spec/megatron.md, preset ``miles``: release name -> Megatron key.
GLOBAL = {
    "model.llm.embed.weight": "embedding.word_embeddings.weight",
    "model.llm.embed_norm.weight": "embedding.embed_norm.weight",
    "model.llm.norm.weight": "decoder.final_layernorm.weight",
    "model.llm.attn_res.output_query": "decoder.output_res_query",
    "model.llm.unembed.weight": "output_layer.weight",
}
LAYER = {  # model.llm.layers.{i}.<hf> -> decoder.layers.{i}.<megatron>
    "attn_norm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "q_input_norm.weight": "self_attention.q_input_norm.weight",
    "k_input_norm.weight": "self_attention.k_input_norm.weight",
    "v_input_norm.weight": "self_attention.v_input_norm.weight",
    "attn.wq_du.weight": "self_attention.linear_qkv.weight.q",
    "attn.wk_dv.weight": "self_attention.linear_qkv.weight.k",
    "attn.wv_dv.weight": "self_attention.linear_qkv.weight.v",
    "attn.wr_du.weight": "self_attention.linear_qkv.weight.r",
    "attn.gate_attn.weight": "self_attention.linear_gate.weight",
    "attn.attn_sink_proj.weight": "self_attention.sink_proj.weight",
    "attn.wo_ud.weight": "self_attention.linear_proj.weight",
    "attn.q_l2_clip.scale": "self_attention.q_scale",
    "attn.rel_l2_clip.scale": "self_attention.rel_scale",
    "attn.rel_logits_proj.proj": "self_attention.rel_proj",
    "attn.k_sconv.weight": "self_attention.k_sconv.weight",
    "attn.v_sconv.weight": "self_attention.v_sconv.weight",
    "attn.k_sconv.static_w": "self_attention.k_sconv.static_weight",
    "attn.v_sconv.static_w": "self_attention.v_sconv.static_weight",
    "attn.k_sconv.weight_proj": "self_attention.k_sconv.weight_proj.weight",
    "attn.v_sconv.weight_proj": "self_attention.v_sconv.weight_proj.weight",
    "attn_sconv.weight": "self_attention.attn_sconv.weight",
    "mlp_norm.weight": "pre_mlp_layernorm.weight",
    "mlp.gate.weight": "mlp.router.weight",
    "mlp.gate.bias": "mlp.router.expert_bias",
    "mlp_sconv.weight": "mlp.mlp_sconv.weight",
}
EXPERTS = {"w13_weight": "linear_fc1", "w2_weight": "linear_fc2"}
TE_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "self_attention.linear_gate",
              "pre_mlp_layernorm")


def release_to_megatron(name: str) -> str:
    if name in GLOBAL:
        return GLOBAL[name]
    m = re.fullmatch(r"model\.llm\.attn_res\.attn_queries\.(\d+)", name)
    if m:  # attn_queries.{k} belongs to layer k+1
        return f"decoder.layers.{int(m.group(1)) + 1}.attn_res_query"
    m = re.fullmatch(r"model\.llm\.attn_res\.mlp_queries\.(\d+)", name)
    if m:
        return f"decoder.layers.{m.group(1)}.mlp_res_query"
    m = re.fullmatch(r"model\.llm\.layers\.(\d+)\.(.+)", name)
    return f"decoder.layers.{m.group(1)}.{LAYER[m.group(2)]}"


def main(mode: str, ckpt: str, hf: str) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    from inkling_ckpt.formats.stacked import decode_stacked
    from inkling_ckpt.layouts.hf import HFCheckpoint

    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:  # one process: an in-memory store, no port
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        else:  # torchrun
            dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    src = HFCheckpoint.open(hf)
    cfg = src.cfg
    E, L = cfg.n_routed_experts, cfg.num_hidden_layers
    per_rank = E // world  # expert parallel: this rank owns experts [rank*per_rank, (rank+1)*per_rank)
    sd: dict[str, object] = {}
    expected: dict[str, torch.Tensor] = {}

    def data(want: torch.Tensor) -> torch.Tensor:
        """save: the values; load: an empty target of the stored dtype (the loader fills it)."""
        return want.clone() if mode == "save" else torch.zeros(want.shape, dtype=want.dtype)

    experts: dict[tuple[int, str], str] = {}
    for name in src.tensors:
        if name.startswith("model.visual."):
            continue  # not part of the Megatron checkpoint
        m = re.fullmatch(r"model\.llm\.layers\.(\d+)\.mlp\.experts\.(w13_weight|w2_weight)(_.*)?", name)
        if m:
            experts[(int(m.group(1)), m.group(2))] = name[: m.end(2)]
            continue
        key = release_to_megatron(name)
        expected[key] = src.get(name)
        t = ShardedTensor.from_rank_offsets(key, data(expected[key]), replica_id=(0, 0, rank))
        if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            t.allow_shape_mismatch = True
        sd[key] = t
    for (layer, which), base in sorted(experts.items()):
        fmt = src.plan.format_of(layer)
        parts = {n[len(base):]: src.get(n) for n in src.tensors if n == base or n.startswith(base + "_")}
        w = decode_stacked(fmt, parts, torch.bfloat16)
        key = f"decoder.layers.{layer}.mlp.experts.experts.{EXPERTS[which]}.weight"
        for local in range(per_rank):
            e = rank * per_rank + local
            if which == "w13_weight":  # fc1: gate rows then up rows, as the swiglu factory shards it
                for half, rows in enumerate((w[e, 0::2], w[e, 1::2])):
                    sk = f"{key}#{e}.{half}"
                    expected[sk] = rows.contiguous()
                    sd[sk] = ShardedTensor.from_rank_offsets(key, data(expected[sk]), (0, e, E), (1, half, 2),
                                                             replica_id=0, prepend_axis_num=1)
            else:
                sk = f"{key}#{e}"
                expected[sk] = w[e].contiguous()
                sd[sk] = ShardedTensor.from_rank_offsets(key, data(expected[sk]), (0, e, E),
                                                         replica_id=0, prepend_axis_num=1)
    objects: list[tuple[str, tuple[int, ...], tuple[int, ...], bool]] = [
        ("embedding.embed_norm", (0,), (1,), False), ("decoder.final_layernorm", (0,), (1,), False)]
    for i in range(L):
        objects += [(f"decoder.layers.{i}.{mod}", (0,), (1,), False) for mod in TE_MODULES]
        objects += [(f"decoder.layers.{i}.mlp.experts.experts.linear_fc{k}", (e,), (E,), True)
                    for k in (1, 2) for e in range(rank * per_rank, (rank + 1) * per_rank)]
    for module, offsets, shape, expert_obj in objects:
        payload = torch.empty(0, dtype=torch.uint8) if mode == "save" else None  # what TE's get_extra_state gives
        sd[f"{module}._extra_state#{offsets[0]}"] = ShardedObject(f"{module}._extra_state", payload, shape, offsets,
                                                                 replica_id=0 if expert_obj else (0, 0, rank))
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
        if got.dtype != want.dtype or not torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
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
