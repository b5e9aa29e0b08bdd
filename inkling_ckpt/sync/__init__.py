"""Weight sync: the library seam a trainer calls (spec/weight-sync.md).

    from inkling_ckpt.sync import WeightSync, verify

    sync = WeightSync.from_checkpoint("served-model/", scales="keep")      # names, plan, scales
    for bucket in sync.buckets(trainer_named_tensors()):                   # (megatron_name, tensor)
        engine.update_weights_from_tensor(bucket.named_tensors)            # transport: the caller's
    report = verify(sync.buckets(trainer_named_tensors()), "served-model/") # bitwise + sha256

Input: ``(megatron_name, tensor)`` pairs as the trainer holds them (whole tensors, or an EP
rank's local experts with ``expert_offset``; experts stacked as in the checkpoint or one per
tensor as TEGroupedMLP / SequentialMLP name them), on CPU or CUDA. Output: buckets of
``(release_name, tensor)`` in the served checkpoint's names, dtypes and shapes (``model.llm.*``,
stacked gate/up-interleaved ``w13_weight``), no larger than ``bucket_bytes`` and never splitting
a load group: one per layer's stacked experts or EP slice of them (every part of w13 and w2,
``LoadGroup.rows`` says which experts). Routed experts are re-encoded in their layer's format
on the tensors' device (fused Triton kernels on CUDA, bit-identical to the CPU reference codec).
"""

from .api import (
    DEFAULT_BUCKET_BYTES,
    EXPERT_NAME_FORMS,
    SELECTIONS,
    Bucket,
    LoadGroup,
    WeightSync,
    expert_param_name,
)
from .source import trainer_tensors
from .verify import VerifyReport, digests, tensor_sha256, verify

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "EXPERT_NAME_FORMS",
    "SELECTIONS",
    "Bucket",
    "LoadGroup",
    "WeightSync",
    "expert_param_name",
    "trainer_tensors",
    "VerifyReport",
    "digests",
    "tensor_sha256",
    "verify",
]
