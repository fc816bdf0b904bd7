"""Training and evaluation data: the embedded offline default (embedded.py), datasets read
lazily from Arrow storage, a stream, or raw text packed into rows (rows.py), each packed row's
attention work (work.py; core/work_order.py orders rows by it), and real long documents from
what the machine has offline, with a held-out split (long_text.py: import it by name)."""

from recipes.data import embedded, rows, work
from recipes.data.embedded import *  # noqa: F403
from recipes.data.rows import *  # noqa: F403
from recipes.data.work import *  # noqa: F403

__all__ = [*embedded.__all__, *rows.__all__, *work.__all__]
