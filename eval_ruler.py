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

import csv
import json
import os
from pathlib import Path

import numpy as np

import easy_context as ec
from easy_context.modes import get_mode
from recipes import ruler
from recipes.configuration import parse, values_of
from recipes.evaluation import load_scorer_for_flags, resolve_model
from recipes.evaluation_config import RulerConfig, parser
from recipes.launch import Stage, run_job, run_main
from recipes.launch import fail as launch_fail
from recipes.plots import task_heatmap


def fail(message: str):
    launch_fail("eval_ruler.py", message)


def parse_args(argv=None) -> RulerConfig:
    """The command line as a RulerConfig (recipes/evaluation_config.py); a failed check exits 2
    with every reason in one line."""
    return parse(RulerConfig, parser(RulerConfig, __doc__), argv)


def main(argv=None):
    config = parse_args(argv)
    timeout = config.parallelism.dist_timeout
    return run_job("eval_ruler.py", lambda accelerator, stage: run_suite(config, accelerator, stage), timeout)


def run_suite(config: RulerConfig, accelerator, stage: Stage) -> list[dict]:
    from tqdm.auto import tqdm

    tasks, parallelism = config.tasks, config.parallelism
    stage.at("loading the model")
    try:
        get_mode(parallelism.parallel_mode).topology(
            accelerator.num_processes, parallelism.sp_size, parallelism.ring_degree
        )
        source = resolve_model(config.model.model)
        longest = max(tasks.length_list) + max(t.max_new_tokens for t in ruler.TASKS.values())
        scorer, tokenizer = load_scorer_for_flags(accelerator, source, config.model, parallelism, longest)
    except (ValueError, OSError) as error:
        fail(str(error))
    cells, too_short = [], {}
    for task in tasks.task_list:
        for length in tasks.length_list:
            try:
                ruler.make_sample(task, tokenizer, length, tasks.seed, 0, depth_for(tasks.depth, task))  # everywhere
            except ValueError as error:
                too_short[(task, length)] = str(error)
                continue
            cells += [(task, length, index) for index in range(tasks.samples)]
    mine = scorer.my_items(cells)
    hidden = config.output.hide_progress or not accelerator.is_local_main_process
    bar = tqdm(total=len(mine), desc="ruler", disable=hidden)
    results = []
    for position, (task, length, index) in mine:
        stage.at(f"answering {task} at {length} tokens")
        sample = ruler.make_sample(task, tokenizer, length, tasks.seed, index, depth_for(tasks.depth, task))
        answer = scorer.answer(tokenizer, sample.input_ids, tasks.max_new_tokens or sample.max_new_tokens)
        outcome = {"answer": answer, "score": ruler.score(answer, sample.outputs)}
        results.append((position, {**record_of(sample), **outcome}))
        bar.update(1)
    bar.close()
    stage.at("collecting the results")
    records = scorer.collect(results)
    if accelerator.is_main_process:
        write_outputs(config, source, records, too_short)
    ec.remove_seq_parallel_monkey_patch()
    return records


def depth_for(depth: float | None, task: str) -> float | None:
    """--depth places the needle tasks' asked needles; the other tasks have no needle depth."""
    return depth if ruler.TASKS[task].family == "niah" else None


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


def write_outputs(config: RulerConfig, source: str, records: list[dict], too_short: dict) -> None:
    out, mode = Path(config.output.output_dir), config.parallelism.parallel_mode
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"ruler_{Path(source.rstrip('/')).name}"
    if records:
        with open(stem.with_suffix(".csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(records[0]))
            writer.writeheader()
            writer.writerows(records)
    scores, lengths, tasks = table(records), config.tasks.length_list, config.tasks.task_list
    summary = {
        "model": source,
        "parallel_mode": mode,
        "scores": {f"{task}/{length}": value for (task, length), value in scores.items()},
        "too_short": {f"{task}/{length}": why for (task, length), why in too_short.items()},
        "args": {**vars(values_of(config)), "task_list": tasks, "length_list": lengths},
    }
    stem.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    name = Path(source.rstrip("/")).name
    mean = float(np.mean(list(scores.values()))) if scores else float("nan")
    task_heatmap(scores, lengths, tasks, stem.with_suffix(".png"), f"{name} ({mode}): mean {mean:.2f}")
    print(f"\nRULER-style scores, {config.tasks.samples} prompts per cell (-: the task does not fit that length):")
    print("| task | " + " | ".join(str(n) for n in lengths) + " |")
    print("|---" * (len(lengths) + 1) + "|")
    for task in tasks:
        row = [f"{scores[(task, n)]:.2f}" if (task, n) in scores else "-" for n in lengths]
        print(f"| {task} | " + " | ".join(row) + " |")
    print(f"mean {mean:.3f}; wrote {stem}.csv, {stem}.json, {stem}.png")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_main(main)
