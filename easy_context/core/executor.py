"""The executor: exact attention over a sequence sharded across a process group, run as a schedule.

A schedule is a list of rounds; a round is a list of units, the same list on every rank. A unit
(query owner, K/V owner, worker, rows) says: `worker` computes the attention of rows `rows`
of the query owner's local queries against the K/V owner's local K/V. The modes differ only
in their schedules:
  ring (core/ring.py)  round t: every rank computes its own queries against the K/V of the
                       rank t before it (worker = query owner);
  dist_flash           LightSeq's balanced schedule: some units are computed by the K/V owner
                       for a query owner further along the sequence (worker = K/V owner).

Each round, the inputs a worker lacks (the rows of the K/V owner's K/V the unit needs, all of
them without a mask; the query owner's query rows, and in the backward its dout/out/lse rows)
are fetched while the previous round computes,
and what a worker computed for another rank (partial out/lse in the forward, dQ/dK/dV in
the backward, fp32) travels back while the next round computes. Units a worker computes for
its own query rows merge straight into its running fp32 state, in round order; returned
partials merge when they arrive, one round later. A unit split between its two ranks (rows
part/parts) is computed apart when it is one kernel call, and its rows merge together with
the rows the other rank returns: one merge over all rows instead of one per part. Nothing is
ever gathered on one rank.

Recompute-free checkpointing (remat.py): given the HF layer, a forward re-run by gradient
checkpointing inside the backward takes the layer's stored output instead of attending again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist

from easy_context.core.blocks import (
    Kernels,
    backward_blocks,
    covers,
    empty_state,
    finish_forward,
    forward_blocks,
    merge_block,
    rows_view,
    safe_lse,
    sinks_grad,
)
from easy_context.core.kernels import accumulation_dtype
from easy_context.core.masking import FULL_ROWS, Block
from easy_context.core.p2p import Pending, buffer_like, exchange
from easy_context.core.remat import AttentionOutputCache, in_backward

__all__ = ["Unit", "Schedule", "execute", "REMAT_CACHE"]

# Attention outputs kept across checkpoint recomputation, per HF layer.
REMAT_CACHE = AttentionOutputCache()


class Unit(NamedTuple):
    """`worker` computes rows part/parts of q_owner's queries against the K/V of kv_owner."""

    q_owner: int
    kv_owner: int
    worker: int
    part: int = 0
    parts: int = 1

    @property
    def causal(self) -> bool:
        return self.q_owner == self.kv_owner

    def rows(self, q_len: int) -> slice:
        size = q_len // self.parts
        stop = q_len if self.part == self.parts - 1 else (self.part + 1) * size
        return slice(self.part * size, stop)


class Schedule(Protocol):
    masked: bool  # whether some rows may have no allowed key in a block (lse = -inf)
    rounds: list  # list of rounds, each a list of Units; identical on every rank

    def rows(self, unit: Unit) -> slice:
        """The query owner's local rows the unit covers."""

    def keys(self, unit: Unit):
        """The K/V owner's local rows the unit needs: FULL_ROWS (all), a slice, or an increasing
        index tensor on the device. Only these travel, and their dK/dV back. A unit whose
        worker owns the K/V takes FULL_ROWS or a slice (its rows are viewed, not copied)."""

    def blocks(self, unit: Unit) -> Sequence[Block]:
        """Kernel calls of the unit: query rows relative to `rows(unit)`, keys relative to `keys(unit)`."""


def _shifted(blocks: Sequence[Block], rows: slice, q_len: int) -> Sequence[Block]:
    """Blocks relative to `rows` as blocks of all q_len local rows."""
    if covers(rows, q_len):
        return blocks
    start, length = rows.start or 0, rows.stop - (rows.start or 0)
    shifted = []
    for block in blocks:
        first, last, _ = block.q.indices(length)
        shifted.append(block._replace(q=slice(start + first, start + last)))
    return shifted


def _split_apart(blocks: Sequence[Block], rows: slice, q_len: int) -> bool:
    """Whether a unit of some of the owner's rows is computed apart from the running state:
    when it is one kernel call over all of its rows, its result is those rows' partial,
    merged in one go with the part of the unit another rank computed (the middle round of
    dist_flash's schedule splits a unit between its two ranks)."""
    if covers(rows, q_len) or len(blocks) != 1:
        return False
    return covers(blocks[0].q, rows.stop - (rows.start or 0)) and blocks[0].batch == FULL_ROWS


