"""Which layout packed rows should take: each layout's attention priced from the schedule it runs.

For a mode that takes a layout per row (document_split) on a ring of R ranks, the three layouts

  static     the mode's own (zigzag, or contiguous for dist_flash_attn)
  cut        document_split=True: every document cut over the whole ring
  workload   document_split="workload": a degree per document (core/balance.py)

are priced on sample rows of the data's document lengths by what their schedules do: the same
rounds, units, kernel calls and K/V rows the attention runs (easy_context's own schedules), so
what is counted here is what a GPU would execute and send. The time model (docs/benchmarks.md,
"The time model and the planner's choice"), per layer, forward + backward:

  compute(rank, round)  = products x 4 D Hq x 3.5 / F    (QK^T and PV; the flash backward 2.5x)
  transfer              = latency + bytes / link, posted when both ranks start the round before
                          (the executor fetches the next round's inputs while one computes)
  a rank starts a round when it has finished the last one and the round's inputs arrived;
  the layer ends when the last rank finishes (`predict`).

Bytes per row that travels: a K/V row, 2 Hkv D x dtype forward and again in the backward, its fp32
dK/dV back; a query row (a unit the K/V owner computes), q forward and q, dout, out in the
backward (dtype), lse, and its fp32 partial output, lse and dQ back.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from easy_context.core.balance import WORK_TOLERANCE, place_documents, split_documents
from easy_context.core.layout import RowLayout
from easy_context.core.masking import SequenceMask
from easy_context.core.ring import RingSchedule, masked_ring_steps
from easy_context.modes import get_mode
from easy_context.modes.dist_flash_attn import dist_flash_schedule
from recipes.plan.speed import efficiency, group_bandwidth

__all__ = [
    "LAYOUTS",
    "LAYOUT_FLAGS",
    "LATENCY_S",
    "LinkModel",
    "long_tailed_lengths",
    "packed_mask",
    "shares_of",
    "schedule_of",
    "products",
    "round_costs",
    "predict",
    "choose_layout",
    "packed_layout",
]

LAYOUTS = ("static", "cut", "workload")
# train.py's flags for each layout (recipes/training/run.py maps them to document_split).
LAYOUT_FLAGS = {"static": "", "cut": "--balance-documents cut", "workload": "--balance-documents workload"}
# Per transfer: an assumption (NCCL point-to-point inside a node is quoted at a few
# to ten microseconds), not measured here; the model prints it.
LATENCY_S = 10e-6
# Sample rows for the planner's choice: the planned length, up to this many tokens (16 s for
# the three layouts at 4 ranks). Shorter samples can choose otherwise: at 4 ranks on H100s rows
# of 64K tokens favour workload by 0.3%, rows of 128K and 256K favour cut by 6% and 12%.
SAMPLE_TOKENS = 262144


@dataclass(frozen=True)
class LinkModel:
    """The time model's parameters: achieved attention TFLOP/s (forward + backward, counted as
    above), the link's GB/s one way, latency per transfer, and the activations' bytes per value."""

    tflops: float
    link_gbs: float
    latency_s: float = LATENCY_S
    dtype_bytes: int = 2

    def describe(self) -> str:
        return (
            f"attention {self.tflops:.0f} TFLOP/s, link {self.link_gbs:g} GB/s one way, "
            f"latency {self.latency_s * 1e6:g} us per transfer, {8 * self.dtype_bytes}-bit activations"
        )


def long_tailed_lengths(
    seq: int, rng: random.Random, median: int = 300, sigma: float = 1.4, shortest: int = 1
) -> list[int]:
    """Log-normal document lengths of at least `shortest` tokens filling a row of `seq` (the
    last one is cut to fit): many short documents and a few long ones, the mix of web / code corpora."""
    lengths = []
    while sum(lengths) < seq:
        lengths.append(min(max(shortest, int(rng.lognormvariate(math.log(median), sigma))), seq - sum(lengths)))
    return lengths


def packed_mask(lengths) -> SequenceMask:
    return SequenceMask.from_positions(torch.cat([torch.arange(n) for n in lengths])[None])


def shares_of(layout: str, mask: SequenceMask, size: int, tolerance: float = WORK_TOLERANCE):
    """Each ring rank's global positions of one unpadded row under `layout` (None: static)."""
    if layout == "static":
        return None
    first_key = mask.first_key[0]
    valid = torch.ones(first_key.shape[0], dtype=torch.bool)
    if layout == "cut":
        return split_documents(first_key, valid, size)
    return place_documents(first_key, valid, size, tolerance)


