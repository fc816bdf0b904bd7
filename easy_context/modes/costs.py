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

from easy_context.core.exchange import ulysses_head_splits

__all__ = [
    "Activations",
    "AttentionShape",
    "Traffic",
    "all_to_all_buffers",
    "all_to_all_traffic",
    "balanced_schedule_traffic",
    "kv_replication",
    "query_head_load",
    "ulysses_heads",
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

    kv_replication: float = 1  # KV heads repeated so they split over the Ulysses degree (uneven heads: a ratio)
    saved: int = 0  # kept for the backward besides q, k, v, the output and lse
    backward_buffers: int = 0  # live during the attention backward besides the kernel's dq, dk, dv
    # Under activation checkpointing, kept for the whole step (modes with keeps_attention_output)
    kept_for_recompute: int = 0


def ulysses_heads(shape: AttentionShape) -> tuple[tuple, tuple, tuple]:
    """Per Ulysses rank: (query heads, K/V heads received, K/V heads its kernel takes), as
    modes/ulysses_attn.py runs them: K/V heads repeated to lcm(Hkv, U) where the query heads
    split evenly; else each rank receives the K/V heads its query heads read, and takes one per
    query head where they read them unevenly."""
    u = shape.ulysses_degree
    if shape.heads % u == 0:
        kv = shape.kv_heads * (math.lcm(shape.kv_heads, u) // shape.kv_heads) // u
        return (shape.heads // u,) * u, (kv,) * u, (kv,) * u
    query, kv = ulysses_head_splits(shape.heads, shape.kv_heads, u)
    held = tuple(
        kv.sizes[r] if kv.local_reads(query, r) is None else query.sizes[r] for r in range(shape.ulysses_degree)
    )
    return query.sizes, kv.sizes, held


def kv_replication(shape: AttentionShape) -> float:
    """How many times the busiest Ulysses rank holds the K/V heads over: lcm(Hkv, U) / Hkv where
    the query heads split evenly (modes/ulysses_attn.py), more where they do not."""
    if shape.ulysses_degree == 1:
        return 1
    held = max(ulysses_heads(shape)[2]) * shape.ulysses_degree
    return held // shape.kv_heads if held % shape.kv_heads == 0 else held / shape.kv_heads


def query_head_load(shape: AttentionShape) -> float:
    """The busiest Ulysses rank's attention work over the mean rank's: ceil(H / U) / (H / U) where
    the query heads do not split evenly (9 over 2: 5 / 4.5), else 1."""
    if shape.ulysses_degree == 1:
        return 1.0
    return max(ulysses_heads(shape)[0]) * shape.ulysses_degree / shape.heads


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
    """Ulysses over U ranks, for the busiest rank i holding h_i query heads and receiving k_i K/V
    heads (K = sum of the k_i, K/V heads replicated where they do not split): forward, q and k, v
    to the other ranks' heads ((H - h_i) + 2 (K - k_i) heads of its local tokens) and the output
    of its heads back ((U - 1) h_i); backward, dout like q and dq, dk, dv like the output
    ((H - h_i) + (U - 1) (h_i + 2 k_i)). Even heads: 1/U of every tensor stays on its rank."""
    u = shape.ulysses_degree
    if u == 1:
        return Traffic()
    per_head = shape.batch * shape.local_len * shape.head_dim * shape.dtype_bytes
    query, received, _ = ulysses_heads(shape)
    total_kv = sum(received)

    def sent(h, k):  # (forward, backward) heads of local tokens
        return (shape.heads - h) + 2 * (total_kv - k) + (u - 1) * h, (shape.heads - h) + (u - 1) * (h + 2 * k)

    forward, backward = max((sent(h, k) for h, k in zip(query, received)), key=sum)
    return Traffic(all_to_all_forward=forward * per_head, all_to_all_backward=backward * per_head)


def all_to_all_buffers(shape: AttentionShape) -> int:
    """Per token, during the Ulysses backward: the all-to-all send and receive buffers (the
    busiest rank's heads, over U times its local tokens)."""
    u = shape.ulysses_degree
    if u == 1:
        return 0
    query, _, held = ulysses_heads(shape)
    return 2 * shape.dtype_bytes * shape.head_dim * u * (max(query) + 2 * max(held))


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
