"""The layouts' work balance itself, counted from the plans the attention runs.

Exactness holds under any split of the sequence, so the exactness tests cannot see a layout
that balances nothing: these tests count each rank's query x key products and hold every
layout to its stated bound.
"""

from __future__ import annotations

import random

import pytest
import torch

from benchmarks.mask_balance import dist_flash_work, long_tailed_lengths, packed_mask, zigzag_work
from easy_context.core.balance import split_documents

WORK_OF = {"zigzag_ring_attn": zigzag_work, "dist_flash_attn": dist_flash_work}


def imbalance(work: list[int]) -> float:
    return max(work) / min(work)


@pytest.mark.parametrize("mode", WORK_OF)
@pytest.mark.parametrize("size", [2, 4])
def test_the_static_layout_balances_one_causal_row(mode, size):
    """One causal row, the case the static layouts are built for: equal work per rank, to
    the rounding of one block's diagonal (zigzag: pieces r and 2P-1-r; dist_flash_attn: the
    balanced schedule's helpers)."""
    seq = 1024
    assert imbalance(WORK_OF[mode](packed_mask([seq]), seq, size)) <= 1.01


@pytest.mark.parametrize("mode", WORK_OF)
@pytest.mark.parametrize("size", [2, 4])
def test_document_split_balances_long_tailed_packed_rows(mode, size):
    """Packed long-tailed rows: the static layout leaves whole ramps of work on some ranks
    (its worst row here is 2.3-7x), document_split stays within 1.02 on every row (measured:
    1.004 at most). With zigzag's mirror piece dropped (piece k to rank k % P) document_split
    balances nothing: 1.7x at P=2, 2.2x at P=4, and this test fails."""
    seq, static, split = 4096, [], []
    for seed in range(6):
        mask = packed_mask(long_tailed_lengths(seq, random.Random(seed)))
        static.append(imbalance(WORK_OF[mode](mask, seq, size)))
        shares = split_documents(mask.first_key[0], torch.ones(seq, dtype=torch.bool), size, mode == "zigzag_ring_attn")
        split.append(imbalance(WORK_OF[mode](mask, seq, size, [share[None] for share in shares])))
    assert max(static) > 1.5, static  # the rows are long-tailed enough to need balancing
    assert max(split) <= 1.02, split
