"""How a sequence is split across the ranks of a sequence-parallel group, and put back.

A layout is pure indexing: it never communicates. `shard` keeps one rank's tokens,
`unshard` reassembles the per-rank pieces, `local_positions` says which global positions a
rank holds (used to check that the model was fed the right position_ids).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Layout", "ZIGZAG", "CONTIGUOUS", "IDENTITY"]


@dataclass(frozen=True)
class Layout:
    name: str
    chunks_per_rank: int  # 2 for zigzag, 1 for contiguous, 0 for "no sharding"

    def multiple(self, world_size: int) -> int:
        """The sequence length must be a multiple of this."""
        return max(1, self.chunks_per_rank * world_size)

    def chunk_ids(self, rank: int, world_size: int) -> list[int]:
        if self.chunks_per_rank == 2:
            # Zigzag: rank r holds chunks r and 2P-1-r, so every rank has the same causal work.
            return [rank, 2 * world_size - 1 - rank]
        return [rank]

    def check_length(self, seq_len: int, world_size: int) -> None:
        multiple = self.multiple(world_size)
        if seq_len % multiple:
            lower, upper = seq_len // multiple * multiple, (seq_len // multiple + 1) * multiple
            raise ValueError(
                f"sequence length {seq_len} is not divisible by {multiple} "
                f"({self.name} layout over {world_size} ranks needs a multiple of {multiple}); "
                f"use e.g. {lower or multiple} or {upper}, or pad/truncate the sequence"
            )

    def shard(self, x: torch.Tensor, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
        if self.chunks_per_rank == 0:
            return x
        self.check_length(x.shape[dim], world_size)
        chunks = x.chunk(self.multiple(world_size), dim=dim)
        return torch.cat([chunks[i] for i in self.chunk_ids(rank, world_size)], dim=dim)

    def unshard(self, pieces: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """Inverse of `shard`: pieces[r] is rank r's local tensor."""
        if self.chunks_per_rank == 0:
            return pieces[0]
        world_size = len(pieces)
        ordered: list[torch.Tensor | None] = [None] * self.multiple(world_size)
        for rank, piece in enumerate(pieces):
            for chunk, i in zip(piece.chunk(self.chunks_per_rank, dim=dim), self.chunk_ids(rank, world_size)):
                ordered[i] = chunk
        return torch.cat(ordered, dim=dim)

    def local_positions(self, local_len: int, rank: int, world_size: int, device=None) -> torch.Tensor:
        """Global positions (from 0) of the tokens rank `rank` holds, for local length `local_len`."""
        if self.chunks_per_rank == 0:
            return torch.arange(local_len, device=device)
        chunk = local_len // self.chunks_per_rank
        return torch.cat(
            [torch.arange(i * chunk, (i + 1) * chunk, device=device) for i in self.chunk_ids(rank, world_size)]
        )


ZIGZAG = Layout("zigzag", 2)
CONTIGUOUS = Layout("contiguous", 1)
IDENTITY = Layout("identity", 0)
