"""ulysses_attn: all-to-all between the sequence and the heads (DeepSpeed-Ulysses).

Each rank holds a contiguous piece of the sequence with all heads; an all-to-all turns that
into the whole sequence with 1/U of the heads, attention runs locally (or, under usp_attn,
as a ring across Ulysses groups), and a second all-to-all turns it back. The communication
per rank shrinks as U grows, unlike a ring's.

KV heads: when num_key_value_heads does not split over U (e.g. 2 KV heads at U = 4), each
KV head is repeated just enough (lcm(Hkv, U) / Hkv times) that every rank receives the KV
heads its query heads read; autograd sums the repeated heads' gradients back.
"""

from __future__ import annotations

import math

import torch.distributed as dist

from easy_context.core.exchange import heads_to_seq, seq_to_heads
from easy_context.core.groups import divisors
from easy_context.modes import SeqParallelMode, fixed_ring_degree
from easy_context.modes.costs import (
    Activations,
    AttentionShape,
    Traffic,
    all_to_all_buffers,
    all_to_all_traffic,
    kv_replication,
    ring_buffers,
    ring_traffic,
)
from easy_context.modes.zigzag_ring_attn import zigzag_ring_attention


def ulysses_attention(q, k, v, scale, groups, layer=None, mask=None, softcap=None, sinks=None):
    """Ulysses over groups.ulysses around a zigzag ring over groups.ring (a local kernel
    when the ring has one rank). After the all-to-all the ring holds its ring-level share of
    the whole sequence, so `mask` (over the whole sequence) applies unchanged; each rank
    applies the sinks (Hq,) of the heads it holds."""
    degree, group = groups.topology.ulysses_degree, groups.ulysses
    if group is None:
        return zigzag_ring_attention(q, k, v, scale, groups.ring, mask, softcap, sinks)
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % degree:
        sp = groups.topology.sp_size
        working = [u for u in divisors(sp) if heads % u == 0]
        raise ValueError(
            f"num_attention_heads={heads} does not split over ulysses_degree={degree}; Ulysses degrees "
            f"that work with sp_size={sp}: {working} (usp_attn with ring_degree in {[sp // u for u in working]}, "
            "or zigzag_ring_attn which has no head constraint)"
        )
    repeat = math.lcm(kv_heads, degree) // kv_heads
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    if groups.ring is None and q.shape[-1] == k.shape[-1] == v.shape[-1] and q.dtype == k.dtype == v.dtype:
        # one all-to-all for q, k and v (one for their gradients): the K/V it returns are views
        # of a shared buffer, which only a ring would have to copy before sending
        q, k, v = seq_to_heads(q, group, k, v)
    else:
        q, k, v = (seq_to_heads(x, group) for x in (q, k, v))
    if sinks is not None:  # rank i of the Ulysses group now holds query heads [i H/U, (i + 1) H/U)
        sinks = sinks.unflatten(0, (degree, -1))[dist.get_rank(group)]
    return heads_to_seq(zigzag_ring_attention(q, k, v, scale, groups.ring, mask, softcap, sinks), group)


def ulysses_traffic(shape: AttentionShape) -> Traffic:
    """The all-to-alls, and the zigzag ring (when ring_degree > 1) over the heads-sharded
    tensors: ring_degree ranks, each with the K/V heads its Ulysses rank holds (replicated
    ones included) over local_len x ulysses_degree tokens, the same bytes as all K/V heads
    over local_len tokens."""
    kv_heads = shape.kv_heads * kv_replication(shape)
    return all_to_all_traffic(shape) + ring_traffic(shape, kv_heads)


def ulysses_activations(shape: AttentionShape) -> Activations:
    """Per token: K/V saved with their replicated heads, the inner attention's output saved
    besides the all-to-all's, and the all-to-all (and ring) buffers in the backward."""
    if shape.ulysses_degree == 1:
        return Activations(backward_buffers=ring_buffers(shape, shape.kv_heads * shape.head_dim))
    rep = kv_replication(shape)
    ring = ring_buffers(shape, shape.kv_heads * rep * shape.head_dim)
    return Activations(
        kv_replication=rep,
        saved=shape.dtype_bytes * shape.heads * shape.head_dim,
        backward_buffers=ring + all_to_all_buffers(shape),
    )


MODE = SeqParallelMode(
    "ulysses_attn",
    ring_degree=fixed_ring_degree("ulysses_attn", lambda sp: 1, "use usp_attn to add a ring"),
    zigzag=False,
    attention=ulysses_attention,
    traffic=ulysses_traffic,
    activations=ulysses_activations,
)