def _key_rows(x: torch.Tensor, keys) -> torch.Tensor:
    """Rows `keys` of a (B, H, S, D) K/V tensor: a view for a slice, a compact copy for an index."""
    return rows_view(x, keys) if isinstance(keys, slice) else x.index_select(2, keys)


def _key_rows_like(x: torch.Tensor, keys) -> torch.Tensor:
    """A receive template with the layout `_key_rows(x, keys)` has on the sender, without copying."""
    return rows_view(x, keys) if isinstance(keys, slice) else x.new_empty((*x.shape[:2], len(keys), *x.shape[3:]))


def _tile_all_rows(rows: Sequence[slice], q_len: int) -> bool:
    """Whether row ranges, in order, cover 0..q_len once."""
    ends = [0] + [r.stop for r in rows]
    return len(rows) > 1 and ends[-1] == q_len and all(r.start == end for r, end in zip(rows, ends))


def _transfer(group, me, units, sender, receiver, payload, template, payload_is_template=False) -> Pending:
    """For each unit whose sender(u) and receiver(u) differ, send payload(i, u) from the sender
    to the receiver, into buffers made by template(u) = [(like, dtype)]. Returns {i: buffers}.
    payload_is_template: the payload has the template's layout (the sender skips making it).
    Both sides post in unit order, so messages between two ranks match."""
    sends, recvs, received = [], [], {}
    for i, unit in enumerate(units):
        src, dst = sender(unit), receiver(unit)
        if src == dst or me not in (src, dst):
            continue
        if me == src:
            tensors = payload(i, unit)
            likes = tensors if payload_is_template else [like for like, _ in template(unit)]
            sends += [(dst, tensor, like) for tensor, like in zip(tensors, likes)]
        else:
            received[i] = [buffer_like(like, dtype) for like, dtype in template(unit)]
            recvs += [(src, buffer) for buffer in received[i]]
    return exchange(group, sends, recvs, received)


def _q_owner(u):
    return u.q_owner


def _kv_owner(u):
    return u.kv_owner


def _worker(u):
    return u.worker


class _Run:
    """One call's schedule, process group and tensors' templates, shared by forward and backward."""

    def __init__(self, schedule: Schedule, group, me: int, softcap):
        self.schedule, self.group, self.me, self.softcap = schedule, group, me, softcap

    def rows(self, unit, x):
        return rows_view(x, self.schedule.rows(unit))

    def keys(self, unit, x):
        return _key_rows(x, self.schedule.keys(unit))

    def keys_like(self, unit, x):
        return _key_rows_like(x, self.schedule.keys(unit))

    def fetch(self, units, q_side, kv):
        """Transfers of the inputs the workers of `units` lack: q-side rows and K/V rows."""
        q_template = lambda u: [(self.rows(u, x), None) for x in q_side]  # noqa: E731
        kv_template = lambda u: [(self.keys_like(u, x), None) for x in kv]  # noqa: E731
        return (
            _transfer(
                self.group,
                self.me,
                units,
                _q_owner,
                _worker,
                lambda i, u: [self.rows(u, x) for x in q_side],
                q_template,
                payload_is_template=True,
            ),
            _transfer(
                self.group,
                self.me,
                units,
                _kv_owner,
                _worker,
                lambda i, u: [self.keys(u, x) for x in kv],
                kv_template,
                payload_is_template=True,  # a view of K/V, or a compact copy: keys_like's layout
            ),
        )

    def rounds(self, q_side, kv):
        """(round's units, fetched q-side rows {i: [...]}, fetched K/V {i: [k, v]}) per round,
        the next round's fetch in flight while the caller computes this one."""
        rounds = self.schedule.rounds
        pending = self.fetch(rounds[0], q_side, kv) if rounds else None
        for t, units in enumerate(rounds):
            fetched_q, fetched_kv = (p.wait() for p in pending)
            pending = self.fetch(rounds[t + 1], q_side, kv) if t + 1 < len(rounds) else None
            yield units, fetched_q, fetched_kv


