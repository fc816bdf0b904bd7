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


def _exchange(send: torch.Tensor, group) -> torch.Tensor:
    """all_to_all_single on a contiguous (U, ...) send buffer: piece i goes to rank i, and piece
    j of the result came from rank j. gloo silently corrupts some strided tensors, so both
    buffers are contiguous."""
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received


# Memory layout: the heads-sharded q/k/v (and dout in the backward) are (B, H/U, S, D) views of
# (B, S, H/U, D)-dense memory, the layout HF's projections have and the one the kernels want:
# cpu_flash's backward copies a dout of any other layout (one more tensor alive at the peak of
# the backward), and the flash kernels take (B, S, H, D) too. Each direction copies once at a
# batch of one (packing the send buffer, or unpacking the received one), twice above.
def _seq_to_heads(xs, group) -> list:
    """[(B, H_i, S/U, D)], any strides -> [(B, H_i/U, S, D)] views of one (B, S, sum H_i/U, D)
    memory: one all-to-all for all of them (a single tensor: over (B, S, H/U, D) memory)."""
    size = dist.get_world_size(group)
    # piece i: heads [i H/U, (i + 1) H/U) of each tensor at my positions, packed (B, S/U, sum H_i/U, D)
    pieces = [x.unflatten(1, (size, -1)).permute(1, 0, 3, 2, 4) for x in xs]
    send = pieces[0].contiguous() if len(pieces) == 1 else torch.cat(pieces, dim=3)
    received = _exchange(send, group)  # piece j: positions [j S/U, (j + 1) S/U)
    del send, pieces
    full = received.transpose(0, 1).flatten(1, 2)  # a view at B = 1
    return [part.transpose(1, 2) for part in full.split([x.shape[1] // size for x in xs], dim=2)]


def _heads_to_seq(ys, group, likes=None) -> list:
    """[(B, H_i/U, S, D)] -> [(B, H_i, S/U, D)], with the strides of `likes` (any device, meta
    included) or else over (B, S/U, H_i, D) memory: one all-to-all for all of them. No copy
    before sending a single y that is a view of (B, S, H/U, D) memory at B = 1 (what the
    kernels return for _seq_to_heads' layout)."""
    size = dist.get_world_size(group)
    # piece i: positions [i S/U, (i + 1) S/U) of my heads, packed (B, S/U, sum H_i/U, D)
    pieces = [y.transpose(1, 2).unflatten(1, (size, -1)).movedim(1, 0) for y in ys]
    send = pieces[0].contiguous() if len(pieces) == 1 else torch.cat(pieces, dim=3)
    received = _exchange(send, group)  # piece j: heads [j H/U, (j + 1) H/U) of each tensor
    del send, pieces
    outs = []
    for i, (y, part) in enumerate(zip(ys, received.split([y.shape[1] for y in ys], dim=3))):
        b, heads, seq, d = y.shape
        if likes is None:
            out = torch.empty(b, seq // size, heads * size, d, dtype=y.dtype, device=y.device).transpose(1, 2)
        else:
            out = torch.empty_strided(likes[i].shape, likes[i].stride(), dtype=y.dtype, device=y.device)
        out.unflatten(1, (size, -1)).copy_(part.permute(1, 0, 3, 2, 4))
        outs.append(out)
    return outs


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *xs):
        # xs' layouts (not xs: nothing is kept alive), so their gradients obey autograd's layout
        # contract and a leaf's .grad is not copied once more by AccumulateGrad
        ctx.group, ctx.likes = group, [torch.empty_like(x, device="meta") for x in xs]
        return tuple(_seq_to_heads(xs, group))

    @staticmethod
    def backward(ctx, *grads):
        device = next(g.device for g in grads if g is not None)
        grads = [torch.zeros_like(like, device=device) if g is None else g for g, like in zip(grads, ctx.likes)]
        return None, *_heads_to_seq(grads, ctx.group, ctx.likes)


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _heads_to_seq([y], group)[0]

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads([grad], ctx.group)[0], None


def seq_to_heads(x, group, *more):
    """(B, H, S/U, D) on each rank -> (B, H/U, S, D), a view of (B, S, H/U, D) memory. With more
    tensors (same dtype and head dim): all in one all-to-all, returned as a tuple of views of
    one (B, S, sum H_i/U, D) memory."""
    out = _SeqToHeads.apply(group, x, *more)
    return out if more else out[0]


def heads_to_seq(x, group):
    """(B, H/U, S, D) on each rank -> (B, H, S/U, D), a view of (B, S/U, H, D) memory."""
    return _HeadsToSeq.apply(x, group)


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
