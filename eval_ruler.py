"""The offline RULER-style suite (recipes/ruler.py): every task at every length,
answered by greedy generation with the prompt's KV cache sharded over the SP group.

    # CPU, 2 processes: the model train.py saves, at the lengths of the default run
    torchrun --standalone --nproc_per_node 2 eval_ruler.py

    # the shipped base, some tasks, longer prompts
    torchrun --standalone --nproc_per_node 2 eval_ruler.py --model models/demo-base \
        --tasks niah_single_1,vt,fwe --lengths 1024,4096 --samples 20

A prompt is exactly --lengths tokens of the model's tokenizer; the same --seed gives the same
prompts. An answer scores the share of the expected strings it contains (RULER's
string_match_all); a cell is the mean over its samples. A task whose instructions do not fit a
length is left out of that column (and said so). Writes <output-dir>/ruler_<model>.csv (one row
per sample), .json (the table) and .png (task x length heatmap), and prints the table.
The same tasks run through lm-eval as `ec_ruler` (eval_harness.py).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
from pathlib import Path

import numpy as np

import easy_context as ec
from easy_context.modes import get_mode
from recipes import ruler
from recipes.configuration import SHARED_BY_SCRIPTS, ParallelismConfig, add_flags
from recipes.evaluation import load_scorer_for_flags, resolve_model
from recipes.launch import (
    Stage,
    ring_degree_error,
    run_job,
    run_main,
)
from recipes.launch import fail as launch_fail
from recipes.plots import task_heatmap


def fail(message: str):
    launch_fail("eval_ruler.py", message)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="hub name or local folder (default: outputs/tiny-llama)")
    p.add_argument("--tasks", default="all", help=f"comma-separated, or all: {','.join(ruler.TASKS)}")
    p.add_argument(
        "--lengths",
        default=",".join(map(str, ruler.DEFAULT_LENGTHS)),
        help="prompt lengths in tokens, comma-separated",
    )
    p.add_argument("--samples", type=int, default=4, help="prompts per (task, length) cell")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--depth",
        type=float,
        default=None,
        help="needle tasks: the asked needles at this fraction of the haystack (default: random depths)",
    )
    p.add_argument("--max-new-tokens", type=int, default=None, help="answer budget (default: each task's own)")
    add_flags(p, [ParallelismConfig], only=SHARED_BY_SCRIPTS)
    p.add_argument("--sp-size", type=int, default=None, help="ranks sharing one prompt (default: all)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--rope-theta", type=float, default=None, help="override the model's RoPE base")
    p.add_argument("--output-dir", default="outputs/eval")
    p.add_argument("--hide-progress", action="store_true")
    args = p.parse_args(argv)
    errors = []
    tasks = list(ruler.TASKS) if args.tasks == "all" else [t for t in args.tasks.split(",") if t]
    if unknown := [t for t in tasks if t not in ruler.TASKS]:
        errors.append(f"--tasks: unknown {unknown}; the tasks are {','.join(ruler.TASKS)}")
    try:
        lengths = sorted({int(n) for n in args.lengths.split(",") if n})
    except ValueError:
        lengths = []
    if not lengths or lengths[0] < 1:
        errors.append(f"--lengths must be positive integers, comma-separated; got {args.lengths!r}")
    if args.depth is not None and not 0.0 <= args.depth <= 1.0:
        errors.append(f"--depth must be a fraction in [0, 1], got {args.depth}")
    if args.samples < 1:
        errors.append(f"--samples must be >= 1, got {args.samples}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        errors.append(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if ring_error := ring_degree_error(args):
        errors.append(ring_error)
    if errors:
        p.error("; ".join(errors))
    args.task_list, args.length_list = tasks, lengths
    return args


def main(argv=None):
    args = parse_args(argv)
    return run_job("eval_ruler.py", lambda accelerator, stage: run_suite(args, accelerator, stage), args.dist_timeout)


def run_suite(args, accelerator, stage: Stage) -> list[dict]:
    from tqdm.auto import tqdm

    stage.at("loading the model")
    try:
        get_mode(args.parallel_mode).topology(accelerator.num_processes, args.sp_size, args.ring_degree)
        source = resolve_model(args.model)
        scorer, tokenizer = load_scorer_for_flags(
            accelerator, source, args, max(args.length_list) + max(t.max_new_tokens for t in ruler.TASKS.values())
        )
    except (ValueError, OSError) as error:
        fail(str(error))
    cells, too_short = [], {}
    for task in args.task_list:
        for length in args.length_list:
            try:
                ruler.make_sample(task, tokenizer, length, args.seed, 0, depth_for(args, task))  # the same everywhere
            except ValueError as error:
                too_short[(task, length)] = str(error)
                continue
            cells += [(task, length, index) for index in range(args.samples)]
    mine = scorer.my_items(cells)
    bar = tqdm(total=len(mine), desc="ruler", disable=args.hide_progress or not accelerator.is_local_main_process)
    results = []
    for position, (task, length, index) in mine:
        stage.at(f"answering {task} at {length} tokens")
        sample = ruler.make_sample(task, tokenizer, length, args.seed, index, depth_for(args, task))
        answer = scorer.answer(tokenizer, sample.input_ids, args.max_new_tokens or sample.max_new_tokens)
        outcome = {"answer": answer, "score": ruler.score(answer, sample.outputs)}
        results.append((position, {**record_of(sample), **outcome}))
        bar.update(1)
    bar.close()
    stage.at("collecting the results")
    records = scorer.collect(results)
    if accelerator.is_main_process:
        write_outputs(args, source, records, too_short)
    ec.remove_seq_parallel_monkey_patch()
    return records


def depth_for(args, task: str) -> float | None:
    """--depth places the needle tasks' asked needles; the other tasks have no needle depth."""
    return args.depth if ruler.TASKS[task].family == "niah" else None


