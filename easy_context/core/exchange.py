"""The all-to-all between sequence shards and head shards (DeepSpeed-Ulysses' exchange),
differentiable, written once: ulysses_attn runs attention between the two exchanges, the
mixers' head exchange runs a recurrent scan there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["seq_to_heads", "heads_to_seq"]


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
