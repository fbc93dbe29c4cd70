"""``smdistributed.modelparallel.torch.patches``: SMP's module-level additions to torch models."""
