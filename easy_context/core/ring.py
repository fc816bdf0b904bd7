"""The ring core: exact attention over a sequence sharded across a process group.

At step t every rank works with the K/V of the rank t places before it. Which (query rows x
key rows) products a rank computes at each step is the only thing that differs between
layouts and masks; a `RingPlan` supplies it. Communication, log-sum-exp merging and the
backward live here once.

Communication is a direct exchange per step: a rank sends its own K/V to the rank t places
after it, while the current step computes. A step no rank has work for is skipped, and a
rank with no work at a step receives nothing (packed documents and sliding windows leave
most steps of a long ring empty; every rank decides this from the same plan, so no rank
waits on a message that never comes). Without masks every step is needed and this moves
exactly what a ring relay moves.

Backward: the same K/V exchange again; the dK/dV of each borrowed K/V block (fp32) goes
straight back to its owner, one step behind the compute. Nothing is ever gathered on one
rank.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch
import torch.distributed as dist

from easy_context.core.kernels import accumulation_dtype, attention_backward, attention_forward, select_backend
from easy_context.core.masking import FULL_ROWS, Block, SequenceMask
from easy_context.core.p2p import Pending, buffer_like, exchange

__all__ = ["Block", "RingPlan", "MaskedRingPlan", "ring_attention", "merge_block", "forward_blocks", "backward_blocks", "Kernels"]


class RingPlan(Protocol):
    masked: bool  # whether some rows may have no allowed key in a block (lse = -inf)

    def blocks(self, step: int, rank: int, size: int, q_len: int, kv_len: int) -> Sequence[Block]:
        """Blocks to compute at `step`, while holding the K/V of rank (rank - step) % size."""

    def needs(self, step: int, rank: int, size: int) -> bool:
        """Whether `rank` computes anything with the K/V of rank (rank - step) % size."""


class MaskedRingPlan:
    """Blocks of any layout under a SequenceMask: `index_of(rank)` gives the global positions
    of a rank's rows; `name` (hashable) identifies the layout for the mask's plan cache."""

    masked = True

    def __init__(self, mask: SequenceMask, index_of: Callable[[int], torch.Tensor], name, device):
        self.mask, self.index_of, self.name, self.device = mask, index_of, name, device

    def blocks(self, step, rank, size, q_len, kv_len):
        source = (rank - step) % size
        return self.mask.blocks((self.name, rank, source), self.index_of(rank), self.index_of(source), self.device)

    def needs(self, step, rank, size):
        source = (rank - step) % size
        return self.mask.has_pairs((self.name, rank, source), self.index_of(rank), self.index_of(source))


def merge_block(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's (out, lse) into running fp32 accumulators, in place.

    out = (e^lse out + e^block_lse block_out) / (e^lse + e^block_lse), written as a lerp with
    weight sigmoid(block_lse - lse): no exponent of a raw log-sum-exp is taken. Rows without
    any key so far or in this block have lse = -inf; the NaN of (-inf) - (-inf) means
    "nothing on either side" and becomes weight 0.
    """
    weight = torch.sigmoid(block_lse - lse).nan_to_num_(0.0).unsqueeze(-1)
    torch.logaddexp(lse, block_lse, out=lse)
    out.lerp_(block_out.to(out.dtype), weight)


def _part(x: torch.Tensor, block: Block, rows: slice) -> torch.Tensor:
    return x[block.batch, :, rows]


class Kernels:
    """The backends for one attention call (plain blocks and masked blocks) and the logit
    softcap every block applies (None: none)."""

    def __init__(self, q, masked: bool, softcap=None):
        self.softcap = softcap or None
        self.plain = select_backend(q, softcap=bool(softcap))
        self.masked = select_backend(q, masked=True, softcap=bool(softcap)) if masked else None

    def __call__(self, block: Block):
        return self.masked if block.mask is not None else self.plain


