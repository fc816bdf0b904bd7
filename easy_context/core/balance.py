"""Layouts of their own for packed rows: equal attention work per rank.

The static layouts balance ONE causal row: zigzag and dist_flash's schedule give every rank
the same share of a cost that rises along the row. A packed row of long-tailed documents
breaks that: a token's cost is its offset in its own document + 1, so long documents are
ramps of rising cost and whole ramps land on some ranks (max/min work 3-18x at S=16K,
benchmarks/mask_balance.py). Two cures, one function each:

  split_documents   (document_split=True) every document is cut over the ring the way the
                    mode cuts one causal row: every rank gets its share of every document,
                    whatever the lengths, but every document then needs K/V from other ranks;
  place_documents   (document_split="workload") documents stay whole, each on one rank,
                    longest first onto the rank with the least work; only the longest ones
                    are cut as above, as few as the balance needs. Ring steps no rank needs
                    are skipped and K/V rows no query needs stay home, so a short document's
                    K/V never travels (dist_flash_attn's schedule still sends the query rows
                    of the units a K/V owner computes for another rank: core/executor.py).

A rank's work here is the query x key products it computes (a document row at offset i
attends i + 1 keys): those of its whole documents, and an equal share of every cut one. Every
rank holds the same number of tokens, so the per-token rest of the layer is equal on every rank.
"""

from __future__ import annotations

import torch

__all__ = ["split_documents", "place_documents", "WORK_TOLERANCE"]

# place_documents cuts documents until the most loaded rank has at most this many times the
# work of the least loaded one. Each cut costs K/V transfers, so it stops at the first cut
# that reaches the bound rather than balancing to the last product.
WORK_TOLERANCE = 1.1


def _documents(first_key_row: torch.Tensor, valid_row: torch.Tensor) -> list[tuple[int, int]]:
    """(start, length) of each document inside the row's non-padding span."""
    index = torch.arange(first_key_row.shape[0])
    starts = torch.nonzero(valid_row & (first_key_row == index)).flatten().tolist()
    end = int(torch.nonzero(valid_row).max()) + 1 if bool(valid_row.any()) else 0
    return [(a, b - a) for a, b in zip(starts, starts[1:] + [end])]


def _pairs(first: int, end: int) -> int:
    """Query x key products of a document's rows first..end-1 (row i attends i + 1 keys)."""
    return (end * (end + 1) - first * (first + 1)) // 2


