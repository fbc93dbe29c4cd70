"""How a model's modules run in a step, whichever engine runs them (the pipeline, tensor
parallelism, the sharded model): activation checkpointing, the compute modes work runs under,
hooks that run where their module computes, forward stubs, task-owned random generators,
the gradients a backward starts from.
"""
