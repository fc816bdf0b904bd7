"""Training and evaluation data: the embedded offline default (embedded.py), datasets read
lazily from Arrow storage, a stream, or raw text packed into rows (rows.py), and each packed
row's attention work (work.py; core/work_order.py orders rows by it)."""

from recipes.data import embedded, rows, work
from recipes.data.embedded import *  # noqa: F403
from recipes.data.rows import *  # noqa: F403
from recipes.data.work import *  # noqa: F403

__all__ = [*embedded.__all__, *rows.__all__, *work.__all__]
