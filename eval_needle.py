"""Needle in a haystack (or passkey retrieval) over context lengths x depths, each prompt
scored in one sequence-parallel forward pass.

    # CPU, 2 processes, the model the README's train.py command saved (outputs/tiny-llama)
    torchrun --standalone --nproc_per_node 2 eval_needle.py

    # GPUs, DeepSpeed ZeRO-3 inference (parameters offloaded), 8 processes
    accelerate launch --config_file accelerate_configs/deepspeed_inference.yaml eval_needle.py \
        --model PATH --max-context-length 1000000 --min-context-length 50000 --context-interval 50000 \
        --depth-interval 0.1 --num-samples 2 --rnd-number-digits 7 --haystack-dir ESSAYS

Scoring is teacher forcing: the prompt and the answer go in together and a sample is right
when the argmax at every answer position is the answer's next token. With --generate the
model also answers in free form (easy_context.generate: greedy, up to --max-new-tokens
tokens, the prompt's KV cache sharded over the SP group); that answer is right when its
first number is exactly the hidden one. Both scores are reported side by side. Writes
<output-dir>/<task>_<model>.png (heatmap; with --generate also <task>_<model>_generate.png),
.csv (one row per sample) and .json.
"""

from __future__ import annotations

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
from recipes.configuration import parse, values_of
from recipes.data import embedded_prose
from recipes.evaluation import load_scorer_for_flags, resolve_model
from recipes.evaluation_config import NeedleConfig, NeedlePromptConfig, NeedleSweepConfig, parser
from recipes.launch import Stage, run_job, run_main
from recipes.launch import fail as launch_fail
from recipes.needle import CITIES, NEEDLE, PASSKEY, PASSKEY_FILLER, Haystack, build_prompt, chat_frame
from recipes.plots import needle_heatmap


def fail(message: str):
    launch_fail("eval_needle.py", message)


# ----------------------------------------------------------------------------- arguments
def parse_args(argv=None) -> NeedleConfig:
    """The command line as a NeedleConfig (recipes/evaluation_config.py); a failed check exits 2
    with every reason in one line."""
    config = parse(NeedleConfig, parser(NeedleConfig, __doc__), argv)
    answers = config.answers
    if answers.generate and answers.max_new_tokens is None:
        answers.max_new_tokens = 2 * config.prompts.rnd_number_digits + 4
    return config


def sweep(settings: NeedleSweepConfig) -> tuple[list[int], list[float]]:
    lengths = list(range(settings.min_context_length, settings.max_context_length + 1, settings.context_interval))
    steps = int(round(1 / settings.depth_interval))
    depths = sorted({round(min(1.0, i * settings.depth_interval), 6) for i in range(steps + 1)} | {1.0})
    return lengths, depths


def haystack_text(prompts: NeedlePromptConfig) -> str:
    if prompts.task == "passkey":
        return PASSKEY_FILLER
    if prompts.haystack_dir is not None:
        return "\n\n".join(
            p.read_text(encoding="utf-8", errors="replace") for p in sorted(Path(prompts.haystack_dir).glob("*.txt"))
        )
    return embedded_prose()


def make_prompt(prompts: NeedlePromptConfig, tokenizer, haystack, length: int, depth: float, sample: int):
    """The prompt of one cell and sample: a pure function of the arguments (every rank of an
    SP group builds the same one)."""
    chat = chat_frame(tokenizer) if prompts.chat_template else None
    rng = random.Random(f"{prompts.seed}/{length}/{depth}/{sample}")
    digits = prompts.rnd_number_digits

    def number() -> str:
        return str(rng.randrange(10 ** (digits - 1), 10**digits))

    if prompts.task == "passkey":
        return build_prompt(tokenizer, haystack, PASSKEY, length, depth, key="", value=number(), chat=chat)
    city, *others = rng.sample(CITIES, 1 + prompts.num_distractor)
    distractors = [(NEEDLE.needle.format(key=other, value=number()), rng.random()) for other in others]
    return build_prompt(
        tokenizer, haystack, NEEDLE, length, depth, key=city, value=number(), distractors=distractors, chat=chat
    )


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


