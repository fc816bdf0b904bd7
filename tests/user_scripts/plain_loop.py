"""A user's plain training loop with the patch, and nothing else: no run_main, no teardown,
no destroy_process_group. It must exit 0 on its own. NCCL and a GPU per rank where there are
GPUs (scripts/gpu_check.sh's exit section), else gloo on CPU.

    torchrun --standalone --nproc_per_node 2 tests/user_scripts/plain_loop.py
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from transformers import LlamaConfig, LlamaForCausalLM

from easy_context import apply_seq_parallel_monkey_patch, prepare_seq_parallel_inputs

cuda = torch.cuda.is_available()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = LlamaForCausalLM(
    LlamaConfig(
        vocab_size=260,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
)
apply_seq_parallel_monkey_patch("zigzag_ring_attn", model)
model = DistributedDataParallel(model.to(device), device_ids=[device] if cuda else None)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(2):
    ids = torch.randint(0, 256, (1, 65), generator=torch.Generator().manual_seed(step))
    local = prepare_seq_parallel_inputs("zigzag_ring_attn", ids[:, :-1], None, ids[:, 1:], rank, world, device)
    logits = model(input_ids=local["local_input_ids"], position_ids=local["local_position_ids"], use_cache=False).logits
    loss = F.cross_entropy(logits.flatten(0, 1), local["local_target_ids"].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
