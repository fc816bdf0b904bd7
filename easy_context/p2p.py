"""Asynchronous point-to-point exchange inside a process group (the only P2P code)."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["Pending", "exchange"]


class Pending:
    """Transfers in flight; `wait()` returns the receive buffers once they have landed."""

    def __init__(self, works, received):
        self._works, self._received = works, received

    def wait(self):
        for work in self._works:
            work.wait()
        self._works = []
        return self._received


def exchange(group, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]], received=None) -> Pending:
    """Post sends (peer, tensor) and receives (peer, buffer); peers are ranks within `group`.

    Messages between two ranks are matched in posting order, so every caller must post in
    an order both sides agree on (all schedules here are deterministic per rank).
    """
    ops = [
        # gloo corrupts some non-contiguous buffers silently: always send contiguous.
        dist.P2POp(dist.isend, tensor.contiguous(), dist.get_global_rank(group, peer), group)
        for peer, tensor in sends
    ]
    ops += [dist.P2POp(dist.irecv, buffer, dist.get_global_rank(group, peer), group) for peer, buffer in recvs]
    works = dist.batch_isend_irecv(ops) if ops else []
    return Pending(works, received if received is not None else [buffer for _, buffer in recvs])