def forward_blocks(q, k, v, blocks: Sequence[Block], scale, kernels: Kernels, state=None):
    """Attention of q's rows over `blocks` of k/v, merged into state = (out, lse) (fp32 from
    the first merge on); returns the new state. Rows no block reaches have out 0, lse -inf."""
    out, lse = state if state is not None else (None, None)
    acc = accumulation_dtype(q.dtype)
    for block in blocks:
        block_out, block_lse = attention_forward(
            _part(q, block, block.q), _part(k, block, block.kv), _part(v, block, block.kv),
            block.causal, scale, kernels(block), mask=block.mask, softcap=kernels.softcap,
        )
        if out is None and block.q == FULL_ROWS and block.batch == FULL_ROWS:
            out, lse = block_out, block_lse.contiguous()  # no copy if nothing is merged in
            continue
        if out is None:
            out, lse = _empty_state(q, acc)
        elif out.dtype != acc:  # the first merge: accumulate in fp32 from here on
            out, lse = out.to(acc), lse.to(acc)
        merge_block(_part(out, block, block.q), lse[block.batch, :, block.q], block_out, block_lse)
    return (out, lse) if out is not None else None


def _empty_state(q, acc):
    return torch.zeros_like(q, dtype=acc), torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)


def finish_forward(q, state, sinks=None):
    """The merged (out, lse) of q's rows, with the sinks folded in (before out is cast to q's
    dtype: one rounding)."""
    out, lse = fold_sinks(*(state if state is not None else _empty_state(q, accumulation_dtype(q.dtype))), sinks)
    return out.to(q.dtype), lse


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
        if rows == FULL_ROWS and block.batch == FULL_ROWS:
            return block_grad.to(acc)
        total = torch.zeros_like(like, dtype=acc)
    _part(total, block, rows).add_(block_grad)
    return total


def backward_blocks(dout, q, k, v, out, lse, blocks: Sequence[Block], scale, kernels: Kernels, grads=(None, None, None)):
    """Gradients of forward_blocks given the global out/lse of q's rows, added to grads =
    (dq, dk, dv) fp32 accumulators (None: not started); returns the new grads."""
    dq, dk, dv = grads
    acc = accumulation_dtype(q.dtype)
    for block in blocks:
        rows = block.q
        block_dq, block_dk, block_dv = attention_backward(
            _part(dout, block, rows), _part(q, block, rows), _part(k, block, block.kv), _part(v, block, block.kv),
            _part(out, block, rows), lse[block.batch, :, rows], block.causal, scale, kernels(block), mask=block.mask,
            softcap=kernels.softcap,
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


def _steps(plan, size) -> list[int]:
    """Steps after the first that some rank has work for (the same list on every rank)."""
    return [t for t in range(1, size) if any(plan.needs(t, r, size) for r in range(size))]


def _kv_by_step(comm, plan, k, v):
    """(step, [K, V] of the rank `step` before me) for step 0 and every step some rank needs,
    the next step's exchange in flight while the caller computes this one. Where I need
    nothing at a step, its K/V is an empty list."""
    size = comm.size if comm else 1
    steps = _steps(plan, size) if comm else []
    pending = _fetch_kv(comm, plan, steps[0], k, v) if steps else None
    yield 0, [k, v]
    for i, step in enumerate(steps):
        kv = pending.wait()
        pending = _fetch_kv(comm, plan, steps[i + 1], k, v) if i + 1 < len(steps) else None
        yield step, kv


def _fetch_kv(comm, plan, step, k, v) -> Pending:
    """My K/V to the rank `step` after me if it needs it; the K/V of the rank `step` before me
    if I need it (else the result is empty)."""
    rank, size = comm.rank, comm.size
    target, source = (rank + step) % size, (rank - step) % size
    sends = [(target, t, t) for t in (k, v)] if plan.needs(step, target, size) else []
    recvs = [(source, buffer_like(t)) for t in (k, v)] if plan.needs(step, rank, size) else []
    return exchange(comm.group, sends, recvs)


class RingComm:
    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)


