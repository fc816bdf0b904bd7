"""How one sequence is split over the ranks of a sequence-parallel (SP) group, and put back.

Two levels, matching how the attention communicates:
  ring level     ring_degree shares; zigzag (2R chunks, ring rank r keeps r and 2R-1-r, so
                 causal work is equal on every rank) or contiguous.
  Ulysses level  each ring share is cut into ulysses_degree contiguous pieces; the Ulysses
                 all-to-all concatenates them back in order, giving the ring its share.
SP rank = ring_rank * ulysses_degree + ulysses_rank (Ulysses over neighbouring ranks).

A layout is pure indexing, never communication: `local_indices` is the single source of
truth and shard, unshard and the position check all derive from it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["Layout", "WHOLE_SEQUENCE"]


@dataclass(frozen=True)
class Layout:
    zigzag: bool
    ring_degree: int = 1
    ulysses_degree: int = 1

    @property
    def size(self) -> int:
        return self.ring_degree * self.ulysses_degree

    @property
    def name(self) -> str:
        ring = f"{'zigzag' if self.zigzag else 'contiguous'} ring x{self.ring_degree}"
        return ring if self.ulysses_degree == 1 else f"{ring}, Ulysses x{self.ulysses_degree}"

    @property
    def multiple(self) -> int:
        """Sequence lengths must be a multiple of this."""
        ring_chunks = 2 * self.ring_degree if self.zigzag and self.ring_degree > 1 else self.ring_degree
        return ring_chunks * self.ulysses_degree

    def check_length(self, seq_len: int) -> None:
        m = self.multiple
        if seq_len % m:
            lower, upper = seq_len // m * m, (seq_len // m + 1) * m
            raise ValueError(
                f"sequence length {seq_len} is not divisible by {m}, which the {self.name} layout "
                f"over {self.size} ranks needs; use e.g. {lower or m} or {upper}, or pad/truncate"
            )

    def local_indices(self, seq_len: int, sp_rank: int) -> torch.Tensor:
        """Global positions (0-based) of the tokens SP rank `sp_rank` holds, in local order."""
        self.check_length(seq_len)
        return _local_indices(self, seq_len, sp_rank)

    def shard(self, x: torch.Tensor, sp_rank: int, dim: int = 1) -> torch.Tensor:
        return x.index_select(dim, self.local_indices(x.shape[dim], sp_rank).to(x.device))

    def unshard(self, pieces: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """Inverse of `shard`: pieces[r] is SP rank r's local tensor."""
        seq_len = pieces[0].shape[dim] * len(pieces)
        order = torch.cat([self.local_indices(seq_len, r) for r in range(len(pieces))]).to(pieces[0].device)
        stacked = torch.cat(pieces, dim=dim)
        return torch.empty_like(stacked).index_copy_(dim, order, stacked)


@functools.lru_cache(maxsize=256)
def _local_indices(layout: Layout, seq_len: int, sp_rank: int) -> torch.Tensor:
    ring_rank, ulysses_rank = divmod(sp_rank, layout.ulysses_degree)
    positions = torch.arange(seq_len)
    if layout.zigzag and layout.ring_degree > 1:
        chunks = positions.chunk(2 * layout.ring_degree)
        share = torch.cat([chunks[ring_rank], chunks[2 * layout.ring_degree - 1 - ring_rank]])
    else:
        share = positions.chunk(layout.ring_degree)[ring_rank]
    return share.chunk(layout.ulysses_degree)[ulysses_rank]


# One rank holds the whole sequence (data_parallel, or an SP group of one).
WHOLE_SEQUENCE = Layout(zigzag=False)
