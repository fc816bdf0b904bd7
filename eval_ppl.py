"""Perplexity against context length: token-weighted, every window in one sequence-parallel
forward pass.

    # CPU, 2 processes: the model the README's train.py command saved, on held-out
    # standard-library sources (the end of the file list; train.py reads from the start)
    torchrun --standalone --nproc_per_node 2 eval_ppl.py

    # GPUs: several models on a tokenized dataset, DeepSpeed ZeRO-3 inference
    accelerate launch --config_file accelerate_configs/deepspeed_inference.yaml eval_ppl.py \
        -m MODEL_A -m MODEL_B --tokenized DATASET --samples 20 --min-tokens 8192 --max-tokens 131072 \
        --tokens-step 8192 --truncate

For each length L, each sample is scored with windows of L tokens: --truncate scores the
first L tokens once; otherwise a window slides by --sliding-window tokens and scores only the
tokens it adds (the first window scores all of its tokens), so every token of a sample is
scored once per L, with up to L tokens of context. Perplexity at L = exp(sum of negative
log-likelihoods / number of scored tokens) over all samples: tokens weigh equally, windows
and samples do not. Lengths the parallel layout cannot split are padded and masked.
Writes --output-file (CSV: header model,<L>...; one row per model) and a .png/.pdf plot
next to it (tools/plot_ppl.py redraws or merges CSVs).
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import math
import os
from pathlib import Path

import torch

import easy_context as ec
from easy_context.modes import get_mode
from recipes.configuration import SHARED_BY_SCRIPTS, ParallelismConfig, add_flags
from recipes.data import load_any_dataset, stdlib_heldout_documents
from recipes.evaluation import load_scorer_for_flags, resolve_model
from recipes.launch import (
    Stage,
    ring_degree_error,
    run_job,
    run_main,
)
from recipes.launch import fail as launch_fail
from recipes.plots import perplexity_curves


def fail(message: str):
    launch_fail("eval_ppl.py", message)


# ----------------------------------------------------------------------------- arguments
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "-m",
        "--model",
        action="append",
        nargs="+",
        default=None,
        help="hub names or local folders, repeatable (default: outputs/tiny-llama, what train.py saves)",
    )
    p.add_argument(
        "-d",
        "--dataset",
        default=None,
        help="raw text dataset: hub name, save_to_disk folder, .json/.jsonl/.parquet/.txt",
    )
    p.add_argument("-s", "--subset", default=None, help="the dataset's configuration name (hub datasets)")
    p.add_argument("-f", "--feature", default="text", help="the text column of --dataset")
    p.add_argument(
        "--tokenized", default=None, help="pre-tokenized dataset with an input_ids column (instead of --dataset)"
    )
    p.add_argument("--split", default="test")
    p.add_argument("--samples", type=int, default=4, help="samples to evaluate (0: all)")
    p.add_argument("--min-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument(
        "--tokens-step", type=int, default=None, help="step between lengths (default: powers of two from --min-tokens)"
    )
    p.add_argument(
        "--sliding-window",
        type=int,
        default=256,
        help="stride of the sliding window (tokens; at most L - 1 so every token is scored)",
    )
    p.add_argument("--truncate", action="store_true", help="score only the first L tokens of each sample")
    p.add_argument(
        "--dataset-min-tokens", type=int, default=None, help="drop samples shorter than this (default: --max-tokens)"
    )
    p.add_argument("--output-file", default="outputs/eval/ppl.csv")
    p.add_argument(
        "--aggressive-memory",
        action="store_true",
        help="smaller output-layer chunks; free cached GPU memory after each window",
    )
    p.add_argument("--hide-progress", action="store_true")
    add_flags(p, [ParallelismConfig], only=SHARED_BY_SCRIPTS)
    p.add_argument(
        "--sp-size",
        type=int,
        default=None,
        help="ranks sharing one window (default: all); other groups take other windows",
    )
    p.add_argument(
        "--rope-theta",
        "--rope_theta",
        dest="rope_theta",
        type=float,
        default=None,
        help="override the models' RoPE base",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bf16 on CUDA, fp32 on CPU",
    )
    args = p.parse_args(argv)
    args.model = [m for group in args.model for m in group] if args.model else [None]

    errors = []
    if args.min_tokens < 2 or args.max_tokens < args.min_tokens:
        errors.append(f"need 2 <= --min-tokens <= --max-tokens, got {args.min_tokens} and {args.max_tokens}")
    for name in ("tokens_step", "sliding_window", "dataset_min_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            errors.append(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.samples < 0:
        errors.append(f"--samples must be >= 0, got {args.samples}")
    if args.dataset and args.tokenized:
        errors.append("give --dataset (raw text) or --tokenized (input_ids), not both")
    if ring_error := ring_degree_error(args):
        errors.append(ring_error)
    if errors:
        p.error("; ".join(errors))
    if args.dataset_min_tokens is None:
        args.dataset_min_tokens = args.max_tokens
    return args


def context_lengths(args) -> list[int]:
    if args.tokens_step is not None:
        return list(range(args.min_tokens, args.max_tokens + 1, args.tokens_step))
    lengths, n = [], args.min_tokens
    while n <= args.max_tokens:
        lengths.append(n)
        n *= 2
    return lengths


# ----------------------------------------------------------------------------- the data
def load_samples(args, tokenizer) -> list[torch.Tensor]:
    """Token-id samples of at least --dataset-min-tokens, at most --samples of them."""
    wanted = args.samples or None
    if args.tokenized is None and args.dataset is None:
        # the embedded default: held-out sources as one stream cut into rows of --max-tokens
        row = max(args.max_tokens, args.dataset_min_tokens)
        separator = tokenizer.eos_token or "\n\n"
        chars = 8 * row * (wanted or 16)  # plenty for any tokenizer (>= 1 char per token)
        ids = tokenizer(separator.join(stdlib_heldout_documents(chars)))["input_ids"]
        rows = [torch.tensor(ids[i : i + row]) for i in range(0, len(ids) - row + 1, row)]
        if not rows:
            raise ValueError(f"the embedded corpus is shorter than one sample of {row} tokens; lower --max-tokens")
        return rows[:wanted]
    source = args.tokenized or args.dataset
    dataset = load_any_dataset(source, args.split, args.subset)
    column = "input_ids" if args.tokenized else args.feature
    if column not in dataset.column_names:
        raise ValueError(f"dataset {source!r} has no {column!r} column (columns: {dataset.column_names})")
    samples, shorter = [], 0
    for row in dataset:
        value = row[column]
        ids = value if args.tokenized else tokenizer(value)["input_ids"]
        if len(ids) < args.dataset_min_tokens:
            shorter += 1
            continue
        samples.append(torch.tensor(ids))
        if wanted and len(samples) == wanted:
            break
    if not samples:
        raise ValueError(
            f"no sample of {source!r} has {args.dataset_min_tokens} tokens or more ({shorter} shorter); "
            "lower --dataset-min-tokens or --max-tokens"
        )
    return samples


def windows(length: int, context: int, stride: int, truncate: bool) -> list[tuple[int, int, int]]:
    """(begin, end, first scored token) of each window over a sample of `length` tokens."""
    if truncate:
        return [(0, min(context, length), 1)]
    # a window's first token has no prediction inside it: windows must overlap by one token
    # at least, or that token would never be scored
    spans, scored_until = [], 1
    for begin in range(0, length, min(stride, context - 1)):
        end = min(begin + context, length)
        spans.append((begin, end, max(scored_until, begin + 1)))
        scored_until = end
        if end == length:
            break
    return spans


def window_nll(scorer, sample: torch.Tensor, begin: int, end: int, first: int) -> tuple[float, int]:
    """Sum of negative log-likelihoods of tokens first..end-1, predicted within sample[begin:end]."""
    ids = sample[begin:end]
    targets = torch.full_like(ids, -100)
    targets[first - 1 - begin : -1] = ids[first - begin :]  # input position i predicts token i + 1
    scores = scorer.score(ids, targets)
    return float(scores.nll.double().sum()), int(scores.scored.sum())


# ------------------------------------------------------------------------------- main
def evaluate_model(
    args, accelerator, source: str, lengths: list[int], bar_position: int
) -> dict[int, tuple[float, int]]:
    from tqdm.auto import tqdm

    chunk_size = 1024 if args.aggressive_memory else 4096
    scorer, tokenizer = load_scorer_for_flags(accelerator, source, args, max(lengths), chunk_size=chunk_size)
    samples = load_samples(args, tokenizer)
    work = [
        (n, i, *span)
        for n in lengths
        for i, s in enumerate(samples)
        for span in windows(len(s), n, args.sliding_window, args.truncate)
    ]
    mine = scorer.my_items(work)
    name = Path(source.rstrip("/")).name
    bar = tqdm(
        total=len(mine),
        desc=f"ppl {name}",
        position=bar_position,
        disable=args.hide_progress or not accelerator.is_local_main_process,
    )
    results = []
    for index, (n, i, begin, end, first) in mine:
        results.append((index, (n, *window_nll(scorer, samples[i], begin, end, first))))
        if args.aggressive_memory and torch.cuda.is_available():
            torch.cuda.empty_cache()
        bar.update(1)
    bar.close()
    totals = {n: (0.0, 0) for n in lengths}
    for n, nll, count in scorer.collect(results):
        totals[n] = (totals[n][0] + nll, totals[n][1] + count)
    del scorer
    gc.collect()
    return totals


def main(argv=None):
    args = parse_args(argv)
    return run_job("eval_ppl.py", lambda accelerator, stage: run_models(args, accelerator, stage), args.dist_timeout)


def run_models(args, accelerator, stage: Stage) -> dict:
    lengths = context_lengths(args)
    try:
        get_mode(args.parallel_mode).topology(accelerator.num_processes, args.sp_size, args.ring_degree)
        sources = [resolve_model(m) for m in args.model]
    except (ValueError, OSError) as error:
        fail(str(error))
    table = {}
    for position, source in enumerate(sources):
        stage.at(f"scoring {source}")
        try:
            totals = evaluate_model(args, accelerator, source, lengths, position)
        except (ValueError, OSError) as error:
            fail(f"{source}: {error}")
        table[source] = {n: (math.exp(nll / count) if count else math.nan, count) for n, (nll, count) in totals.items()}
    if accelerator.is_main_process:
        write_outputs(args, lengths, table)
    ec.remove_seq_parallel_monkey_patch()
    return table


def write_outputs(args, lengths, table) -> None:
    out = Path(args.output_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model", *lengths])
        for source, row in table.items():
            writer.writerow([source, *(f"{row[n][0]:.6g}" for n in lengths)])
    details = {
        "args": vars(args),
        "perplexity": {
            s: {str(n): {"ppl": ppl, "tokens": count} for n, (ppl, count) in row.items()} for s, row in table.items()
        },
    }
    out.with_suffix(".json").write_text(json.dumps(details, indent=1))
    curves = {Path(s.rstrip("/")).name: [row[n][0] for n in lengths] for s, row in table.items()}
    perplexity_curves(
        lengths, curves, [out.with_suffix(".png"), out.with_suffix(".pdf")], title="perplexity vs context length"
    )

    print("\n| model | " + " | ".join(str(n) for n in lengths) + " |")
    print("|---" * (len(lengths) + 1) + "|")
    for source, row in table.items():
        print(f"| {source} | " + " | ".join(f"{row[n][0]:.4f}" for n in lengths) + " |")
    counts = {n: next(iter(table.values()))[n][1] for n in lengths}
    print(f"scored tokens per length: {counts}; wrote {out}, {out.with_suffix('.png')}, {out.with_suffix('.pdf')}")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_main(main)  # exit code 0/2/3/4 without the interpreter's teardown (easy_context.core.groups.exit_process)
