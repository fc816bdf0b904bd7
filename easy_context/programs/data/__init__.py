"""Training and evaluation data: the embedded offline default (embedded.py) and datasets
read lazily from Arrow storage, a stream, or raw text packed into rows (rows.py)."""

from easy_context.programs.data.embedded import *  # noqa: F401,F403
from easy_context.programs.data.embedded import __all__ as _embedded
from easy_context.programs.data.rows import *  # noqa: F401,F403
from easy_context.programs.data.rows import __all__ as _rows

__all__ = [*_embedded, *_rows]