def _forward(q, k, v, scale, run: _Run, sinks=None):
    schedule, me, acc = run.schedule, run.me, accumulation_dtype(q.dtype)
    kernels = Kernels(q, run.softcap)
    lse_like = torch.empty(q.shape[:3], dtype=acc, device=q.device)  # the shape of a returned lse
    state = None

    def merge_parts(parts):
        """Fold (rows, out, lse) of one round into the state: parts whose rows tile all of them
        (a unit split between its two owners) as one merge over all rows."""
        nonlocal state
        if not parts:
            return
        if state is None or state[0].dtype != acc:
            state = empty_state(q, acc) if state is None else (state[0].to(acc), state[1].to(acc))
        parts.sort(key=lambda part: part[0].start)
        if _tile_all_rows([r for r, _, _ in parts], q.shape[2]):
            parts = [(FULL_ROWS, *(torch.cat(x, dim=2) for x in list(zip(*parts))[1:]))]
        for r, block_out, block_lse in parts:
            merge_block(rows_view(state[0], r), rows_view(state[1], r), block_out, block_lse, schedule.masked)

    def merge_returned(returning):
        units, pending, parts = returning
        merge_parts(parts + [(schedule.rows(units[i]), *result) for i, result in pending.wait().items()])

    returning = None
    for units, fetched_q, fetched_kv in run.rounds([q], [k, v]):
        results, parts = {}, []
        for i, u in enumerate(units):
            if u.worker != me:
                continue
            uk, uv = fetched_kv.get(i) or [run.keys(u, x) for x in (k, v)]
            if u.q_owner == me and _split_apart(schedule.blocks(u), schedule.rows(u), q.shape[2]):
                # some of my rows in one call: merged with the rows computed for me this round
                parts.append(
                    (schedule.rows(u), *forward_blocks(run.rows(u, q), uk, uv, schedule.blocks(u), scale, kernels))
                )
            elif u.q_owner == me:
                blocks = _shifted(schedule.blocks(u), schedule.rows(u), q.shape[2])
                state = forward_blocks(q, uk, uv, blocks, scale, kernels, state)
            else:
                uq = fetched_q[i][0]
                results[i] = list(finish_forward(uq, forward_blocks(uq, uk, uv, schedule.blocks(u), scale, kernels)))
        if returning is not None:
            merge_returned(returning)
        returning = None
        if any(u.worker != u.q_owner for u in units):
            returning = (
                units,
                _transfer(
                    run.group,
                    me,
                    units,
                    _worker,
                    _q_owner,
                    lambda i, u, results=results: results[i],
                    lambda u: [(run.rows(u, q), None), (run.rows(u, lse_like), None)],
                ),
                parts,
            )
        else:
            merge_parts(parts)
    if returning is not None:
        merge_returned(returning)
    return finish_forward(q, state, sinks)


