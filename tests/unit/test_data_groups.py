"""One data stream per SP group (easy_context/core/data_groups.py): the one rule that
SequenceParallel.dataloader, prepare_trainer and train.py's micro-batches deal rows by, and the
seeded shuffling that gives every rank of a group the same stream."""

import torch
from torch.utils.data import DataLoader

from easy_context.core.data_groups import DataParallelShard, batches_per_group, group_rows, seed_shuffling


def test_each_group_reads_its_own_batches_and_together_every_whole_step_once():
    rows, batch, dp = torch.arange(23), 2, 3
    per_group = batches_per_group(len(rows) // batch, dp)
    read = [[group_rows(rows, k, g, dp, batch) for k in range(per_group)] for g in range(dp)]
    assert per_group == 3
    assert torch.equal(read[1][2], torch.tensor([14, 15]))  # batch 2 * 3 + 1 of the stream
    assert sorted(torch.cat([b for group in read for b in group]).tolist()) == list(range(18))  # the tail dropped


def test_a_loaders_batches_go_round_robin_as_group_rows_deals_an_order():
    batches = [torch.tensor([2 * i, 2 * i + 1]) for i in range(7)]
    rows = torch.arange(14)
    for g in range(2):
        shard = list(DataParallelShard(batches, g, 2))
        assert len(shard) == len(DataParallelShard(batches, g, 2)) == 3
        assert all(torch.equal(b, group_rows(rows, k, g, 2, 2)) for k, b in enumerate(shard))


def test_seeded_shuffling_gives_every_rank_the_same_order_whatever_its_random_state():
    def order(rank_state: int, seed=None):
        torch.manual_seed(rank_state)  # a rank's own random state, as a rank-dependent seed leaves it
        loader = DataLoader(range(16), batch_size=4, shuffle=True)
        seed_shuffling(loader, seed)
        return [b.tolist() for b in loader]

    assert order(0, seed=7) == order(1, seed=7) != order(0, seed=8)
    own = DataLoader(range(16), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    generator = own.batch_sampler.sampler.generator
    seed_shuffling(own, 7)
    assert own.batch_sampler.sampler.generator is generator  # a loader with its own generator is left alone