def record_of(sample: ruler.Sample) -> dict:
    return {
        "task": sample.task,
        "length": sample.length,
        "sample": sample.index,
        "tokens": len(sample.input_ids),
        "expected": "|".join(sample.outputs),
        "needle_positions": " ".join(map(str, sample.needle_positions)),
    }


def table(records: list[dict]) -> dict:
    """(task, length) -> mean score."""
    cells = {}
    for r in records:
        cells.setdefault((r["task"], r["length"]), []).append(r["score"])
    return {cell: float(np.mean(scores)) for cell, scores in cells.items()}


def write_outputs(args, source: str, records: list[dict], too_short: dict) -> None:
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"ruler_{Path(source.rstrip('/')).name}"
    if records:
        with open(stem.with_suffix(".csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(records[0]))
            writer.writeheader()
            writer.writerows(records)
    scores, lengths, tasks = table(records), args.length_list, args.task_list
    summary = {
        "model": source,
        "parallel_mode": args.parallel_mode,
        "scores": {f"{task}/{length}": value for (task, length), value in scores.items()},
        "too_short": {f"{task}/{length}": why for (task, length), why in too_short.items()},
        "args": {k: v for k, v in vars(args).items()},
    }
    stem.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    name = Path(source.rstrip("/")).name
    mean = float(np.mean(list(scores.values()))) if scores else float("nan")
    task_heatmap(scores, lengths, tasks, stem.with_suffix(".png"), f"{name} ({args.parallel_mode}): mean {mean:.2f}")
    print(f"\nRULER-style scores, {args.samples} prompts per cell (-: the task does not fit that length):")
    print("| task | " + " | ".join(str(n) for n in lengths) + " |")
    print("|---" * (len(lengths) + 1) + "|")
    for task in tasks:
        row = [f"{scores[(task, n)]:.2f}" if (task, n) in scores else "-" for n in lengths]
        print(f"| {task} | " + " | ".join(row) + " |")
    print(f"mean {mean:.3f}; wrote {stem}.csv, {stem}.json, {stem}.png")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_main(main)
