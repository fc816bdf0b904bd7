"""Block math: one query shard's attention over kernel blocks, merged exactly.

Every executor schedule reduces to these: `forward_blocks` runs a unit's kernel calls and folds
each block's (out, log-sum-exp) into fp32 accumulators (`merge_block`), `backward_blocks`
gives the gradients from the global out/lse, and sinks are folded once at the end.
Nothing here communicates.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from easy_context.core.kernels import accumulation_dtype, attention_backward, attention_forward, select_backend
from easy_context.core.masking import FULL_ROWS, Block

__all__ = [
    "Kernels",
    "covers",
    "rows_view",
    "merge_block",
    "forward_blocks",
    "backward_blocks",
    "finish_forward",
    "empty_state",
    "fold_sinks",
    "sinks_grad",
    "safe_lse",
]


def merge_block(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor, block_has_empty_rows=True
) -> None:
    """Fold one block's (out, lse) into running fp32 accumulators, in place.

    out = (e^lse out + e^block_lse block_out) / (e^lse + e^block_lse), written as a lerp with
    weight sigmoid(block_lse - lse): no exponent of a raw log-sum-exp is taken. Rows without
    any key so far or in this block have lse = -inf; the NaN of (-inf) - (-inf) means
    "nothing on either side" and becomes weight 0. block_has_empty_rows=False: every row of
    the block attends some key (a block of the mask's kernel calls), so no NaN can arise and none is looked for.
    """
    weight = torch.sigmoid(block_lse - lse)
    if block_has_empty_rows:
        weight = weight.nan_to_num_(0.0)
    weight = weight.unsqueeze(-1)
    torch.logaddexp(lse, block_lse, out=lse)
    out.lerp_(block_out.to(out.dtype), weight)


def covers(rows: slice, n: int) -> bool:
    """Whether `rows` selects all n rows (slice(None), or 0..n written out)."""
    return not rows.start and (rows.stop is None or rows.stop >= n) and rows.step in (None, 1)


def rows_view(x: torch.Tensor, rows: slice, batch: slice = FULL_ROWS) -> torch.Tensor:
    """x[batch, :, rows] for (B, H, S, ...) tensors; full slices are skipped (each would be a
    dispatched op: launch-free, yet it counts in the per-layer op budget tests hold us to)."""
    if batch != FULL_ROWS:
        x = x[batch]
    if covers(rows, x.shape[2]):
        return x
    return x[:, :, rows]


def _part(x: torch.Tensor, block: Block, rows: slice) -> torch.Tensor:
    return rows_view(x, rows, block.batch)


class Kernels:
    """The backends for one attention call (plain blocks, window blocks, and blocks of packed
    documents) and the logit softcap every block applies (None: none)."""

    def __init__(self, q, softcap=None):
        self.softcap = softcap or None
        self.plain = select_backend(q, softcap=bool(softcap))
        self.windowed = select_backend(q, softcap=bool(softcap), window=True)
        self.segmented = select_backend(q, softcap=bool(softcap), window=True, segments=True)  # None: no such kernel

    def calls(self, block: Block) -> list[tuple[Block, object]]:
        """(block, backend) for each kernel call of `block`: one, or one per document where no
        backend here takes documents in one call."""
        if block.segments is not None:
            if self.segmented is not None:
                return [(block, self.segmented)]
            return [(part, self._single(part)) for part in block.split()]
        return [(block, self._single(block))]

    def _single(self, block: Block):
        return self.plain if block.window is None else self.windowed


def forward_blocks(q, k, v, blocks: Sequence[Block], scale, kernels: Kernels, state=None):
    """Attention of q's rows over `blocks` of k/v, merged into state = (out, lse) (fp32 from
    the first merge on); returns the new state. Rows no block reaches have out 0, lse -inf."""
    out, lse = state if state is not None else (None, None)
    acc = accumulation_dtype(q.dtype)
    # Rows of a state this call made that no block has reached yet take a block's result as it
    # is (two copies instead of a merge's six kernels: a merge into nothing is that result).
    written = [] if state is None else None
    for block, backend in (call for b in blocks for call in kernels.calls(b)):
        block_out, block_lse = attention_forward(
            _part(q, block, block.q),
            _part(k, block, block.kv),
            _part(v, block, block.kv),
            block.causal,
            scale,
            backend,
            softcap=kernels.softcap,
            window=block.window,
            segments=block.segments,
        )
        if out is None and covers(block.q, q.shape[2]) and block.batch == FULL_ROWS:
            out, lse, written = block_out, block_lse.contiguous(), None  # no copy if nothing is merged in
            continue
        if out is None:
            out, lse = empty_state(q, acc)
        elif out.dtype != acc:  # the first merge: accumulate in fp32 from here on
            out, lse = out.to(acc), lse.to(acc)
        if written is not None and not any(_overlap(block, other, q.shape) for other in written):
            _part(out, block, block.q).copy_(block_out)
            _part(lse, block, block.q).copy_(block_lse)
            written.append(block)
            continue
        # the mask's kernel calls leave out rows with nothing to attend: no row of theirs is empty
        merge_block(_part(out, block, block.q), _part(lse, block, block.q), block_out, block_lse, False)
    return (out, lse) if out is not None else None


def _overlap(a: Block, b: Block, shape) -> bool:
    """Whether two blocks share a (batch row, query row)."""

    def meet(x: slice, y: slice, n: int) -> bool:
        x0, x1, _ = x.indices(n)
        y0, y1, _ = y.indices(n)
        return max(x0, y0) < min(x1, y1)

    return meet(a.batch, b.batch, shape[0]) and meet(a.q, b.q, shape[2])


def empty_state(q, acc):
    return torch.zeros_like(q, dtype=acc), torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)


def finish_forward(q, state, sinks=None):
    """The merged (out, lse) of q's rows, with the sinks folded in (before out is cast to q's
    dtype: one rounding), out in q's memory layout."""
    out, lse = fold_sinks(*(state if state is not None else empty_state(q, accumulation_dtype(q.dtype))), sinks)
    return in_layout_of(q, out.to(q.dtype)), lse


