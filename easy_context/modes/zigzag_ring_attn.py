"""zigzag_ring_attn: ring attention over a zigzag layout.

The sequence is cut into 2P chunks and rank r keeps chunks r and 2P-1-r. With causal
attention every ring step then costs each rank the same: half of a full local block.
Under a mask (packed documents, padding, windows) the blocks are the mask's kernel calls on
the same layout (or the row's own layout under document_split), and ring steps nobody needs
are skipped. Given the HF layer, gradient checkpointing does not recompute it.
"""

from __future__ import annotations

import torch.distributed as dist

from easy_context.core.masking import Block
from easy_context.core.ring import masked_ring_steps, ring_attention
from easy_context.modes import SeqParallelMode, fixed_ring_degree
from easy_context.modes.costs import Activations, ring_buffers, ring_traffic

_ALL = slice(None)


class ZigzagSteps:
    """The causal zigzag ring's steps (a ring.RingSteps); local rows are [chunk r | chunk 2P-1-r]."""

    masked = False

    def needs(self, step, rank, size):
        return True

    def keys(self, step, rank, size):
        return _ALL

    def blocks(self, step, rank, size, q_len, kv_len):
        if step == 0:
            return [Block(_ALL, _ALL, causal=True)]
        source = (rank - step) % size
        if source < rank:
            # Both of our chunks come after the source's first chunk and before its second.
            return [Block(_ALL, slice(0, kv_len // 2), causal=False)]
        # Only our second chunk (2P-1-r) comes after both of the source's chunks.
        return [Block(slice(q_len // 2, None), _ALL, causal=False)]


CAUSAL_STEPS = ZigzagSteps()


def ring_steps(mask, group, local_len: int, device):
    """The ring steps for `mask` (a SequenceMask or None) on the zigzag layout of `group`."""
    if mask is None or mask.is_causal:
        return CAUSAL_STEPS
    size = dist.get_world_size(group) if group is not None else 1
    return masked_ring_steps(mask, True, size, local_len, device)


def zigzag_ring_attention(q, k, v, scale, group=None, mask=None, softcap=None, sinks=None, layer=None):
    """Causal attention of zigzag-sharded q/k/v over the ranks of `group`; `mask` (a
    SequenceMask over the group's whole sequence) restricts it further; softcap, sinks and
    layer (recompute-free checkpointing) as in ring.ring_attention."""
    return ring_attention(q, k, v, scale, ring_steps(mask, group, q.shape[2], q.device), group, softcap, sinks, layer)


MODE = SeqParallelMode(
    "zigzag_ring_attn",
    ring_degree=fixed_ring_degree("zigzag_ring_attn", lambda sp: sp, "use usp_attn to mix a ring with Ulysses"),
    zigzag=True,
    attention=lambda q, k, v, scale, groups, layer=None, mask=None, **logits: zigzag_ring_attention(
        q, k, v, scale, groups.ring, mask, **logits
    ),
    document_split=True,
    traffic=lambda shape: ring_traffic(shape, shape.kv_heads),
    activations=lambda shape: Activations(backward_buffers=ring_buffers(shape, shape.kv_heads * shape.head_dim)),
)
