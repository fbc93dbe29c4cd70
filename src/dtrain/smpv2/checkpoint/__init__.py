"""SMP v2's distributed checkpoints (``torch.sagemaker.distributed.checkpoint`` and
``torch.sagemaker.checkpoint.utils``), on torch's distributed checkpoint (DCP).

* :mod:`.storage`: the storage reader and writer, on fsspec: local folders and ``s3://``;
* :mod:`.unpickling`: what reading a checkpoint may unpickle (nothing the job did not write);
* :mod:`.saving`: ``save`` and ``async_save`` (planned over the group at once, written in a
  background thread, finished by ``maybe_finalize_async_calls``), :mod:`.async_calls` the queue;
* :mod:`.loading`: ``load``, in place;
* :mod:`.local_state`: SMP's local state dicts (``SM_LOCAL_STATE_DICT``), ``init_optim_state``;
* :mod:`.subdirs`: keeping the newest checkpoint folders.
"""
