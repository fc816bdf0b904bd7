"""usp_attn: Ulysses x ring (unified sequence parallelism).

sp_size = ulysses_degree x ring_degree. Ulysses runs over neighbouring ranks (inside a
node), a zigzag ring over strided ranks (across nodes). Only the split of the SP group
differs from ulysses_attn; the attention function is the same.
"""

from __future__ import annotations

from easy_context.core.groups import Placement, divisors
from easy_context.modes import SeqParallelMode
from easy_context.modes.costs import query_head_load
from easy_context.modes.ulysses_attn import ulysses_activations, ulysses_attention, ulysses_traffic


def _ring_degree(sp_size: int, requested: int | None, placement: Placement | None = None) -> int:
    """An explicit ring_degree wins. Else, on one node, pure Ulysses (the least communication);
    when the SP group spans nodes, Ulysses inside a node and the ring across nodes: the Ulysses
    degree is the largest that divides the ranks per node (so its groups, consecutive ranks,
    stay on one node) and the query and key/value heads (no head is repeated), and the ring
    runs over the rest. An all-to-all over the network is what this avoids."""
    if requested is not None:
        return requested
    if placement is None or placement.ranks_per_node is None:
        return 1
    node = placement.ranks_per_node
    if sp_size <= node and node % sp_size == 0:  # every SP group on one node
        return 1
    heads = [h for h in (placement.heads, placement.kv_heads) if h is not None]
    ulysses = max(u for u in divisors(sp_size) if node % u == 0 and all(h % u == 0 for h in heads))
    return sp_size // ulysses


MODE = SeqParallelMode(
    "usp_attn",
    ring_degree=_ring_degree,
    zigzag=True,
    attention=ulysses_attention,
    document_split=True,
    takes_ring_degree=True,
    # ring_degree 1 is ulysses_attn's split and sp_size zigzag_ring_attn's: the planner prices them as those
    ring_degree_choices=lambda sp: tuple(r for r in divisors(sp) if 1 < r < sp),
    traffic=ulysses_traffic,  # the same attention as ulysses_attn, so the same costs
    activations=ulysses_activations,
    attention_load=query_head_load,
)
