"""SMP's user-facing API: DistributedModel, DistributedOptimizer, the step, placement, checkpoints,
comm, amp, half precision, sharded data parallelism and model creation.
"""
