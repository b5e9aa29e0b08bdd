"""The file names of a Megatron ``torch_dist`` checkpoint folder.

Kept apart from :mod:`inkling_ckpt.layouts.megatron` so that recognising a folder (``layouts.detect``)
does not import ``torch.distributed.checkpoint``, which costs seconds that commands on HF
checkpoints never need.
"""

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
METADATA_JSON = "metadata.json"
COMMON = "common.pt"
DCP_METADATA = ".metadata"

__all__ = ["TRACKER", "RELEASE", "METADATA_JSON", "COMMON", "DCP_METADATA"]
