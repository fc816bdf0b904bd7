"""A user's plain HF Trainer script made sequence-parallel with prepare_trainer, and nothing
else: no run_main, no shutdown, no destroy_process_group. It must exit 0 on its own.

    torchrun --standalone --nproc_per_node 2 tests/user_scripts/plain_trainer.py
"""

import random

import torch
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import easy_context

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
rng = random.Random(0)
rows = [{"input_ids": [rng.randrange(256) for _ in range(rng.randrange(8, 60))]} for _ in range(16)]
args = TrainingArguments(
    output_dir="/tmp/easy-context-plain-trainer",
    max_steps=2,
    per_device_train_batch_size=4,
    report_to=[],
    save_strategy="no",
    use_cpu=not torch.cuda.is_available(),
)
trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=DataCollatorWithFlattening())
easy_context.prepare_trainer("zigzag_ring_attn", trainer)
trainer.train()
