"""A layout of its own for each packed row (document_split): equal attention work per rank.

The static layouts balance ONE causal row: zigzag and dist_flash's schedule give every rank
the same share of a cost that rises along the row. A packed row of long-tailed documents
breaks that: a token's cost is its offset in its own document + 1, so long documents are
ramps of rising cost and whole ramps land on some ranks (max/min work 3-18x at S=16K,
benchmarks/mask_balance.py). Cutting every document over the ring the way the mode cuts one
causal row gives every rank its share of every document, whatever the lengths.
"""

from __future__ import annotations

import torch

__all__ = ["split_documents"]


def _documents(first_key_row: torch.Tensor, valid_row: torch.Tensor) -> list[tuple[int, int]]:
    """(start, length) of each document inside the row's non-padding span."""
    index = torch.arange(first_key_row.shape[0])
    starts = torch.nonzero(valid_row & (first_key_row == index)).flatten().tolist()
    end = int(torch.nonzero(valid_row).max()) + 1 if bool(valid_row.any()) else 0
    return [(a, b - a) for a, b in zip(starts, starts[1:] + [end])]


def split_documents(
    first_key_row: torch.Tensor, valid_row: torch.Tensor, ring_degree: int, zigzag: bool = True
) -> list[torch.Tensor]:
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
            owner[at : at + size] = rank_of_piece[piece]
            at += size
    padding = torch.nonzero(~valid_row).flatten()
    counts = torch.bincount(owner[valid_row], minlength=ring_degree)
    owner[padding] = torch.repeat_interleave(torch.arange(ring_degree), seq // ring_degree - counts)
    return [torch.nonzero(owner == r).flatten() for r in range(ring_degree)]
