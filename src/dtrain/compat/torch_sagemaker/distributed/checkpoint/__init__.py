"""``torch.sagemaker.distributed.checkpoint``: SMP v2's distributed checkpoints (DCP-style)."""
