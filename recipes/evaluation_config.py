"""The eval scripts' configurations (eval_needle.py, eval_ppl.py, eval_ruler.py) and
tools/generate.py's: one dataclass per concern, each field with its default, its doc and its
check, as train.py's (recipes/training/config.py; recipes/configuration.py generates the
command line). The sections the scripts share are declared once: the model evaluated
(--model, --rope-theta, --dtype), the parallelism (train.py's fields and --sp-size) and the
output. One spelling, dashed; EasyContext's underscore spellings (--max_context_length) still
work and warn until configuration.ALIASES_REMOVED.

    python -m recipes.evaluation_config [SCRIPT]   the docs' flag tables, between their markers
    python -m recipes.evaluation_config --write    ... written into docs/guides/evaluation.md and generation.md
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from recipes import ruler
from recipes.configuration import (
    ParallelismConfig,
    add_flags,
    at_least,
    flag_table,
    option,
    optional_at_least,
    same_as,
    sections_of,
    writable_folder,
)
from recipes.models.downloads import DOWNLOADS
from recipes.needle import CITIES

__all__ = [
    "EvalModelConfig",
    "EvalParallelismConfig",
    "OutputConfig",
    "NeedleConfig",
    "PerplexityConfig",
    "RulerConfig",
    "GenerateConfig",
    "CONFIGS",
    "parser",
    "markers",
]

DTYPES = ["auto", "float32", "bfloat16", "float16"]


# ------------------------------------------------------------------ the sections every script shares
@dataclass
class EvalModelConfig:
    title: ClassVar[str] = "model"
    model: str | None = option(
        None,
        f"hub name, local folder or downloadable model ({', '.join(DOWNLOADS)}: python -m recipes.models get NAME; "
        "default: outputs/tiny-llama, what train.py saves)",
    )
    rope_theta: float | None = option(None, "override the model's RoPE base", aliases=("--rope_theta",))
    dtype: str = option("auto", "auto: bf16 on CUDA, fp32 on CPU", choices=DTYPES)


@dataclass
class EvalParallelismConfig:
    title: ClassVar[str] = "parallelism"
    parallel_mode: str = same_as(ParallelismConfig, "parallel_mode")
    ring_degree: int | None = same_as(ParallelismConfig, "ring_degree")
    sp_size: int | None = option(
        None,
        "ranks sharing one prompt or window (default: all); the other groups take other ones",
        aliases=("--sp_size",),
    )
    dist_timeout: float = same_as(ParallelismConfig, "dist_timeout")


@dataclass
class OutputConfig:
    title: ClassVar[str] = "output"
    output_dir: str = option(
        "outputs/eval", "where the CSV, JSON and heatmaps go", writable_folder, aliases=("--output_dir",)
    )
    hide_progress: bool = option(False, "no progress bar", aliases=("--hide_progress",))


# ------------------------------------------------------------------ eval_needle.py
def _context_lengths(name, value, settings):
    if value < 1 or settings.max_context_length < value:
        return f"need 1 <= --min-context-length <= --max-context-length, got {value} and {settings.max_context_length}"
    return None


def _depth_interval(name, value, settings):
    return None if 0 < value <= 1 else f"--depth-interval must be in (0, 1], got {value}"


def _samples_and_digits(name, value, settings):
    if value < 1 or settings.rnd_number_digits < 1:
        return f"--num-samples and --rnd-number-digits must be >= 1, got {value} and {settings.rnd_number_digits}"
    return None


def _num_distractor(name, value, settings):
    errors = []
    if not 0 <= value < len(CITIES):
        errors.append(f"--num-distractor must be between 0 and {len(CITIES) - 1}, got {value}")
    if settings.task == "passkey" and value:
        errors.append("--num-distractor applies to the needle task only (a passkey prompt has one key)")
    return "; ".join(errors) or None


def _haystack_dir(name, value, settings):
    if value is not None and not sorted(Path(value).glob("*.txt")):
        return f"--haystack-dir {value}: no .txt files there"
    return None


def _needle_max_new_tokens(name, value, settings):
    if value is not None and (not settings.generate or value < 1):
        return f"--max-new-tokens needs --generate and a value >= 1, got {value}"
    return None


@dataclass
class NeedleSweepConfig:
    title: ClassVar[str] = "sweep"
    # 256 to 2,048 tokens: the shipped base's context (512) and the default train.py job's (2,048) inside
    min_context_length: int = option(256, "the shortest prompt (tokens)", _context_lengths, ("--min_context_length",))
    max_context_length: int = option(2048, "the longest prompt (tokens)", aliases=("--max_context_length",))
    context_interval: int = option(256, "step between context lengths (tokens)", at_least(1), ("--context_interval",))
    depth_interval: float = option(
        0.25, "step between depths, as a fraction (0.1: 0%, 10%, ..., 100%)", _depth_interval, ("--depth_interval",)
    )
    num_samples: int = option(
        2, "prompts per (length, depth) cell, each with its own key and number", _samples_and_digits, ("--num_samples",)
    )


@dataclass
class NeedlePromptConfig:
    title: ClassVar[str] = "prompts"
    task: str = option("needle", "city magic number, or Landmark-style passkey", choices=["needle", "passkey"])
    rnd_number_digits: int = option(7, "digits of the hidden number", aliases=("--rnd_number_digits",))
    num_distractor: int = option(
        0, "other cities' magic numbers hidden in the haystack (needle task)", _num_distractor, ("--num_distractor",)
    )
    haystack_dir: str | None = option(
        None,
        "folder of .txt files (default: the Python reference docs every Python has)",
        _haystack_dir,
        ("--haystack_dir",),
    )
    seed: int = option(42, "the prompts' seed (the same seed, the same prompts)")
    chat_template: bool = option(
        False,
        "ask through the tokenizer's chat template: the haystack and the question as the user's turn, "
        "the bare number as the assistant's answer (an instruct model; with --generate, answered freely)",
    )


@dataclass
class NeedleAnswerConfig:
    title: ClassVar[str] = "answers"
    generate: bool = option(False, "also answer in free form (greedy) and score the digits by exact match")
    max_new_tokens: int | None = option(
        None,
        "--generate: tokens to generate (default: 2 x digits + 4)",
        _needle_max_new_tokens,
        ("--max_new_tokens",),
    )


@dataclass
class NeedleConfig:
    """eval_needle.py's settings."""

    model: EvalModelConfig
    sweep: NeedleSweepConfig
    prompts: NeedlePromptConfig
    answers: NeedleAnswerConfig
    parallelism: EvalParallelismConfig
    output: OutputConfig


