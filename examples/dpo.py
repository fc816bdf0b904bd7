"""TRL's DPOTrainer made sequence-parallel by one line: preference pairs whose prompt and
completions are split over the ranks, the loss and gradients those of one process.

    # CPU, 2 processes, zigzag ring attention over each [prompt + chosen] and [prompt + rejected] row
    torchrun --standalone --nproc_per_node 2 examples/dpo.py

    # another mode or loss type; or one process (the patch changes nothing there)
    torchrun --standalone --nproc_per_node 2 examples/dpo.py --mode ulysses_attn --loss-type ipo
    python examples/dpo.py

Offline: a tiny Llama (configs/tiny-llama, random weights), the byte tokenizer, and preference
pairs cut from standard library sources: half with a long prompt and a short answer (the real
next line against another file's line), half with a short prompt and a long answer (real code
against the same code with its lines reversed). Everything but the marked line is a plain TRL
script: drop the line and it trains data-parallel instead.
"""

import argparse
import copy
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoConfig, AutoModelForCausalLM

import easy_context as ec
from recipes.data import byte_tokenizer, stdlib_source_files
from recipes.launch import run_main, shutdown

ROOT = Path(__file__).resolve().parents[1]


def preference_pairs(count: int, prompt_chars: int) -> Dataset:
    texts = [f.read_text(errors="replace") for f in stdlib_source_files()[: count + 1]]
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for i, text in enumerate(texts[:count]):
        lines = [line for line in text.splitlines() if line.strip()][:20]
        if i % 2 == 0:  # a long prompt, a one-line answer
            head = text[:prompt_chars]
            cut = head.rfind("\n") + 1
            following = text[cut:].splitlines()[0] if text[cut:] else "pass"
            other = [line for line in texts[i + 1].splitlines() if line.strip()][:1] or ["pass"]
            rows["prompt"].append(head[:cut])
            rows["chosen"].append(following + "\n")
            rows["rejected"].append(other[0] + "\n")
        else:  # a short prompt, a long answer
            rows["prompt"].append(f"# {stdlib_source_files()[i].name}\n")
            rows["chosen"].append("\n".join(lines) + "\n")
            rows["rejected"].append("\n".join(reversed(lines)) + "\n")
    return Dataset.from_dict(rows)


def main():
    from trl import DPOConfig, DPOTrainer

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="zigzag_ring_attn", choices=ec.MODE_NAMES)
    p.add_argument("--loss-type", default="sigmoid", help="any of TRL's DPO loss types (sigmoid, ipo, hinge, ...)")
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--prompt-chars", type=int, default=800, help="length of the long prompts")
    p.add_argument("--output-dir", default="outputs/dpo")
    args = p.parse_args()

    tokenizer = byte_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(0)  # every rank starts from the same weights
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(ROOT / "configs" / "tiny-llama"), attn_implementation="sdpa"
    )
    trainer = DPOTrainer(
        model=model,
        ref_model=copy.deepcopy(model),  # the frozen reference: the starting weights
        args=DPOConfig(
            output_dir=args.output_dir,
            loss_type=[args.loss_type],
            max_steps=args.max_steps,
            per_device_train_batch_size=2,
            per_device_eval_batch_size=2,
            learning_rate=1e-3,
            logging_steps=1,
            save_strategy="no",
            max_length=None,
            bf16=torch.cuda.is_available(),
            report_to=[],
            use_cpu=not torch.cuda.is_available(),
        ),
        train_dataset=preference_pairs(16, args.prompt_chars),
        eval_dataset=preference_pairs(4, args.prompt_chars),
        processing_class=tokenizer,
    )

    ec.prepare_trainer(args.mode, trainer)  # <- the one added line

    trainer.train()
    print(trainer.evaluate())
    shutdown(trainer.accelerator)  # engines and process groups torn down in order


if __name__ == "__main__":
    run_main(main)  # exit code 0/2/3/4 without the interpreter's teardown (easy_context.core.groups.exit_process)
