#!/usr/bin/env python
"""What the attention features of newer architectures cost (issue 15): one attention layer,
forward + backward, fp32, on CPU, in fresh processes per configuration.

    python scripts/bench_features.py                        # S = 4096, 8192; ~4 minutes on 2 cores
    python scripts/bench_features.py --seq-len 2048 --iters 1

Rows, each at P = 1 (the layer alone, no process group: the kernels and the merge only) and
P = 2 (zigzag_ring_attn over gloo, one thread per rank):

  plain     causal GQA attention, 8 query heads over 2 KV heads, head dim 64: cpu_flash
  softcap   the same with Gemma 2's logit softcap (50): torch's CPU flash op has none, so the
            math backend runs it, in tiles of query rows (kernels.MATH_TILE_LOGITS)
  sinks     gpt-oss attention sinks: cpu_flash, then one fold of the sinks into the merged
            output; the backward needs no extra kernel work
  mla       DeepSeek-V3's head dims (query/key 192, value 128): v padded to 192 (hf.py),
            cpu_flash; its reference row is `dims-192`, equal head dims of 192

Columns: median fwd+bwd seconds (slowest rank) and per-rank peak RSS growth (MiB) over the
steps, as scripts/bench_attention.py measures them. glibc keeps freed memory (per thread), so
RSS overstates live tensors; --exact-memory runs the ranks with MALLOC_MMAP_THRESHOLD_=65536
(freed tensors go back to the OS at once) for the memory columns, at some cost in time.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention import _reset_peak_rss, _rss_bytes  # noqa: E402

FEATURES = {  # name -> (query/key head dim, value head dim, softcap, sinks)
    "plain": (64, 64, None, False),
    "softcap": (64, 64, 50.0, False),
    "sinks": (64, 64, None, True),
    "dims-192": (192, 192, None, False),
    "mla": (192, 128, None, False),
}


def _rank(rank, world, rendezvous, spec, results):
    import resource

    import torch.distributed as dist

    from easy_context.hf.admission import equal_head_dims
    from easy_context.modes import get_mode
    from easy_context.core.groups import get_groups

    torch.set_num_threads(max(1, 2 // world))
    d_qk, d_v, softcap, with_sinks = FEATURES[spec["feature"]]
    seq, heads, kv_heads = spec["seq"], 8, 2
    mode = get_mode("zigzag_ring_attn")
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=600))
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
        out = mode.attention(pq, pk, pv, d_qk ** -0.5, groups, **logits)
        out = out if value_dim is None else out[..., :value_dim]
        out.backward(dout)
        for x in (q, k, v):
            x.grad = None

    _reset_peak_rss()
    before = _rss_bytes()
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
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    results[rank] = (statistics.median(times), peak / 2**20)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def measure(feature: str, seq: int, world: int, iters: int):
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as workdir, ctx.Manager() as manager:
        results = manager.dict()
        spec = {"feature": feature, "seq": seq, "iters": iters}
        procs = [ctx.Process(target=_rank, args=(r, world, f"{workdir}/rdv", spec, results)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs) or len(results) != world:
            return None
        return max(results[r][0] for r in range(world)), max(results[r][1] for r in range(world))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", default="4096,8192", help="comma separated (default 4096,8192)")
    parser.add_argument("--features", default=",".join(FEATURES), help=f"comma separated, of {list(FEATURES)}")
    parser.add_argument("--iters", type=int, default=2, help="measured steps after one warm-up (default 2)")
    parser.add_argument("--exact-memory", action="store_true", help="MALLOC_MMAP_THRESHOLD_=65536 in the ranks (see above)")
    args = parser.parse_args()
    if args.exact_memory:  # read by glibc when each spawned rank starts
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    features = args.features.split(",")
    unknown = sorted(set(features) - set(FEATURES))
    if unknown:
        parser.error(f"unknown feature(s) {unknown}; choose from {list(FEATURES)}")
    print("| feature | S | P=1 s | P=1 peak MiB | P=2 s | P=2 peak MiB/rank | P=1 time vs plain |")
    print("|---|---|---|---|---|---|---|")
    for seq in (int(s) for s in args.seq_len.split(",")):
        plain = None
        for feature in features:
            one, two = measure(feature, seq, 1, args.iters), measure(feature, seq, 2, args.iters)
            if feature == "plain" and one:
                plain = one[0]
            cell = lambda r, i: "failed" if r is None else f"{r[i]:.2f}" if i == 0 else f"{r[i]:.0f}"  # noqa: E731
            ratio = f"{one[0] / plain:.2f}x" if one and plain else ""
            print(f"| {feature} | {seq} | {cell(one, 0)} | {cell(one, 1)} | {cell(two, 0)} | {cell(two, 1)} | {ratio} |",
                  flush=True)


if __name__ == "__main__":
    main()
