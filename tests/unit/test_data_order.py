"""The data-parallel order by attention work (core/work_order.py, train.py --data-order,
prepare_trainer's balance_work): the
groups of a step get rows of equal work, an epoch trains on the same rows as the random order,
and the order is a pure function of its arguments (a resumed run reads the same rows)."""

import numpy as np
import torch

from easy_context.core.work_order import balanced_epoch_order
from recipes.data import PackedRows, document_positions, packed_row_products

DP, BATCH = 2, 1


def long_tailed_work(rows: int, seed: int) -> np.ndarray:
    """Rows of 4096 tokens packed from log-normal document lengths: products per row."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(300), 1.4, rows * 40).astype(np.int64), 1, 16384)
    return packed_row_products(np.cumsum(lengths + 1), 4096, rows)


def slowest_over_mean(order: torch.Tensor, work: np.ndarray, dp: int = DP, batch: int = BATCH) -> float:
    """Sum over the epoch's steps of the slowest group's work, over the sum of the mean group's:
    the time every group spends waiting, when time follows work."""
    steps = len(order) // (dp * batch)
    per_group = work[order[: steps * dp * batch].numpy()].reshape(steps, dp, batch).sum(axis=2)
    return float(per_group.max(axis=1).sum() / per_group.mean(axis=1).sum())


def test_packed_row_products_equal_the_products_of_the_rows_read():
    """The work of each PackedRows row, from the document lengths alone, equals the products of
    the row as read with --document-masking's positions (a document cut by a row start restarts)."""
    import datasets

    length, eos = 8, 99
    documents = [list(range(1, 8)), list(range(10, 25)), [], list(range(30, 50)), [7], list(range(60, 66))]
    rows = PackedRows(datasets.Dataset.from_dict({"input_ids": documents}), length, eos, "docs")
    read = rows[range(len(rows))]
    # products of a row: each token attends its offset in its document + 1 keys
    want = (document_positions(read, eos) + 1).sum(dim=1).double().numpy()
    assert np.array_equal(rows.row_products(), want), (rows.row_products(), want)


def test_balanced_order_gives_each_step_equal_work_and_the_same_rows_per_epoch():
    """Long-tailed packed rows, 2 data-parallel groups: in the random order the slowest group
    does 1.3x+ the mean work summed over the epoch; in the balanced order within 1.1x. Each
    epoch trains on the rows the random order trains on (the tail past the last whole step
    too stays out), and the same arguments give the same order."""
    work = long_tailed_work(1001, seed=0)
    for seed in range(3):
        plain = torch.randperm(len(work), generator=torch.Generator().manual_seed(seed))
        balanced = balanced_epoch_order(plain, work, DP, BATCH, seed)
        used = len(work) // (DP * BATCH) * DP * BATCH
        assert sorted(balanced[:used].tolist()) == sorted(plain[:used].tolist())
        assert torch.equal(balanced, balanced_epoch_order(plain, work, DP, BATCH, seed))
        random_ratio, balanced_ratio = slowest_over_mean(plain, work), slowest_over_mean(balanced, work)
        print(f"seed {seed}: slowest group / mean, random {random_ratio:.3f}, balanced {balanced_ratio:.3f}")
        assert random_ratio > 1.3 and balanced_ratio <= 1.1, (random_ratio, balanced_ratio)


def test_balanced_order_with_several_rows_per_group():
    """batch_size 3 over 4 groups: each group still gets exactly batch_size rows of a step."""
    work = long_tailed_work(240, seed=1)
    plain = torch.randperm(len(work), generator=torch.Generator().manual_seed(5))
    balanced = balanced_epoch_order(plain, work, 4, 3, 5, window=8)
    assert sorted(balanced.tolist()) == sorted(plain.tolist())
    assert slowest_over_mean(balanced, work, 4, 3) <= 1.1 < slowest_over_mean(plain, work, 4, 3)


def test_work_balanced_sampler_as_accelerate_deals_it():
    """WorkBalancedSampler (prepare_trainer's balance_work) read through accelerate's loader for
    2 groups, as prepare_trainer prepares it (batch i to group i % 2): each step's groups get
    equal work (the random deal: 1.3x+), every epoch reads every row of its whole steps once,
    and set_epoch gives another order that is the same on every rank."""
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader

    from easy_context.core.work_order import WorkBalancedSampler

    work = long_tailed_work(400, seed=2)

    def read(epoch: int) -> torch.Tensor:
        """(steps, groups): the row each group reads at each step."""
        loader = DataLoader(range(len(work)), batch_size=BATCH, sampler=WorkBalancedSampler(work, DP, BATCH, seed=3))
        groups = [prepare_data_loader(loader, num_processes=DP, process_index=g, put_on_device=False) for g in (0, 1)]
        for group in groups:
            group.set_epoch(epoch)  # as the Trainer does at each epoch
        return torch.stack([torch.cat(list(group)) for group in groups], dim=1)

    first, again, second = read(0), read(0), read(1)
    assert torch.equal(first, again) and not torch.equal(first, second)
    for rows in (first, second):
        assert sorted(rows.flatten().tolist()) == list(range(len(work)))
        balanced = slowest_over_mean(rows.flatten(), work)
        assert balanced <= 1.1, balanced
    shuffled = torch.randperm(len(work), generator=torch.Generator().manual_seed(3))
    assert slowest_over_mean(shuffled, work) > 1.3
