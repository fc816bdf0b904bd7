"""The ring core: exact attention over a sequence sharded across a process group.

K/V blocks travel around the ring (rank i sends to i+1) while the block in hand is being
computed. Which (query rows x key rows) products a rank computes at each step is the only
thing that differs between ring layouts; a mode supplies it as a `RingPlan`. Everything
else (communication, log-sum-exp merging, the backward) lives here once.

Backward: K/V rotate again in the same direction and each block's dK/dV accumulator (fp32)
travels with it, one step behind, so after P steps every rank holds the complete gradient
of its own K/V. Nothing is ever gathered on one rank.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .kernels import accumulation_dtype, attention_backward, attention_forward, select_backend
from .p2p import Pending, exchange

__all__ = ["Block", "RingPlan", "RingComm", "ring_attention", "merge_block"]


class Block(NamedTuple):
    """One kernel call: local query rows `q` attend to rows `kv` of the K/V block in hand."""

    q: slice
    kv: slice
    causal: bool


class RingPlan(Protocol):
    def blocks(self, step: int, rank: int, size: int, q_len: int, kv_len: int) -> Sequence[Block]:
        """Blocks to compute at `step`, while holding the K/V of rank (rank - step) % size.

        Step 0 (own K/V) must start with a block that covers every local query row.
        """


class RingComm:
    """Exchange with both ring neighbours of `group`: send to rank+1, receive from rank-1.

    Every rank issues the same sequence of `start` calls, so the k-th message a rank sends
    to its successor is matched by the successor's k-th receive.
    """

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)

    def start(self, tensors: Sequence[torch.Tensor]) -> Pending:
        following, preceding = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        return exchange(
            self.group,
            [(following, t) for t in tensors],
            [(preceding, torch.empty_like(t, memory_format=torch.contiguous_format)) for t in tensors],
        )


def merge_block(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block's (out, lse) into running fp32 accumulators, in place.

    Stable form of out = (e^lse out + e^block_lse block_out) / (e^lse + e^block_lse):
    no exponent of a raw log-sum-exp is ever taken.
    """
    weight = torch.sigmoid(block_lse - lse).unsqueeze(-1)
    out.sub_(weight * (out - block_out.to(out.dtype)))
    lse.sub_(F.logsigmoid(lse - block_lse))


def _rows(x: torch.Tensor, rows: slice) -> torch.Tensor:
    return x[:, :, rows]


def _ring_forward(q, k, v, scale, plan, comm):
    size, rank = (comm.size, comm.rank) if comm else (1, 0)
    backend = select_backend(q)
    acc = accumulation_dtype(q.dtype)
    out = lse = None
    kv = [k, v]
    for step in range(size):
        pending = comm.start(kv) if step + 1 < size else None
        for block in plan.blocks(step, rank, size, q.shape[2], k.shape[2]):
            block_out, block_lse = attention_forward(
                _rows(q, block.q), _rows(kv[0], block.kv), _rows(kv[1], block.kv), block.causal, scale, backend
            )
            if out is None:
                assert block.q == slice(None), "a plan must start with a block covering all rows"
                out, lse = block_out, block_lse.contiguous()  # no copy if nothing is merged in
            else:
                if out.dtype != acc:  # the first merge: accumulate in fp32 from here on
                    out, lse = out.to(acc), lse.to(acc)
                merge_block(_rows(out, block.q), lse[:, :, block.q], block_out, block_lse)
        if pending is not None:
            kv = pending.wait()
    return out.to(q.dtype), lse


def _accumulate(total, rows: slice, block_grad, like, acc):
    """total[rows] += block_grad, where a missing total starts as the block gradient itself
    when the block covers every row (no zero-filled buffer, no copy in fp32)."""
    if total is None:
        if rows == slice(None):
            return block_grad.to(acc)
        total = torch.zeros_like(like, dtype=acc)
    _rows(total, rows).add_(block_grad)
    return total


def _ring_backward(dout, q, k, v, out, lse, scale, plan, comm):
    size, rank = (comm.size, comm.rank) if comm else (1, 0)
    backend = select_backend(q)
    acc = accumulation_dtype(q.dtype)
    dq = None
    kv, pending_kv, pending_dkv = [k, v], None, None
    for step in range(size):
        if step + 1 < size:
            pending_kv = comm.start(kv)
        dk = dv = None
        for block in plan.blocks(step, rank, size, q.shape[2], k.shape[2]):
            rows = block.q
            block_dq, block_dk, block_dv = attention_backward(
                _rows(dout, rows), _rows(q, rows), _rows(kv[0], block.kv), _rows(kv[1], block.kv),
                _rows(out, rows), lse[:, :, rows], block.causal, scale, backend,
            )
            dq = _accumulate(dq, rows, block_dq, q, acc)
            dk = _accumulate(dk, block.kv, block_dk, k, acc)
            dv = _accumulate(dv, block.kv, block_dv, v, acc)
            del block_dq, block_dk, block_dv
        if pending_dkv is not None:  # what the ranks before us added for this K/V block
            earlier_dk, earlier_dv = pending_dkv.wait()
            dk.add_(earlier_dk)
            dv.add_(earlier_dv)
            del earlier_dk, earlier_dv
        if comm is None:
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        # After the last step this goes to the block's owner, complete.
        pending_dkv = comm.start([dk, dv])
        if pending_kv is not None:
            kv, pending_kv = pending_kv.wait(), None
    dk, dv = pending_dkv.wait()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, plan, comm):
        out, lse = _ring_forward(q, k, v, scale, plan, comm)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.plan, ctx.comm = scale, plan, comm
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout.contiguous(), q, k, v, out, lse, ctx.scale, ctx.plan, ctx.comm)
        return dq, dk, dv, None, None, None


def ring_attention(q, k, v, scale: float, plan: RingPlan, group=None) -> torch.Tensor:
    """Exact attention of the local queries against the K/V of every rank in `group`.

    q (B, Hq, S_local, D), k/v (B, Hkv, S_local, D); returns (B, Hq, S_local, D).
    `group=None` or a group of one rank computes plain local attention.
    """
    comm = RingComm(group) if group is not None and dist.get_world_size(group) > 1 else None
    return _RingAttention.apply(q, k, v, scale, plan, comm)
