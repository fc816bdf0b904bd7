"""The engine: exact attention over shards of one sequence. Never imports transformers.

kernels.py   a local attention block -> (out, lse) and its backward: backend choice, checks
backends/    the backends, one file per family: math_tiles, cpu_flash, cuda (cuda_flash,
             cuda_efficient), flash_attn, flex; masks.py the helpers they share
masking.py   documents, padding and windows described once; the kernel calls they imply
global_mask.py  the whole-sequence mask from every rank's shard (one all-gather per forward)
blocks.py    a query shard over kernel blocks: fp32 log-sum-exp merging, sinks, exact backward
executor.py  the one executor: rounds of (query owner, K/V owner, worker, rows) units, with
             prefetch of the K/V rows a unit needs and send-back; forward, backward,
             recompute-free checkpointing
ring.py      the ring as an executor schedule (the zigzag and masked rings' steps build on it)
p2p.py       batched point-to-point exchange with prefetch
collectives.py  all-gather and the same-data-on-every-rank check, written once
remat.py     recompute-free checkpointing (attention outputs kept for the backward)
layout.py    how tokens are split over an SP group (zigzag/contiguous x Ulysses), and the
             per-row layout of document_split
balance.py   document_split: a layout per packed row that balances the ranks' work (every
             document cut, or documents placed whole by work and only the longest cut)
groups.py    world = dp x sp, sp = ring x ulysses; process groups created once
work_order.py  an epoch's row order with equal attention work per data-parallel group
data_groups.py  one data stream per SP group: the rows data-parallel group g of G reads, seeded shuffling
pieces.py    a layout's runs: the stretches of consecutive positions each rank holds
exchange.py  the all-to-all between sequence shards and head shards, differentiable
call_counts.py  the attention kernels' calls and (query, key) products, counted for tests
environment.py  every environment variable easy-context reads, one list
"""
