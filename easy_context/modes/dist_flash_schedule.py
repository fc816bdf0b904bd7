"""The balanced causal schedule of DistFlashAttn (LightSeq), for any number of ranks.

Contiguous layout: rank r holds chunk r of the sequence (queries and keys). Causal
attention needs the products q_r x kv_s for every s <= r: the diagonal (s = r) plus
P(P-1)/2 off-diagonal units. In a plain ring, rank r does r units and rank 0 idles.

Here round t pairs ring step t with ring step P-t:
  - every rank r >= t computes its own q_r x kv_{r-t}           (step t),
  - every rank r <  t computes q_{r+P-t} x kv_r for rank r+P-t  (step P-t), with its own
    K/V, and sends the partial (out, lse) back.
That is exactly one unit per rank per round. For even P the middle round (t = P/2) has
only P/2 units; each is split by query rows between the owner and the K/V owner. So every
rank computes the same number of query x key products: the diagonal plus (P-1)/2 units.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Unit", "balanced_schedule", "products_per_rank"]


class Unit(NamedTuple):
    """`worker` computes rows part/parts of q_{q_owner} against the K/V of kv_owner."""

    q_owner: int
    kv_owner: int
    worker: int
    part: int = 0
    parts: int = 1

    @property
    def causal(self) -> bool:
        return self.q_owner == self.kv_owner

    def rows(self, q_len: int) -> slice:
        size = q_len // self.parts
        stop = q_len if self.part == self.parts - 1 else (self.part + 1) * size
        return slice(self.part * size, stop)


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
