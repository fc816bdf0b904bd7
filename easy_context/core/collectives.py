"""The collectives the library runs over an SP group, written once.

Every rank of a group calls them with tensors of the same shape and dtype (collectives
require it), and every rank reaches the same verdict, so no rank is left waiting.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["world_size", "rank", "all_gather", "all_gather_with_grad", "broadcast", "fingerprint", "check_same"]


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def all_gather(local: torch.Tensor, group) -> list:
    """Every rank's `local`, in group rank order (a one-element list without a group)."""
    if group is None:
        return [local]
    local = local.contiguous()
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local, group=group)
    return pieces


class _AllGather(torch.autograd.Function):
    """(P, *x.shape): every rank's x. The backward sends each rank its slice of this rank's
    gradient (an all-to-all, the reduce-scatter an all-gather's gradient is) and sums what
    arrives: each direction sends (P - 1) x the bytes of x. Both directions send contiguous
    tensors (gloo silently corrupts some strided ones)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return torch.stack(all_gather(x, group))

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        received = torch.empty_like(grad)
        dist.all_to_all_single(received, grad, group=ctx.group)
        return received.sum(dim=0), None


def broadcast(tensor: torch.Tensor, source: int, group) -> torch.Tensor:
    """`tensor` of the group's rank `source` on every rank (others pass a tensor of the same
    shape and dtype to receive into); not differentiable."""
    if group is not None:
        tensor = tensor.contiguous()
        dist.broadcast(tensor, group=group, group_src=source)
    return tensor


def all_gather_with_grad(x: torch.Tensor, group) -> torch.Tensor:
    """(P, *x.shape): every rank's `x` in group rank order, differentiable (x[None] without a group)."""
    return x[None] if group is None else _AllGather.apply(x, group)


def fingerprint(x: torch.Tensor | None, device) -> torch.Tensor:
    """(number of elements, rows, columns, position-weighted sum) in float64: equal tensors give
    equal fingerprints, and a changed, moved or reshaped value changes them. Position weights
    cycle below 9973 so that the sum of token ids stays exact in float64."""
    if x is None:
        return torch.zeros(4, dtype=torch.float64, device=device)
    x = x.to(device)
    shape = [float(s) for s in (list(x.shape) + [0, 0])[:2]] if x.dim() else [0.0, 0.0]
    weights = torch.arange(1, x.numel() + 1, dtype=torch.float64, device=device).remainder_(9973).add_(1)
    summary = (x.flatten().double() * weights).sum()
    return torch.stack(
        [
            torch.tensor(float(x.numel()), dtype=torch.float64, device=device),
            *(torch.tensor(s, dtype=torch.float64, device=device) for s in shape),
            summary,
        ]
    )


def check_same(group, tensors: Sequence[torch.Tensor | None], error: Callable[[list], str], device=None) -> None:
    """Raise ValueError(error(shapes)) on every rank of `group` unless every rank holds the same
    `tensors` (None counts as a value); shapes: the first tensor's (rows, columns) by rank. One
    all-gather of 4 numbers per tensor."""
    if group is None:
        return
    device = device if device is not None else next((t.device for t in tensors if t is not None), torch.device("cpu"))
    local = torch.cat([fingerprint(t, device) for t in tensors])
    every = all_gather(local, group)
    if any(not torch.equal(other, every[0]) for other in every):
        shapes = [tuple(int(v) for v in other[1:3]) for other in every]
        raise ValueError(error(shapes))