def in_layout_of(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x (q's shape but the last dim) with q's memory order, copied only when it has another.
    Every rank's out then has the same strides (their q's do), which the executor relies on:
    a rank receives another's rows of out into a buffer shaped like its own."""
    order = sorted(range(q.dim()), key=lambda d: q.stride(d), reverse=True)
    strides, step = [0] * x.dim(), 1
    for d in reversed(order):
        strides[d] = step
        step *= x.shape[d]
    if list(x.stride()) == strides or x.numel() == 0:
        return x
    return torch.empty_strided(x.shape, strides, dtype=x.dtype, device=x.device).copy_(x)


# Attention sinks (gpt-oss): a learned logit per head that joins every row's softmax
# denominator once, with a value of zero. Folding it into the merged (out, lse) makes the
# result the attention over the keys plus the sink. The backward then needs nothing new: with
# that out and lse, the kernels' usual backward (p = exp(s - lse), delta = rowsum(dout * out))
# is exactly the gradient of the attention with the sink, and the sink's own gradient is
# -sum over rows of exp(sink - lse) * delta.
def fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks) -> tuple:
    """(out, lse) of q's rows over every key -> the same with the sinks (Hq,) in the softmax."""
    if sinks is None:
        return out, lse
    if sinks.shape != (lse.shape[1],):
        raise ValueError(f"sinks must hold one logit per query head, shape ({lse.shape[1]},), got {tuple(sinks.shape)}")
    total = torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None])
    return out * torch.exp(lse - total).unsqueeze(-1).to(out.dtype), total


def sinks_grad(dout, out, lse, sinks):
    """d loss / d sinks for rows whose (out, lse) include the sinks (fold_sinks)."""
    if sinks is None or not sinks.requires_grad:
        return None
    acc = lse.dtype
    delta = (dout.to(acc) * out.to(acc)).sum(-1)  # (B, H, S)
    return -(torch.exp(sinks.to(acc)[None, :, None] - lse) * delta).sum((0, 2)).to(sinks.dtype)


def _accumulate(total, block: Block, rows: slice, block_grad, like, acc):
    """total[rows] += block_grad, where a missing total starts as the block gradient itself
    when the block covers every row (no zero-filled buffer, no copy in fp32)."""
    if total is None:
        if covers(rows, like.shape[2]) and block.batch == FULL_ROWS:
            return block_grad.to(acc)
        total = torch.zeros_like(like, dtype=acc)
    _part(total, block, rows).add_(block_grad)
    return total


def backward_blocks(
    dout, q, k, v, out, lse, blocks: Sequence[Block], scale, kernels: Kernels, grads=(None, None, None)
):
    """Gradients of forward_blocks given the global out/lse of q's rows, added to grads =
    (dq, dk, dv) fp32 accumulators (None: not started); returns the new grads."""
    dq, dk, dv = grads
    acc = accumulation_dtype(q.dtype)
    for block, backend in (call for b in blocks for call in kernels.calls(b)):
        rows = block.q
        block_dq, block_dk, block_dv = attention_backward(
            _part(dout, block, rows),
            _part(q, block, rows),
            _part(k, block, block.kv),
            _part(v, block, block.kv),
            _part(out, block, rows),
            _part(lse, block, rows),
            block.causal,
            scale,
            backend,
            softcap=kernels.softcap,
            window=block.window,
            segments=block.segments,
        )
        dq = _accumulate(dq, block, rows, block_dq, q, acc)
        dk = _accumulate(dk, block, block.kv, block_dk, k, acc)
        dv = _accumulate(dv, block, block.kv, block_dv, v, acc)
        del block_dq, block_dk, block_dv
    return dq, dk, dv


def safe_lse(lse: torch.Tensor, masked: bool) -> torch.Tensor:
    """Rows that attend nothing (padding) have lse -inf; the backward sees 0 there, so they get
    no gradient and no NaN from (-inf) - (-inf)."""
    return lse.masked_fill(lse == float("-inf"), 0.0) if masked else lse
