"""Document order for balanced work: packed documents reordered inside their row.

Attention never crosses a document, so the order of a row's documents changes nothing per
token (each keeps its position ids and its target); it changes which rank holds which
tokens, and so how the work of the static layouts splits. A token's work is the number of
keys it attends (its offset in its document + 1): long documents are ramps of rising cost.

Zigzag and dist_flash both balance ONE causal ramp over the whole row. So documents are laid
out from both ends of the row, longest first, each at the end with less filled: a long
document's ramp at the left end meets a mirrored ramp at the right end on the same ranks.
A short local search (swaps of two documents, deterministic) then lowers the most loaded
rank's work under the mode's own work model. Padding stays where it is (row ends).
"""

from __future__ import annotations

import torch

from .dist_flash_attn.schedule import balanced_schedule
from .layout import Layout

__all__ = ["balanced_order", "rank_work", "split_documents"]

SEARCH_STEPS = 200


def _documents(first_key_row: torch.Tensor, valid_row: torch.Tensor) -> list[tuple[int, int]]:
    """(start, length) of each document inside the row's non-padding span."""
    index = torch.arange(first_key_row.shape[0])
    starts = torch.nonzero(valid_row & (first_key_row == index)).flatten().tolist()
    end = int(torch.nonzero(valid_row).max()) + 1 if bool(valid_row.any()) else 0
    return [(a, b - a) for a, b in zip(starts, starts[1:] + [end])]


class _WorkModel:
    """Allowed (query, key) pairs each rank of the ring computes, for a row's first_key (S,).
    Rings: a rank computes its own queries against every key. dist_flash: the work of each
    schedule unit (a half or all of a query chunk against one key chunk) goes to its worker."""

    def __init__(self, seq: int, layout: Layout, dist_flash: bool):
        self.seq, self.size, self.dist_flash = seq, layout.ring_degree, dist_flash
        self.index = torch.arange(seq)
        if not dist_flash:
            self.owner = torch.empty(seq, dtype=torch.long)
            for r in range(self.size):
                self.owner[layout.local_indices(seq, r)] = r
            return
        chunk = seq // self.size
        self.starts = torch.arange(self.size)[:, None] * chunk
        self.chunk = chunk
        # worker of each (key owner, query owner, half) cell
        self.worker = torch.full((self.size, self.size, 2), -1, dtype=torch.long)
        for units in balanced_schedule(self.size):
            for u in units:
                halves = [0, 1] if u.parts == 1 else [u.part]
                for h in halves:
                    self.worker[u.kv_owner, u.q_owner, h] = u.worker

    def __call__(self, first_key: torch.Tensor) -> torch.Tensor:
        if not self.dist_flash:
            return torch.bincount(self.owner, weights=(self.index - first_key + 1).double(), minlength=self.size)
        ends = self.starts + self.chunk - 1
        overlap = (torch.minimum(self.index, ends) - torch.maximum(first_key, self.starts) + 1).clamp(min=0)
        cells = overlap.reshape(self.size, self.size, 2, -1).sum(-1).double()
        live = self.worker >= 0
        return torch.bincount(self.worker[live], weights=cells[live], minlength=self.size)


def rank_work(first_key: torch.Tensor, layout: Layout, dist_flash: bool) -> torch.Tensor:
    return _WorkModel(first_key.shape[0], layout, dist_flash)(first_key)


def balanced_order(first_key_row: torch.Tensor, valid_row: torch.Tensor, layout: Layout, dist_flash: bool) -> torch.Tensor:
    """A permutation of the row's token indices (S,) that reorders whole documents."""
    seq = first_key_row.shape[0]
    documents = _documents(first_key_row, valid_row)
    if len(documents) < 2 or layout.ring_degree < 2:
        return torch.arange(seq)
    span_start = documents[0][0]
    lengths = torch.tensor([n for _, n in documents])
    model = _WorkModel(seq, layout, dist_flash)

    def load(order):
        ordered = lengths[order]
        starts = span_start + torch.cumsum(ordered, 0) - ordered
        first_key = torch.arange(seq)
        first_key[span_start:span_start + int(ordered.sum())] = torch.repeat_interleave(starts, ordered)
        return float(model(first_key).max())

    by_length = sorted(range(len(documents)), key=lambda d: -documents[d][1])
    left, right, filled = [], [], [0, 0]
    for d in by_length:
        side = 0 if filled[0] <= filled[1] else 1
        (left if side == 0 else right).append(d)
        filled[side] += documents[d][1]
    candidates = [_improve(list(start), load) for start in (left + right[::-1], range(len(documents)))]
    order = min(candidates, key=lambda c: c[1])[0]
    pieces = [torch.arange(span_start)] + [torch.arange(a, a + n) for a, n in (documents[d] for d in order)]
    end = span_start + int(lengths.sum())
    return torch.cat(pieces + [torch.arange(end, seq)])


def _improve(order, load):
    """Swap pairs of documents while the most loaded rank gets lighter (deterministic)."""
    best = load(order)
    generator = torch.Generator().manual_seed(0)
    n = len(order)
    for _ in range(SEARCH_STEPS):
        i, j = torch.randint(n, (2,), generator=generator).tolist()
        if i == j:
            continue
        order[i], order[j] = order[j], order[i]
        candidate = load(order)
        if candidate < best:
            best = candidate
        else:
            order[i], order[j] = order[j], order[i]
    return order, best


def split_documents(first_key_row: torch.Tensor, valid_row: torch.Tensor, ring_degree: int, zigzag: bool = True) -> list[torch.Tensor]:
    """A layout of its own for one packed row (document_split): every document is cut into
    pieces in order and spread over the R ring ranks the way the static layout spreads one
    causal row: zigzag, 2R pieces with rank r keeping pieces r and 2R-1-r; contiguous
    (dist_flash_attn), R pieces with rank r keeping piece r, so a rank's queries still need
    keys of its own and lower ranks only. Every rank then gets its share of every document's
    work, whatever the lengths. Pieces differ by at most one token; the extra tokens go to the
    ranks in turn, so token counts differ by at most one before padding fills every rank to
    S / R. Returns the R increasing index tensors (global positions of each rank's rows)."""
    seq = first_key_row.shape[0]
    chunks = 2 * ring_degree if zigzag else ring_degree
    rank_of_piece = [min(k, chunks - 1 - k) for k in range(chunks)] if zigzag else list(range(chunks))
    owner = torch.empty(seq, dtype=torch.long)
    turn = 0
    for start, length in _documents(first_key_row, valid_row):
        sizes = [length // chunks] * chunks
        for _ in range(length % chunks):  # the extra tokens: to the ranks in turn
            rank = turn % ring_degree
            pieces = [k for k in range(chunks) if rank_of_piece[k] == rank]
            sizes[pieces[(turn // ring_degree) % len(pieces)]] += 1
            turn += 1
        at = start
        for piece, size in enumerate(sizes):
            owner[at:at + size] = rank_of_piece[piece]
            at += size
    padding = torch.nonzero(~valid_row).flatten()
    counts = torch.bincount(owner[valid_row], minlength=ring_degree)
    owner[padding] = torch.repeat_interleave(torch.arange(ring_degree), seq // ring_degree - counts)
    return [torch.nonzero(owner == r).flatten() for r in range(ring_degree)]
