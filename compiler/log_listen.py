"""Listening to torch's own loggers for the length of a block (`listening`): the graph-break records Dynamo logs
at DEBUG and the cache-bypass lines Inductor and AOTAutograd log at INFO say what no counter does. A logger
nobody asked for at that level is switched on for the block only and kept off the process's other handlers; one
the user turned on (TORCH_LOGS) keeps reaching them. Every logger is left as it was.

This module imports no torch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager


@contextmanager
def listening(pairs: Iterable[tuple[logging.Logger, logging.Handler]], level: int) -> Iterator[None]:
    """Inside the block each logger of `pairs` hands its records at `level` and above to its handler."""
    saved = []
    for logger, handler in pairs:
        saved.append((logger, handler, logger.level, logger.propagate))
        if not logger.isEnabledFor(level):
            logger.setLevel(level)
            logger.propagate = False
        logger.addHandler(handler)
    try:
        yield
    finally:
        for logger, handler, old_level, propagate in saved:
            logger.removeHandler(handler)
            logger.setLevel(old_level)
            logger.propagate = propagate
