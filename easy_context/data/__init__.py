"""Training and evaluation data: the embedded offline default (embedded.py) and datasets
read lazily from Arrow storage, a stream, or raw text packed into rows (rows.py)."""

from .embedded import *  # noqa: F401,F403
from .embedded import __all__ as _embedded
from .rows import *  # noqa: F401,F403
from .rows import __all__ as _rows

__all__ = [*_embedded, *_rows]
