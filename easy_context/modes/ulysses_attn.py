"""ulysses_attn: all-to-all between the sequence and the heads (DeepSpeed-Ulysses).

Each rank holds a contiguous piece of the sequence with all heads; an all-to-all turns that
into the whole sequence with 1/U of the heads, attention runs locally (or, under usp_attn,
as a ring across Ulysses groups), and a second all-to-all turns it back. The communication
per rank shrinks as U grows, unlike a ring's.

KV heads: when num_key_value_heads does not split over U (e.g. 2 KV heads at U = 4), each
KV head is repeated just enough (lcm(Hkv, U) / Hkv times) that every rank receives the KV
heads its query heads read; autograd sums the repeated heads' gradients back.

Query heads that do not split over U (9 over 2, as in SmolLM2; 28 over 8 in Qwen2.5-7B) are
split as evenly as can be (5 + 4; exchange.ulysses_head_splits), each rank receiving the K/V heads its query
heads read (a shared one goes to both ranks): the busiest rank does ceil(H/U) / (H/U) of the
mean's attention work, which the costs below and the planner count.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from easy_context.core.exchange import heads_to_seq, seq_to_heads, ulysses_head_splits
from easy_context.modes import SeqParallelMode, fixed_ring_degree
from easy_context.modes.costs import (
    Activations,
    AttentionShape,
    Traffic,
    all_to_all_buffers,
    all_to_all_traffic,
    kv_replication,
    query_head_load,
    ring_buffers,
    ring_traffic,
    ulysses_heads,
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
        return _uneven_heads_attention(q, k, v, scale, groups, mask, softcap, sinks)
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


def _uneven_heads_attention(q, k, v, scale, groups, mask, softcap, sinks):
    """Ulysses when the query heads do not divide the group (ulysses_head_splits). A rank whose query
    heads read their K/V heads unevenly (5 query heads over K/V heads 0, 0, 0, 1, 1) gets one K/V
    head per query head, repeated from the ones it received, since the kernels' grouped-query
    mapping needs equal groups; autograd sums the repeats' gradients."""
    group, rank = groups.ulysses, dist.get_rank(groups.ulysses)
    query, keys = ulysses_head_splits(q.shape[1], k.shape[1], groups.topology.ulysses_degree)
    q = seq_to_heads(q, group, splits=(query,))
    if q.shape[-1] == k.shape[-1] == v.shape[-1] and k.dtype == v.dtype:
        k, v = seq_to_heads(k, group, v, splits=(keys, keys))
    else:
        k, v = (seq_to_heads(x, group, splits=(keys,)) for x in (k, v))
    reads = keys.local_reads(query, rank)
    if reads is not None:  # over the (B, S, H, D) memory the exchange returns, kept that way
        index = torch.tensor(reads, device=k.device)
        k, v = (x.transpose(1, 2).index_select(2, index).transpose(1, 2) for x in (k, v))
    if sinks is not None:
        sinks = sinks[query.starts[rank] : query.stops[rank]]
    out = zigzag_ring_attention(q, k, v, scale, groups.ring, mask, softcap, sinks)
    return heads_to_seq(out, group, split=query)


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
        saved=shape.dtype_bytes * max(ulysses_heads(shape)[0]) * shape.ulysses_degree * shape.head_dim,
        backward_buffers=ring + all_to_all_buffers(shape),
    )


MODE = SeqParallelMode(
    "ulysses_attn",
    ring_degree=fixed_ring_degree("ulysses_attn", lambda sp: 1, "use usp_attn to add a ring"),
    zigzag=False,
    attention=ulysses_attention,
    traffic=ulysses_traffic,
    activations=ulysses_activations,
    attention_load=query_head_load,
)
