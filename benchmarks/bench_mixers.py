"""Hybrid layers' two strategies side by side: one process, and 2 ranks under state passing and
under head exchange (easy_context/mixers/).

    python -m benchmarks.bench_mixers --seq-lengths 16384,32768 [--csv docs/bench_mixers.csv]

A model of each family whose every layer is a mixer (so the bytes counted are the mixers'):
2 layers, hidden 256, random weights, fp32, batch 1, zigzag layout (2 runs on rank 0):
  mamba2      Mamba-2 (mamba2), 8 heads of 64, state 64, 2 groups, conv kernel 4
  gdn         the gated delta rule (qwen3_next, linear-attention layers only), 4 key and 4 value
              heads, dk = dv = 64, conv kernel 4
  conv        short convolutions (lfm2, conv layers only), 256 channels, kernel 3
Each row runs in fresh processes on the same 2 cores (one process with 2 threads, or 2 ranks
with 1 each; gloo). Columns: fwd+bwd seconds (median of --repeats after a warm-up), peak RSS
growth of a rank over the step (MiB), bytes one rank sent per mixer layer (counted) and as
mixers/costs.py declares them, and the crossover length: the S above which state passing sends
fewer bytes than head exchange (from the declarations; it does not depend on the run).
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import (
    init_gloo,
    int_list,
    reset_peak_rss,
    spawn_ranks,
    status_bytes,
    table_header,
    table_row,
    write_csv,
    write_result,
)

FAMILIES = {
    "mamba2": (
        "mamba2",
        dict(hidden_size=256, num_heads=8, head_dim=64, expand=2, n_groups=2, state_size=64, num_hidden_layers=2),
    ),
    "gdn": (
        "qwen3_next",
        dict(
            hidden_size=256,
            num_hidden_layers=2,
            layer_types=["linear_attention"] * 2,
            linear_num_key_heads=4,
            linear_num_value_heads=4,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
        ),
    ),
    "conv": ("lfm2", dict(hidden_size=256, num_hidden_layers=2, layer_types=["conv"] * 2)),
}
SETTINGS = ("1 process", "state_passing", "head_exchange")


def build(family: str):
    import torch
    import transformers

    from easy_context.hf.architectures import attn_implementation
    from tools.sweep_models import causal_lm_class
    from tools.tiny_configs import tiny_config

    model_type, overrides = FAMILIES[family]
    config = tiny_config(model_type, **overrides)
    config._attn_implementation = attn_implementation(config)
    torch.manual_seed(0)
    return getattr(transformers, causal_lm_class(model_type).__name__)(config)


def _worker(rank, world, spec, workdir):
    import torch
    import torch.distributed as dist

    import easy_context as ec
    from benchmarks.attention_comm import CommCounter
    from easy_context.core.pieces import local_pieces
    from easy_context.hf.mixers import mixer_shapes
    from easy_context.mixers.costs import positions_traffic, traffic

    family, seq, setting, repeats = spec
    torch.set_num_threads(2 // world)
    model = build(family)
    tokens = torch.randint(3, 100, (1, seq), generator=torch.Generator().manual_seed(1))
    declared = 0
    if world > 1:
        init_gloo(rank, world, workdir)
        CommCounter.install(dist)
        context = ec.setup("zigzag_ring_attn", model, mixer_strategy=setting)
        tokens = context.shard(tokens)["local_input_ids"]
        positions = context.shard(torch.arange(seq)[None])["local_input_ids"]
        runs = max(len(local_pieces(context.layout(), seq, r)) for r in range(world))
        shapes = mixer_shapes(model, 1, seq, world, runs)
        declared = sum(traffic(setting, s) for s in shapes) / len(shapes)
        # once per forward, not per layer: the position_ids' all-gather (Mamba2Model takes none)
        once = 0 if family == "mamba2" else positions_traffic(1, seq, world)
    else:
        positions = torch.arange(seq)[None]

    def step():
        model.zero_grad()
        logits = model(input_ids=tokens, position_ids=positions, use_cache=False).logits
        logits.float().square().mean().backward()

    step()  # warm-up
    times, sent = [], 0
    reset_peak_rss()
    before = status_bytes("VmRSS:")
    for _ in range(repeats):
        if world > 1:
            CommCounter.instance.bytes, CommCounter.instance.enabled = 0, True
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
        if world > 1:
            CommCounter.instance.enabled = False
            sent = (CommCounter.instance.bytes - once) / 2  # per mixer layer (2 layers, all mixers)
    peak = (status_bytes("VmHWM:") - before) / 2**20
    write_result(workdir, rank, [statistics.median(times), peak, sent, declared])
    if world > 1:
        ec.teardown()
        dist.destroy_process_group()


def crossover(family: str) -> int | None:
    """The shortest S (a multiple of 4, as the zigzag layout of 2 ranks needs) at which state
    passing sends fewer bytes than head exchange, from the declarations; None for a family
    without a scan (its convolution sends the same under both)."""
    import dataclasses

    from easy_context.hf.mixers import mixer_shapes
    from easy_context.mixers.costs import traffic

    shape = mixer_shapes(build(family), 1, 4, 2, 2)[0]
    if shape.scan is None:
        return None
    for seq in range(4, 2**24 + 1, 4):
        at = dataclasses.replace(shape, seq_len=seq)
        if traffic("state_passing", at) < traffic("head_exchange", at):
            return seq
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lengths", type=int_list, default=[16384, 32768])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        parser.error(f"--families: unknown {unknown}; choose from {list(FAMILIES)}")
    columns = ["family", "S", "setting", "fwd+bwd s", "peak MiB/rank", "KB sent/layer", "KB declared/layer"]
    print(table_header(columns))
    rows = []
    for family in families:
        for seq in args.seq_lengths:
            for setting in SETTINGS:
                world = 1 if setting == "1 process" else 2
                result = spawn_ranks(_worker, (family, seq, setting, args.repeats), world)
                if result is None:
                    cells = [family, seq, setting, "failed", "", "", ""]
                else:
                    seconds, peak = max(r[0] for r in result), max(r[1] for r in result)
                    sent, declared = max(r[2] for r in result) / 1e3, result[0][3] / 1e3
                    cells = [family, seq, setting, f"{seconds:.2f}", f"{peak:.0f}", f"{sent:.0f}", f"{declared:.0f}"]
                rows.append(dict(zip(columns, cells)))
                print(table_row([str(c) for c in cells]), flush=True)
    print()
    for family in families:
        length = crossover(family)
        if length is None:
            print(f"{family}: no scan; the convolution's halo is the same under both strategies")
        else:
            print(f"{family}: state passing sends fewer bytes than head exchange from S = {length} (2 ranks, zigzag)")
    if args.csv:
        write_csv(args.csv, rows, columns)


if __name__ == "__main__":
    main()
