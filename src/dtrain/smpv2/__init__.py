"""SMP v2 (``import torch.sagemaker as tsm``): SageMaker's model parallelism on FSDP.

AWS's SMP v2 scripts build their model and wrap it in torch's FSDP themselves; the library gives
them ``tsm.init()``, the parallel degrees and groups on ``tsm.state``, and model transformations.
The package ``torch.sagemaker`` (:mod:`dtrain.compat.torch_sagemaker`, made importable by
:mod:`dtrain.compat.graft`) re-exports what is here under SMP's names.

* :mod:`.runtime`: ``init``, ``state``, ``is_initialized`` (and ``shutdown``, for tests);
* :mod:`.layout`: where each rank sits in the grid (replicate, shard, cp, tp);
* :mod:`.rng`: the random streams of tensor-parallel code;
* :mod:`.logger`, :mod:`.utils`: what scripts import from ``torch.sagemaker.logger``/``utils``;
* :mod:`.grad_norm`: ``clip_grad_norm_`` over sharded and tensor-parallel gradients;
* :mod:`.checkpoint`: distributed checkpoints (``torch.sagemaker.distributed.checkpoint``);
* :mod:`.unavailable`: the names not implemented yet, which fail naming themselves.
"""

from dtrain.smpv2.runtime import init, is_initialized, shutdown, state

__all__ = ["init", "is_initialized", "shutdown", "state"]
