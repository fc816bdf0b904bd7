"""How one sequence is split over the ranks of a sequence-parallel (SP) group, and put back.

Two levels, matching how the attention communicates:
  ring level     ring_degree shares; zigzag (2R chunks, ring rank r keeps r and 2R-1-r, so
                 causal work is equal on every rank) or contiguous.
  Ulysses level  each ring share is cut into ulysses_degree contiguous pieces; the Ulysses
                 all-to-all concatenates them back in order, giving the ring its share.
SP rank = ring_rank * ulysses_degree + ulysses_rank (Ulysses over neighbouring ranks).

A layout is pure indexing, never communication: `local_indices` is the single source of
truth and shard, unshard and the position check all derive from it.

`RowLayout` (document_split) is a layout of its own per batch row, balancing the ranks' work
on packed documents (balance.py): document_split=True cuts every document over the ring the
way the static layout cuts one causal row; document_split="workload" keeps documents whole on
one rank each and cuts only the longest. The ring's steps read either kind through
`ring_positions`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from easy_context.core.balance import place_documents, split_documents
from easy_context.core.masking import SequenceMask

__all__ = ["Layout", "RowLayout", "WHOLE_SEQUENCE", "DOCUMENT_SPLITS", "check_document_split_value", "ring_layout"]

# The values of the document_split option that ask for a layout per row, and how each places a
# row's documents on the ring (None and False: the mode's static layout).
DOCUMENT_SPLITS = {True: split_documents, "workload": place_documents}


def check_document_split_value(value) -> None:
    """None or False (the mode's static layout), or a key of DOCUMENT_SPLITS."""
    if value is None or isinstance(value, bool) or (isinstance(value, str) and value in DOCUMENT_SPLITS):
        return
    raise ValueError(
        f"document_split={value!r} is not one of None, False, True (every document cut over the ring) "
        "or 'workload' (each document whole on one rank or cut over as few ranks as the balance needs)"
    )


@dataclass(frozen=True)
class Layout:
    zigzag: bool
    ring_degree: int = 1
    ulysses_degree: int = 1

    per_row = False  # one layout for every batch row (RowLayout: one per row)

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

    def padding(self, seq_len: int) -> int:
        """Tokens to add at the end of a row of seq_len so that this layout splits it."""
        return -seq_len % self.multiple

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

    def ring_positions(self, seq_len: int, ring_rank: int) -> torch.Tensor:
        """(n,) global positions of ring rank `ring_rank`'s share (its Ulysses pieces together)."""
        return Layout(self.zigzag, self.ring_degree).local_indices(seq_len, ring_rank)

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


class RowLayout:
    """document_split: each batch row split over the ranks its own way. shares[r] (B, S / R):
    the global positions of ring rank r's rows, increasing per batch row; a share is cut into
    ulysses_degree contiguous pieces, one per Ulysses rank, as `Layout` cuts a ring share."""

    per_row = True

    def __init__(self, shares: list, ulysses_degree: int = 1):
        self.shares, self.ulysses_degree = shares, ulysses_degree

    @property
    def ring_degree(self) -> int:
        return len(self.shares)

    @classmethod
    def of_documents(cls, position_ids, attention_mask, ring_degree: int, ulysses_degree: int, split=True) -> RowLayout:
        """The split of a batch (position_ids (B, S): documents restart their positions; attention_mask
        (B, S) 0/1 or None), each row placed on the ring by DOCUMENT_SPLITS[split]. Documents
        are cut zigzag in every mode: each mode runs a layout per row as a ring."""
        place = DOCUMENT_SPLITS[split]
        valid = None if attention_mask is None else attention_mask.cpu().bool()
        first_key = SequenceMask.from_positions(position_ids, valid).first_key
        valid = torch.ones_like(first_key, dtype=torch.bool) if valid is None else valid
        per_row = [place(first_key[b], valid[b], ring_degree) for b in range(len(valid))]
        return cls([torch.stack([shares[r] for shares in per_row]) for r in range(ring_degree)], ulysses_degree)

    @classmethod
    def from_local_indices(cls, indices: list, ring_degree: int, ulysses_degree: int) -> RowLayout:
        """The layout whose SP rank i holds the rows at indices[i] (B, S_local) (the local_token_index
        of every rank of the SP group); refused unless they cover each row exactly once."""
        index = torch.cat(indices, dim=1)
        if not bool((torch.sort(index, dim=1).values == torch.arange(index.shape[1])).all()):
            raise ValueError(
                "seq_parallel_index of the sequence-parallel group is not a permutation of the row's positions: "
                "pass local_token_index from prepare_seq_parallel_inputs (same batch, same options)"
            )
        u = ulysses_degree
        return cls([torch.cat(indices[r * u : (r + 1) * u], dim=1) for r in range(ring_degree)], ulysses_degree)

    def ring_positions(self, seq_len: int, ring_rank: int) -> torch.Tensor:
        """(B, n) global positions of ring rank `ring_rank`'s rows (seq_len: as Layout's; implied here)."""
        return self.shares[ring_rank]

    def local_indices(self, sp_rank: int) -> torch.Tensor:
        """(B, S_local) global positions of SP rank `sp_rank`'s rows, in local order."""
        ring_rank, ulysses_rank = divmod(sp_rank, self.ulysses_degree)
        return self.shares[ring_rank].chunk(self.ulysses_degree, dim=1)[ulysses_rank]

    def unshard(self, pieces: list) -> torch.Tensor:
        """pieces[i] (..., B, S_local): SP rank i's rows in local order -> (..., B, S) in row order."""
        stacked = torch.cat(pieces, dim=-1)
        index = torch.cat([self.local_indices(i) for i in range(len(pieces))], dim=1).to(stacked.device)
        return torch.empty_like(stacked).scatter_(-1, index.expand_as(stacked), stacked)


def ring_layout(mask: SequenceMask | None, zigzag: bool, ring_degree: int):
    """How a ring of `ring_degree` ranks holds the rows `mask` describes: the mask's per-row layout
    (document_split), else the static zigzag or contiguous one."""
    if mask is not None and mask.row_layout is not None:
        return mask.row_layout
    return Layout(zigzag, ring_degree)


# One rank holds the whole sequence (data_parallel, or an SP group of one).
WHOLE_SEQUENCE = Layout(zigzag=False)
