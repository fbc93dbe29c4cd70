"""Errors of the model-parallel runtime: each says what went wrong, where (rank), and what to do."""

from __future__ import annotations

from dtrain.errors import DtrainError


class ModelParallelError(DtrainError):
    """Base class of model-parallel runtime errors."""


class NotInitializedError(ModelParallelError):
    """An API that needs ``smp.init()`` was called before it."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what} needs the model-parallel runtime: call smp.init() first")


class NotInStepError(ModelParallelError):
    """The model (or ``model.backward``) ran outside an ``@smp.step`` function."""

    @classmethod
    def used(cls, what: str) -> NotInStepError:
        return cls(
            f"{what} was used outside an @smp.step function: call the model and "
            "model.backward inside the function decorated with @smp.step"
        )


class MultipleDistributedModelError(ModelParallelError):
    """A second ``DistributedModel`` in one process (SMP allows one per script)."""


class PartitionError(ModelParallelError):
    """The partition plan cannot be used (bad partition id, tied modules split, ...)."""


class MicrobatchSplitError(ModelParallelError, ValueError):
    """A step input cannot be split into the configured number of microbatches."""


class RemoteError(ModelParallelError):
    """An exception raised on another rank, re-raised here with its rank and traceback."""

    def __init__(self, rank: int, exc_type: str, message: str, remote_traceback: str) -> None:
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.remote_traceback = remote_traceback
        super().__init__(
            f"{exc_type}: {message} (raised on rank {rank}; remote traceback below)\n"
            f"{remote_traceback.rstrip()}"
        )

    def __reduce__(self) -> tuple[type, tuple[int, str, str, str]]:
        return (type(self), (self.rank, self.exc_type, self.message, self.remote_traceback))


class StepFailedError(RemoteError):
    """The step failed on the pipeline leader; the other ranks of the pipeline raise this."""


class CommunicationTimeoutError(ModelParallelError, TimeoutError):
    """A wait for another rank (a reply, the compute token, the end of a step) ran out of time."""


class MemoryLimitError(PartitionError):
    """A partition of the plan needs more memory than a rank has (``--memory-per-rank``, or the
    GPU's free memory); the message says which, by how much, and a layout that would fit."""
