"""The engine: exact attention over shards of one sequence. Never imports transformers.

    kernels.py   a local attention block -> (out, lse) and its backward; CPU/CUDA backends, masks
    masking.py   documents, padding and windows described once; the kernel calls they imply
    blocks.py    a query shard over kernel blocks: fp32 log-sum-exp merging, sinks, exact backward
    executor.py  the one executor: rounds of (query owner, K/V owner, worker, rows) units, with
                 prefetch and send-back; forward, backward, recompute-free checkpointing
    ring.py      the ring as an executor plan (zigzag and masked ring plans build on it)
    p2p.py       batched point-to-point exchange with prefetch
    remat.py     recompute-free checkpointing (attention outputs kept for the backward)
    layout.py    how tokens are split over an SP group (zigzag/contiguous x Ulysses), and the
                 per-row layout of document_split
    balance.py   document_split: a layout per packed row that balances the ranks' work
    groups.py    world = dp x sp, sp = ring x ulysses; process groups created once
"""
