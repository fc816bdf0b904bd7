"""The ring: every rank attends its own queries to the K/V of each rank in turn.

At step t every rank works with the K/V of the rank t places before it. Which (query rows x
key rows) products a rank computes at each step is the only thing that differs between
layouts and masks; a `RingSteps` supplies it, and `RingSchedule` turns it into the executor's
schedule (executor.py): round t holds a unit (r, r - t, r) for each rank r with work at step t,
so the K/V travels straight from its owner, the next step's while this one computes, and
the dK/dV of each borrowed block (fp32) goes straight back, one step behind.

A step no rank has work for is skipped, and a rank with no work at a step receives nothing
(packed documents and sliding windows leave most steps of a long ring empty; every rank
decides this from the same steps, so no rank waits on a message that never comes). Of the K/V
a rank needs, only the rows its queries may attend travel (`keys`): under
document_split="workload" short documents sit whole on one rank and only the rows of the
documents cut or spilled over ranks are sent. Without masks every step and row is needed and this
moves exactly what a ring relay moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from easy_context.core.blocks import fold_sinks, merge_block
from easy_context.core.executor import Unit, execute
from easy_context.core.layout import ring_layout
from easy_context.core.masking import FULL_ROWS, Block, SequenceMask

__all__ = [
    "Block",
    "RingSteps",
    "MaskedRingSteps",
    "RingSchedule",
    "masked_ring_steps",
    "ring_attention",
    # block math, in blocks.py since the executor; release 0.1 imported it from easy_context.ring
    "merge_block",
    "fold_sinks",
]


class RingSteps(Protocol):
    """Which (query rows x key rows) products each rank computes at each ring step."""

    masked: bool  # whether some rows may have no allowed key in a block (lse = -inf)

    def blocks(self, step: int, rank: int, size: int, q_len: int, kv_len: int) -> Sequence[Block]:
        """Blocks to compute at `step`, while holding the rows `keys(...)` of the K/V of rank
        (rank - step) % size (key slices relative to them)."""

    def needs(self, step: int, rank: int, size: int) -> bool:
        """Whether `rank` computes anything with the K/V of rank (rank - step) % size."""

    def keys(self, step: int, rank: int, size: int):
        """The rows of rank (rank - step) % size's K/V that `rank` needs at `step`: FULL_ROWS, a
        slice or an index tensor (see executor.Schedule.keys)."""


class MaskedRingSteps:
    """Blocks of any layout under a SequenceMask: `layout.ring_positions(seq_len, rank)` gives the
    global positions of a ring rank's rows (shared by the batch rows, or per row)."""

    masked = True

    def __init__(self, mask: SequenceMask, layout, seq_len: int, device):
        self.mask, self.layout, self.seq_len, self.device = mask, layout, seq_len, device
        self.name = (layout, seq_len)  # the layout, in the keys of the mask's memo

    def _positions(self, rank):
        return self.layout.ring_positions(self.seq_len, rank)

    def _key_rows(self, step, rank, size, device=None):
        if step == 0:  # its own K/V: nothing travels
            return FULL_ROWS
        source = (rank - step) % size
        return self.mask.key_rows((self.name, rank, source), self._positions(rank), self._positions(source), device)

    def keys(self, step, rank, size):
        return self._key_rows(step, rank, size, self.device)

    def blocks(self, step, rank, size, q_len, kv_len):
        source = (rank - step) % size
        keys = self._positions(source)[..., self._key_rows(step, rank, size)]
        return self.mask.blocks((self.name, rank, source), self._positions(rank), keys, self.device)

    def needs(self, step, rank, size):
        source = (rank - step) % size
        return self.mask.has_pairs((self.name, rank, source), self._positions(rank), self._positions(source))


def masked_ring_steps(mask: SequenceMask, zigzag: bool, size: int, local_len: int, device) -> MaskedRingSteps:
    """The ring steps for `mask` on a ring of `size` ranks holding `local_len` rows each, in the
    mask's per-row layout (document_split) or else the static zigzag/contiguous one."""
    return MaskedRingSteps(mask, ring_layout(mask, zigzag, size), local_len * size, device)


class RingSchedule:
    """RingSteps as an executor schedule: round 0 is every rank's own K/V; then one round per step
    some rank has work at, with a unit for each such rank (the same list on every rank)."""

    def __init__(self, steps: RingSteps, size: int, q_len: int, kv_len: int):
        self.steps, self.size, self.q_len, self.kv_len = steps, size, q_len, kv_len
        self.masked = steps.masked
        self.rounds = [[Unit(r, r, r) for r in range(size) if steps.needs(0, r, size)]]
        for step in range(1, size):
            units = [Unit(r, (r - step) % size, r) for r in range(size) if steps.needs(step, r, size)]
            if units:
                self.rounds.append(units)

    def rows(self, unit: Unit) -> slice:
        return FULL_ROWS

    def keys(self, unit: Unit):
        return self.steps.keys((unit.q_owner - unit.kv_owner) % self.size, unit.q_owner, self.size)

    def blocks(self, unit: Unit) -> Sequence[Block]:
        step = (unit.q_owner - unit.kv_owner) % self.size
        return self.steps.blocks(step, unit.q_owner, self.size, self.q_len, self.kv_len)


def ring_attention(
    q, k, v, scale: float, steps: RingSteps, group=None, softcap=None, sinks=None, layer=None
) -> torch.Tensor:
    """Exact attention of the local queries against the K/V of every rank in `group`.

    q (B, Hq, S_local, D), k/v (B, Hkv, S_local, D); returns (B, Hq, S_local, D). `steps`
    (RingSteps): the products each rank computes at each step. `group=None` or a group of
    one rank computes plain local attention. softcap: logits c * tanh(s / c); sinks (Hq,): a
    learned logit per head in every row's softmax; layer: the HF attention module, for
    recompute-free checkpointing (executor.execute).
    """
    size = dist.get_world_size(group) if group is not None else 1
    schedule = RingSchedule(steps, size, q.shape[2], k.shape[2])
    return execute(q, k, v, scale, schedule, group, layer, softcap, sinks)