def _ring_forward(q, k, v, scale, plan, comm, softcap=None, sinks=None):
    size, rank = (comm.size, comm.rank) if comm else (1, 0)
    kernels = Kernels(q, plan.masked, softcap)
    state = None
    for step, kv in _kv_by_step(comm, plan, k, v):
        if plan.needs(step, rank, size):
            blocks = plan.blocks(step, rank, size, q.shape[2], k.shape[2])
            state = forward_blocks(q, kv[0], kv[1], blocks, scale, kernels, state)
    return finish_forward(q, state, sinks)


def _ring_backward(dout, q, k, v, out, lse, scale, plan, comm, softcap=None):
    size, rank = (comm.size, comm.rank) if comm else (1, 0)
    kernels = Kernels(q, plan.masked, softcap)
    lse = safe_lse(lse, plan.masked)
    dq = own_dk = own_dv = None
    returning = None  # the previous step's dK/dV exchange
    for step, kv in _kv_by_step(comm, plan, k, v):
        dk = dv = None
        if plan.needs(step, rank, size):
            blocks = plan.blocks(step, rank, size, q.shape[2], k.shape[2])
            dq, dk, dv = backward_blocks(dout, q, kv[0], kv[1], out, lse, blocks, scale, kernels, (dq, None, None))
        if step == 0:
            own_dk, own_dv = dk, dv
            continue
        if returning is not None:
            own_dk, own_dv = _add_returned(returning, own_dk, own_dv)
        returning = _return_dkv(comm, plan, step, dk, dv, k, accumulation_dtype(q.dtype))
    if returning is not None:
        own_dk, own_dv = _add_returned(returning, own_dk, own_dv)
    dq = torch.zeros_like(q) if dq is None else dq
    own_dk = torch.zeros_like(k) if own_dk is None else own_dk
    own_dv = torch.zeros_like(v) if own_dv is None else own_dv
    return dq.to(q.dtype), own_dk.to(k.dtype), own_dv.to(v.dtype)


def _return_dkv(comm, plan, step, dk, dv, k, acc) -> Pending:
    """dK/dV of the borrowed K/V back to its owner (the rank `step` before me); the dK/dV of my
    K/V from the rank `step` after me, if it used them."""
    rank, size = comm.rank, comm.size
    source, target = (rank - step) % size, (rank + step) % size
    sends = []
    if dk is not None:  # I had work with the borrowed K/V
        sends = [(source, dk, k), (source, dv, k)]
    recvs = [(target, buffer_like(k, acc)) for _ in range(2)] if plan.needs(step, target, size) else []
    return exchange(comm.group, sends, recvs)


def _add_returned(pending: Pending, own_dk, own_dv):
    received = pending.wait()
    if received:
        returned_dk, returned_dv = received
        own_dk = returned_dk if own_dk is None else own_dk.add_(returned_dk)
        own_dv = returned_dv if own_dv is None else own_dv.add_(returned_dv)
    return own_dk, own_dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, scale, plan, comm, softcap):
        out, lse = _ring_forward(q, k, v, scale, plan, comm, softcap, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.scale, ctx.plan, ctx.comm, ctx.softcap = scale, plan, comm, softcap
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, ctx.scale, ctx.plan, ctx.comm, ctx.softcap)
        return dq, dk, dv, sinks_grad(dout, out, lse, sinks), None, None, None, None


def ring_attention(q, k, v, scale: float, plan: RingPlan, group=None, softcap=None, sinks=None) -> torch.Tensor:
    """Exact attention of the local queries against the K/V of every rank in `group`.

    q (B, Hq, S_local, D), k/v (B, Hkv, S_local, D); returns (B, Hq, S_local, D).
    `group=None` or a group of one rank computes plain local attention. softcap: logits
    c * tanh(s / c); sinks (Hq,): a learned logit per head in every row's softmax.
    """
    comm = RingComm(group) if group is not None and dist.get_world_size(group) > 1 else None
    return _RingAttention.apply(q, k, v, sinks, scale, plan, comm, softcap)
