"""Asynchronous point-to-point exchange inside a process group (the only P2P code).

Wire layout: a tensor travels in the memory layout of `torch.empty_like(like)`, where `like`
is a tensor both sides hold with the same shape and strides (e.g. their own K). For the
dense but transposed tensors HF hands us ((B, H, S, D) views of (B, S, H, D) memory) that is
the tensor itself: it is sent as a permuted contiguous view, with no copy and no change of
layout for the kernels on the other side. gloo silently corrupts some strided buffers, so
what reaches the backend is always contiguous.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["Pending", "exchange", "buffer_like"]


class Pending:
    """Transfers in flight; `wait()` returns the receive buffers once they have landed."""

    def __init__(self, works, received, keep_alive=()):
        self._works, self._received, self._keep_alive = works, received, keep_alive

    def wait(self):
        for work in self._works:
            work.wait()
        self._works, self._keep_alive = [], ()
        return self._received


def _dense_view(x: torch.Tensor) -> torch.Tensor | None:
    """x as a contiguous tensor (its dims permuted) when its memory is dense, else None."""
    if x.is_contiguous():
        return x
    order = sorted(range(x.dim()), key=lambda d: x.stride(d), reverse=True)
    view = x.permute(order)
    return view if view.is_contiguous() else None


def buffer_like(like: torch.Tensor, dtype=None) -> torch.Tensor:
    """A receive buffer in the wire layout of `like`."""
    return torch.empty_like(like, dtype=dtype)


def _wire(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if tensor.stride() == like.stride():
        view = _dense_view(tensor)
        if view is not None:
            return view
    view = _dense_view(buffer_like(like, tensor.dtype).copy_(tensor))
    assert view is not None, f"no dense layout for strides {like.stride()}"
    return view


def exchange(
    group,
    sends: Sequence[tuple[int, torch.Tensor, torch.Tensor]],
    recvs: Sequence[tuple[int, torch.Tensor]],
    received=None,
) -> Pending:
    """Post sends (peer, tensor, like) and receives (peer, buffer from `buffer_like`); peers are
    ranks within `group`. The receiver's buffer must be made from a `like` with the sender's
    shape and strides.

    Messages between two ranks are matched in posting order, so every caller must post in
    an order both sides agree on (all schedules here are deterministic per rank).
    """
    wire = [_wire(tensor, like) for _, tensor, like in sends]
    ops = [dist.P2POp(dist.isend, w, dist.get_global_rank(group, peer), group) for (peer, _, _), w in zip(sends, wire)]
    for peer, buffer in recvs:
        view = _dense_view(buffer)
        assert view is not None, "receive buffers must come from buffer_like"
        ops.append(dist.P2POp(dist.irecv, view, dist.get_global_rank(group, peer), group))
    works = dist.batch_isend_irecv(ops) if ops else []
    return Pending(works, received if received is not None else [buffer for _, buffer in recvs], wire)
