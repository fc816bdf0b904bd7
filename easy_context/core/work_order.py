"""Equal attention work across data-parallel groups: the order an epoch's rows are read in.

Every data-parallel (DP) group waits for the slowest at the gradient all-reduce, and equal token
counts are not equal work: a row's attention costs the sum over its documents of L(L+1)/2 query x
key products, so a row of one long document costs many times a row of short ones.
`balanced_epoch_order` reorders an epoch's rows so that the rows trained in the same step cost
about the same on every DP group:

  1. the epoch's random order is cut into windows of `window` steps;
  2. in a window, rows are sorted by work, and each step takes dp_size x batch_size rows of
     similar work; inside the step, they go to the groups longest first onto the least loaded
     group (batch_size rows each);
  3. the window's steps are shuffled (seeded), so heavy steps do not all come first.

It only moves rows between the steps of one window and between the groups of one step: an
epoch trains on exactly the rows the plain random order trains on. It is a pure function of
its arguments, so a resumed run reads what the uninterrupted run would have read.

train.py reads its rows through it (--data-order balanced); `WorkBalancedSampler` is the same
order as a torch sampler, for loaders that deal batch i to DP group i % dp_size (the rule of
core/data_groups.py: accelerate's, and so the HF Trainer's under prepare_trainer(...,
balance_work=True)).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.data import Sampler

__all__ = ["balanced_epoch_order", "WorkBalancedSampler", "document_products", "BALANCE_WINDOW_STEPS"]

# Steps whose rows are sorted together. Larger: closer work per step; smaller: an order closer
# to the random one (heavy rows spread evenly over the epoch).
BALANCE_WINDOW_STEPS = 64


def document_products(lengths: Sequence[int]) -> float:
    """Query x key products of one row whose documents have these lengths (each token attends
    its offset in its document + 1 keys)."""
    lengths = torch.as_tensor(lengths, dtype=torch.float64)
    return float((lengths * (lengths + 1) / 2).sum())


def balanced_epoch_order(
    order: torch.Tensor,
    work: Sequence[float],
    dp_size: int,
    batch_size: int,
    seed: int,
    window: int = BALANCE_WINDOW_STEPS,
) -> torch.Tensor:
    """`order` (an epoch's random permutation of the row indices) rearranged so that step s's
    rows for group g sit at order[(s * dp_size + g) * batch_size :][:batch_size], as the plain
    order is read, with equal work per group in each step. `work[i]`: row i's cost. Rows past
    the last whole step keep their places (they are not trained this epoch either way)."""
    work = torch.as_tensor(work, dtype=torch.float64)
    step_rows = dp_size * batch_size
    used = len(order) // step_rows * step_rows
    result = order.clone()
    generator = torch.Generator().manual_seed(seed)
    for first in range(0, used, window * step_rows):
        rows = order[first : min(used, first + window * step_rows)]
        by_work = rows[torch.sort(-work[rows], stable=True).indices]
        steps = [_deal(by_work[s : s + step_rows], work, dp_size, batch_size) for s in range(0, len(rows), step_rows)]
        shuffled = torch.randperm(len(steps), generator=generator).tolist()
        result[first : first + len(rows)] = torch.cat([steps[s] for s in shuffled])
    return result


def _deal(rows: torch.Tensor, work: torch.Tensor, dp_size: int, batch_size: int) -> torch.Tensor:
    """One step's rows (heaviest first) onto the DP groups, each to the least loaded group that
    has room; returned group by group."""
    groups, load = [[] for _ in range(dp_size)], [0.0] * dp_size
    for row in rows.tolist():
        group = min((g for g in range(dp_size) if len(groups[g]) < batch_size), key=lambda g: (load[g], g))
        groups[group].append(row)
        load[group] += float(work[row])
    return torch.tensor([row for group in groups for row in group], dtype=torch.int64)


class WorkBalancedSampler(Sampler[int]):
    """Epoch e's order is balanced_epoch_order of a permutation seeded with seed + e (set_epoch,
    which the HF Trainer calls through accelerate's loader): batch i of batch_size rows is the
    rows of step i // dp_size for DP group i % dp_size, as a loader that deals batches
    round-robin reads it. Every rank builds the same order; no state but the epoch."""

    def __init__(self, work: Sequence[float], dp_size: int, batch_size: int, seed: int):
        self.work = torch.as_tensor(work, dtype=torch.float64)
        if self.work.dim() != 1 or not bool(torch.isfinite(self.work).all()) or bool((self.work < 0).any()):
            smallest = self.work.min().item() if self.work.numel() else None
            raise ValueError(
                "WorkBalancedSampler: work must be one finite, non-negative number per row "
                f"(got shape {tuple(self.work.shape)}, smallest {smallest})"
            )
        self.dp_size, self.batch_size, self.seed, self.epoch = dp_size, batch_size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.work)

    def __iter__(self):
        seed = self.seed + self.epoch
        order = torch.randperm(len(self.work), generator=torch.Generator().manual_seed(seed))
        return iter(balanced_epoch_order(order, self.work, self.dp_size, self.batch_size, seed).tolist())
