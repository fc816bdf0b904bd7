"""Dynamo's recompile-limit warnings, collected: past its limit Dynamo warns once per function
and runs it eager from then on (for flex: the whole score matrix), which no result shows."""

import contextlib
import logging


@contextlib.contextmanager
def recompile_limit_hits():
    """Yields a list that gains the message of every recompile-limit warning inside the block."""
    hits = []
    handler = logging.Handler()
    handler.emit = lambda record: hits.extend([record.getMessage()] * ("recompile_limit" in record.getMessage()))
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(handler)
    try:
        yield hits
    finally:
        logger.removeHandler(handler)
