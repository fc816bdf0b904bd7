"""Needle in a haystack (or passkey retrieval) over context lengths x depths, each prompt
scored in one sequence-parallel forward pass.

    # CPU, 2 processes, the model the README's train.py command saved (outputs/tiny-llama)
    torchrun --standalone --nproc_per_node 2 eval_needle.py

    # GPUs, DeepSpeed ZeRO-3 inference (parameters offloaded), 8 processes
    accelerate launch --config_file accelerate_configs/deepspeed_inference.yaml eval_needle.py \
        --model PATH --max_context_length 1000000 --min_context_length 50000 --context_interval 50000 \
        --depth_interval 0.1 --num_samples 2 --rnd_number_digits 7 --haystack_dir ESSAYS

Scoring is teacher forcing: the prompt and the answer go in together and a sample is right
when the argmax at every answer position is the answer's next token. With --generate the
model also answers in free form (easy_context.generate: greedy, up to --max_new_tokens
tokens, the prompt's KV cache sharded over the SP group); that answer is right when its
first number is exactly the hidden one. Both scores are reported side by side. Writes
<output-dir>/<task>_<model>.png (heatmap; with --generate also <task>_<model>_generate.png),
.csv (one row per sample) and .json.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import re
from pathlib import Path

import numpy as np
import torch

import easy_context as ec
from easy_context.modes import get_mode
from recipes.configuration import SHARED_BY_SCRIPTS, ParallelismConfig, add_flags
from recipes.data import embedded_prose
from recipes.evaluation import load_scorer_for_flags, resolve_model
from recipes.launch import (
    Stage,
    ring_degree_error,
    run_job,
    run_main,
)
from recipes.launch import fail as launch_fail
from recipes.needle import CITIES, NEEDLE, PASSKEY, PASSKEY_FILLER, Haystack, build_prompt
from recipes.plots import needle_heatmap


def fail(message: str):
    launch_fail("eval_needle.py", message)


# ----------------------------------------------------------------------------- arguments
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    def flag(name, **kwargs):  # EasyContext's underscore spelling, and the dashed one
        p.add_argument(f"--{name}", f"--{name.replace('_', '-')}", dest=name, **kwargs)

    flag("model", default=None, help="hub name or local folder (default: outputs/tiny-llama, what train.py saves)")
    flag("task", default="needle", choices=["needle", "passkey"], help="city magic number, or Landmark-style passkey")
    # 256 to 2,048 tokens: the shipped base's context (512) and the default train.py job's (2,048) inside
    flag("max_context_length", type=int, default=2048)
    flag("min_context_length", type=int, default=256)
    flag("context_interval", type=int, default=256, help="step between context lengths (tokens)")
    flag(
        "depth_interval",
        type=float,
        default=0.25,
        help="step between depths, as a fraction (0.1: 0%%, 10%%, ..., 100%%)",
    )
    flag("num_samples", type=int, default=2, help="prompts per (length, depth) cell, each with its own key and number")
    flag("rnd_number_digits", type=int, default=7)
    flag("num_distractor", type=int, default=0, help="other cities' magic numbers hidden in the haystack (needle task)")
    flag(
        "haystack_dir", default=None, help="folder of .txt files (default: the Python reference docs every Python has)"
    )
    flag("rope_theta", type=float, default=None, help="override the model's RoPE base")
    add_flags(p, [ParallelismConfig], only=SHARED_BY_SCRIPTS)
    flag(
        "sp_size",
        type=int,
        default=None,
        help="ranks sharing one prompt (default: all); other groups take other prompts",
    )
    flag(
        "dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bf16 on CUDA, fp32 on CPU",
    )
    flag("generate", action="store_true", help="also answer in free form (greedy) and score the digits by exact match")
    flag("max_new_tokens", type=int, default=None, help="--generate: tokens to generate (default: 2 x digits + 4)")
    flag("output_dir", default="outputs/eval")
    flag("seed", type=int, default=42)
    flag("hide_progress", action="store_true")
    args = p.parse_args(argv)

    errors = []
    if args.min_context_length < 1 or args.max_context_length < args.min_context_length:
        errors.append(
            "need 1 <= --min_context_length <= --max_context_length, "
            f"got {args.min_context_length} and {args.max_context_length}"
        )
    if args.context_interval < 1:
        errors.append(f"--context_interval must be >= 1, got {args.context_interval}")
    if not 0 < args.depth_interval <= 1:
        errors.append(f"--depth_interval must be in (0, 1], got {args.depth_interval}")
    if args.num_samples < 1 or args.rnd_number_digits < 1:
        errors.append(
            f"--num_samples and --rnd_number_digits must be >= 1, got {args.num_samples} and {args.rnd_number_digits}"
        )
    if not 0 <= args.num_distractor < len(CITIES):
        errors.append(f"--num_distractor must be between 0 and {len(CITIES) - 1}, got {args.num_distractor}")
    if args.task == "passkey" and args.num_distractor:
        errors.append("--num_distractor applies to the needle task only (a passkey prompt has one key)")
    if args.haystack_dir is not None and not sorted(Path(args.haystack_dir).glob("*.txt")):
        errors.append(f"--haystack_dir {args.haystack_dir}: no .txt files there")
    if args.max_new_tokens is not None and (not args.generate or args.max_new_tokens < 1):
        errors.append(f"--max_new_tokens needs --generate and a value >= 1, got {args.max_new_tokens}")
    if ring_error := ring_degree_error(args):
        errors.append(ring_error)
    if errors:
        p.error("; ".join(errors))
    return args


def sweep(args) -> tuple[list[int], list[float]]:
    lengths = list(range(args.min_context_length, args.max_context_length + 1, args.context_interval))
    steps = int(round(1 / args.depth_interval))
    depths = sorted({round(min(1.0, i * args.depth_interval), 6) for i in range(steps + 1)} | {1.0})
    return lengths, depths


def haystack_text(args) -> str:
    if args.task == "passkey":
        return PASSKEY_FILLER
    if args.haystack_dir is not None:
        return "\n\n".join(
            p.read_text(encoding="utf-8", errors="replace") for p in sorted(Path(args.haystack_dir).glob("*.txt"))
        )
    return embedded_prose()


def make_prompt(args, tokenizer, haystack, length: int, depth: float, sample: int):
    """The prompt of one cell and sample: a pure function of the arguments (every rank of an
    SP group builds the same one)."""
    rng = random.Random(f"{args.seed}/{length}/{depth}/{sample}")

    def number() -> str:
        return str(rng.randrange(10 ** (args.rnd_number_digits - 1), 10**args.rnd_number_digits))

    if args.task == "passkey":
        return build_prompt(tokenizer, haystack, PASSKEY, length, depth, key="", value=number())
    city, *others = rng.sample(CITIES, 1 + args.num_distractor)
    distractors = [(NEEDLE.needle.format(key=other, value=number()), rng.random()) for other in others]
    return build_prompt(tokenizer, haystack, NEEDLE, length, depth, key=city, value=number(), distractors=distractors)


def evaluate_prompt(scorer, tokenizer, prompt) -> dict:
    ids = torch.tensor(prompt.input_ids)
    targets = torch.full_like(ids, -100)
    targets[prompt.answer_start - 1 : -1] = ids[prompt.answer_start :]  # predict each answer token
    scores = scorer.score(ids, targets)
    rows = scores.scored
    predicted = scores.predictions[rows]
    right = predicted == targets[rows]
    return {
        "correct": bool(right.all()),
        "token_accuracy": round(float(right.float().mean()), 4),  # partial credit, reported only
        "predicted": tokenizer.decode(predicted.tolist()),
        "answer_nll": float(scores.nll[rows].mean()),
    }


def generate_answer(args, scorer, tokenizer, prompt) -> dict:
    """The model's free-form answer to the prompt (without the answer), greedy; right when its
    first number is the hidden value, digit for digit."""
    budget = args.max_new_tokens or 2 * args.rnd_number_digits + 4
    text = scorer.answer(tokenizer, prompt.input_ids[: prompt.answer_start], budget)
    number = re.search(r"\d+", text)
    return {"generated": text, "generated_correct": number is not None and number.group() == prompt.value}


def main(argv=None):
    args = parse_args(argv)
    return run_job("eval_needle.py", lambda accelerator, stage: run_sweep(args, accelerator, stage), args.dist_timeout)


def run_sweep(args, accelerator, stage: Stage) -> list[dict]:
    from tqdm.auto import tqdm

    lengths, depths = sweep(args)
    stage.at("loading the model")
    try:
        get_mode(args.parallel_mode).topology(accelerator.num_processes, args.sp_size, args.ring_degree)
        source = resolve_model(args.model)
        scorer, tokenizer = load_scorer_for_flags(accelerator, source, args, args.max_context_length)
    except (ValueError, OSError) as error:
        fail(str(error))
    try:
        haystack = Haystack(tokenizer, haystack_text(args), min_tokens=args.max_context_length)
        make_prompt(args, tokenizer, haystack, lengths[0], 0.0, 0)  # the tightest fit, checked on every rank
    except ValueError as error:
        fail(f"--min_context_length {lengths[0]}: {error}")

    cells = [(length, depth, sample) for length in lengths for depth in depths for sample in range(args.num_samples)]
    mine = scorer.my_items(cells)
    bar = tqdm(
        total=len(mine), desc=f"{args.task} sweep", disable=args.hide_progress or not accelerator.is_local_main_process
    )
    results = []
    for index, (length, depth, sample) in mine:
        stage.at(f"scoring a {length}-token prompt at depth {depth}")
        prompt = make_prompt(args, tokenizer, haystack, length, depth, sample)
        outcome = evaluate_prompt(scorer, tokenizer, prompt)
        if args.generate:
            stage.at(f"generating an answer to a {length}-token prompt at depth {depth}")
            outcome.update(generate_answer(args, scorer, tokenizer, prompt))
        results.append(
            (
                index,
                {
                    "context_length": length,
                    "depth": depth,
                    "sample": sample,
                    "tokens": len(prompt.input_ids),
                    "needle_position": prompt.needle_position,
                    "requested_position": prompt.requested_position,
                    "actual_depth": round(prompt.actual_depth, 4),
                    "key": prompt.key,
                    "value": prompt.value,
                    "distractors": len(prompt.distractors),
                    **outcome,
                },
            )
        )
        bar.update(1)
        bar.set_postfix(length=length, depth=depth, correct=outcome["correct"])
    bar.close()
    stage.at("collecting the results")
    records = scorer.collect(results)
    if accelerator.is_main_process:
        write_outputs(args, source, lengths, depths, records)
    ec.remove_seq_parallel_monkey_patch()
    return records


def write_outputs(args, source: str, lengths, depths, records) -> None:
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{args.task}_{Path(source.rstrip('/')).name}"
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    accuracy = cell_accuracy(records, lengths, depths, "correct")
    overall = float(np.mean([r["correct"] for r in records]))
    summary = {
        "model": source,
        "task": args.task,
        "parallel_mode": args.parallel_mode,
        "overall_accuracy": overall,
        "accuracy": {f"{length}/{depth}": a for (length, depth), a in accuracy.items()},
        "args": vars(args),
        "samples": records,
    }
    if args.generate:
        generated = cell_accuracy(records, lengths, depths, "generated_correct")
        summary["generate_overall_accuracy"] = float(np.mean([r["generated_correct"] for r in records]))
        summary["generate_accuracy"] = {f"{length}/{depth}": a for (length, depth), a in generated.items()}
    stem.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    name = f"{args.task}: {Path(source.rstrip('/')).name} ({args.parallel_mode})"
    needle_heatmap(accuracy, lengths, depths, stem.with_suffix(".png"), f"{name}, accuracy {overall:.2f}")
    if args.generate:
        title = f"{name}, generated answers, accuracy {summary['generate_overall_accuracy']:.2f}"
        needle_heatmap(generated, lengths, depths, stem.with_name(stem.name + "_generate.png"), title)

    print_table(f"{args.task} accuracy (teacher forcing)", accuracy, lengths, depths, len(records))
    if args.generate:
        print_table(f"{args.task} accuracy (generated answer, exact digits)", generated, lengths, depths, len(records))
        print(f"generated answers: overall accuracy {summary['generate_overall_accuracy']:.3f}")
    heatmaps = f"{stem}.png, {stem}_generate.png" if args.generate else f"{stem}.png"
    print(f"teacher forcing: overall accuracy {overall:.3f}; wrote {heatmaps}, {stem}.csv, {stem}.json")


def cell_accuracy(records, lengths, depths, field: str) -> dict:
    return {
        (length, depth): float(
            np.mean([r[field] for r in records if r["context_length"] == length and r["depth"] == depth])
        )
        for length in lengths
        for depth in depths
    }


def print_table(title: str, accuracy: dict, lengths, depths, prompts: int) -> None:
    print(f"\n{title} by depth (rows) and context length (columns), {prompts} prompts:")
    print("| depth | " + " | ".join(str(n) for n in lengths) + " |")
    print("|---" * (len(lengths) + 1) + "|")
    for depth in depths:
        print(f"| {100 * depth:.0f}% | " + " | ".join(f"{accuracy[(n, depth)]:.2f}" for n in lengths) + " |")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_main(main)  # exit code 0/2/3/4 without the interpreter's teardown (easy_context.core.groups.exit_process)
