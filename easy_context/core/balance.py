"""Layouts of their own for packed rows: equal attention work per rank.

The static layouts balance ONE causal row: zigzag and dist_flash's schedule give every rank
the same share of a cost that rises along the row. A packed row of long-tailed documents
breaks that: a token's cost is its offset in its own document + 1, so long documents are
ramps of rising cost and whole ramps land on some ranks (max/min work 3-18x at S=16K,
benchmarks/mask_balance.py). Two cures, one function each:

  split_documents   (document_split=True) every document is cut zigzag over the ring, the way
                    zigzag cuts one causal row: every rank gets its share of every document,
                    whatever the lengths, but every document then needs K/V from other ranks;
  place_documents   (document_split="workload") every document gets a degree: 1 keeps it
                    whole on one rank, d > 1 cuts it zigzag over d consecutive ranks (a
                    subgroup of the ring). Degrees start at the smallest that lets a document's
                    share fit one rank's tokens and mean work; then one of the documents loading
                    the busiest rank most widens by one rank at a time until the work is
                    balanced. A document's K/V travels only inside its subgroup (ring steps no
                    rank needs are skipped, K/V rows no query needs stay home: core/ring.py), so
                    a rank sends what its own documents need, not a share of every long one.

Every mode runs these layouts as a ring (dist_flash_attn too: its helpers balance the static
layout, and these balance themselves), so a rank's work is the query x key products of its own
queries (a document row at offset i attends i + 1 keys). Every rank holds the same number of
tokens, so the per-token rest of the layer is equal on every rank.
"""

from __future__ import annotations

import math

import torch

__all__ = ["split_documents", "place_documents", "placement_work", "WORK_TOLERANCE"]

# place_documents widens documents until the most loaded rank has at most this many times the
# work of the least loaded one. Each widening costs K/V transfers, so it stops at the first
# placement that reaches the bound rather than balancing to the last product.
WORK_TOLERANCE = 1.1

# How many of the documents loading the busiest rank most each widening step tries.
_CANDIDATES = 3


def _documents(first_key_row: torch.Tensor, valid_row: torch.Tensor) -> list[tuple[int, int]]:
    """(start, length) of each document inside the row's non-padding span."""
    index = torch.arange(first_key_row.shape[0])
    starts = torch.nonzero(valid_row & (first_key_row == index)).flatten().tolist()
    end = int(torch.nonzero(valid_row).max()) + 1 if bool(valid_row.any()) else 0
    return [(a, b - a) for a, b in zip(starts, starts[1:] + [end])]


def _pairs(first: int, end: int) -> int:
    """Query x key products of a document's rows first..end-1 (row i attends i + 1 keys)."""
    return (end * (end + 1) - first * (first + 1)) // 2


def _cut(length: int, ranks: list[int], extras: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(first, end, rank) of a document's pieces cut zigzag over `ranks` (consecutive,
    increasing): 2d pieces, the j-th rank keeping pieces j and 2d-1-j, so each holds an equal
    share of the document's work; offsets in the document. Pieces differ by at most one token:
    the length % 2d extra tokens go to extras[i] = (j, which of its two pieces) in turn."""
    chunks = 2 * len(ranks)
    owners = [min(k, chunks - 1 - k) for k in range(chunks)]
    sizes = [length // chunks] * chunks
    for j, which in extras[: length % chunks]:
        sizes[j if which % 2 == 0 else chunks - 1 - j] += 1
    pieces, at = [], 0
    for owner, size in zip(owners, sizes):
        pieces.append((at, at + size, ranks[owner]))
        at += size
    return pieces


def placement_work(pieces, ring_degree: int) -> list[float]:
    """Query x key products each ring rank computes for one document's pieces [(first, end,
    rank)] (offsets in the document, in order): a rank computes its own queries'."""
    work = [0.0] * ring_degree
    for first, end, rank in pieces:
        work[rank] += _pairs(first, end)
    return work


