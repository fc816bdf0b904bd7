"""The mask over the whole sequence, assembled from every SP rank's shard.

At the first attention call of a forward, every rank of the SP group all-gathers its local
position_ids and padding (S small integers, once per forward) and builds one
`masking.SequenceMask` over the whole sequence: documents (position_ids restarting), padding
and, per layer, the sliding window. Every rank derives it from the same gathered data, so a
check on it fails on all ranks alike and no rank is left waiting in a collective.
"""

from __future__ import annotations

import torch

from easy_context.core.collectives import all_gather
from easy_context.core.groups import SeqParallelGroups
from easy_context.core.layout import Layout, RowLayout
from easy_context.core.masking import SequenceMask

__all__ = ["gather_sequence_mask", "check_padding", "check_positions"]


def gather_sequence_mask(position_ids, padding, groups: SeqParallelGroups, layout: Layout, token_index) -> SequenceMask:
    if position_ids is None:
        raise ValueError(
            "the model passed no position_ids to its attention; sequence parallelism needs them "
            "(pass local_position_ids from prepare_seq_parallel_inputs)"
        )
    batch = position_ids.shape[0] if padding is None else padding.shape[0]
    rows = [
        position_ids.expand(batch, -1).long(),
        torch.ones_like(position_ids.expand(batch, -1), dtype=torch.long) if padding is None else padding.long(),
    ]
    if token_index is not None:
        rows.append(token_index.to(position_ids.device).expand(batch, -1).long())
    local = torch.stack(rows).contiguous()
    size, rank = groups.topology.sp_size, groups.sp_rank
    pieces = all_gather(local, groups.sp)  # on the data's device: NCCL takes only CUDA tensors
    if token_index is None:
        whole = layout.unshard(pieces, dim=2).cpu()  # the one host copy per forward: kernel calls are made there
        check_positions(pieces, size, rank, layout)
        row_layout = None
    else:  # document_split: each rank's rows sit at the global positions its third row names
        pieces = [piece.cpu() for piece in pieces]
        row_layout = RowLayout.from_local_indices(
            [piece[2] for piece in pieces], layout.ring_degree, layout.ulysses_degree
        )
        whole = row_layout.unshard([piece[:2] for piece in pieces])
    positions, valid = whole[0], whole[1]
    check_padding(valid)
    return SequenceMask.from_positions(positions, None if bool(valid.all()) else valid.bool(), row_layout)


def check_positions(pieces, size: int, rank: int, layout: Layout) -> None:
    """Positions left to the model's default (arange over each local shard) give wrong RoPE
    on every rank but the first, and would read as documents cut at shard boundaries."""
    local_len = pieces[0].shape[-1]
    if size == 1 or local_len == 1:  # one token per rank: real positions can look like the default
        return
    arange = torch.arange(local_len, device=pieces[0].device)
    if all(bool((piece[0] == arange).all()) for piece in pieces):
        raise ValueError(
            f"position_ids on rank {rank} of {size} are the model's default (0..{local_len - 1} on every rank), "
            f"not this rank's {layout.name} share of the sequence. Pass the `local_position_ids` returned "
            "by prepare_seq_parallel_inputs (to generate, use easy_context.generate, not model.generate)."
        )


def check_padding(valid: torch.Tensor) -> None:
    """Padding = zeros at the start and/or end of a row; zeros inside a row are refused."""
    if not bool(((valid == 0) | (valid == 1)).all()):
        raise ValueError("attention_mask must hold 0 (padding) and 1 (token) only")
    ones = valid.bool()
    inside = ones.long().cummax(dim=1).values.bool() & ones.flip(1).long().cummax(dim=1).values.flip(1).bool()
    holes = inside & ~ones
    if bool(holes.any()):
        row, col = (int(i) for i in torch.nonzero(holes)[0])
        raise ValueError(
            f"attention_mask row {row} has a 0 at position {col} between tokens: only padding (zeros at the "
            "start and/or end of a row) is supported under sequence parallelism; pack documents with "
            "position_ids restarting at 0 instead of masking inside a row"
        )