# ------------------------------------------------------------------ eval_ppl.py
def _token_range(name, value, settings):
    if value < 2 or settings.max_tokens < value:
        return f"need 2 <= --min-tokens <= --max-tokens, got {value} and {settings.max_tokens}"
    return None


def _not_both(name, value, settings):
    return "give --dataset (raw text) or --tokenized (input_ids), not both" if value and settings.dataset else None


@dataclass
class PerplexityModelConfig(EvalModelConfig):
    title: ClassVar[str] = "models"
    model: list[str] | None = option(
        None,
        f"hub names, local folders or downloadable models ({', '.join(DOWNLOADS)}), repeatable "
        "(default: outputs/tiny-llama, what train.py saves)",
        short="-m",
        action="append",
        nargs="+",
    )


@dataclass
class PerplexityDataConfig:
    title: ClassVar[str] = "data"
    dataset: str | None = option(
        None, "raw text dataset: hub name, save_to_disk folder, .json/.jsonl/.parquet/.txt", short="-d"
    )
    subset: str | None = option(None, "the dataset's configuration name (hub datasets)", short="-s")
    feature: str = option("text", "the text column of --dataset", short="-f")
    tokenized: str | None = option(
        None, "pre-tokenized dataset with an input_ids column (instead of --dataset)", _not_both
    )
    split: str = option("test", "the dataset's split")
    samples: int = option(4, "samples to evaluate (0: all)", at_least(0))
    dataset_min_tokens: int | None = option(
        None, "drop samples shorter than this (default: --max-tokens)", optional_at_least(1)
    )


@dataclass
class PerplexityWindowConfig:
    title: ClassVar[str] = "windows"
    min_tokens: int = option(256, "the shortest context length (tokens)", _token_range)
    max_tokens: int = option(4096, "the longest context length (tokens)")
    tokens_step: int | None = option(
        None, "step between lengths (default: powers of two from --min-tokens)", optional_at_least(1)
    )
    sliding_window: int = option(
        256, "stride of the sliding window (tokens; at most L - 1 so every token is scored)", at_least(1)
    )
    truncate: bool = option(False, "score only the first L tokens of each sample")
    aggressive_memory: bool = option(False, "smaller output-layer chunks; free cached GPU memory after each window")


@dataclass
class PerplexityOutputConfig:
    title: ClassVar[str] = "output"
    output_file: str = option("outputs/eval/ppl.csv", "the CSV; the .json and the .png/.pdf plot go beside it")
    hide_progress: bool = same_as(OutputConfig, "hide_progress")


@dataclass
class PerplexityConfig:
    """eval_ppl.py's settings."""

    model: PerplexityModelConfig
    data: PerplexityDataConfig
    windows: PerplexityWindowConfig
    parallelism: EvalParallelismConfig
    output: PerplexityOutputConfig


# ------------------------------------------------------------------ eval_ruler.py
def task_names(text: str) -> list[str]:
    """--tasks: comma-separated task names, or all."""
    return list(ruler.TASKS) if text == "all" else [t for t in text.split(",") if t]


def prompt_lengths(text: str) -> list[int]:
    """--lengths: the sorted distinct lengths, or [] if one is not an integer."""
    try:
        return sorted({int(n) for n in text.split(",") if n})
    except ValueError:
        return []


def _tasks(name, value, settings):
    if unknown := [t for t in task_names(value) if t not in ruler.TASKS]:
        return f"--tasks: unknown {unknown}; the tasks are {','.join(ruler.TASKS)}"
    return None


