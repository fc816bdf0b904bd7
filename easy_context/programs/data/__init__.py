"""Training and evaluation data: the embedded offline default (embedded.py), datasets read
lazily from Arrow storage, a stream, or raw text packed into rows (rows.py), and the order
that gives data-parallel groups equal attention work (work.py)."""

from easy_context.programs.data import embedded, rows, work
from easy_context.programs.data.embedded import *  # noqa: F403
from easy_context.programs.data.rows import *  # noqa: F403
from easy_context.programs.data.work import *  # noqa: F403

__all__ = [*embedded.__all__, *rows.__all__, *work.__all__]