def schedule_of(mode: str, mask: SequenceMask, seq: int, size: int, shares=None):
    """The executor schedule the mode runs for `mask` on `size` ranks: its static layout, or the
    per-row layout whose ring rank r holds shares[r] (one batch row)."""
    layout = None if shares is None else RowLayout([share[None] for share in shares])
    mask = SequenceMask(mask.first_key, row_layout=layout)
    if not get_mode(mode).zigzag:  # the contiguous mode: its balanced schedule (a ring on a layout per row)
        return dist_flash_schedule(mask, size, seq // size, "cpu")
    steps = masked_ring_steps(mask, True, size, seq // size, "cpu")
    return RingSchedule(steps, size, seq // size, seq // size)


def products(blocks) -> int:
    """Query x key products the kernel calls compute (causal square n(n+1)/2, else nq x nk)."""
    total = 0
    for block in (part for b in blocks for part in b.split()):
        nq, nk = block.q.stop - block.q.start, block.kv.stop - block.kv.start
        total += nq * (nq + 1) // 2 if block.causal else nq * nk
    return total


def _count(rows, local_len: int) -> int:
    return len(range(local_len)[rows]) if isinstance(rows, slice) else len(rows)


def round_costs(schedule, size: int, local_len: int) -> list[dict]:
    """Per round of the schedule's forward: the products each rank computes ("products") and
    the rows that travel, {(owner, worker): (K/V rows, query rows)} ("transfers")."""
    rounds = []
    for units in schedule.rounds:
        cost = {"products": [0] * size, "transfers": {}}
        for unit in units:
            cost["products"][unit.worker] += products(schedule.blocks(unit))
            for owner, kv, q in (
                (unit.kv_owner, _count(schedule.keys(unit), local_len), 0),
                (unit.q_owner, 0, _count(schedule.rows(unit), local_len)),
            ):
                if owner != unit.worker:
                    before = cost["transfers"].get((owner, unit.worker), (0, 0))
                    cost["transfers"][owner, unit.worker] = (before[0] + kv, before[1] + q)
        rounds.append(cost)
    return rounds


def predict(rounds: list[dict], heads: int, kv_heads: int, head_dim: int, link: LinkModel) -> dict:
    """Seconds of one layer's attention (forward + backward) from `round_costs`, and the
    busiest rank's bytes (sent + received over both passes).

    The rounds are not barriers: as the executor does, each rank posts a round's transfers when
    it starts the round before, a transfer ends `latency + bytes / link` after both of its ranks
    posted it (a rank's transfers of one round share its link), and a rank starts a round when
    it has finished the last one and its inputs have arrived. The forward and the backward are
    taken as one pass (compute x 3.5; the bytes of both, the results going back included)."""
    b, kv_row, q_row = link.dtype_bytes, 2 * kv_heads * head_dim, heads * head_dim
    # bytes per row travelling, both passes: K/V forward and again backward, fp32 dK/dV back; q
    # forward, q, dout, out (+ lse) backward, fp32 partial out + lse and dQ back
    kv_bytes = 2 * kv_row * b + kv_row * 4
    q_bytes = 4 * q_row * b + 4 * heads + 2 * q_row * 4 + 2 * 4 * heads
    size = len(rounds[0]["products"]) if rounds else 1
    moved, started, finished = [0] * size, [0.0] * size, [0.0] * size
    bandwidth, flop_s = link.link_gbs * 1e9, link.tflops * 1e12
    for cost in rounds:
        arrival, load = list(finished), [0] * size
        for (src, dst), (kv, q) in cost["transfers"].items():
            nbytes = kv * kv_bytes + q * q_bytes
            load[src], load[dst] = load[src] + nbytes, load[dst] + nbytes
            moved[src], moved[dst] = moved[src] + nbytes, moved[dst] + nbytes
        for (src, dst), _ in cost["transfers"].items():
            posted = max(started[src], started[dst])
            arrival[dst] = max(arrival[dst], posted + link.latency_s + max(load[src], load[dst]) / bandwidth)
        for r in range(size):
            started[r] = max(finished[r], arrival[r])
            finished[r] = started[r] + cost["products"][r] * 4 * head_dim * heads * 3.5 / flop_s
    return {"seconds": max(finished), "bytes": max(moved)}


def choose_layout(
    mode: str,
    ring_degree: int,
    seq: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    link: LinkModel,
    median: int = 300,
    sigma: float = 1.4,
    rows: int = 2,
) -> tuple[str, str]:
    """(layout, why): the layout with the least predicted attention time on `rows` sample rows
    of log-normal documents (median, sigma) of min(seq, SAMPLE_TOKENS) tokens, on a ring of
    `ring_degree` ranks of the mode (heads: those one ring rank attends with)."""
    sample = min(seq, SAMPLE_TOKENS)
    sample -= sample % (2 * ring_degree)
    totals = {layout: [0.0, 0] for layout in LAYOUTS}
    for seed in range(rows):
        mask = packed_mask(long_tailed_lengths(sample, random.Random(seed), median, sigma, shortest=64))
        for layout in LAYOUTS:
            schedule = schedule_of(mode, mask, sample, ring_degree, shares_of(layout, mask, ring_degree))
            cost = predict(round_costs(schedule, ring_degree, sample // ring_degree), heads, kv_heads, head_dim, link)
            totals[layout][0] += cost["seconds"] / rows
            totals[layout][1] += cost["bytes"] / rows
    best = min(LAYOUTS, key=lambda layout: (totals[layout][0], LAYOUTS.index(layout)))
    each = ", ".join(
        f"{layout} {seconds * 1e3:.2f} ms ({moved / 2**20:.1f} MiB)" for layout, (seconds, moved) in totals.items()
    )
    why = (
        f"predicted attention per layer, forward + backward, on {rows} rows of {sample:,} tokens of log-normal "
        f"documents (median {median}, sigma {sigma}) over a ring of {ring_degree}: {each}; {link.describe()}"
    )
    return best, why


def packed_layout(row: dict, model, device, gpus: int, seq: int, median: int = 300, sigma: float = 1.4):
    """(layout, why) for a planner row on packed rows: `choose_layout` on the row's ring, its
    heads per ring rank (Ulysses splits them), the device's attention TFLOP/s (speed.efficiency)
    and the ring's link (speed.group_bandwidth); None where the mode takes no layout per row."""
    ring, ulysses = row["ring_degree"] or 1, row["ulysses_degree"] or 1
    if not get_mode(row["mode"]).document_split or ring < 2:
        return None
    link = LinkModel(
        tflops=device.tflops * efficiency(device)[1],
        link_gbs=group_bandwidth(device, gpus, ring, ulysses) / 1e9,
        dtype_bytes=2,
    )
    heads, kv_heads = model.heads // ulysses, max(1, model.kv_heads // ulysses)
    return choose_layout(row["mode"], ring, seq, heads, kv_heads, model.head_dim, link, median, sigma)
