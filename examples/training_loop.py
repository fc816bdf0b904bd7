"""A custom training loop made sequence-parallel: each rank holds its shard of one long sequence.

    # CPU, 2 processes (gloo): the shipped demo base on 2,048-token rows of random tokens
    torchrun --standalone --nproc_per_node 2 examples/training_loop.py
    # the same steps in one process, unpatched, on the whole sequence (the losses agree)
    torchrun --standalone --nproc_per_node 1 examples/training_loop.py --mode data_parallel

Only the lines marked "easy-context" differ from a plain DDP loop. The docs include this file
(docs/guides/training-loop.md), and a test runs it both ways and compares the losses.
"""

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForCausalLM

from easy_context import MODE_NAMES, apply_seq_parallel_monkey_patch, global_token_mean, prepare_seq_parallel_inputs

DEMO_BASE = Path(__file__).resolve().parents[1] / "models" / "demo-base"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="zigzag_ring_attn", choices=MODE_NAMES)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")

    apply_seq_parallel_monkey_patch(args.mode, "llama")  # easy-context: once, after init_process_group
    model = AutoModelForCausalLM.from_pretrained(DEMO_BASE, attn_implementation="sdpa").to(device)
    model = DistributedDataParallel(model)  # the SP group's gradients are averaged, as for data parallelism
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    generator = torch.Generator().manual_seed(0)  # every rank of the SP group reads the same rows
    for step in range(args.steps):
        input_ids = torch.randint(0, model.module.config.vocab_size, (1, args.seq_length), generator=generator)
        position_ids = torch.arange(args.seq_length)[None]
        target_ids = torch.cat([input_ids[:, 1:], torch.full((1, 1), -100)], dim=1)  # next token; -100 = ignore

        # easy-context: this rank's shard of the inputs, positions and targets
        local = prepare_seq_parallel_inputs(args.mode, input_ids, position_ids, target_ids, rank, world_size, device)
        logits = model(
            input_ids=local["local_input_ids"],
            position_ids=local["local_position_ids"],  # RoPE stays right on every rank
            use_cache=False,
        ).logits
        targets = local["local_target_ids"]
        loss_sum = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
        # the shard's loss sum over the valid targets of the whole sequence, scaled for DDP's average
        loss, mean = global_token_mean(loss_sum, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step} loss {mean.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
