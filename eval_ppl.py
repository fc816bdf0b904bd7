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

import csv
import gc
import json
import math
import os
from pathlib import Path

import torch

import easy_context as ec
from easy_context.modes import get_mode
from recipes.configuration import parse, values_of
from recipes.data import load_any_dataset, stdlib_heldout_documents
from recipes.evaluation import load_scorer_for_flags, resolve_model
from recipes.evaluation_config import PerplexityConfig, PerplexityDataConfig, PerplexityWindowConfig, parser
from recipes.launch import Stage, run_job, run_main
from recipes.launch import fail as launch_fail
from recipes.plots import perplexity_curves


def fail(message: str):
    launch_fail("eval_ppl.py", message)


# ----------------------------------------------------------------------------- arguments
def parse_args(argv=None) -> PerplexityConfig:
    """The command line as a PerplexityConfig (recipes/evaluation_config.py): -m's groups joined
    into one list ([None]: the default model), --dataset-min-tokens filled in; a failed check
    exits 2 with every reason in one line."""
    config = parse(PerplexityConfig, parser(PerplexityConfig, __doc__), argv)
    models = config.model.model
    config.model.model = [m for group in models for m in group] if models else [None]
    if config.data.dataset_min_tokens is None:
        config.data.dataset_min_tokens = config.windows.max_tokens
    return config


def context_lengths(windows: PerplexityWindowConfig) -> list[int]:
    if windows.tokens_step is not None:
        return list(range(windows.min_tokens, windows.max_tokens + 1, windows.tokens_step))
    lengths, n = [], windows.min_tokens
    while n <= windows.max_tokens:
        lengths.append(n)
        n *= 2
    return lengths


# ----------------------------------------------------------------------------- the data
def load_samples(data: PerplexityDataConfig, max_tokens: int, tokenizer) -> list[torch.Tensor]:
    """Token-id samples of at least --dataset-min-tokens, at most --samples of them."""
    wanted = data.samples or None
    if data.tokenized is None and data.dataset is None:
        # the embedded default: held-out sources as one stream cut into rows of --max-tokens
        row = max(max_tokens, data.dataset_min_tokens)
        separator = tokenizer.eos_token or "\n\n"
        chars = 8 * row * (wanted or 16)  # plenty for any tokenizer (>= 1 char per token)
        ids = tokenizer(separator.join(stdlib_heldout_documents(chars)))["input_ids"]
        rows = [torch.tensor(ids[i : i + row]) for i in range(0, len(ids) - row + 1, row)]
        if not rows:
            raise ValueError(f"the embedded corpus is shorter than one sample of {row} tokens; lower --max-tokens")
        return rows[:wanted]
    source = data.tokenized or data.dataset
    dataset = load_any_dataset(source, data.split, data.subset)
    column = "input_ids" if data.tokenized else data.feature
    if column not in dataset.column_names:
        raise ValueError(f"dataset {source!r} has no {column!r} column (columns: {dataset.column_names})")
    samples, shorter = [], 0
    for row in dataset:
        value = row[column]
        ids = value if data.tokenized else tokenizer(value)["input_ids"]
        if len(ids) < data.dataset_min_tokens:
            shorter += 1
            continue
        samples.append(torch.tensor(ids))
        if wanted and len(samples) == wanted:
            break
    if not samples:
        raise ValueError(
            f"no sample of {source!r} has {data.dataset_min_tokens} tokens or more ({shorter} shorter); "
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
    config: PerplexityConfig, accelerator, source: str, lengths: list[int], bar_position: int
) -> dict[int, tuple[float, int]]:
    from tqdm.auto import tqdm

    spans = config.windows
    chunk_size = 1024 if spans.aggressive_memory else 4096
    scorer, tokenizer = load_scorer_for_flags(
        accelerator, source, config.model, config.parallelism, max(lengths), chunk_size=chunk_size
    )
    samples = load_samples(config.data, spans.max_tokens, tokenizer)
    work = [
        (n, i, *span)
        for n in lengths
        for i, s in enumerate(samples)
        for span in windows(len(s), n, spans.sliding_window, spans.truncate)
    ]
    mine = scorer.my_items(work)
    name = Path(source.rstrip("/")).name
    bar = tqdm(
        total=len(mine),
        desc=f"ppl {name}",
        position=bar_position,
        disable=config.output.hide_progress or not accelerator.is_local_main_process,
    )
    results = []
    for index, (n, i, begin, end, first) in mine:
        results.append((index, (n, *window_nll(scorer, samples[i], begin, end, first))))
        if spans.aggressive_memory and torch.cuda.is_available():
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
    config = parse_args(argv)
    timeout = config.parallelism.dist_timeout
    return run_job("eval_ppl.py", lambda accelerator, stage: run_models(config, accelerator, stage), timeout)


def run_models(config: PerplexityConfig, accelerator, stage: Stage) -> dict:
    lengths, parallelism = context_lengths(config.windows), config.parallelism
    try:
        get_mode(parallelism.parallel_mode).topology(
            accelerator.num_processes, parallelism.sp_size, parallelism.ring_degree
        )
        sources = [resolve_model(m) for m in config.model.model]
    except (ValueError, OSError) as error:
        fail(str(error))
    table = {}
    for position, source in enumerate(sources):
        stage.at(f"scoring {source}")
        try:
            totals = evaluate_model(config, accelerator, source, lengths, position)
        except (ValueError, OSError) as error:
            fail(f"{source}: {error}")
        table[source] = {n: (math.exp(nll / count) if count else math.nan, count) for n, (nll, count) in totals.items()}
    if accelerator.is_main_process:
        write_outputs(config, lengths, table)
    ec.remove_seq_parallel_monkey_patch()
    return table


def write_outputs(config: PerplexityConfig, lengths, table) -> None:
    out = Path(config.output.output_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model", *lengths])
        for source, row in table.items():
            writer.writerow([source, *(f"{row[n][0]:.6g}" for n in lengths)])
    details = {
        "args": vars(values_of(config)),
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
