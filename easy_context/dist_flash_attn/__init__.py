"""dist_flash_attn: DistFlashAttn (LightSeq) on the shared kernel layer.

Contiguous shards; the balanced causal schedule of `schedule.py` (every rank computes the
same work, for any number of ranks); the next round's K/V and queries are fetched while
the current round computes, and partial results travel back while the next one computes;
with gradient checkpointing the forward is not recomputed in the backward (remat.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..kernels import accumulation_dtype, attention_backward, attention_forward, select_backend
from ..modes import SeqParallelMode, fixed_ring_degree
from ..p2p import exchange
from ..remat import AttentionOutputCache, in_backward
from ..ring import merge_block
from .schedule import balanced_schedule

__all__ = ["dist_flash_attention", "REMAT_CACHE", "MODE"]

REMAT_CACHE = AttentionOutputCache()


def _transfer(group, me, units, sender, receiver, payload, template):
    """For each unit whose `sender(u)` and `receiver(u)` differ, send `payload(i, u)` from the
    sender to the receiver, into buffers shaped like `template(u)`. Returns {i: buffers}."""
    sends, recvs, received = [], [], {}
    for i, unit in enumerate(units):
        src, dst = sender(unit), receiver(unit)
        if src == dst:
            continue
        if me == src:
            sends += [(dst, tensor) for tensor in payload(i, unit)]
        if me == dst:
            received[i] = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in template(unit)]
            recvs += [(src, buffer) for buffer in received[i]]
    return exchange(group, sends, recvs, received)


def _q_owner(u):
    return u.q_owner


def _kv_owner(u):
    return u.kv_owner


def _worker(u):
    return u.worker


def _forward(q, k, v, scale, group, me, rounds):
    backend, q_len = select_backend(q), q.shape[2]
    rows = lambda u, x: x[:, :, u.rows(q_len)]  # noqa: E731  (rows of a q-side tensor)

    def fetch(units):
        return (
            _transfer(group, me, units, _q_owner, _worker, lambda i, u: [rows(u, q)], lambda u: [rows(u, q)]),
            _transfer(group, me, units, _kv_owner, _worker, lambda i, u: [k, v], lambda u: [k, v]),
        )

    pending = fetch(rounds[1]) if len(rounds) > 1 else None  # in flight during the diagonal
    out, lse = attention_forward(q, k, v, True, scale, backend)
    out, lse = out.to(accumulation_dtype(q.dtype)), lse.contiguous()

    def merge(unit, block_out, block_lse):
        r = unit.rows(q_len)
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
            block_out, block_lse = attention_forward(uq, uk, uv, u.causal, scale, backend)
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
    return out.to(q.dtype), lse


def _merge_returned(units, pending, merge):
    for i, (block_out, block_lse) in pending.wait().items():
        merge(units[i], block_out, block_lse)


def _backward(dout, q, k, v, out, lse, scale, group, me, rounds):
    backend, q_len, acc = select_backend(q), q.shape[2], accumulation_dtype(q.dtype)
    rows = lambda u, x: x[:, :, u.rows(q_len)]  # noqa: E731
    q_side = lambda u: [rows(u, x) for x in (q, dout, out, lse)]  # noqa: E731

    def fetch(units):
        return (
            _transfer(group, me, units, _q_owner, _worker, lambda i, u: q_side(u), q_side),
            _transfer(group, me, units, _kv_owner, _worker, lambda i, u: [k, v], lambda u: [k, v]),
        )

    pending = fetch(rounds[1]) if len(rounds) > 1 else None  # in flight during the diagonal
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, True, scale, backend)
    dq, dk, dv = dq.to(acc), dk.to(acc), dv.to(acc)

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
            block_dq, block_dk, block_dv = attention_backward(udout, uq, uk, uv, uout, ulse, u.causal, scale, backend)
            grads[i] = [block_dq.to(acc), block_dk.to(acc), block_dv.to(acc)]
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
    def forward(ctx, q, k, v, scale, group, layer):
        me = dist.get_rank(group) if group is not None else 0
        rounds = balanced_schedule(dist.get_world_size(group) if group is not None else 1)
        cached = REMAT_CACHE.take(layer, q, k, v) if layer is not None and in_backward() else None
        if cached is not None:  # a checkpointed layer re-running its forward: nothing to recompute
            out, lse = cached
            entry = None
        else:
            out, lse = _forward(q, k, v, scale, group, me, rounds)
            entry = REMAT_CACHE.put(layer, q, k, v, out, lse) if layer is not None and layer.training else None
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.group, ctx.me, ctx.rounds, ctx.layer, ctx.entry = scale, group, me, rounds, layer, entry
        return out.detach()

    @staticmethod
    def backward(ctx, dout):
        if ctx.entry is not None:  # not checkpointed: the entry was never needed
            REMAT_CACHE.discard(ctx.layer, ctx.entry)
        q, k, v, out, lse = ctx.saved_tensors
        grads = _backward(dout.contiguous(), q, k, v, out, lse, ctx.scale, ctx.group, ctx.me, ctx.rounds)
        return (*grads, None, None, None)


def dist_flash_attention(q, k, v, scale, group=None, layer=None):
    """Causal attention of contiguously sharded q/k/v over `group`. `layer` (the HF
    attention module) enables checkpoint-aware reuse of the forward output."""
    return _DistFlashAttention.apply(q, k, v, scale, group, layer)


MODE = SeqParallelMode(
    "dist_flash_attn",
    ring_degree=fixed_ring_degree("dist_flash_attn", lambda sp: sp, "it has no Ulysses part"),
    zigzag=False,
    attention=lambda q, k, v, scale, groups, layer=None: dist_flash_attention(q, k, v, scale, groups.ring, layer),
)
