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

import torch
import torch.distributed as dist

from ..modes import SeqParallelMode, fixed_ring_degree
from ..process_groups import divisors
from ..zigzag_ring_attn import zigzag_ring_attention


def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Piece i of x along scatter_dim goes to rank i; the pieces received are concatenated
    along gather_dim. Copies only where the layout forces one: the send buffer must be
    contiguous (gloo silently corrupts some strided tensors) and is x itself when its pieces
    already are (heads of a batch of one); the result is a view of the receive buffer when
    the pieces line up (the sequence back from heads at batch one)."""
    size = dist.get_world_size(group)
    send = x.unflatten(scatter_dim, (size, -1)).movedim(scatter_dim, 0).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    del send
    return received.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


_HEADS, _SEQ = 1, 2  # dims of (B, H, S, D)


def seq_to_heads(x, group):
    """(B, H, S/U, D) on each rank -> (B, H/U, S, D)."""
    return _AllToAll.apply(x, group, _HEADS, _SEQ)


def heads_to_seq(x, group):
    """(B, H/U, S, D) on each rank -> (B, H, S/U, D)."""
    return _AllToAll.apply(x, group, _SEQ, _HEADS)


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
    q, k, v = (seq_to_heads(x, group) for x in (q, k, v))
    if sinks is not None:  # rank i of the Ulysses group now holds query heads [i H/U, (i + 1) H/U)
        sinks = sinks.unflatten(0, (degree, -1))[dist.get_rank(group)]
    return heads_to_seq(zigzag_ring_attention(q, k, v, scale, groups.ring, mask, softcap, sinks), group)


MODE = SeqParallelMode(
    "ulysses_attn",
    ring_degree=fixed_ring_degree("ulysses_attn", lambda sp: 1, "use usp_attn to add a ring"),
    zigzag=False,
    attention=ulysses_attention,
)
