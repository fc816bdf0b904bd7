"""Work balance under packed documents: query x key products each rank's kernel calls compute
(causal square n(n+1)/2, rectangle nq*nk, masked tile nq*nk), from the same kernel
calls the attention runs. No processes, no timing: they are pure functions of the mask.

    python -m benchmarks.mask_balance                      # S=16K, long-tailed mix, P=2 and 4
    python -m benchmarks.mask_balance --seq 32768 --seeds 20

Document lengths are drawn from a long-tailed (log-normal) distribution: many short
documents and a few long ones, the mix of web / code corpora.
"""

from __future__ import annotations

import argparse
import math
import random

import torch

from easy_context.core.balance import split_documents
from easy_context.core.layout import Layout, RowLayout
from easy_context.core.masking import SequenceMask
from easy_context.core.ring import RingSchedule, masked_ring_steps
from easy_context.modes.dist_flash_attn import DistFlashSchedule, balanced_schedule, split_rows


def long_tailed_lengths(
    seq: int, rng: random.Random, median: int = 300, sigma: float = 1.4, shortest: int = 1
) -> list[int]:
    """Log-normal document lengths of at least `shortest` tokens filling a row of `seq` (the
    last one is cut to fit)."""
    lengths = []
    while sum(lengths) < seq:
        lengths.append(min(max(shortest, int(rng.lognormvariate(math.log(median), sigma))), seq - sum(lengths)))
    return lengths


def packed_mask(lengths) -> SequenceMask:
    return SequenceMask.from_positions(torch.cat([torch.arange(n) for n in lengths])[None])


def computed(blocks) -> int:
    total = 0
    for block in (part for b in blocks for part in b.split()):
        nq, nk = block.q.stop - block.q.start, block.kv.stop - block.kv.start
        total += nq * (nq + 1) // 2 if block.causal else nq * nk
    return total


def _normal(index: torch.Tensor) -> tuple:
    return tuple(index.tolist()[:1]) + (len(index),)


def zigzag_work(mask: SequenceMask, seq: int, size: int, index=None) -> list[int]:
    layout = Layout(zigzag=True, ring_degree=size)
    key = "z" if index is None else "zs"
    index = index or [layout.local_indices(seq, r) for r in range(size)]
    return [
        sum(computed(mask.blocks((key, r, s), index[r], index[s], "cpu")) for s in range(size)) for r in range(size)
    ]


def dist_flash_work(mask: SequenceMask, seq: int, size: int, index=None) -> list[int]:
    layout, local = Layout(zigzag=False, ring_degree=size), seq // size
    key = "d" if index is None else "ds"
    index = index or [layout.local_indices(seq, r) for r in range(size)]
    work = [0] * size
    for units in balanced_schedule(size):
        for u in units:
            rows = split_rows(mask, u, index, local) if key == "ds" else u.rows(local)
            work[u.worker] += computed(mask.blocks((key, u), index[u.q_owner][..., rows], index[u.kv_owner], "cpu"))
    return work


def schedule_of(mode: str, mask: SequenceMask, seq: int, size: int, shares=None):
    """The executor schedule the mode runs for `mask` on `size` ranks: its static layout, or the
    per-row layout whose ring rank r holds shares[r] (one batch row)."""
    layout = None if shares is None else RowLayout([share[None] for share in shares])
    mask = SequenceMask(mask.first_key, row_layout=layout)
    if mode == "dist_flash_attn":
        return DistFlashSchedule(mask, size, seq // size, "cpu")
    steps = masked_ring_steps(mask, True, size, seq // size, "cpu")
    return RingSchedule(steps, size, seq // size, seq // size)


def rows_moved(schedule, local_len: int) -> int:
    """Rows of K/V (and of queries, for units computed by another rank) the schedule's forward
    fetches from other ranks: what the executor sends, one row = one token's K, V or q heads."""
    moved = 0
    for units in schedule.rounds:
        for unit in units:
            if unit.worker != unit.kv_owner:
                keys = schedule.keys(unit)
                moved += len(range(local_len)[keys]) if isinstance(keys, slice) else len(keys)
            if unit.worker != unit.q_owner:
                moved += len(range(local_len)[schedule.rows(unit)])
    return moved


WORK_OF = {"zigzag_ring_attn": zigzag_work, "dist_flash_attn": dist_flash_work}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--sizes", default="2,4")
    parser.add_argument("--seeds", type=int, default=10)
    args = parser.parse_args()
    print(f"S={args.seq}, long-tailed documents (log-normal, median 300 tokens), {args.seeds} rows per cell;")
    print("max/min query x key products per rank, as computed; 'split' = document_split=True")
    print("(every document cut over the ring as the mode cuts one causal row)")
    print("| mode | P | mean | worst | split: mean | split: worst | longest document (mean) |")
    print("|---|---|---|---|---|---|---|")
    for name, work_of in (("zigzag_ring_attn", zigzag_work), ("dist_flash_attn", dist_flash_work)):
        for size in map(int, args.sizes.split(",")):
            plain, split, longest = [], [], []
            for seed in range(args.seeds):
                lengths = long_tailed_lengths(args.seq, random.Random(seed))
                mask = packed_mask(lengths)
                work = work_of(mask, args.seq, size)
                plain.append(max(work) / max(1, min(work)))
                index = [
                    i[None]
                    for i in split_documents(
                        mask.first_key[0], torch.ones(args.seq, dtype=torch.bool), size, name == "zigzag_ring_attn"
                    )
                ]  # (B=1, n) per rank, as the attention gets it
                work = work_of(mask, args.seq, size, index)
                split.append(max(work) / max(1, min(work)))
                longest.append(max(lengths))
            mean = lambda x: sum(x) / len(x)  # noqa: E731
            cells = f"{mean(split):.3f} | {max(split):.3f}"
            print(f"| {name} | {size} | {mean(plain):.3f} | {max(plain):.3f} | {cells} | {mean(longest):.0f} |")


if __name__ == "__main__":
    main()
