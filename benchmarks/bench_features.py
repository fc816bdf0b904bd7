#!/usr/bin/env python
"""What the attention features of newer architectures cost (issue 15): one attention layer,
forward + backward, fp32, on CPU, in fresh processes per configuration.

    python -m benchmarks.bench_features                        # S = 4096, 8192; ~4 minutes on 2 cores
    python -m benchmarks.bench_features --seq-len 2048 --iters 1

Rows, each at P = 1 (the layer alone, no process group: the kernels and the merge only) and
P = 2 (zigzag_ring_attn over gloo, one thread per rank):

  plain     causal GQA attention, 8 query heads over 2 KV heads, head dim 64: cpu_flash
  softcap   the same with Gemma 2's logit softcap (50): torch's CPU flash op has none, so the
            math backend runs it, in tiles of query rows (backends.math_tiles.MATH_TILE_LOGITS)
  sinks     gpt-oss attention sinks: cpu_flash, then one fold of the sinks into the merged
            output; the backward needs no extra kernel work
  mla       DeepSeek-V3's head dims (query/key 192, value 128): v padded to 192 (hf.py),
            cpu_flash; its reference row is `dims-192`, equal head dims of 192

Columns: median fwd+bwd seconds (slowest rank) and per-rank peak RSS growth (MiB) over the
steps, as benchmarks/bench_attention.py measures them. glibc keeps freed memory (per thread), so
RSS overstates live tensors; --exact-memory runs the ranks with MALLOC_MMAP_THRESHOLD_=65536
(freed tensors go back to the OS at once) for the memory columns, at some cost in time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import (
    init_gloo,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
    spawn_ranks,
    table_header,
    use_exact_memory,
    write_result,
)

FEATURES = {  # name -> (query/key head dim, value head dim, softcap, sinks)
    "plain": (64, 64, None, False),
    "softcap": (64, 64, 50.0, False),
    "sinks": (64, 64, None, True),
    "dims-192": (192, 192, None, False),
    "mla": (192, 128, None, False),
}


def _rank(rank, world, spec, workdir):
    import torch.distributed as dist

    from easy_context.core.groups import get_groups
    from easy_context.hf.admission import equal_head_dims
    from easy_context.modes import get_mode

    torch.set_num_threads(max(1, 2 // world))
    d_qk, d_v, softcap, with_sinks = FEATURES[spec["feature"]]
    seq, heads, kv_heads = spec["seq"], 8, 2
    mode = get_mode("zigzag_ring_attn")
    if world > 1:
        init_gloo(rank, world, workdir)
    groups = get_groups(mode.topology(world))
    layout = mode.layout(groups.topology)
    g = torch.Generator().manual_seed(0)
    make = lambda h, d: layout.shard(torch.randn(1, h, seq, d, generator=g), groups.sp_rank, dim=2).contiguous()  # noqa: E731
    q, k, v, dout = make(heads, d_qk), make(kv_heads, d_qk), make(kv_heads, d_v), make(heads, d_v)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    sinks = torch.randn(heads, generator=g).requires_grad_() if with_sinks else None
    logits = {"softcap": softcap, "sinks": sinks}

    def step():
        pq, pk, pv, value_dim = equal_head_dims(q, k, v)  # what the patch does for MLA
        out = mode.attention(pq, pk, pv, d_qk**-0.5, groups, **logits)
        out = out if value_dim is None else out[..., :value_dim]
        out.backward(dout)
        for x in (q, k, v):
            x.grad = None

    reset_peak_rss()
    before = rss_bytes()
    times = []
    for i in range(spec["iters"] + 1):  # one warm-up
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        step()
        elapsed = torch.tensor([time.perf_counter() - start])
        if world > 1:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i:
            times.append(float(elapsed))
    peak = peak_rss_bytes() - before
    write_result(workdir, rank, [statistics.median(times), peak / 2**20])
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def measure(feature: str, seq: int, world: int, iters: int):
    """(median seconds of the slowest rank, the largest per-rank peak MiB), or None if a rank failed."""
    values = spawn_ranks(_rank, {"feature": feature, "seq": seq, "iters": iters}, world)
    if values is None:
        return None
    return max(v[0] for v in values), max(v[1] for v in values)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", default="4096,8192", help="comma separated (default 4096,8192)")
    parser.add_argument("--features", default=",".join(FEATURES), help=f"comma separated, of {list(FEATURES)}")
    parser.add_argument("--iters", type=int, default=2, help="measured steps after one warm-up (default 2)")
    parser.add_argument(
        "--exact-memory", action="store_true", help="MALLOC_MMAP_THRESHOLD_=65536 in the ranks (see above)"
    )
    args = parser.parse_args()
    if args.exact_memory:
        use_exact_memory()
    features = args.features.split(",")
    unknown = sorted(set(features) - set(FEATURES))
    if unknown:
        parser.error(f"unknown feature(s) {unknown}; choose from {list(FEATURES)}")
    print(table_header(["feature", "S", "P=1 s", "P=1 peak MiB", "P=2 s", "P=2 peak MiB/rank", "P=1 time vs plain"]))
    for seq in (int(s) for s in args.seq_len.split(",")):
        plain = None
        for feature in features:
            one, two = measure(feature, seq, 1, args.iters), measure(feature, seq, 2, args.iters)
            if feature == "plain" and one:
                plain = one[0]
            cell = lambda r, i: "failed" if r is None else f"{r[i]:.2f}" if i == 0 else f"{r[i]:.0f}"  # noqa: E731
            ratio = f"{one[0] / plain:.2f}x" if one and plain else ""
            print(
                f"| {feature} | {seq} | {cell(one, 0)} | {cell(one, 1)} | {cell(two, 0)} | {cell(two, 1)} | {ratio} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
