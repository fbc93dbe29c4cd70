"""Tensor parallelism on DTensor: SMP's ``smp.nn`` modules and the swapping of plain modules
for them (``smp.tensor_parallelism``, ``smp.set_tensor_parallelism``, ``smp.tp_register``).

Imported on first use (``smp.nn``, or a model wrapped with ``tensor_parallel_degree`` above 1):
DTensor takes a second to import. See ``docs/design/tensor-parallel.md``.
"""
