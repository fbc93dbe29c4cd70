"""Exit statuses of ``dtrain``'s commands."""

EXIT_OK = 0
EXIT_FAILED = 1
"""The job failed, or the command found what it checks wrong (a plan over the memory limit)."""
EXIT_BAD_INPUT = 2
"""The command line or a file it names was wrong (a :class:`~dtrain.errors.DtrainError`)."""
EXIT_STOPPED = 3