def _backward(dout, q, k, v, out, lse, scale, run: _Run):
    schedule, me, acc = run.schedule, run.me, accumulation_dtype(q.dtype)
    kernels = Kernels(q, run.softcap)
    lse = safe_lse(lse, schedule.masked)
    grads = [None, None, None]  # this rank's dQ, dK, dV (fp32), started at the first contribution

    def add_dq(parts):
        """Add (rows, dQ rows) of one round; parts that tile all rows as one addition."""
        if not parts:
            return
        parts.sort(key=lambda part: part[0].start)
        if _tile_all_rows([r for r, _ in parts], q.shape[2]):
            parts = [(FULL_ROWS, torch.cat([g for _, g in parts], dim=2))]
        for r, block_dq in parts:
            if grads[0] is None:
                grads[0] = torch.zeros_like(q, dtype=acc)
            rows_view(grads[0], r).add_(block_dq)

    def kv_rows(unit):
        """This rank's dK/dV accumulators for a unit of its own K/V: the totals themselves when
        the unit needs every key row, else views of its key rows (the totals started as zeros)."""
        keys = schedule.keys(unit)
        if covers(keys, k.shape[2]):
            return grads[1], grads[2]
        for j, x in ((1, k), (2, v)):
            if grads[j] is None:
                grads[j] = torch.zeros_like(x, dtype=acc)
        return rows_view(grads[1], keys), rows_view(grads[2], keys)

    def add_kv(unit, block_dk, block_dv):
        """Add the dK/dV another rank computed with this rank's K/V rows `keys(unit)`."""
        keys = schedule.keys(unit)
        if isinstance(keys, slice) and covers(keys, k.shape[2]) and grads[1] is None:
            grads[1], grads[2] = block_dk, block_dv  # the first: no zero-filled total
        elif isinstance(keys, slice):
            for total, block_grad in zip(kv_rows(unit), (block_dk, block_dv)):
                total.add_(block_grad)
        else:
            for j, x, block_grad in ((1, k, block_dk), (2, v, block_dv)):
                if grads[j] is None:
                    grads[j] = torch.zeros_like(x, dtype=acc)
                grads[j].index_add_(2, keys, block_grad)

    def add_returned(returning):
        units, dq_pending, dkv_pending, dq_parts = returning
        add_dq(dq_parts + [(schedule.rows(units[i]), block_dq) for i, (block_dq,) in dq_pending.wait().items()])
        for i, (block_dk, block_dv) in dkv_pending.wait().items():
            add_kv(units[i], block_dk, block_dv)

    returning = None
    for units, fetched_q, fetched_kv in run.rounds([q, dout, out, lse], [k, v]):
        partial = {}  # unit index -> [dQ rows or None, dK or None, dV or None] for other ranks
        dq_parts = []  # (rows, dQ) of my split units, added with the rows computed for me this round
        for i, u in enumerate(units):
            if u.worker != me:
                continue
            uk, uv = fetched_kv.get(i) or [run.keys(u, x) for x in (k, v)]
            own_kv = u.kv_owner == me
            kv_grads = kv_rows(u) if own_kv else (None, None)
            if u.q_owner == me and not _split_apart(schedule.blocks(u), schedule.rows(u), q.shape[2]):
                blocks = _shifted(schedule.blocks(u), schedule.rows(u), q.shape[2])
                dq, dk, dv = backward_blocks(dout, q, uk, uv, out, lse, blocks, scale, kernels, (grads[0], *kv_grads))
                grads[0] = dq
            elif u.q_owner == me:
                dq, dk, dv = backward_blocks(
                    *(run.rows(u, x) for x in (dout, q)),
                    uk,
                    uv,
                    *(run.rows(u, x) for x in (out, lse)),
                    schedule.blocks(u),
                    scale,
                    kernels,
                    (None, *kv_grads),
                )
                dq_parts.append((schedule.rows(u), dq))
            else:
                uq, udout, uout, ulse = fetched_q[i]
                dq, dk, dv = backward_blocks(
                    udout,
                    uq,
                    uk,
                    uv,
                    uout,
                    ulse,
                    schedule.blocks(u),
                    scale,
                    kernels,
                    (None, *kv_grads),
                )
            if own_kv and covers(schedule.keys(u), k.shape[2]):  # else added in place to the views
                grads[1], grads[2] = dk, dv
            partial[i] = [None if u.q_owner == me else dq, None if own_kv else dk, None if own_kv else dv]
        if returning is not None:
            add_returned(returning)
        returning = (
            units,
            _transfer(
                run.group,
                me,
                units,
                _worker,
                _q_owner,
                lambda i, u, partial=partial: partial[i][:1],
                lambda u: [(run.rows(u, q), acc)],
            ),
            _transfer(
                run.group,
                me,
                units,
                _worker,
                _kv_owner,
                lambda i, u, partial=partial: partial[i][1:],
                lambda u: [(run.keys_like(u, k), acc), (run.keys_like(u, v), acc)],
            ),
            dq_parts,
        )
    if returning is not None:
        add_returned(returning)
    return tuple(torch.zeros_like(x) if g is None else g.to(x.dtype) for g, x in zip(grads, (q, k, v)))


class _Executed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, scale, run, layer, graph):
        cached = REMAT_CACHE.take(layer) if layer is not None and in_backward() else None
        tag = None
        if cached is not None:  # a checkpointed layer re-running its forward: nothing to recompute
            out, lse = cached
        else:
            out, lse = _forward(q, k, v, scale, run, sinks)
            if layer is not None and layer.training and not in_backward():
                tag = REMAT_CACHE.put(layer, out, lse, graph)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.scale, ctx.run, ctx.layer, ctx.tag = scale, run, layer, tag
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
                out, lse = _forward(q, k, v, ctx.scale, ctx.run, sinks)
        dq, dk, dv = _backward(dout, q, k, v, out, lse, ctx.scale, ctx.run)
        return dq, dk, dv, sinks_grad(dout, out, lse, sinks), None, None, None, None


def execute(
    q, k, v, scale: float, schedule: Schedule, group=None, layer=None, softcap=None, sinks=None
) -> torch.Tensor:
    """Exact attention of the local queries against the K/V of every rank in `group`, as `schedule`
    orders it. q (B, Hq, S_local, D), k/v (B, Hkv, S_kv, D); returns (B, Hq, S_local, D).
    `group=None` or a group of one rank: the schedule's units of rank 0, with no communication.
    `layer` (the HF attention module): reuse its stored output when gradient checkpointing
    re-runs the forward in the backward. softcap: logits c * tanh(s / c); sinks (Hq,): a
    learned logit per head in every row's softmax."""
    distributed = group is not None and dist.get_world_size(group) > 1
    run = _Run(schedule, group if distributed else None, dist.get_rank(group) if distributed else 0, softcap)
    # Grad mode is off inside autograd.Function.forward: read it here.
    return _Executed.apply(q, k, v, sinks, scale, run, layer, torch.is_grad_enabled())
