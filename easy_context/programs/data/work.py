"""Equal attention work across data-parallel groups.

Every data-parallel (DP) group waits for the slowest at the gradient all-reduce, and equal token
counts are not equal work: with --document-masking a row's attention costs the sum over its
documents of L(L+1)/2 query x key products, so a row of one long document costs many times a
row of short ones. `balanced_epoch_order` reorders an epoch's rows so that the rows trained in
the same step cost about the same on every DP group:

  1. the epoch's random order is cut into windows of `window` steps;
  2. in a window, rows are sorted by work, and each step takes dp_size x batch_size rows of
     similar work; inside the step, they go to the groups longest first onto the least loaded
     group (batch_size rows each);
  3. the window's steps are shuffled (seeded), so heavy steps do not all come first.

It only moves rows between the steps of one window and between the groups of one step: an
epoch trains on exactly the rows the plain random order trains on. It is a pure function of
its arguments, so a resumed run reads what the uninterrupted run would have read.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["packed_row_products", "balanced_epoch_order", "BALANCE_WINDOW_STEPS"]

# Steps whose rows are sorted together. Larger: closer work per step; smaller: an order closer
# to the random one (heavy rows spread evenly over the epoch).
BALANCE_WINDOW_STEPS = 64


def packed_row_products(document_ends: np.ndarray, row_length: int, rows: int) -> np.ndarray:
    """Query x key products of each of `rows` rows of `row_length` tokens cut from documents
    that end (exclusive, cumulative) at `document_ends`, with every row start restarting the
    document it cuts (as --document-masking's positions do). From the lengths alone: no token
    is read."""
    total = rows * row_length
    cuts = np.union1d(document_ends[document_ends < total], np.arange(0, total + 1, row_length))
    lengths = np.diff(cuts).astype(np.float64)
    return np.bincount(cuts[:-1] // row_length, weights=lengths * (lengths + 1) / 2, minlength=rows)[:rows]


def balanced_epoch_order(
    order: torch.Tensor, work: np.ndarray, dp_size: int, batch_size: int, seed: int, window: int = BALANCE_WINDOW_STEPS
) -> torch.Tensor:
    """`order` (an epoch's random permutation of the row indices) rearranged so that step s's
    rows for group g sit at order[(s * dp_size + g) * batch_size :][:batch_size], as the plain
    order is read, with equal work per group in each step. `work[i]`: row i's cost. Rows past
    the last whole step keep their places (they are not trained this epoch either way)."""
    step_rows = dp_size * batch_size
    used = len(order) // step_rows * step_rows
    result = order.clone()
    generator = torch.Generator().manual_seed(seed)
    for first in range(0, used, window * step_rows):
        rows = order[first : min(used, first + window * step_rows)].numpy()
        by_work = rows[np.argsort(-work[rows], kind="stable")]
        steps = [_deal(by_work[s : s + step_rows], work, dp_size, batch_size) for s in range(0, len(rows), step_rows)]
        shuffled = torch.randperm(len(steps), generator=generator).tolist()
        result[first : first + len(rows)] = torch.from_numpy(np.concatenate([steps[s] for s in shuffled]))
    return result


def _deal(rows: np.ndarray, work: np.ndarray, dp_size: int, batch_size: int) -> np.ndarray:
    """One step's rows (heaviest first) onto the DP groups, each to the least loaded group that
    has room; returned group by group."""
    groups, load = [[] for _ in range(dp_size)], [0.0] * dp_size
    for row in rows:
        group = min((g for g in range(dp_size) if len(groups[g]) < batch_size), key=lambda g: (load[g], g))
        groups[group].append(row)
        load[group] += float(work[row])
    return np.array([row for group in groups for row in group], dtype=np.int64)
