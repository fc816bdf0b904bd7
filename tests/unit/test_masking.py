"""The mask description and its kernel calls, single process: every allowed (query, key)
pair is computed exactly once, no other pair unmasked, for packed rows, padding, windows and
every layout's (query shard x key shard) pairs."""

import random

import pytest
import torch

from easy_context.core.kernels import band_mask
from easy_context.core.layout import Layout
from easy_context.core.masking import Block, SequenceMask


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
    count = torch.zeros(b, q_index.shape[-1], k_index.shape[-1], dtype=torch.long)
    blocks = mask.blocks(("test", id(q_index), id(k_index)), q_index, k_index, "cpu")
    for block in (part for b in blocks for part in b.split()):  # documents: each its own square
        rows, cols = block.q, block.kv
        nq = len(range(*rows.indices(q_index.shape[-1])))
        nk = len(range(*cols.indices(k_index.shape[-1])))
        if block.window is not None:
            pattern = band_mask(nq, nk, block.window, torch.device("cpu"))[0, 0].long()
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
@pytest.mark.parametrize(
    "layout", [Layout(True, 4), Layout(False, 3), Layout(True, 2, 2)], ids=lambda layout: layout.name
)
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


def test_plain_causal_rows_are_one_block_per_shard_pair():
    seq, layout = 64, Layout(True, 2)
    mask = SequenceMask.from_positions(torch.arange(seq)[None]).with_window(None)
    qi = layout.local_indices(seq, 1)
    blocks = mask.blocks("plain", qi, qi, "cpu")
    # rank 1 holds chunks 1 and 2 of 4: chunk 2 sees chunk 1 fully, both diagonals causally
    assert [(b.q, b.kv, b.causal, b.window) for b in blocks] == [(slice(0, 32), slice(0, 32), True, None)]


def test_packed_documents_of_a_shard_are_one_block_with_segments():
    """Documents on a shard's diagonal are one call (flash's variable-length call), under
    causal rows and under a window (a causal document no longer than the band is the band)."""
    positions = packed_positions([3, 40, 21])[None]
    index = torch.arange(64)
    mask = SequenceMask.from_positions(positions)
    assert mask.blocks("docs", index, index, "cpu") == [
        Block(slice(0, 64), slice(0, 64), True, segments=(0, 3, 43, 64))
    ]
    windowed = SequenceMask.from_positions(positions).with_window(30)
    assert windowed.blocks("docs", index, index, "cpu") == [
        Block(slice(0, 64), slice(0, 64), False, window=(29, 0), segments=(0, 3, 43, 64))
    ]
    # kernels without segments run one call per document
    split = Block(slice(0, 64), slice(0, 64), True, segments=(0, 3, 43, 64)).split()
    assert [(b.q, b.kv, b.segments) for b in split] == [
        (slice(0, 3), slice(0, 3), None),
        (slice(3, 43), slice(3, 43), None),
        (slice(43, 64), slice(43, 64), None),
    ]


def test_a_row_with_nothing_to_attend_does_not_hide_the_next_row():
    """Empty rows are stored as keys [0, 0); the next row's keys [0, 1) must not join their run
    (found with the document_split layout: a 7-token document over 8 pieces)."""
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]])
    mask = SequenceMask.from_positions(positions)
    q_index, k_index = torch.tensor([0, 6]), torch.tensor([3, 7])  # query 0 sees none of these keys
    assert torch.equal(coverage(mask, q_index, k_index)[0], torch.tensor([[0, 0], [1, 0]]))


def test_per_row_layouts_cover_each_allowed_pair_exactly_once():
    """document_split: every batch row has a layout of its own, (B, n) index arrays."""
    from easy_context.core.balance import split_documents

    rng = random.Random(3)
    seq, ring = 192, 4
    positions = torch.stack([random_row(seq, rng), random_row(seq, rng)])
    valid = torch.stack([torch.arange(seq) >= 11, torch.arange(seq) < seq - 5])
    for window in (None, 9):
        mask = SequenceMask.from_positions(positions, valid).with_window(window)
        shares = [split_documents(mask.first_key[b], valid[b], ring) for b in range(2)]
        index = [torch.stack([shares[b][r] for b in range(2)]) for r in range(ring)]
        truth = allowed_matrix(mask.first_key, window)
        for qr in range(ring):
            for kr in range(ring):
                want = torch.stack([truth[b][index[qr][b]][:, index[kr][b]] for b in range(2)]).long()
                assert torch.equal(coverage(mask, index[qr], index[kr]), want), (window, qr, kr)


@pytest.mark.parametrize("seed", range(24))
def test_random_masks_and_layouts_cover_each_allowed_pair_exactly_once(seed):
    """The window planner (runs joined into bands and their clipped edges) on random packed,
    padded and windowed rows, every layout's shard pairs."""
    rng = random.Random(seed)
    layout = rng.choice([Layout(True, 2), Layout(True, 4), Layout(False, 3), Layout(True, 2, 2)])
    seq = rng.choice([8, 24, 40]) * layout.multiple
    positions = torch.stack([random_row(seq, rng) if rng.random() < 0.6 else torch.arange(seq) for _ in range(2)])
    valid = None
    if rng.random() < 0.4:
        valid = torch.stack([torch.arange(seq) >= rng.randrange(seq // 2), torch.arange(seq) < seq - rng.randrange(9)])
    window = rng.choice([None, 1, 2, 7, 33, seq // 3])
    mask = SequenceMask.from_positions(positions, valid).with_window(window)
    truth = allowed_matrix(mask.first_key, mask.window)
    for qr in range(layout.size):
        for kr in range(layout.size):
            qi, ki = layout.local_indices(seq, qr), layout.local_indices(seq, kr)
            want = truth[:, qi][:, :, ki]
            got = coverage(mask, qi, ki).expand_as(want)
            assert torch.equal(got, want.long()), (seed, layout.name, qr, kr, window)


def test_window_kernel_calls_cost_the_same_at_any_length():
    """A sliding window is a few window blocks per shard pair, the same number at 2K and
    32K tokens, with a bounded number of host reads (no per-row `.item()`)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostReads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in ("_local_scalar_dense", "is_nonzero", "equal"):
                HostReads.count += 1
            return func(*args, **(kwargs or {}))

    layout, calls = Layout(True, 2), {}
    for seq in (2048, 32768):
        mask = SequenceMask.from_positions(torch.arange(seq)[None]).with_window(256)
        HostReads.count = 0
        with HostReads():
            calls[seq] = [
                [
                    (b.causal, b.window)
                    for b in mask.blocks((q, k), layout.local_indices(seq, q), layout.local_indices(seq, k))
                ]
                for q in range(2)
                for k in range(2)
            ]
        assert HostReads.count <= 8, (seq, HostReads.count)
    assert calls[2048] == calls[32768]
    assert max(len(pair) for pair in calls[32768]) <= 2
