"""The mask description and its block plans, single process: every allowed (query, key)
pair is computed exactly once, no other pair unmasked, for packed rows, padding, windows and
every layout's (query shard x key shard) pairs."""

import random

import pytest
import torch

from easy_context.layout import Layout
from easy_context.masking import SequenceMask


def allowed_matrix(first_key: torch.Tensor, window=None) -> torch.Tensor:
    """(B, S, S) bool: the rule written out densely."""
    s = first_key.shape[1]
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = (j >= first_key[:, :, None]) & (j <= i)
    if window is not None:
        allowed &= (i - j) < window
    return allowed


def packed_positions(lengths):
    return torch.cat([torch.arange(n) for n in lengths])


def random_row(seq, rng):
    lengths = []
    while sum(lengths) < seq:
        lengths.append(min(rng.choice([1, 2, 5, 17, 40, 90, 300]), seq - sum(lengths)))
    return packed_positions(lengths)


def coverage(mask: SequenceMask, q_index, k_index):
    """(B, len q, len k) count of how often each pair is computed as allowed, and whether
    any disallowed pair is computed without a mask."""
    b = mask.first_key.shape[0]
    count = torch.zeros(b, len(q_index), len(k_index), dtype=torch.long)
    for block in mask.blocks(("test", id(q_index), id(k_index)), q_index, k_index, "cpu"):
        rows, cols = block.q, block.kv
        nq = len(range(*rows.indices(len(q_index))))
        nk = len(range(*cols.indices(len(k_index))))
        if block.mask is not None:
            pattern = block.mask[0, 0].long()
        elif block.causal:
            assert nq == nk
            pattern = torch.ones(nq, nk, dtype=torch.long).tril()
        else:
            pattern = torch.ones(nq, nk, dtype=torch.long)
        count[block.batch, rows, cols] += pattern
    return count


CASES = {
    "one document": lambda s, rng: (torch.arange(s)[None], None, None),
    "packed, batch 2": lambda s, rng: (torch.stack([random_row(s, rng), random_row(s, rng)]), None, None),
    "single-token documents": lambda s, rng: (torch.zeros(1, s, dtype=torch.long), None, None),
    "left and right padding": lambda s, rng: (
        torch.arange(s).expand(2, s),
        torch.stack([torch.arange(s) >= s // 3, torch.arange(s) < s - 7]),
        None,
    ),
    "window shorter than a shard": lambda s, rng: (torch.arange(s)[None], None, 13),
    "window, packed and padded": lambda s, rng: (
        torch.stack([random_row(s, rng), random_row(s, rng)]),
        torch.stack([torch.arange(s) >= 5, torch.ones(s, dtype=torch.bool)]),
        70,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", [Layout(True, 4), Layout(False, 3), Layout(True, 2, 2)], ids=lambda l: l.name)
def test_blocks_cover_each_allowed_pair_exactly_once(case, layout):
    seq = 24 * layout.multiple
    positions, valid, window = CASES[case](seq, random.Random(0))
    mask = SequenceMask.from_positions(positions, valid).with_window(window)
    truth = allowed_matrix(mask.first_key, window)
    for qr in range(layout.size):
        for kr in range(layout.size):
            qi, ki = layout.local_indices(seq, qr), layout.local_indices(seq, kr)
            want = truth[:, qi][:, :, ki].expand(truth.shape[0], -1, -1)
            got = coverage(mask, qi, ki).expand_as(want)
            assert torch.equal(got, want.long()), (case, layout.name, qr, kr)
            assert mask.allowed_pairs(qi, ki) == int(want.sum())


def test_description_of_documents_and_padding():
    positions = torch.tensor([[0, 1, 2, 0, 0, 1, 5, 6], [3, 4, 5, 6, 7, 8, 9, 10]])
    valid = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 0, 0]]).bool()
    mask = SequenceMask.from_positions(positions, valid)
    # row 0: documents [0,3) [3] [4,6) [6,8) (a jump that is not a restart also starts one)
    assert mask.first_key[0].tolist() == [0, 0, 0, 3, 4, 4, 6, 6]
    # row 1: padding attends nothing (first key after itself), the tokens form one document
    assert mask.first_key[1].tolist() == [1, 2, 2, 2, 2, 2, 7, 8]
    assert not mask.is_causal and SequenceMask.from_positions(torch.arange(8)[None]).is_causal


def test_plain_causal_rows_plan_one_block_per_shard_pair():
    seq, layout = 64, Layout(True, 2)
    mask = SequenceMask.from_positions(torch.arange(seq)[None]).with_window(None)
    qi = layout.local_indices(seq, 1)
    blocks = mask.blocks("plain", qi, qi, "cpu")
    # rank 1 holds chunks 1 and 2 of 4: chunk 2 sees chunk 1 fully, both diagonals causally
    assert [(b.q, b.kv, b.causal, b.mask is None) for b in blocks] == [(slice(0, 32), slice(0, 32), True, True)]
