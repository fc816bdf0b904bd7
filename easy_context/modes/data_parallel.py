"""data_parallel: no sequence parallelism; every rank runs whole sequences of its own.

The model keeps its own attention; inputs are not sharded. Present so that scripts can
switch modes with one flag.
"""

from easy_context.modes import SeqParallelMode

MODE = SeqParallelMode("data_parallel", ring_degree=lambda sp, requested: 1, zigzag=False, attention=None)
