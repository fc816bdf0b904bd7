"""data_parallel: no sequence parallelism; every rank runs whole sequences of its own.

The model keeps its own attention; inputs are not sharded. Present so that scripts can
switch modes with one flag. Its attention sends nothing and keeps nothing beyond the model's own.
"""

from easy_context.modes import SeqParallelMode, no_activations, no_traffic

MODE = SeqParallelMode(
    "data_parallel",
    ring_degree=lambda sp, requested: 1,
    zigzag=False,
    attention=None,
    traffic=no_traffic,
    activations=no_activations,
)
