"""The all-to-all between sequence shards and head shards (DeepSpeed-Ulysses' exchange),
differentiable, written once: ulysses_attn runs attention between the two exchanges, the
mixers' head exchange runs a recurrent scan there.

Heads split evenly by default (H/U per rank). A `HeadSplit` gives each rank a range of heads of
its own size, for head counts that do not divide the group (9 query heads over 2 ranks: 5 + 4);
ranges may overlap (a K/V head that query heads on two ranks read goes to both), and the way
back sums what the ranks hold of a shared head, which is the gradient of sending it twice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["HeadSplit", "ulysses_head_splits", "seq_to_heads", "heads_to_seq"]


@dataclass(frozen=True)
class HeadSplit:
    """Rank i of a group holds heads [starts[i], stops[i]) of a tensor of `heads` heads."""

    heads: int
    starts: tuple
    stops: tuple

    @classmethod
    def balanced(cls, heads: int, size: int) -> HeadSplit:
        """Contiguous ranges as equal as can be: the first heads % size ranks hold one head more."""
        big, base = heads % size, heads // size
        bounds = [r * base + min(r, big) for r in range(size + 1)]
        return cls(heads, tuple(bounds[:-1]), tuple(bounds[1:]))

    @classmethod
    def read_by(cls, query: HeadSplit, kv_heads: int) -> HeadSplit:
        """The ranges of `kv_heads` K/V heads that each rank's query heads read under grouped-query
        attention (query head h reads K/V head h // (query heads / K/V heads), as in HF)."""
        group = query.heads // kv_heads
        starts = tuple(s // group for s in query.starts)
        return cls(kv_heads, starts, tuple((e - 1) // group + 1 for e in query.stops))

    @property
    def sizes(self) -> tuple:
        return tuple(e - s for s, e in zip(self.starts, self.stops))

    @property
    def even(self) -> bool:
        """Disjoint ranges of one size in rank order: what the plain exchange does."""
        size = len(self.starts)
        return self.heads % size == 0 and self == HeadSplit.balanced(self.heads, size)

    def local_reads(self, query: HeadSplit, rank: int) -> list | None:
        """For rank `rank`: which of its K/V heads (positions in its range) each of its query heads
        reads, or None where that is the kernels' own grouped-query mapping (every K/V head read by
        the same number of consecutive query heads)."""
        group = query.heads // self.heads
        reads = [h // group - self.starts[rank] for h in range(query.starts[rank], query.stops[rank])]
        held = self.sizes[rank]
        if len(reads) % held == 0 and reads == [j // (len(reads) // held) for j in range(len(reads))]:
            return None
        return reads


def _exchange(send: torch.Tensor, group) -> torch.Tensor:
    """all_to_all_single on a contiguous (U, ...) send buffer: piece i goes to rank i, and piece
    j of the result came from rank j. gloo silently corrupts some strided tensors, so both
    buffers are contiguous."""
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return received


def ulysses_head_splits(heads: int, kv_heads: int, degree: int) -> tuple[HeadSplit, HeadSplit]:
    """(query split, K/V split) over a Ulysses group of `degree` ranks: query heads as even as can
    be (9 over 2: 5 + 4), and each rank the K/V heads its query heads read (one read on two ranks
    goes to both). More ranks than query heads would leave a rank without work: refused."""
    if degree > heads:
        raise ValueError(
            f"ulysses_degree={degree} exceeds num_attention_heads={heads}: every Ulysses rank needs a query head; "
            f"use a Ulysses degree of at most {heads} (usp_attn with a larger ring_degree, or zigzag_ring_attn)"
        )
    query = HeadSplit.balanced(heads, degree)
    return query, HeadSplit.read_by(query, kv_heads)


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


def _seq_to_heads_split(xs, splits, group) -> list:
    """_seq_to_heads with a HeadSplit per tensor: rank i receives heads splits[t] of tensor t.
    The send sizes differ by destination; what arrives from every source has one size."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    b, _, n, d = xs[0].shape
    widths = [sum(split.sizes[i] for split in splits) for i in range(size)]  # heads sent to rank i
    send = torch.empty(b * n * d * sum(widths), dtype=xs[0].dtype, device=xs[0].device)
    offset = 0
    for i, width in enumerate(widths):  # piece i: rank i's heads at my positions, (B, S/U, width, D)
        piece, column = send[offset : offset + b * n * width * d].view(b, n, width, d), 0
        for x, split in zip(xs, splits):
            piece[:, :, column : column + split.sizes[i]].copy_(x[:, split.starts[i] : split.stops[i]].transpose(1, 2))
            column += split.sizes[i]
        offset += piece.numel()
    received = torch.empty(size * b * n * widths[me] * d, dtype=send.dtype, device=send.device)
    dist.all_to_all_single(
        received, send, [b * n * widths[me] * d] * size, [b * n * w * d for w in widths], group=group
    )
    del send
    full = received.view(size, b, n, widths[me], d).transpose(0, 1).flatten(1, 2)  # (B, S, width, D)
    return [part.transpose(1, 2) for part in full.split([split.sizes[me] for split in splits], dim=2)]


def _heads_to_seq_split(ys, splits, group, likes=None) -> list:
    """_heads_to_seq with a HeadSplit per tensor: ys[t] holds this rank's heads splits[t]; a
    head that several ranks hold comes back as the sum of their values."""
    size = dist.get_world_size(group)
    pieces = [y.transpose(1, 2).unflatten(1, (size, -1)).movedim(1, 0) for y in ys]  # (U, B, S/U, h_t, D)
    send = pieces[0].contiguous() if len(pieces) == 1 else torch.cat(pieces, dim=3)
    _, b, n, _, d = send.shape
    widths = [sum(split.sizes[i] for split in splits) for i in range(size)]  # heads rank i sends me
    received = torch.empty(b * n * d * sum(widths), dtype=send.dtype, device=send.device)
    dist.all_to_all_single(
        received, send.view(-1), [b * n * w * d for w in widths], [send[0].numel()] * size, group=group
    )
    del send, pieces
    outs = []
    for t, (y, split) in enumerate(zip(ys, splits)):
        shape = (b, split.heads, n, d)
        if likes is None:
            out = torch.zeros(b, n, split.heads, d, dtype=y.dtype, device=y.device).transpose(1, 2)
        else:
            out = torch.empty_strided(shape, likes[t].stride(), dtype=y.dtype, device=y.device).zero_()
        outs.append(out)
    offset = 0
    for i, width in enumerate(widths):
        piece, column = received[offset : offset + b * n * width * d].view(b, n, width, d), 0
        for out, split in zip(outs, splits):
            out[:, split.starts[i] : split.stops[i]].add_(piece[:, :, column : column + split.sizes[i]].transpose(1, 2))
            column += split.sizes[i]
        offset += piece.numel()
    return outs


def _to_heads(xs, group, splits) -> list:
    if splits is None or all(split.even for split in splits):
        return _seq_to_heads(xs, group)
    return _seq_to_heads_split(xs, splits, group)


def _to_seq(ys, group, splits, likes=None) -> list:
    if splits is None or all(split.even for split in splits):
        return _heads_to_seq(ys, group, likes)
    return _heads_to_seq_split(ys, splits, group, likes)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, splits, *xs):
        # xs' layouts (not xs: nothing is kept alive), so their gradients obey autograd's layout
        # contract and a leaf's .grad is not copied once more by AccumulateGrad
        ctx.group, ctx.splits, ctx.likes = group, splits, [torch.empty_like(x, device="meta") for x in xs]
        return tuple(_to_heads(xs, group, splits))

    @staticmethod
    def backward(ctx, *grads):
        device = next(g.device for g in grads if g is not None)
        grads = [torch.zeros_like(like, device=device) if g is None else g for g, like in zip(grads, ctx.likes)]
        return None, None, *_to_seq(grads, ctx.group, ctx.splits, ctx.likes)


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, split):
        ctx.group, ctx.splits = group, None if split is None else (split,)
        return _to_seq([y], group, ctx.splits)[0]

    @staticmethod
    def backward(ctx, grad):
        return _to_heads([grad], ctx.group, ctx.splits)[0], None, None


def seq_to_heads(x, group, *more, splits=None):
    """(B, H, S/U, D) on each rank -> (B, H/U, S, D), a view of (B, S, H/U, D) memory. With more
    tensors (same dtype and head dim): all in one all-to-all, returned as a tuple of views of
    one (B, S, sum H_i/U, D) memory. `splits`: a HeadSplit per tensor (None: even)."""
    out = _SeqToHeads.apply(group, splits, x, *more)
    return out if more else out[0]


def heads_to_seq(x, group, split=None):
    """(B, H/U, S, D) on each rank -> (B, H, S/U, D), a view of (B, S/U, H, D) memory; `split`:
    the HeadSplit of x's heads (None: even)."""
    return _HeadsToSeq.apply(x, group, split)