def _lengths(name, value, settings):
    lengths = prompt_lengths(value)
    if not lengths or lengths[0] < 1:
        return f"--lengths must be positive integers, comma-separated; got {value!r}"
    return None


def _depth(name, value, settings):
    return None if value is None or 0.0 <= value <= 1.0 else f"--depth must be a fraction in [0, 1], got {value}"


@dataclass
class RulerTaskConfig:
    title: ClassVar[str] = "tasks"
    tasks: str = option("all", f"comma-separated, or all: {','.join(ruler.TASKS)}", _tasks)
    lengths: str = option(
        ",".join(map(str, ruler.DEFAULT_LENGTHS)), "prompt lengths in tokens, comma-separated", _lengths
    )
    samples: int = option(4, "prompts per (task, length) cell", at_least(1))
    seed: int = option(0, "the prompts' seed (the same seed, the same prompts)")
    depth: float | None = option(
        None, "needle tasks: the asked needles at this fraction of the haystack (default: random depths)", _depth
    )
    max_new_tokens: int | None = option(None, "answer budget (default: each task's own)", optional_at_least(1))

    @property
    def task_list(self) -> list[str]:
        return task_names(self.tasks)

    @property
    def length_list(self) -> list[int]:
        return prompt_lengths(self.lengths)


@dataclass
class RulerConfig:
    """eval_ruler.py's settings."""

    model: EvalModelConfig
    tasks: RulerTaskConfig
    parallelism: EvalParallelismConfig
    output: OutputConfig


# ------------------------------------------------------------------ tools/generate.py
def _one_prompt(name, value, settings):
    if value is None and settings.prompt is None:
        return "one of --prompt-file and --prompt is required"
    if value is not None and settings.prompt is not None:
        return "give --prompt-file or --prompt, not both"
    if value not in (None, "-") and not Path(value).is_file():
        return f"--prompt-file {value}: no such file"
    return None


def _sampling(name, value, settings):
    if not value and any(getattr(settings, x) is not None for x in ("temperature", "top_p", "top_k")):
        return "--temperature/--top-p/--top-k need --do-sample"
    return None


@dataclass
class PromptConfig:
    title: ClassVar[str] = "prompt"
    prompt_file: str | None = option(
        None, "a UTF-8 text file ('-': stdin); this or --prompt", _one_prompt, ("--prompt_file",), metavar="FILE"
    )
    prompt: str | None = option(None, "the prompt text itself", metavar="TEXT")


@dataclass
class DecodingConfig:
    title: ClassVar[str] = "decoding"
    max_new_tokens: int = option(64, "tokens to generate", at_least(1), ("--max_new_tokens",))
    do_sample: bool = option(False, "sample (default: greedy)", _sampling, ("--do_sample",))
    temperature: float | None = option(None, "sampling temperature (with --do-sample)")
    top_p: float | None = option(None, "nucleus sampling's probability mass (with --do-sample)", aliases=("--top_p",))
    top_k: int | None = option(None, "sample among the k likeliest tokens (with --do-sample)", aliases=("--top_k",))
    seed: int = option(0, "the same on every rank, so sampling agrees")


@dataclass
class GenerateConfig:
    """tools/generate.py's settings."""

    prompt: PromptConfig
    model: EvalModelConfig
    decoding: DecodingConfig
    parallelism: EvalParallelismConfig


# ------------------------------------------------------------------ parsers and the docs' tables
CONFIGS = {  # script -> (its configuration, the page its flag table is on)
    "eval_needle.py": (NeedleConfig, "docs/guides/evaluation.md"),
    "eval_ppl.py": (PerplexityConfig, "docs/guides/evaluation.md"),
    "eval_ruler.py": (RulerConfig, "docs/guides/evaluation.md"),
    "tools/generate.py": (GenerateConfig, "docs/guides/generation.md"),
}


def parser(config_class: type, description: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, sections_of(config_class).values())
    return p


def markers(script: str) -> tuple[str, str]:
    """The comments around a script's flag table in the docs."""
    name = Path(script).stem
    return f"<!-- flags:{name}:begin -->", f"<!-- flags:{name}:end -->"


def table_block(script: str) -> str:
    """A script's flag table between its markers, as the docs hold it."""
    begin, end = markers(script)
    return f"{begin}\n{flag_table(sections_of(CONFIGS[script][0]))}\n{end}"


def write_docs(root: Path) -> None:
    """Each script's block in its page replaced by the table generated now."""
    for script, (_, page) in CONFIGS.items():
        path, (begin, end) = root / page, markers(script)
        head, rest = path.read_text().split(begin, 1)
        path.write_text(head + table_block(script) + rest.split(end, 1)[1])


if __name__ == "__main__":  # python -m recipes.evaluation_config [SCRIPT | --write]: the docs' flag tables
    if sys.argv[1:] == ["--write"]:
        write_docs(Path(__file__).resolve().parents[1])
    else:
        for script in sys.argv[1:] or CONFIGS:
            print(f"{CONFIGS[script][1]}, {script}:\n{table_block(script)}\n")
