"""One data stream per sequence-parallel group: which rows a rank reads.

The ranks of a sequence-parallel (SP) group hold pieces of the same sequences, so they must read
the same rows, and the dp_size data-parallel (DP) groups must read different ones. One rule
deals them, whatever hands the rows out:

    batch i of the stream goes to DP group i % dp_size

so group g's k-th batch is batch k * dp_size + g of the stream (`group_batch`), and each group
reads batches // dp_size of them (`batches_per_group`): the tail that does not divide is
dropped, and no group waits at a collective for a batch another never gets. A rank's DP group
is Topology.dp_rank (core/groups.py: rank // sp_size). The stream is

- a loader's batches: `DataParallelShard` (SequenceParallel.dataloader);
- an epoch's order of rows (or row indices) cut into batches: `group_rows` (train.py's
  micro-batches; core/work_order.py's balanced order is laid out for it);
- accelerate's loader prepared as for dp_size processes, with the DP group as process index
  (prepare_trainer): accelerate deals batches by the same rule, and evens the tail out by
  repeating the first batches, as it does for plain DDP.

The rule needs the same stream on every rank of a group. A shuffling sampler without a generator
draws its order from the process's own random state, which nothing keeps equal across ranks:
`seed_shuffling` gives it a generator seeded alike on every rank.
"""

from __future__ import annotations

import itertools

import torch

__all__ = ["group_batch", "batches_per_group", "group_rows", "DataParallelShard", "seed_shuffling"]


def group_batch(k: int, dp_rank: int, dp_size: int) -> int:
    """The index in the stream of DP group `dp_rank`'s k-th batch."""
    return k * dp_size + dp_rank


def batches_per_group(batches: int, dp_size: int) -> int:
    """How many of a stream's `batches` each of dp_size groups reads (the same for every group)."""
    return batches // dp_size


def group_rows(order, k: int, dp_rank: int, dp_size: int, batch_size: int):
    """DP group `dp_rank`'s k-th batch of `batch_size` rows from `order` (rows, or row indices,
    read batch after batch): order[(k * dp_size + dp_rank) * batch_size :][:batch_size]."""
    start = group_batch(k, dp_rank, dp_size) * batch_size
    return order[start : start + batch_size]


class DataParallelShard:
    """A loader's batches for DP group `dp_rank` of `dp_size`: batch i of the wrapped loader goes
    to group i % dp_size. Every rank of one SP group reads the same batches; all groups get the
    same number of batches (the tail that does not divide is dropped) so no group waits on another.
    """

    def __init__(self, loader, dp_rank: int, dp_size: int):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is not a data-parallel group of dp_size={dp_size}")
        self.loader, self.dp_rank, self.dp_size = loader, dp_rank, dp_size

    def __len__(self) -> int:
        return batches_per_group(len(self.loader), self.dp_size)

    def __iter__(self):
        stop = len(self) * self.dp_size if hasattr(self.loader, "__len__") else None
        return itertools.islice(self.loader, self.dp_rank, stop, self.dp_size)


def seed_shuffling(loader, seed: int | None = None) -> None:
    """Every rank of an SP group must draw the same order. A loader's sampler that shuffles
    without a generator of its own draws from the process's random state; give it a generator
    seeded with `seed` (a data seed), else with the process's initial seed (torch's default, or
    what the script seeded: the same on every rank). A loader whose sampler has its generator,
    or shuffles nothing, is left alone."""
    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    if sampler is not None and hasattr(sampler, "generator") and sampler.generator is None:
        sampler.generator = torch.Generator().manual_seed(torch.random.initial_seed() if seed is None else seed)
