"""zigzag_ring_attn: ring attention over a zigzag layout.

The sequence is cut into 2P chunks and rank r keeps chunks r and 2P-1-r. With causal
attention every ring step then costs each rank the same: half of a full local block.
"""

from __future__ import annotations

from ..modes import SeqParallelMode, fixed_ring_degree
from ..ring import Block, ring_attention

_ALL = slice(None)


class ZigzagPlan:
    """Blocks of the causal zigzag ring; local rows are [chunk r | chunk 2P-1-r]."""

    def blocks(self, step, rank, size, q_len, kv_len):
        if step == 0:
            return [Block(_ALL, _ALL, causal=True)]
        source = (rank - step) % size
        if source < rank:
            # Both of our chunks come after the source's first chunk and before its second.
            return [Block(_ALL, slice(0, kv_len // 2), causal=False)]
        # Only our second chunk (2P-1-r) comes after both of the source's chunks.
        return [Block(slice(q_len // 2, None), _ALL, causal=False)]


PLAN = ZigzagPlan()


def zigzag_ring_attention(q, k, v, scale, group=None):
    """Causal attention of zigzag-sharded q/k/v over the ranks of `group`."""
    return ring_attention(q, k, v, scale, PLAN, group)


MODE = SeqParallelMode(
    "zigzag_ring_attn",
    ring_degree=fixed_ring_degree("zigzag_ring_attn", lambda sp: sp, "use usp_attn to mix a ring with Ulysses"),
    zigzag=True,
    attention=lambda q, k, v, scale, groups, layer=None: zigzag_ring_attention(q, k, v, scale, groups.ring),
)
