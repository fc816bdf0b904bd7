"""A complete HF Trainer (or TRL SFTTrainer) script made sequence-parallel by one line.

    # CPU, 2 processes, zigzag ring attention over each packed row (offline: a tiny Llama
    # and a byte tokenizer on standard library sources, documents of up to 1K tokens)
    torchrun --standalone --nproc_per_node 2 examples/hf_trainer.py

    # the same with TRL's SFTTrainer and packing=True; or another mode / collator
    torchrun --standalone --nproc_per_node 2 examples/hf_trainer.py --sft
    torchrun --standalone --nproc_per_node 2 examples/hf_trainer.py --mode ulysses_attn --collator padded

Everything but the marked line is a plain Trainer script: drop the line and it trains
data-parallel instead, with the same losses on one process.
"""

import argparse
from pathlib import Path

import torch
from datasets import Dataset
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DataCollatorForLanguageModeling,
    DataCollatorWithFlattening,
    Trainer,
    TrainingArguments,
)

import easy_context as ec
from recipes.data import byte_tokenizer, stdlib_source_files
from recipes.launch import run_main, shutdown

ROOT = Path(__file__).resolve().parents[1]


def documents(tokenizer, count: int, max_tokens: int) -> Dataset:
    files = stdlib_source_files()[:count]
    texts = [f.read_text(errors="replace")[: max_tokens * 2] for f in files]
    ids = [tokenizer(text)["input_ids"][: max_tokens - 1] + [tokenizer.eos_token_id] for text in texts]
    return Dataset.from_dict({"input_ids": ids})


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="zigzag_ring_attn", choices=ec.MODE_NAMES)
    p.add_argument("--collator", default="packed", choices=["packed", "padded"])
    p.add_argument("--sft", action="store_true", help="TRL's SFTTrainer with packing=True")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--output-dir", default="outputs/hf-trainer")
    args = p.parse_args()

    tokenizer = byte_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(0)  # every rank starts from the same weights
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(ROOT / "configs" / "tiny-llama"), attn_implementation="sdpa"
    )
    train_set, eval_set = documents(tokenizer, 400, 1024), documents(tokenizer, 8, 1024)
    common = dict(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        logging_steps=5,
        save_steps=10,
        eval_strategy="steps",
        eval_steps=10,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
    )
    if args.sft:
        from trl import SFTConfig, SFTTrainer

        trainer = SFTTrainer(
            model=model,
            args=SFTConfig(**common, packing=True, max_length=4096, bf16=False),
            train_dataset=train_set,
            eval_dataset=eval_set,
            processing_class=tokenizer,
        )
    else:
        collator = (
            DataCollatorWithFlattening()
            if args.collator == "packed"
            else DataCollatorForLanguageModeling(tokenizer, mlm=False)
        )
        trainer = Trainer(
            model=model,
            args=TrainingArguments(**common),
            train_dataset=train_set,
            eval_dataset=eval_set,
            data_collator=collator,
        )

    ec.prepare_trainer(args.mode, trainer)  # <- the one added line

    trainer.train()
    print(trainer.evaluate())
    shutdown(trainer.accelerator)  # engines and process groups torn down in order


if __name__ == "__main__":
    run_main(main)  # exit code 0/2/3/4 without the interpreter's teardown (easy_context.core.groups.exit_process)
