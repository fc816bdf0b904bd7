"""The engine: exact attention over shards of one sequence. Never imports transformers.

    kernels.py   a local attention block -> (out, lse) and its backward; CPU/CUDA backends, masks
    masking.py   documents, padding and windows described once; the kernel calls they imply
    ring.py      the executor: K/V exchange, log-sum-exp merging, exact backward
    p2p.py       batched point-to-point exchange with prefetch
    remat.py     recompute-free checkpointing (attention outputs kept for the backward)
    layout.py    how tokens are split over an SP group (zigzag/contiguous x Ulysses)
    balance.py   document_split: a layout per packed row that balances the ranks' work
    groups.py    world = dp x sp, sp = ring x ulysses; process groups created once
"""
