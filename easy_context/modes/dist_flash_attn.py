"""dist_flash_attn: DistFlashAttn (LightSeq) as a schedule for the executor (core/executor.py).

Contiguous layout: rank r holds chunk r of the sequence (queries and keys). Causal
attention needs the products q_r x kv_s for every s <= r: the diagonal (s = r) plus
P(P-1)/2 off-diagonal units. In a plain ring, rank r does r units and rank 0 idles.

Here round t pairs ring step t with ring step P-t:
  - every rank r >= t computes its own q_r x kv_{r-t}           (step t),
  - every rank r <  t computes q_{r+P-t} x kv_r for rank r+P-t  (step P-t), with its own
    K/V, and sends the partial (out, lse) back.
That is exactly one unit per rank per round. For even P the middle round (t = P/2) has
only P/2 units; each is split by query rows between the owner and the K/V owner. So every
rank computes the same number of query x key products: the diagonal plus (P-1)/2 units,
for any number of ranks. The executor fetches the next round's K/V and queries while the
current round computes and sends partial results back while the next one computes; with
gradient checkpointing the forward is not recomputed in the backward.

Under a layout of its own per row (document_split) the layout balances the work, and the mode
runs it as a ring (`dist_flash_schedule`).
"""

from __future__ import annotations

import torch.distributed as dist

from easy_context.core.executor import REMAT_CACHE, Unit, execute
from easy_context.core.layout import Layout
from easy_context.core.masking import FULL_ROWS, Block
from easy_context.core.ring import RingSchedule, masked_ring_steps
from easy_context.modes import SeqParallelMode, fixed_ring_degree
from easy_context.modes.costs import Activations, AttentionShape, balanced_schedule_traffic

__all__ = [
    "dist_flash_attention",
    "dist_flash_schedule",
    "DistFlashSchedule",
    "balanced_schedule",
    "products_per_rank",
    "REMAT_CACHE",
    "MODE",
]


def balanced_schedule(size: int) -> list[list[Unit]]:
    """Rounds of units; round 0 is every rank's own causal diagonal."""
    rounds = [[Unit(r, r, r) for r in range(size)]]
    for t in range(1, size // 2 + 1):
        if t < size - t:
            own = [Unit(r, r - t, r) for r in range(t, size)]
            helped = [Unit(o, o - (size - t), o - (size - t)) for o in range(size - t, size)]
        else:  # middle round of an even size: split each unit between its two ranks
            own = [Unit(r, r - t, r, 0, 2) for r in range(t, size)]
            helped = [Unit(r, r - t, r - t, 1, 2) for r in range(t, size)]
        rounds.append(own + helped)
    return rounds


def products_per_rank(size: int, seq_len: int) -> list[int]:
    """Query x key products each rank computes (causal diagonal counted as S(S+1)/2)."""
    local = seq_len // size
    work = [0] * size
    for units in balanced_schedule(size):
        for unit in units:
            rows = unit.rows(local)
            n = rows.stop - rows.start
            work[unit.worker] += n * (n + 1) // 2 if unit.causal else n * local
    return work


def dist_flash_schedule(mask, size: int, local_len: int, device):
    """The executor schedule dist_flash_attn runs for `mask` on `size` ranks. The balanced
    schedule's helpers balance the static contiguous layout; a layout of its own per row
    (document_split, core/balance.py) balances its own work, its documents cut zigzag over the
    ranks they need (keys on later ranks included), so it runs as a ring: every unit computed
    by its query owner, a document's K/V only within the ranks it is cut over, and no query
    rows travelling."""
    if mask is not None and mask.row_layout is not None:
        return RingSchedule(masked_ring_steps(mask, False, size, local_len, device), size, local_len, local_len)
    return DistFlashSchedule(mask, size, local_len, device)


class DistFlashSchedule:
    """The balanced schedule on the static contiguous layout, as the executor runs it (an
    executor.Schedule). Kernel calls of each unit: one block (causal on the diagonal) without a
    mask; under a mask, the mask's blocks, and units with no allowed pair are dropped on every
    rank (no compute, no transfer)."""

    def __init__(self, mask, size: int, local_len: int, device):
        if mask is not None and mask.row_layout is not None:
            raise ValueError("a layout per row runs as a ring: use dist_flash_schedule")
        self.mask, self.device, self.local_len = mask, device, local_len
        self.masked = mask is not None and not mask.is_causal
        self.layout, self.seq_len = Layout(False, size), local_len * size
        self.rounds = [[u for u in units if self._needed(u)] for units in balanced_schedule(size)]

    def rows(self, unit: Unit) -> slice:
        return unit.rows(self.local_len)

    def keys(self, unit: Unit):
        """The K/V owner's rows the unit's queries may attend: under a mask only these travel
        (packed documents that stay whole on a rank need none of another's)."""
        return self._key_rows(unit, self.device)

    def _key_rows(self, unit: Unit, device=None):
        if not self.masked or unit.worker == unit.kv_owner:  # its own K/V: nothing travels
            return FULL_ROWS
        return self.mask.key_rows(("dist_flash", self.seq_len, unit), *self._indices(unit), device)

    def _positions(self, rank: int):
        return self.layout.ring_positions(self.seq_len, rank)

    def _indices(self, unit: Unit):
        return self._positions(unit.q_owner)[..., self.rows(unit)], self._positions(unit.kv_owner)

    def blocks(self, unit: Unit):
        if not self.masked:
            return [Block(FULL_ROWS, FULL_ROWS, unit.causal)]
        queries, keys = self._indices(unit)
        keys = keys[..., self._key_rows(unit)]
        return self.mask.blocks(("dist_flash", self.seq_len, unit), queries, keys, self.device)

    def _needed(self, unit: Unit) -> bool:
        return not self.masked or self.mask.has_pairs(("dist_flash", self.seq_len, unit), *self._indices(unit))


def dist_flash_attention(q, k, v, scale, group=None, layer=None, mask=None, softcap=None, sinks=None):
    """Causal attention of contiguously sharded q/k/v over `group`. `layer` (the HF
    attention module) enables checkpoint-aware reuse of the forward output; `mask` (a
    SequenceMask over the group's whole sequence) restricts the attention further; softcap
    and sinks as in ring.ring_attention."""
    size = dist.get_world_size(group) if group is not None else 1
    schedule = dist_flash_schedule(mask, size, q.shape[2], q.device)
    return execute(q, k, v, scale, schedule, group, layer, softcap, sinks)


def dist_flash_activations(shape: AttentionShape) -> Activations:
    """Per token: in the backward the prefetched q, k, v and the fp32 partial dK/dV going back;
    under checkpointing the remat cache's output and fp32 lse of every layer."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    buffers = 2 * shape.dtype_bytes * (q + 2 * kv) + shape.accumulate_bytes * 2 * kv if shape.sp_size > 1 else 0
    return Activations(backward_buffers=buffers, kept_for_recompute=shape.dtype_bytes * q + 4 * shape.heads)


MODE = SeqParallelMode(
    "dist_flash_attn",
    ring_degree=fixed_ring_degree("dist_flash_attn", lambda sp: sp, "it has no Ulysses part"),
    zigzag=False,
    attention=lambda q, k, v, scale, groups, layer=None, mask=None, **logits: dist_flash_attention(
        q, k, v, scale, groups.ring, layer, mask, **logits
    ),
    document_split=True,
    traffic=balanced_schedule_traffic,
    activations=dist_flash_activations,
    keeps_attention_output=True,
)
