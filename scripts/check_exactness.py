"""Check a parallel mode against the single-process model, on any machine.

    torchrun --standalone --nproc_per_node 2 scripts/check_exactness.py --mode zigzag_ring_attn

Builds a tiny random Llama/Mistral/Qwen model (no download), runs one forward+backward with
the sequence sharded over the ranks, and prints the largest logits/loss/gradient difference
from the unpatched model on the whole sequence. gloo on CPU, NCCL on CUDA.
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

import easy_context as ec


def loss_and_grads(model, input_ids, position_ids, target_ids, group):
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), target_ids.flatten(), reduction="sum")
    count = torch.tensor(float(target_ids.numel()), device=logits.device)
    if group is not None:
        count = count * dist.get_world_size(group)
    (loss_sum / count).backward()
    total = loss_sum.detach()
    if group is not None:
        dist.all_reduce(total, group=group)
    return logits.detach(), (total / count).item(), {n: p.grad.float() for n, p in model.named_parameters()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="zigzag_ring_attn", choices=ec.BUILT_MODES)
    parser.add_argument("--model-type", default="llama", choices=ec.SUPPORTED_MODEL_TYPES)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--ring-degree", type=int, default=None)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    config = AutoConfig.for_model(args.model_type, vocab_size=1024, hidden_size=128, intermediate_size=256,
                                  num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device)
    tokens = torch.randint(0, 1024, (1, args.seq_length + 1), generator=torch.Generator().manual_seed(1))
    input_ids, target_ids = tokens[:, :-1], tokens[:, 1:]

    want = loss_and_grads(model, input_ids.to(device), None, target_ids.to(device), None)
    model.zero_grad()
    ec.apply_seq_parallel_monkey_patch(args.mode, args.model_type, ring_degree=args.ring_degree)
    local = ec.prepare_seq_parallel_inputs(args.mode, input_ids, None, target_ids, rank, world, device)
    logits, loss, grads = loss_and_grads(model, local["local_input_ids"], local["local_position_ids"],
                                         local["local_target_ids"], dist.group.WORLD)
    for grad in grads.values():
        dist.all_reduce(grad)
    logits = ec.gather_seq_parallel_outputs(args.mode, logits)
    if rank == 0:
        grad_err = max(((grads[n] - want[2][n]).abs().max() / want[2][n].abs().max()).item() for n in grads)
        print(f"{args.mode} on {world} ranks ({device.type}), {args.model_type}, {args.seq_length} tokens:")
        print(f"  max |logits - single process| = {(logits - want[0]).abs().max().item():.2e}")
        print(f"  |loss - single process|       = {abs(loss - want[1]):.2e}   (loss {loss:.4f})")
        print(f"  max relative gradient error    = {grad_err:.2e}   over {len(grads)} parameters")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
