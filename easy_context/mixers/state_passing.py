"""State passing: what each run of the sequence carries into the next, composed over the ranks.

Every rank holds runs of the sequence (core/pieces.py). For a run it can compute, on its own:
a convolution's tail (its last kernel - 1 inputs), and a scan's summary: since a linear
recurrence's final state is an affine function of its initial state, S_end = T(S_0) + c, the
summary is T (the transition) and c (the final state from a zero start). One differentiable
all-gather of the tails, or of the summaries, gives every rank what the runs before its own
carry; gradients flow back through it to the ranks that computed them.

Every rank's result depends on what was gathered, even where nothing comes before its runs
(zeros made from the gathered tensor): the gather's backward is a collective, and a rank whose
result did not depend on it would never join it while its peers wait.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from easy_context.core.collectives import all_gather_with_grad, broadcast
from easy_context.core.pieces import local_pieces, pieces

__all__ = ["split", "join", "halos", "carried", "run_starts", "stretches", "document_start", "holder", "from_holder"]


def split(x: torch.Tensor, sharding, dim: int) -> list[tuple[int, torch.Tensor]]:
    """(index in sequence order, slice of x) for this rank's runs, along the sequence `dim`."""
    return [
        (i, x.narrow(dim, p.offset, p.length))
        for i, p in local_pieces(sharding.layout, sharding.seq_len, sharding.rank)
    ]


def run_starts(sharding) -> list[int]:
    """The global position of the first token of each of this rank's runs, in local order."""
    return [p.start for _, p in local_pieces(sharding.layout, sharding.seq_len, sharding.rank)]


def stretches(sharding, row: int, start: int, length: int) -> list[tuple[int, int, bool]]:
    """The tokens [start, start + length) of `row` cut where documents start: (lo, hi, begins)
    offsets from `start`, and whether the stretch begins a document (else it continues the one
    before `start`)."""
    begins = sharding.starts[row, start : start + length]
    cuts = sorted({0, *torch.nonzero(begins).flatten().tolist()})
    return [(lo, hi, bool(begins[lo])) for lo, hi in zip(cuts, [*cuts[1:], length])]


def document_start(sharding, row: int, position: int) -> int:
    """The first position of the document that holds `position` in `row`."""
    return int(torch.nonzero(sharding.starts[row, : position + 1]).max())


def holder(sharding, position: int) -> tuple[int, int | None]:
    """(the SP rank holding `position`, the index among this rank's runs of the run that holds
    it, None on other ranks)."""
    for local, (_, p) in enumerate(local_pieces(sharding.layout, sharding.seq_len, sharding.rank)):
        if p.start <= position < p.start + p.length:
            return sharding.rank, local
    owner = next(p.rank for p in pieces(sharding.layout, sharding.seq_len) if p.start <= position < p.start + p.length)
    return owner, None


def from_holder(mine: torch.Tensor | None, like: torch.Tensor, sharding, position: int) -> torch.Tensor:
    """The tensor the rank holding `position` computed (`mine` there, None elsewhere), on every
    rank: one broadcast of a tensor shaped and typed like `like`."""
    owner, _ = holder(sharding, position)
    received = mine if mine is not None else torch.empty_like(like)
    return broadcast(received, owner, sharding.group)


def join(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """This rank's runs back into one tensor, in local order."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _gathered(per_run: list[list[torch.Tensor]], sharding) -> Callable[[int], list[torch.Tensor]]:
    """All ranks' per-run tensors in one all-gather (each run's tensors flattened into one row;
    runs padded to the most any rank holds): a function from a run's index in sequence order to
    its tensors. One collective, whatever the number of tensors, so every rank's backward runs
    the same collectives in the same order."""
    shapes = [t.shape for t in per_run[0]]
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in per_run[0]))
    rows = [torch.cat([t.reshape(-1).to(dtype) for t in tensors]) for tensors in per_run]
    everything = pieces(sharding.layout, sharding.seq_len)
    most = max(sum(1 for p in everything if p.rank == r) for r in range(sharding.size))
    gathered = all_gather_with_grad(
        torch.stack(rows + [torch.zeros_like(rows[0])] * (most - len(rows))), sharding.group
    )
    slot = {}
    for rank in range(sharding.size):
        for j, (i, _) in enumerate(local_pieces(sharding.layout, sharding.seq_len, rank)):
            slot[i] = (rank, j)
    sizes = [math.prod(shape) for shape in shapes]

    def of(i: int) -> list[torch.Tensor]:
        row = gathered[slot[i]]
        return [part.reshape(shape) for part, shape in zip(row.split(sizes), shapes)]

    return of


def halos(tails: list[torch.Tensor], sharding) -> list[torch.Tensor]:
    """For each of this rank's runs (in local order), the tail of the run before it in the
    sequence (zeros for the first run): `tails` are this rank's runs' tails, same shapes."""
    tail_of = _gathered([[tail] for tail in tails], sharding)
    runs = local_pieces(sharding.layout, sharding.seq_len, sharding.rank)
    return [(tail_of(0)[0] * 0 if i == 0 else tail_of(i - 1)[0]).to(tails[0].dtype) for i, _ in runs]


def carried(
    finals: list[torch.Tensor],
    transitions: list[torch.Tensor],
    sharding,
    apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> list[torch.Tensor | None]:
    """The state each of this rank's runs starts from (zeros for the first run of the
    sequence): S_in(i) = apply(T(i - 1), S_in(i - 1)) + c(i - 1), composed in sequence order
    from every rank's summaries (finals: c of this rank's runs, transitions: T, in local order)."""
    summary_of = _gathered([[final, transition] for final, transition in zip(finals, transitions)], sharding)
    runs = local_pieces(sharding.layout, sharding.seq_len, sharding.rank)
    wanted = {i for i, _ in runs}
    states, state = {}, summary_of(0)[0] * 0
    for i in range(max(wanted) + 1):
        if i in wanted:
            states[i] = state
        final, transition = summary_of(i)
        state = apply(transition, state) + final
    return [states[i].to(finals[0].dtype) for i, _ in runs]
