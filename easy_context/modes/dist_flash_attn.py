"""dist_flash_attn: DistFlashAttn (LightSeq) on the shared kernel layer.

Contiguous shards; the balanced causal schedule of `schedule.py` (every rank computes the
same work, for any number of ranks); the next round's K/V and queries are fetched while
the current round computes, and partial results travel back while the next one computes;
with gradient checkpointing the forward is not recomputed in the backward (remat.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from easy_context.core.kernels import accumulation_dtype
from easy_context.core.layout import Layout
from easy_context.core.masking import FULL_ROWS, Block
from easy_context.modes import SeqParallelMode, fixed_ring_degree
from easy_context.modes.costs import Activations, AttentionShape, balanced_schedule_traffic
from easy_context.core.p2p import buffer_like, exchange
from easy_context.core.remat import AttentionOutputCache, in_backward
from easy_context.core.ring import Kernels, backward_blocks, finish_forward, fold_sinks, forward_blocks, merge_block, safe_lse, sinks_grad
from easy_context.modes.dist_flash_schedule import Unit, balanced_schedule

__all__ = ["dist_flash_attention", "REMAT_CACHE", "MODE"]

REMAT_CACHE = AttentionOutputCache()


class _Plan:
    """Kernel calls of each schedule unit: one block (causal on the diagonal) without a mask;
    under a mask, the mask's blocks, and units with no allowed pair are dropped on every rank
    (no compute, no transfer)."""

    def __init__(self, mask, size: int, local_len: int, device):
        self.mask, self.device, self.local_len = mask, device, local_len
        self.masked = mask is not None and not mask.is_causal
        self.layout, self.seq_len = Layout(zigzag=False, ring_degree=size), local_len * size

    def rows(self, unit: Unit) -> slice:
        """The unit's query rows. The middle round's halves split the unit's work, which for a
        layout of its own per row (document_split) is not half of its rows."""
        if self.mask is None or self.mask.ring_index is None:
            return unit.rows(self.local_len)
        return split_rows(self.mask, unit, self.mask.ring_index, self.local_len)

    def _index(self, rank: int):
        if self.mask.ring_index is not None:  # document_split: a layout of its own per row
            return self.mask.ring_index[rank]
        return self.layout.local_indices(self.seq_len, rank)

    def _indices(self, unit: Unit):
        return self._index(unit.q_owner)[..., self.rows(unit)], self._index(unit.kv_owner)

    def blocks(self, unit: Unit):
        if not self.masked:
            return [Block(FULL_ROWS, FULL_ROWS, unit.causal)]
        return self.mask.blocks(("dist_flash", self.seq_len, unit), *self._indices(unit), self.device)

    def needed(self, unit: Unit) -> bool:
        return not self.masked or self.mask.has_pairs(("dist_flash", self.seq_len, unit), *self._indices(unit))

    def rounds(self, size: int):
        return [[u for u in units if self.needed(u)] for units in balanced_schedule(size)]


def split_rows(mask, unit: Unit, index, local_len: int) -> slice:
    """Rows of a unit under a per-row layout: all of them, or the half of the allowed pairs of
    q_owner's rows x kv_owner's keys that `unit.part` names (cut at the same row on every rank:
    the mask is the same everywhere)."""
    if unit.parts == 1:
        return slice(0, local_len)
    key = ("dist_flash cut", unit.q_owner, unit.kv_owner)
    if key not in mask._plans:
        work = mask.pairs_per_query(index[unit.q_owner], index[unit.kv_owner]).cumsum(0)
        mask._plans[key] = int(torch.searchsorted(work, work[-1] / 2).clamp(1, local_len - 1)) if local_len > 1 else 0
    cut = mask._plans[key]
    return slice(0, cut) if unit.part == 0 else slice(cut, local_len)


def _transfer(group, me, units, sender, receiver, payload, template):
    """For each unit whose `sender(u)` and `receiver(u)` differ, send `payload(i, u)` from the
    sender to the receiver, into buffers shaped like `template(u)`. Returns {i: buffers}."""
    sends, recvs, received = [], [], {}
    for i, unit in enumerate(units):
        src, dst = sender(unit), receiver(unit)
        if src == dst:
            continue
        if me == src:
            sends += [(dst, tensor, like) for tensor, like in zip(payload(i, unit), template(unit))]
        if me == dst:
            received[i] = [buffer_like(t) for t in template(unit)]
            recvs += [(src, buffer) for buffer in received[i]]
    return exchange(group, sends, recvs, received)
def _q_owner(u):
    return u.q_owner


def _kv_owner(u):
    return u.kv_owner


def _worker(u):
    return u.worker


def _forward(q, k, v, scale, group, me, plan, rounds, softcap=None, sinks=None):
    kernels = Kernels(q, plan.masked, softcap)
    rows = lambda u, x: x[:, :, plan.rows(u)]  # noqa: E731  (rows of a q-side tensor)

    def fetch(units):
        return (
            _transfer(group, me, units, _q_owner, _worker, lambda i, u: [rows(u, q)], lambda u: [rows(u, q)]),
            _transfer(group, me, units, _kv_owner, _worker, lambda i, u: [k, v], lambda u: [k, v]),
        )

    pending = fetch(rounds[1]) if len(rounds) > 1 else None  # in flight during the diagonal
    state = None
    for unit in rounds[0]:  # the diagonal, if this rank has anything to attend there
        if unit.worker == me:
            state = forward_blocks(q, k, v, plan.blocks(unit), scale, kernels)
    out, lse = state if state is not None else finish_forward(q, None)  # merged state stays fp32
    out, lse = out.to(accumulation_dtype(q.dtype)), lse.contiguous()

    def merge(unit, block_out, block_lse):
        r = plan.rows(unit)
        merge_block(out[:, :, r], lse[:, :, r], block_out, block_lse)

    returning = None
    for t in range(1, len(rounds)):
        units = rounds[t]
        fetched_q, fetched_kv = (p.wait() for p in pending)
        pending = fetch(rounds[t + 1]) if t + 1 < len(rounds) else None  # overlap with compute
        results = {}
        for i, u in enumerate(units):
            if u.worker != me:
                continue
            uq = fetched_q[i][0] if i in fetched_q else rows(u, q)
            uk, uv = fetched_kv.get(i, (k, v))
            block_out, block_lse = finish_forward(uq, forward_blocks(uq, uk, uv, plan.blocks(u), scale, kernels))
            if u.q_owner == me:
                merge(u, block_out, block_lse)
            else:
                results[i] = [block_out, block_lse]
        if returning is not None:
            _merge_returned(*returning, merge)
        returning = (units, _transfer(
            group, me, units, _worker, _q_owner, lambda i, u: results[i],
            lambda u: [rows(u, q), rows(u, lse)],
        ))
    if returning is not None:
        _merge_returned(*returning, merge)
    out, lse = fold_sinks(out, lse, sinks)  # on the fp32 accumulators, before the cast
    return out.to(q.dtype), lse


def _merge_returned(units, pending, merge):
    for i, (block_out, block_lse) in pending.wait().items():
        merge(units[i], block_out, block_lse)


def _backward(dout, q, k, v, out, lse, scale, group, me, plan, rounds, softcap=None):
    kernels, acc = Kernels(q, plan.masked, softcap), accumulation_dtype(q.dtype)
    lse = safe_lse(lse, plan.masked)
    rows = lambda u, x: x[:, :, plan.rows(u)]  # noqa: E731
    q_side = lambda u: [rows(u, x) for x in (q, dout, out, lse)]  # noqa: E731

    def fetch(units):
        return (
            _transfer(group, me, units, _q_owner, _worker, lambda i, u: q_side(u), q_side),
            _transfer(group, me, units, _kv_owner, _worker, lambda i, u: [k, v], lambda u: [k, v]),
        )

    pending = fetch(rounds[1]) if len(rounds) > 1 else None  # in flight during the diagonal
    dq = dk = dv = None
    for unit in rounds[0]:
        if unit.worker == me:
            dq, dk, dv = backward_blocks(dout, q, k, v, out, lse, plan.blocks(unit), scale, kernels)
    dq = torch.zeros_like(q, dtype=acc) if dq is None else dq
    dk = torch.zeros_like(k, dtype=acc) if dk is None else dk
    dv = torch.zeros_like(v, dtype=acc) if dv is None else dv

    def send_back(units, grads):
        return (
            units,
            _transfer(group, me, units, _worker, _q_owner, lambda i, u: [grads[i][0]], lambda u: [rows(u, dq)]),
            _transfer(group, me, units, _worker, _kv_owner, lambda i, u: grads[i][1:], lambda u: [dk, dv]),
        )

    def accumulate(units, dq_pending, dkv_pending):
        for i, (block_dq,) in dq_pending.wait().items():
            rows(units[i], dq).add_(block_dq)
        for block_dk, block_dv in dkv_pending.wait().values():
            dk.add_(block_dk)
            dv.add_(block_dv)

    returning = None
    for t in range(1, len(rounds)):
        units = rounds[t]
        fetched_q, fetched_kv = (p.wait() for p in pending)
        pending = fetch(rounds[t + 1]) if t + 1 < len(rounds) else None
        grads = {}
        for i, u in enumerate(units):
            if u.worker != me:
                continue
            uq, udout, uout, ulse = fetched_q.get(i) or q_side(u)
            uk, uv = fetched_kv.get(i, (k, v))
            grads[i] = list(backward_blocks(udout, uq, uk, uv, uout, ulse, plan.blocks(u), scale, kernels))
            if u.q_owner == me:
                rows(u, dq).add_(grads[i][0])
            if u.kv_owner == me:
                dk.add_(grads[i][1])
                dv.add_(grads[i][2])
        if returning is not None:
            accumulate(*returning)
        returning = send_back(units, grads)
    if returning is not None:
        accumulate(*returning)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _DistFlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, scale, group, layer, mask, graph, softcap):
        me = dist.get_rank(group) if group is not None else 0
        size = dist.get_world_size(group) if group is not None else 1
        plan = _Plan(mask, size, q.shape[2], q.device)
        rounds = plan.rounds(size)
        cached = REMAT_CACHE.take(layer) if layer is not None and in_backward() else None
        tag = None
        if cached is not None:  # a checkpointed layer re-running its forward: nothing to recompute
            out, lse = cached
        else:
            out, lse = _forward(q, k, v, scale, group, me, plan, rounds, softcap, sinks)
            if layer is not None and layer.training and not in_backward():
                tag = REMAT_CACHE.put(layer, out, lse, graph)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.scale, ctx.group, ctx.me, ctx.plan, ctx.rounds, ctx.layer, ctx.tag = scale, group, me, plan, rounds, layer, tag
        ctx.softcap = softcap
        return out.detach()

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        if ctx.tag is not None:
            REMAT_CACHE.discard(ctx.layer, ctx.tag)  # not checkpointed: the entry was never needed
            served = REMAT_CACHE.served(ctx.layer)
            if served is not None and served != ctx.tag:
                # The re-run got another forward's output (a forward ran between ours and this
                # backward): recompute ours. Every rank sees the same sequence of calls.
                out, lse = _forward(q, k, v, ctx.scale, ctx.group, ctx.me, ctx.plan, ctx.rounds, ctx.softcap, sinks)
        grads = _backward(dout, q, k, v, out, lse, ctx.scale, ctx.group, ctx.me, ctx.plan, ctx.rounds, ctx.softcap)
        return (*grads, sinks_grad(dout, out, lse, sinks), None, None, None, None, None, None)


def dist_flash_attention(q, k, v, scale, group=None, layer=None, mask=None, softcap=None, sinks=None):
    """Causal attention of contiguously sharded q/k/v over `group`. `layer` (the HF
    attention module) enables checkpoint-aware reuse of the forward output; `mask` (a
    SequenceMask over the group's whole sequence) restricts the attention further; softcap
    and sinks as in ring.ring_attention."""
    # Grad mode is off inside autograd.Function.forward: read it here.
    return _DistFlashAttention.apply(q, k, v, sinks, scale, group, layer, mask, torch.is_grad_enabled(), softcap)


def dist_flash_activations(shape: AttentionShape) -> Activations:
    """Per token: in the backward the prefetched q, k, v and the fp32 partial dK/dV going back;
    under checkpointing the remat cache's output and fp32 lse of every layer."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    buffers = 2 * shape.dtype_bytes * (q + 2 * kv) + shape.accumulate_bytes * 2 * kv if shape.sp_size > 1 else 0
    return Activations(backward_buffers=buffers, kept_for_recompute=shape.dtype_bytes * q + 4 * shape.heads)


MODE = SeqParallelMode(
    "dist_flash_attn",
    ring_degree=fixed_ring_degree("dist_flash_attn", lambda sp: sp, "it has no Ulysses part"),
    zigzag=False,
    attention=lambda q, k, v, scale, groups, layer=None, mask=None, **logits: dist_flash_attention(
        q, k, v, scale, groups.ring, layer, mask, **logits
    ),
    document_split=True,
    traffic=balanced_schedule_traffic,
    activations=dist_flash_activations,
    keeps_attention_output=True,
)
