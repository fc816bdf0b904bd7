"""What one attention layer of a mode costs one rank: bytes sent, and activation bytes.

Each mode declares its costs in its own file (`SeqParallelMode.traffic` and `.activations`)
from the pieces here, which follow the code that runs: core/ring.py's ring (K/V rotate, dK/dV
go straight back to their owner), the Ulysses all-to-alls, and dist_flash_attn's balanced
schedule. Pure arithmetic: the planner (recipes/plan) and the attention benchmark ask the
modes for the same numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "Activations",
    "AttentionShape",
    "Traffic",
    "all_to_all_buffers",
    "all_to_all_traffic",
    "balanced_schedule_traffic",
    "kv_replication",
    "ring_buffers",
    "ring_traffic",
]


@dataclass(frozen=True)
class AttentionShape:
    """One attention layer of a batch over one SP group: q (B, heads, S, D), k/v (B, kv_heads, S, D).

    seq_len is the whole sequence S of the group (0 where only per-token terms are asked)."""

    heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int  # q, k, v, the output and their gradients
    sp_size: int = 1
    ring_degree: int = 1
    seq_len: int = 0
    batch: int = 1

    @property
    def ulysses_degree(self) -> int:
        return self.sp_size // self.ring_degree

    @property
    def local_len(self) -> int:  # tokens of the sequence on one rank
        return self.seq_len // self.sp_size

    @property
    def accumulate_bytes(self) -> int:  # dq, dK, dV accumulate in fp32 (or the dtype, if wider)
        return max(self.dtype_bytes, 4)


@dataclass(frozen=True)
class Traffic:
    """Bytes one rank sends in one layer, forward and backward: point-to-point (a ring's
    exchanges, overlapped with compute) and all-to-all (on the critical path). Where ranks
    differ, the busiest rank's."""

    p2p_forward: float = 0
    p2p_backward: float = 0
    all_to_all_forward: float = 0
    all_to_all_backward: float = 0

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(
            self.p2p_forward + other.p2p_forward,
            self.p2p_backward + other.p2p_backward,
            self.all_to_all_forward + other.all_to_all_forward,
            self.all_to_all_backward + other.all_to_all_backward,
        )

    @property
    def total(self) -> float:  # one forward and one backward
        return self.p2p_forward + self.p2p_backward + self.all_to_all_forward + self.all_to_all_backward


@dataclass(frozen=True)
class Activations:
    """Bytes per local token of one layer that a mode adds to a plain attention layer's."""

    kv_replication: int = 1  # KV heads repeated so they split over the Ulysses degree
    saved: int = 0  # kept for the backward besides q, k, v, the output and lse
    backward_buffers: int = 0  # live during the attention backward besides the kernel's dq, dk, dv
    # Under activation checkpointing, kept for the whole step (modes with keeps_attention_output)
    kept_for_recompute: int = 0


def kv_replication(shape: AttentionShape) -> int:
    """How many times Ulysses repeats each KV head: lcm(Hkv, U) / Hkv (modes/ulysses_attn.py)."""
    u = shape.ulysses_degree
    return math.lcm(shape.kv_heads, u) // shape.kv_heads if u > 1 else 1


def ring_traffic(shape: AttentionShape, kv_heads: int) -> Traffic:
    """core/ring.py's ring over ring_degree R ranks, each holding kv_heads K/V heads of
    local_len tokens. Forward: K and V rotate R - 1 times. Backward: K and V rotate R - 1 times
    again, and the fp32 dK/dV of each borrowed block go straight back to its owner. Causal,
    unmasked: every step is needed (masks skip steps and their transfers)."""
    r = shape.ring_degree
    if r == 1:
        return Traffic()
    kv = shape.batch * kv_heads * shape.local_len * shape.head_dim  # elements of K (and of V)
    return Traffic(
        p2p_forward=2 * (r - 1) * kv * shape.dtype_bytes,
        p2p_backward=2 * (r - 1) * kv * shape.dtype_bytes + 2 * (r - 1) * kv * shape.accumulate_bytes,
    )


