"""TRL's GRPOTrainer made sequence-parallel by one line: each prompt + completion row split over
the ranks for every log-prob forward, the rollout drawn once per SP group, the loss and gradients
those of one process.

    # CPU, 2 processes, zigzag ring attention over each [prompt + completion] row
    torchrun --standalone --nproc_per_node 2 examples/grpo.py

    # another mode or loss type; or one process (the patch changes nothing there)
    torchrun --standalone --nproc_per_node 2 examples/grpo.py --mode ulysses_attn --loss-type grpo
    python examples/grpo.py

Offline: a tiny Llama (configs/tiny-llama, random weights), the byte tokenizer, prompts cut from
standard library sources (their first lines) and a rule-based reward: the share of a
completion's characters that are lowercase letters or spaces (text-like output). Sampling is on;
every rank of an SP group draws the same completions (easy_context's sharded generation, from
one random state), and the data-parallel groups draw their own. Everything but the marked line
is a plain TRL script: drop the line and it trains data-parallel instead.
"""

import argparse
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoConfig, AutoModelForCausalLM

import easy_context as ec
from recipes.data import byte_tokenizer, stdlib_source_files
from recipes.launch import run_main, shutdown

ROOT = Path(__file__).resolve().parents[1]


def prompts(count: int, prompt_chars: int) -> Dataset:
    texts = [f.read_text(errors="replace")[:prompt_chars] for f in stdlib_source_files()[:count]]
    return Dataset.from_dict({"prompt": [text[: text.rfind("\n") + 1] or text for text in texts]})


def text_like(completions, **kwargs) -> list[float]:
    """The rule-based reward: the share of lowercase letters and spaces."""
    return [sum(c.islower() or c == " " for c in text) / max(1, len(text)) for text in completions]


def main():
    from trl import GRPOConfig, GRPOTrainer

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="zigzag_ring_attn", choices=ec.MODE_NAMES)
    p.add_argument("--loss-type", default="dapo", help="any of TRL's GRPO loss types (dapo, grpo, bnpo, cispo, ...)")
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--prompt-chars", type=int, default=400, help="length of the prompts")
    p.add_argument("--completion-tokens", type=int, default=32, help="max_completion_length")
    p.add_argument("--output-dir", default="outputs/grpo")
    args = p.parse_args()

    tokenizer = byte_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    torch.manual_seed(0)  # every rank starts from the same weights
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(ROOT / "configs" / "tiny-llama"), attn_implementation="sdpa"
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=text_like,
        args=GRPOConfig(
            output_dir=args.output_dir,
            loss_type=args.loss_type,
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=args.completion_tokens,
            max_steps=args.max_steps,
            learning_rate=1e-4,
            logging_steps=1,
            save_strategy="no",
            bf16=torch.cuda.is_available(),
            report_to=[],
            use_cpu=not torch.cuda.is_available(),
        ),
        train_dataset=prompts(16, args.prompt_chars),
        processing_class=tokenizer,
    )

    ec.prepare_trainer(args.mode, trainer)  # <- the one added line

    trainer.train()
    print(trainer.state.log_history[-1])  # train_loss, train_runtime, ...
    shutdown(trainer.accelerator)  # engines and process groups torn down in order


if __name__ == "__main__":
    run_main(main)  # exit code 0/2/3/4 without the interpreter's teardown (easy_context.core.groups.exit_process)
