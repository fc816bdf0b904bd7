"""Long-prompt generation: easy_context.generate on P ranks vs one process's model.generate.

    python -m benchmarks.bench_generate --seq-lengths 16384,32768 [--new-tokens 64] [--csv out.csv]

The tiny Llama of bench_train.py (vocab 32000, 4 layers, hidden 256, 4 query / 2 KV heads
of 64), random weights, fp32, one random prompt (batch 1), greedy. Each row runs in fresh
processes on the same cores (CPU, 2 threads in all: one process with 2 threads, or P
processes with 2 / P each; gloo).
  hf          1 process: the unpatched model's generate (DynamicCache)
  MODE P=2    easy_context.generate: the prompt prefilled in MODE's layout, the K/V cache
              sharded over the ranks, decoding through transformers' generate
Columns (each the median of --repeats runs, default 3: the machine's timings vary by up to
~1.8x between runs):
  first token s   prompt in, first new token out: the prefill (ours: sharded, then the last
                  prompt token as the first decoding step)
  ms/token        median time between two new tokens afterwards
  KV MiB/rank     K/V the cache holds on one rank at the end (allocated storage)
  peak MiB/rank   peak RSS growth of one rank while generating (VmHWM, reset before)
  where a decoding step's time goes, per token, all layers (the rest is the model's other
  layers, the lm head and transformers' loop):
    attn ms       the attention kernel (ours: over the rank's shard; hf: its sdpa function)
    cache ms      the cache's update (hf: DynamicCache concatenates the whole layer's K/V at
                  every token; ours: a write into spare slots)
    gather ms     ours: the all-gather of the partial (out, lse), waiting for the peer included
    idle gather us  ours: one such all-gather with nothing else running (the collective's own
                  latency), measured before generating
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.bench_train import tiny_llama
from benchmarks.common import init_gloo, reset_peak_rss, spawn_ranks, status_bytes, write_csv, write_result


def _model(vocab: int):
    return tiny_llama(vocab, checkpointing=False, tile=0).eval()


class _Clock:
    """A streamer that notes when the prompt and each new token arrive."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


class _Timed:
    """Wraps a function (the cache's kernel, all-gather or update) and adds up the seconds spent in it."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


class _Reset:
    """The baseline's streamer: at the first new token, zero the counters (what ran before
    was its prefill) and note the time."""

    def __init__(self, clock, *timers):
        self.clock, self.timers = clock, timers

    def put(self, value):
        self.clock.put(value)
        if len(self.clock.times) == 2:
            for timer in self.timers:
                timer.seconds = 0.0

    def end(self):
        pass


def _idle_gather_us(world: int) -> float:
    """Microseconds per all-gather of one decoding step's partial (out, lse) of one layer, with
    nothing else running: the collective's own latency."""
    if world == 1:
        return float("nan")
    piece = torch.zeros(1, 4, 1, 65)
    pieces = [torch.empty_like(piece) for _ in range(world)]
    for _ in range(20):
        dist.all_gather(pieces, piece)
    start = time.perf_counter()
    for _ in range(200):
        dist.all_gather(pieces, piece)
    return (time.perf_counter() - start) / 200 * 1e6