def generate_answer(scorer, tokenizer, prompt, max_new_tokens: int) -> dict:
    """The model's free-form answer to the prompt (without the answer), greedy, up to
    max_new_tokens; right when its first number is the hidden value, digit for digit."""
    text = scorer.answer(tokenizer, prompt.input_ids[: prompt.answer_start], max_new_tokens)
    number = re.search(r"\d+", text)
    return {"generated": text, "generated_correct": number is not None and number.group() == prompt.value}


def main(argv=None):
    config = parse_args(argv)
    timeout = config.parallelism.dist_timeout
    return run_job("eval_needle.py", lambda accelerator, stage: run_sweep(config, accelerator, stage), timeout)


def run_sweep(config: NeedleConfig, accelerator, stage: Stage) -> list[dict]:
    from tqdm.auto import tqdm

    prompts, parallelism = config.prompts, config.parallelism
    lengths, depths = sweep(config.sweep)
    stage.at("loading the model")
    try:
        get_mode(parallelism.parallel_mode).topology(
            accelerator.num_processes, parallelism.sp_size, parallelism.ring_degree
        )
        source = resolve_model(config.model.model)
        max_length = config.sweep.max_context_length
        scorer, tokenizer = load_scorer_for_flags(accelerator, source, config.model, parallelism, max_length)
    except (ValueError, OSError) as error:
        fail(str(error))
    try:
        haystack = Haystack(tokenizer, haystack_text(prompts), min_tokens=max_length)
        make_prompt(prompts, tokenizer, haystack, lengths[0], 0.0, 0)  # the tightest fit, checked on every rank
    except ValueError as error:
        fail(f"--min-context-length {lengths[0]}: {error}")

    samples = config.sweep.num_samples
    cells = [(length, depth, sample) for length in lengths for depth in depths for sample in range(samples)]
    mine = scorer.my_items(cells)
    hidden = config.output.hide_progress or not accelerator.is_local_main_process
    bar = tqdm(total=len(mine), desc=f"{prompts.task} sweep", disable=hidden)
    results = []
    for index, (length, depth, sample) in mine:
        stage.at(f"scoring a {length}-token prompt at depth {depth}")
        prompt = make_prompt(prompts, tokenizer, haystack, length, depth, sample)
        outcome = evaluate_prompt(scorer, tokenizer, prompt)
        if config.answers.generate:
            stage.at(f"generating an answer to a {length}-token prompt at depth {depth}")
            outcome.update(generate_answer(scorer, tokenizer, prompt, config.answers.max_new_tokens))
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
        write_outputs(config, source, lengths, depths, records)
    ec.remove_seq_parallel_monkey_patch()
    return records


def write_outputs(config: NeedleConfig, source: str, lengths, depths, records) -> None:
    task, mode, generate = config.prompts.task, config.parallelism.parallel_mode, config.answers.generate
    out = Path(config.output.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{task}_{Path(source.rstrip('/')).name}"
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)
    accuracy = cell_accuracy(records, lengths, depths, "correct")
    overall = float(np.mean([r["correct"] for r in records]))
    summary = {
        "model": source,
        "task": task,
        "parallel_mode": mode,
        "overall_accuracy": overall,
        "accuracy": {f"{length}/{depth}": a for (length, depth), a in accuracy.items()},
        "args": vars(values_of(config)),
        "samples": records,
    }
    if generate:
        generated = cell_accuracy(records, lengths, depths, "generated_correct")
        summary["generate_overall_accuracy"] = float(np.mean([r["generated_correct"] for r in records]))
        summary["generate_accuracy"] = {f"{length}/{depth}": a for (length, depth), a in generated.items()}
    stem.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    name = f"{task}: {Path(source.rstrip('/')).name} ({mode})"
    needle_heatmap(accuracy, lengths, depths, stem.with_suffix(".png"), f"{name}, accuracy {overall:.2f}")
    if generate:
        title = f"{name}, generated answers, accuracy {summary['generate_overall_accuracy']:.2f}"
        needle_heatmap(generated, lengths, depths, stem.with_name(stem.name + "_generate.png"), title)

    print_table(f"{task} accuracy (teacher forcing)", accuracy, lengths, depths, len(records))
    if generate:
        print_table(f"{task} accuracy (generated answer, exact digits)", generated, lengths, depths, len(records))
        print(f"generated answers: overall accuracy {summary['generate_overall_accuracy']:.3f}")
    heatmaps = f"{stem}.png, {stem}_generate.png" if generate else f"{stem}.png"
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