class _Cutter:
    """Cuts documents over the ring the way the static layout cuts one causal row: zigzag, 2R
    pieces with rank r keeping pieces r and 2R-1-r; contiguous (dist_flash_attn), R pieces with
    rank r keeping piece r, so a rank's queries still need keys of its own and lower ranks
    only. Pieces differ by at most one token; the extra tokens go to the ranks in turn (the
    turn runs on over the documents a row cuts), so token counts differ by at most one."""

    def __init__(self, ring_degree: int, zigzag: bool):
        self.ring_degree, self.chunks = ring_degree, 2 * ring_degree if zigzag else ring_degree
        self.rank_of_piece = (
            [min(k, self.chunks - 1 - k) for k in range(self.chunks)] if zigzag else list(range(self.chunks))
        )
        self.turn = 0

    def pieces(self, length: int) -> list[tuple[int, int, int]]:
        """(first, end, rank) of the document's pieces, offsets in the document."""
        sizes = [length // self.chunks] * self.chunks
        for _ in range(length % self.chunks):
            rank = self.turn % self.ring_degree
            mine = [k for k in range(self.chunks) if self.rank_of_piece[k] == rank]
            sizes[mine[(self.turn // self.ring_degree) % len(mine)]] += 1
            self.turn += 1
        pieces, at = [], 0
        for piece, size in enumerate(sizes):
            pieces.append((at, at + size, self.rank_of_piece[piece]))
            at += size
        return pieces


def _shares(owner: torch.Tensor, valid_row: torch.Tensor, ring_degree: int) -> list[torch.Tensor]:
    """Padding fills every rank up to S / R tokens; the R increasing index tensors."""
    seq = owner.shape[0]
    padding = torch.nonzero(~valid_row).flatten()
    counts = torch.bincount(owner[valid_row], minlength=ring_degree)
    owner[padding] = torch.repeat_interleave(torch.arange(ring_degree), seq // ring_degree - counts)
    return [torch.nonzero(owner == r).flatten() for r in range(ring_degree)]


def split_documents(
    first_key_row: torch.Tensor, valid_row: torch.Tensor, ring_degree: int, zigzag: bool = True
) -> list[torch.Tensor]:
    """document_split=True for one packed row: every document cut over the ring (`_Cutter`).
    Returns the R increasing index tensors (global positions of each rank's rows)."""
    owner = torch.empty(first_key_row.shape[0], dtype=torch.long)
    cutter = _Cutter(ring_degree, zigzag)
    for start, length in _documents(first_key_row, valid_row):
        for first, end, rank in cutter.pieces(length):
            owner[start + first : start + end] = rank
    return _shares(owner, valid_row, ring_degree)


def _placement(docs, cut: set, ring_degree: int, capacity: int, zigzag: bool):
    """(pieces [(start, end, rank)] in the row, work per rank) with the documents in `cut` cut
    over the ring and the others whole, longest first onto the least loaded rank with room.
    A document no rank has room for spills over the ranks with room, lowest rank first, so a
    later piece never sits on a lower rank (dist_flash's schedule has no unit for it)."""
    room, work, pieces = [capacity] * ring_degree, [0.0] * ring_degree, []
    cutter = _Cutter(ring_degree, zigzag)
    for i, (start, length) in enumerate(docs):
        if i in cut:
            for first, end, rank in cutter.pieces(length):
                pieces.append((start + first, start + end, rank))
                room[rank] -= end - first
            # A cut document's work is shared equally: zigzag's mirrored pieces carry equal
            # products; a contiguous cut's later pieces carry more, and dist_flash's balanced
            # schedule hands that surplus to the earlier ranks, as it does for one causal row.
            for rank in range(ring_degree):
                work[rank] += _pairs(0, length) / ring_degree
    for i in sorted((i for i in range(len(docs)) if i not in cut), key=lambda i: (-docs[i][1], i)):
        start, length = docs[i]
        fits = [r for r in range(ring_degree) if room[r] >= length]
        if fits:
            rank = min(fits, key=lambda r: (work[r], r))
            spans = [(0, length, rank)]
        else:
            spans, at = [], 0
            for rank in range(ring_degree):
                take = min(room[rank], length - at)
                if take > 0:
                    spans.append((at, at + take, rank))
                    at += take
        for first, end, rank in spans:
            pieces.append((start + first, start + end, rank))
            room[rank] -= end - first
            work[rank] += _pairs(first, end)
    return pieces, work


def place_documents(
    first_key_row: torch.Tensor,
    valid_row: torch.Tensor,
    ring_degree: int,
    zigzag: bool = True,
    tolerance: float = WORK_TOLERANCE,
) -> list[torch.Tensor]:
    """document_split="workload" for one packed row: documents whole, each on one rank, longest
    first onto the least loaded rank; the longest documents are cut over the ring (as
    `split_documents` cuts them), one more at a time, until the ranks' work is within
    `tolerance` (max/min). With every document cut this is `split_documents`' layout.
    Returns the R increasing index tensors (global positions of each rank's rows)."""
    seq = first_key_row.shape[0]
    docs = _documents(first_key_row, valid_row)
    longest_first = sorted(range(len(docs)), key=lambda i: (-docs[i][1], i))
    for n_cut in range(len(docs) + 1):
        pieces, work = _placement(docs, set(longest_first[:n_cut]), ring_degree, seq // ring_degree, zigzag)
        if max(work) <= tolerance * min(work):
            break
    owner = torch.empty(seq, dtype=torch.long)
    for first, end, rank in pieces:
        owner[first:end] = rank
    return _shares(owner, valid_row, ring_degree)