def _worker(rank, world, spec, workdir):
    torch.set_num_threads(max(1, 2 // world))
    if world > 1:
        init_gloo(rank, world, workdir, timeout_s=1200)
    from transformers import AttentionInterface, DynamicCache

    import easy_context as ec
    from easy_context.core import collectives
    from easy_context.hf import sharded_cache
    from easy_context.versions import output_cache

    model = _model(spec["vocab"])
    prompt = torch.randint(0, spec["vocab"], (1, spec["seq"]), generator=torch.Generator().manual_seed(1))
    kwargs = dict(
        max_new_tokens=spec["new_tokens"],
        min_new_tokens=spec["new_tokens"],
        do_sample=False,
        return_dict_in_generate=True,
        use_cache=True,
        pad_token_id=0,
    )
    mode = spec["mode"]
    gather_us = _idle_gather_us(world)
    # decoding's only collective, and the two small checks of generate's start and end
    gather = _Timed(collectives.all_gather)
    collectives.all_gather = gather
    cache_class = sharded_cache.ShardedKVCache if mode is not None else DynamicCache
    cache_update = _Timed(cache_class.update)
    cache_class.update = lambda self, *args, **kwargs: cache_update(self, *args, **kwargs)
    if mode is not None:
        attn = _Timed(sharded_cache.attention_forward)
        sharded_cache.attention_forward = attn
        ec.apply_seq_parallel_monkey_patch(mode, model)
    else:  # the unpatched model's attention function
        attn = _Timed(AttentionInterface._global_mapping["sdpa"])
        AttentionInterface._global_mapping["sdpa"] = attn
    clock = _Clock()
    before = status_bytes("VmRSS:")
    reset_peak_rss(required=True)  # VmHWM back to the current RSS
    start = time.perf_counter()
    with torch.no_grad():
        if mode is not None:
            output = ec.generate(mode, model, prompt, streamer=clock, **kwargs)
        else:
            output = model.generate(prompt, streamer=_Reset(clock, attn, cache_update), **kwargs)
    peak = status_bytes("VmHWM:") - before
    gaps = [b - a for a, b in zip(clock.times[1:], clock.times[2:])]
    steps = len(clock.times) - 1  # decoding steps through the cache (ours: the first one included)
    if mode is None:
        steps -= 1  # the baseline's counters start at its first new token
    result = [
        clock.times[1] - start,
        statistics.median(gaps),
        sharded_cache.kv_bytes(output_cache(output)),
        peak,
        attn.seconds / steps,
        gather.seconds / steps if mode is not None else float("nan"),
        cache_update.seconds / steps,
        gather_us,
    ]
    write_result(workdir, rank, result)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    os._exit(0)  # the result is written; gloo's threads can abort the interpreter's teardown (issue 17)


def run(spec, world):
    values = spawn_ranks(_worker, spec, world)
    if values is None:
        return None
    first, per_token, kv, peak, attn, gather, cache, gather_us = (max(v[i] for v in values) for i in range(8))
    return {
        "first_token_s": first,
        "ms_per_token": 1000 * per_token,
        "kv_mib": kv / 2**20,
        "peak_mib": peak / 2**20,
        "attn_ms": 1000 * attn,
        "gather_ms": 1000 * gather,
        "cache_ms": 1000 * cache,
        "idle_gather_us": gather_us,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lengths", default="16384,32768")
    parser.add_argument("--modes", default="zigzag_ring_attn,dist_flash_attn,ulysses_attn")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=3, help="runs per row; the table gives each column's median")
    parser.add_argument("--csv", default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, for CI")
    args = parser.parse_args()
    seqs = [1000, 2000] if args.smoke else [int(s) for s in args.seq_lengths.split(",")]
    new_tokens, vocab = (8, 1000) if args.smoke else (args.new_tokens, args.vocab)
    args.repeats = 1 if args.smoke else args.repeats
    configs = [("hf", None, 1)] + [(f"{m} P={args.world_size}", m, args.world_size) for m in args.modes.split(",")]

    print(
        "| config | S | first token s | ms/token | x hf ms/token | KV MiB/rank | x hf KV | peak MiB/rank | "
        "attn ms/token | "
        "cache ms/token | gather ms/token | idle gather us |\n|---|---|---|---|---|---|---|---|---|---|---|---|",
        flush=True,
    )
    rows = []
    for seq in seqs:
        baseline = None
        for name, mode, world in configs:
            runs = [
                run({"seq": seq, "mode": mode, "vocab": vocab, "new_tokens": new_tokens}, world)
                for _ in range(args.repeats)
            ]
            runs = [r for r in runs if r is not None]
            result = {key: statistics.median(r[key] for r in runs) for key in runs[0]} if runs else None
            rows.append({"config": name, "seq": seq, "world": world, "repeats": len(runs), **(result or {})})
            if result is None:
                print(f"| {name} | {seq} | failed | | | | | | | | | |", flush=True)
                continue
            baseline = baseline or result
            print(
                f"| {name} | {seq} | {result['first_token_s']:.2f} | {result['ms_per_token']:.1f} | "
                f"{result['ms_per_token'] / baseline['ms_per_token']:.2f} | {result['kv_mib']:.1f} | "
                f"{result['kv_mib'] / baseline['kv_mib']:.2f} | {result['peak_mib']:.0f} | {result['attn_ms']:.1f} | "
                f"{result['cache_ms']:.1f} | {result['gather_ms']:.1f} | {result['idle_gather_us']:.0f} |",
                flush=True,
            )
    if args.csv:
        write_csv(args.csv, rows, sorted({key for row in rows for key in row}, key=str))


if __name__ == "__main__":
    main()
