"""A layout's runs: the stretches of consecutive positions each rank of an SP group holds.

A recurrent or convolution layer reads the sequence in order, so what it needs of the layout is
where each run of a rank's tokens sits in the sequence: zigzag gives a rank two runs, a
contiguous layout one, Ulysses pieces of a zigzag share one or two. `pieces` lists every run of
every rank in sequence order; state passing (mixers/) carries a state from each run to the next.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

__all__ = ["Piece", "pieces", "local_pieces"]


@dataclass(frozen=True)
class Piece:
    start: int  # global position of its first token
    length: int
    rank: int  # the SP rank that holds it
    offset: int  # where it starts among that rank's local tokens


@functools.lru_cache(maxsize=64)
def pieces(layout, seq_len: int) -> tuple[Piece, ...]:
    """Every run of every SP rank, in sequence order (`layout`: core.layout.Layout)."""
    found = []
    for rank in range(layout.size):
        positions = layout.local_indices(seq_len, rank).tolist()
        begin = 0
        for i in range(1, len(positions) + 1):
            if i == len(positions) or positions[i] != positions[i - 1] + 1:
                found.append(Piece(positions[begin], i - begin, rank, begin))
                begin = i
    return tuple(sorted(found, key=lambda p: p.start))


def local_pieces(layout, seq_len: int, rank: int) -> list[tuple[int, Piece]]:
    """(index in sequence order, piece) of the runs `rank` holds, in its local order."""
    return sorted(((i, p) for i, p in enumerate(pieces(layout, seq_len)) if p.rank == rank), key=lambda t: t[1].offset)
