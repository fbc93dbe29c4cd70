"""``torch.sagemaker.logger.get_logger()``: the library's logger, which AWS's scripts log with.

Messages at INFO and above go to standard error, each line with its time, level and process
rank; the logger does not pass them on to the root logger, so a script that configures logging
itself does not print them twice.
"""

from __future__ import annotations

import logging
import os

NAME = "torch.sagemaker"
FORMAT = "%(asctime)s %(levelname)s [rank %(rank)s] %(name)s: %(message)s"


class _RankFilter(logging.Filter):
    """Adds the process's rank (the launcher's ``RANK``) to each record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = os.environ.get("RANK", "?")
        return True


def get_logger() -> logging.Logger:
    """The ``torch.sagemaker`` logger, set up on first use."""
    logger = logging.getLogger(NAME)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(FORMAT))
        handler.addFilter(_RankFilter())
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger
