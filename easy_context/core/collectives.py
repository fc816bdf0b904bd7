"""The collectives the library runs over an SP group, written once.

Every rank of a group calls them with tensors of the same shape and dtype (collectives
require it), and every rank reaches the same verdict, so no rank is left waiting.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["world_size", "rank", "all_gather", "fingerprint", "check_same"]


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
