"""usp_attn: Ulysses x ring (unified sequence parallelism).

sp_size = ulysses_degree x ring_degree. Ulysses runs over neighbouring ranks (inside a
node), a zigzag ring over strided ranks (across nodes). Only the split of the SP group
differs from ulysses_attn; the attention function is the same.
"""

from __future__ import annotations

from easy_context.core.groups import divisors
from easy_context.modes import SeqParallelMode
from easy_context.modes.ulysses_attn import ulysses_activations, ulysses_attention, ulysses_traffic


def _ring_degree(sp_size: int, requested: int | None) -> int:
    # Default: pure Ulysses (the least communication); pass ring_degree when the heads
    # don't split over sp_size, or to run the ring across nodes.
    return 1 if requested is None else requested


MODE = SeqParallelMode(
    "usp_attn",
    ring_degree=_ring_degree,
    zigzag=True,
    attention=ulysses_attention,
    document_split=True,
    takes_ring_degree=True,
    # ring_degree 1 is ulysses_attn's split and sp_size zigzag_ring_attn's: planned under those
    ring_degree_choices=lambda sp: tuple(r for r in divisors(sp) if 1 < r < sp),
    traffic=ulysses_traffic,  # the same attention as ulysses_attn, so the same costs
    activations=ulysses_activations,
)