def ring_buffers(shape: AttentionShape, kv_width: int) -> int:
    """Per token, during the ring's backward: the K/V block in use and the one arriving, and
    the fp32 dK/dV accumulators, local and in flight (kv_width = K/V heads x head_dim)."""
    if shape.ring_degree == 1:
        return 0
    return 2 * shape.dtype_bytes * 2 * kv_width + 2 * shape.accumulate_bytes * 2 * kv_width


def all_to_all_traffic(shape: AttentionShape) -> Traffic:
    """Ulysses over U ranks: q, k, v and the output (forward), dout, dq, dk, dv (backward) each
    cross one all-to-all, which keeps 1/U of every tensor on its rank; K/V heads replicated
    first where they do not split over U."""
    u = shape.ulysses_degree
    if u == 1:
        return Traffic()
    per_head = shape.batch * shape.local_len * shape.head_dim
    elements = (2 * shape.heads + 2 * shape.kv_heads * kv_replication(shape)) * per_head
    one_way = elements * shape.dtype_bytes * (u - 1) / u
    return Traffic(all_to_all_forward=one_way, all_to_all_backward=one_way)


def all_to_all_buffers(shape: AttentionShape) -> int:
    """Per token, during the Ulysses backward: the all-to-all send and receive buffers."""
    if shape.ulysses_degree == 1:
        return 0
    kv_width = shape.kv_heads * kv_replication(shape) * shape.head_dim
    return 2 * shape.dtype_bytes * (shape.heads * shape.head_dim + 2 * kv_width)


def balanced_schedule_traffic(shape: AttentionShape) -> Traffic:
    """dist_flash_attn's balanced schedule (modes/dist_flash_attn.py) over sp_size = P ranks,
    for the busiest rank. Each round t < P/2, rank r either computes its own queries against
    the K/V of rank r - t (r >= t) or helps rank r + P - t with its own K/V (r < t), and either
    lends its K/V to rank r + t (r < P - t) or has its queries computed by rank r - P + t. A
    unit that borrows K/V moves: K, V forward and again backward (owner -> worker), fp32 dK/dV
    back. A helped unit moves: q forward, q, out, dout and the fp32 lse backward (owner ->
    worker); the partial out and lse forward, the fp32 dq backward (worker -> owner). For even
    P the middle round splits each unit by query rows between the two ranks."""
    p = shape.sp_size
    if p == 1:
        return Traffic()
    e, acc, n = shape.dtype_bytes, shape.accumulate_bytes, shape.local_len
    kv = shape.batch * shape.kv_heads * n * shape.head_dim

    def helped_owner(rows):  # (forward, backward) bytes the owner of the queries sends
        q, lse = shape.batch * shape.heads * rows * shape.head_dim, shape.batch * shape.heads * rows
        return q * e, 3 * q * e + 4 * lse

    def helper(rows):  # (forward, backward) bytes the rank that computes them sends back
        q, lse = shape.batch * shape.heads * rows * shape.head_dim, shape.batch * shape.heads * rows
        return q * e + 4 * lse, q * acc

    lender, borrower = (2 * kv * e, 2 * kv * e), (0, 2 * kv * acc)
    rounds = (p - 1) // 2  # rounds with whole units; an even P adds a middle round
    middle = n - n // 2 if p % 2 == 0 else 0  # the rows of a middle unit that move

    def sent(r):
        borrowing, lending = min(r, rounds), min(rounds, p - 1 - r)
        parts = [
            (borrower, borrowing),
            (helper(n), rounds - borrowing),
            (lender, lending),
            (helped_owner(n), rounds - lending),
        ]
        if middle:
            parts += [(borrower, 1), (helped_owner(middle), 1)] if r >= p // 2 else [(lender, 1), (helper(middle), 1)]
        return sum(f * k for (f, _), k in parts), sum(b * k for (_, b), k in parts)

    # sent(r) is linear in r between the ranks where a count above changes slope or the middle
    # round changes sides, so the busiest rank is one of these (the first of equals)
    edges = {0, p - 1}
    for b in (rounds, p - 1 - rounds, p // 2):
        edges.update(x for x in (b - 1, b, b + 1) if 0 <= x < p)
    busiest = max(sorted(edges), key=lambda r: sum(sent(r)))
    forward, backward = sent(busiest)
    return Traffic(p2p_forward=forward, p2p_backward=backward)
