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
import random

import torch

from easy_context.core.balance import split_documents
from easy_context.core.layout import Layout
from easy_context.core.masking import SequenceMask
from easy_context.modes.dist_flash_attn import balanced_schedule
from recipes.plan.packed import long_tailed_lengths, packed_mask, products


def _normal(index: torch.Tensor) -> tuple:
    return tuple(index.tolist()[:1]) + (len(index),)


def zigzag_work(mask: SequenceMask, seq: int, size: int, index=None) -> list[int]:
    layout = Layout(zigzag=True, ring_degree=size)
    key = "z" if index is None else "zs"
    index = index or [layout.local_indices(seq, r) for r in range(size)]
    return [
        sum(products(mask.blocks((key, r, s), index[r], index[s], "cpu")) for s in range(size)) for r in range(size)
    ]


def dist_flash_work(mask: SequenceMask, seq: int, size: int, index=None) -> list[int]:
    if index is not None:  # a layout per row runs as a ring (modes/dist_flash_attn.dist_flash_schedule)
        return zigzag_work(mask, seq, size, index)
    layout, local = Layout(zigzag=False, ring_degree=size), seq // size
    index = [layout.local_indices(seq, r) for r in range(size)]
    work = [0] * size
    for units in balanced_schedule(size):
        for u in units:
            rows = u.rows(local)
            work[u.worker] += products(mask.blocks(("d", u), index[u.q_owner][..., rows], index[u.kv_owner], "cpu"))
    return work


WORK_OF = {"zigzag_ring_attn": zigzag_work, "dist_flash_attn": dist_flash_work}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--sizes", default="2,4")
    parser.add_argument("--seeds", type=int, default=10)
    args = parser.parse_args()
    print(f"S={args.seq}, long-tailed documents (log-normal, median 300 tokens), {args.seeds} rows per cell;")
    print("max/min query x key products per rank, as computed; 'split' = document_split=True")
    print("(every document cut zigzag over the ring, which every mode runs as a ring)")
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
                    i[None] for i in split_documents(mask.first_key[0], torch.ones(args.seq, dtype=torch.bool), size)
                ]  # (B=1, n) per rank, as the attention gets it
                work = work_of(mask, args.seq, size, index)
                split.append(max(work) / max(1, min(work)))
                longest.append(max(lengths))
            mean = lambda x: sum(x) / len(x)  # noqa: E731
            cells = f"{mean(split):.3f} | {max(split):.3f}"
            print(f"| {name} | {size} | {mean(plain):.3f} | {max(plain):.3f} | {cells} | {mean(longest):.0f} |")


if __name__ == "__main__":
    main()
