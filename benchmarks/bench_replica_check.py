"""What the replica guard costs (easy_context/hf/replicas.py): per check, and per training step.

    torchrun --standalone --nproc_per_node 2 -m benchmarks.bench_replica_check

Trains the tiny Llama of configs/ (zigzag_ring_attn, 2 gloo ranks, DDP) for a few steps at
each sequence length with the guard off, on at its default (every CHECK_EVERY forwards,
after the first few) and on at every forward, and times one check on its own. Prints a
markdown table.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist

import easy_context as ec
from easy_context.hf import replicas

ROOT = Path(__file__).resolve().parents[1]


def step_seconds(model, optimizer, local, steps: int) -> float:
    times = []
    for _ in range(steps + 1):  # the first step warms up
        dist.barrier()
        start = time.perf_counter()
        out = model(input_ids=local["local_input_ids"], position_ids=local["local_position_ids"], use_cache=False)
        loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), local["local_target_ids"].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lengths", default="2048,8192")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (torch.get_num_threads() or 2) // world))
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(ROOT / "configs" / "tiny-llama"), attn_implementation="sdpa"
    )
    ec.apply_seq_parallel_monkey_patch("zigzag_ring_attn", "llama")
    model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    # one check on its own: checksum of the first attention module + one all-gather of 1 number
    attention = model.module.model.layers[0].self_attn
    group = ec.hf.active_patch().groups().sp
    dist.barrier()
    start, checks = time.perf_counter(), 200
    for _ in range(checks):
        _check_now(attention, group, rank)
    check_ms = (time.perf_counter() - start) / checks * 1e3

    rows, default = [], replicas.check_every()
    for seq in (int(s) for s in args.seq_lengths.split(",")):
        ids = torch.randint(
            0, model.module.config.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(seq)
        )
        local = ec.prepare_seq_parallel_inputs("zigzag_ring_attn", ids[:, :-1], None, ids[:, 1:], rank, world, "cpu")
        timing = {}
        for label, every in (("off", 0), ("every forward", 1)):
            replicas.CHECK_EVERY = every
            timing[label] = step_seconds(model, optimizer, local, args.steps)
        rows.append((seq, timing))
    replicas.CHECK_EVERY = every = default
    if rank == 0:
        print(f"one check (checksum + all-gather of 1 int64 over {world} gloo ranks): {check_ms:.3f} ms\n")
        print(
            "| seq len | step, guard off (s) | step, every forward (s) | one check / step | "
            f"overhead at every {every} forwards |"
        )
        print("|---|---|---|---|---|")
        for seq, timing in rows:
            off = timing["off"]
            print(
                f"| {seq} | {off:.3f} | {timing['every forward']:.3f} | {check_ms / 1e3 / off:.3%} | "
                f"{check_ms / 1e3 / off / every:.4%} |"
            )
    ec.remove_seq_parallel_monkey_patch()
    dist.destroy_process_group()


def _check_now(module, group, rank):
    """One check regardless of the schedule."""
    saved = replicas.check_every()
    replicas.CHECK_EVERY = 1
    try:
        replicas.check_replicas(module, group, rank, "cpu")
    finally:
        replicas.CHECK_EVERY = saved


if __name__ == "__main__":
    main()
