"""Training and evaluation data: the embedded offline default (embedded.py) and datasets
read lazily from Arrow storage, a stream, or raw text packed into rows (rows.py)."""

from easy_context.programs.data import embedded, rows
from easy_context.programs.data.embedded import *  # noqa: F403
from easy_context.programs.data.rows import *  # noqa: F403

__all__ = [*embedded.__all__, *rows.__all__]