class _Cutter:
    """Cuts documents over the whole ring (split_documents); the extra tokens go to the ranks
    in turn, and the turn runs on over the documents a row cuts, so token counts differ by at
    most one."""

    def __init__(self, ring_degree: int):
        self.ring_degree, self.turn = ring_degree, 0

    def pieces(self, length: int) -> list[tuple[int, int, int]]:
        turns = range(self.turn, self.turn + length % (2 * self.ring_degree))
        self.turn += len(turns)
        extras = [(t % self.ring_degree, t // self.ring_degree) for t in turns]
        return _cut(length, list(range(self.ring_degree)), extras)


def _shares(owner: torch.Tensor, valid_row: torch.Tensor, ring_degree: int) -> list[torch.Tensor]:
    """Padding fills every rank up to S / R tokens; the R increasing index tensors."""
    seq = owner.shape[0]
    padding = torch.nonzero(~valid_row).flatten()
    counts = torch.bincount(owner[valid_row], minlength=ring_degree)
    owner[padding] = torch.repeat_interleave(torch.arange(ring_degree), seq // ring_degree - counts)
    return [torch.nonzero(owner == r).flatten() for r in range(ring_degree)]


def _owner_of(pieces, seq: int) -> torch.Tensor:
    owner = torch.empty(seq, dtype=torch.long)
    for first, end, rank in pieces:
        owner[first:end] = rank
    return owner


def split_documents(first_key_row: torch.Tensor, valid_row: torch.Tensor, ring_degree: int) -> list[torch.Tensor]:
    """document_split=True for one packed row: every document cut over the ring (`_Cutter`).
    Returns the R increasing index tensors (global positions of each rank's rows)."""
    cutter = _Cutter(ring_degree)
    pieces = [
        (start + first, start + end, rank)
        for start, length in _documents(first_key_row, valid_row)
        for first, end, rank in cutter.pieces(length)
    ]
    return _shares(_owner_of(pieces, first_key_row.shape[0]), valid_row, ring_degree)


class _Placement:
    """Documents placed by their degrees, widest first (their pieces need room on all their
    ranks), then largest share first: a whole document (degree 1) onto the least loaded rank
    with room, a cut one onto the window of consecutive ranks whose busiest rank ends least
    loaded. A document nothing has room for spills over the ranks with room, lowest first."""

    def __init__(self, docs, degrees, ring_degree: int, capacity: int):
        self.ring_degree = ring_degree
        self.room, self.work = [capacity] * ring_degree, [0.0] * ring_degree
        self.pieces, self.carried = [], [{} for _ in range(ring_degree)]  # rank -> {document: its work there}
        order = sorted(range(len(docs)), key=lambda i: (-degrees[i], -_pairs(0, docs[i][1]) / degrees[i], i))
        for i in order:
            self._place(i, *docs[i], degrees[i])

    def _place(self, i: int, start: int, length: int, degree: int) -> None:
        options = []
        for first in range(self.ring_degree - degree + 1):
            ranks = list(range(first, first + degree))
            by_room = sorted(ranks, key=lambda r: (-self.room[r], r))
            extras = [(r - first, which) for which in (0, 1) for r in by_room]
            pieces = _cut(length, ranks, extras)
            if all(self.room[r] >= n for r, n in _tokens(pieces).items()):
                work = placement_work(pieces, self.ring_degree)
                options.append((max(self.work[r] + work[r] for r in ranks), first, pieces, work))
        if options:
            _, _, pieces, work = min(options, key=lambda o: o[:2])
        else:
            pieces, at = [], 0
            for rank in range(self.ring_degree):
                take = min(self.room[rank], length - at)
                if take > 0:
                    pieces.append((at, at + take, rank))
                    at += take
            work = placement_work(pieces, self.ring_degree)
        for rank, n in _tokens(pieces).items():
            self.room[rank] -= n
        for rank, w in enumerate(work):
            if w:
                self.work[rank] += w
                self.carried[rank][i] = w
        self.pieces += [(start + first, start + end, rank) for first, end, rank in pieces]

    def imbalance(self) -> float:
        return max(self.work) / min(self.work) if min(self.work) > 0 else math.inf

    def busiest_sends(self, docs, degrees) -> float:
        """About the most K/V rows one rank sends: a document cut over d ranks has each send
        (d - 1) / d of its length (a document spilled over ranks with room is counted whole)."""
        sent = [0.0] * self.ring_degree
        for rank, carried in enumerate(self.carried):
            for i in carried:
                sent[rank] += docs[i][1] * (degrees[i] - 1) / degrees[i]
        return max(sent)

    def widenable_on_busiest(self, degrees, count: int) -> list[int]:
        """The documents carrying the most work on the busiest rank (at most `count`), among
        those that can widen."""
        busiest = max(range(self.ring_degree), key=lambda r: self.work[r])
        wider = [i for i in self.carried[busiest] if degrees[i] < self.ring_degree]
        return sorted(wider, key=lambda i: (-self.carried[busiest][i], i))[:count]


def _tokens(pieces) -> dict:
    counts = {}
    for first, end, rank in pieces:
        counts[rank] = counts.get(rank, 0) + end - first
    return counts


def _least_degree(length: int, mean_work: float, capacity: int, ring_degree: int) -> int:
    """The smallest degree whose pieces fit one rank's tokens and whose share (a zigzag cut
    gives its ranks equal shares) fits one rank's mean work."""
    degree = max(math.ceil(length / capacity), math.ceil(_pairs(0, length) / max(mean_work, 1)), 1)
    return min(degree, ring_degree)


def place_documents(
    first_key_row: torch.Tensor, valid_row: torch.Tensor, ring_degree: int, tolerance: float = WORK_TOLERANCE
) -> list[torch.Tensor]:
    """document_split="workload" for one packed row: a degree per document, each document whole
    on one rank or cut over as few consecutive ranks as the balance needs (`_Placement`),
    until the ranks' work is within `tolerance` (max/min). A row no placement balances (a
    rank left with padding only, or a tolerance of 1) gets `split_documents`' layout.
    Returns the R increasing index tensors (global positions of each rank's rows)."""
    seq = first_key_row.shape[0]
    docs, capacity = _documents(first_key_row, valid_row), seq // ring_degree
    if not docs:
        return split_documents(first_key_row, valid_row, ring_degree)
    mean_work = sum(_pairs(0, length) for _, length in docs) / ring_degree
    degrees = [_least_degree(length, mean_work, capacity, ring_degree) for _, length in docs]
    placement = _Placement(docs, degrees, ring_degree, capacity)
    while placement.imbalance() > tolerance:
        # Widen one of the documents loading the busiest rank most: the one whose widening
        # balances best (widening the largest alone can starve another rank of work).
        tried = []
        for i in placement.widenable_on_busiest(degrees, _CANDIDATES):
            wider = degrees[:i] + [degrees[i] + 1] + degrees[i + 1 :]
            tried.append((_Placement(docs, wider, ring_degree, capacity), wider))
        if not tried:
            return split_documents(first_key_row, valid_row, ring_degree)
        balanced = [t for t in tried if t[0].imbalance() <= tolerance]
        if balanced:  # of the widenings that balance, the one that sends least
            placement, degrees = min(balanced, key=lambda t: t[0].busiest_sends(docs, t[1]))
        else:
            placement, degrees = min(tried, key=lambda t: t[0].imbalance())
    return _shares(_owner_of(placement.pieces, seq), valid_row, ring_degree)
