"""train.py's configuration: one dataclass per concern (model, data, parallelism, memory,
optimisation, checkpoints, logging), each field with its default, its doc and its check.

`train.py --help` (grouped by section), the docs' flag table (docs/guides/train-py.md) and the
checks all come from these fields (recipes/configuration.py generates the command line). The
steps of a run take the sections, or the fields, they need: `config.data.seq_length`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import ClassVar

from recipes.configuration import (
    ParallelismConfig,
    add_flags,
    at_least,
    needs,
    option,
    optional_at_least,
    parse,
    sections_of,
    writable_folder,
)
from recipes.models.downloads import DOWNLOADS, ModelNotFetched, NoSuchModelFolder, model_source
from recipes.training.sources import DEMO_BASE, SCRATCH_CONFIG, config_path, presets

__all__ = [
    "TrainConfig",
    "ModelConfig",
    "DataConfig",
    "ParallelismConfig",
    "MemoryConfig",
    "OptimisationConfig",
    "CheckpointConfig",
    "LoggingConfig",
    "JOB_DEFAULTS",
    "DEFAULT_RETRIEVAL_FRACTION",
    "parser",
    "parse_config",
]

DEFAULT_RETRIEVAL_FRACTION = 0.5  # the byte-level corpus: half the rows teach retrieval (the demo's numbers)
# Settings that default differently per job: the default job extends the shipped base from 512 to
# 2,048 tokens. Its RoPE base: in single-process probes at 2,048 tokens (the same data and
# steps), needle accuracy plateaued at 0.53-0.56 with 40,000 and 80,000 and reached 0.88 with
# 160,000, which answers 0.41 even before training (40,000: 0.00).
JOB_DEFAULTS = {
    "demo": {"rope_theta": 160000.0, "learning_rate": 3e-4, "max_train_steps": 300},
    "other": {"learning_rate": 1e-3, "max_train_steps": 60},  # --from-scratch, and any --model
}


# ---------------------------------------------------------------------------------- checks
def _model(name, value, args):
    try:
        model_source(value)
    except (ModelNotFetched, NoSuchModelFolder) as error:
        return f"--model {error}"
    return None


def _from_scratch(name, value, args):
    if value and args.model is not None:
        return (
            f"--from-scratch trains configs/tiny-llama from random weights; drop --model {args.model} or --from-scratch"
        )
    return None


def _from_config(name, value, args):
    if value is None:
        return None
    if args.model is not None or args.from_scratch:
        other = f"--model {args.model}" if args.model is not None else "--from-scratch"
        return f"--from-config builds a model with random weights; drop {other} or --from-config"
    path = config_path(value)
    if path is None:
        return f"--from-config {value}: no such config.json, folder or preset (presets: {', '.join(presets())})"
    try:
        json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        return f"--from-config {value}: {path} is not a valid JSON file ({error}); give a model's config.json"
    return None


def _retrieval_fraction(name, value, args):
    if value is not None and (args.dataset is not None or not 0 <= value <= 1):
        return f"--retrieval-fraction applies to the embedded corpus (no --dataset) and must be in [0, 1], got {value}"
    return None


def _learning_rate(name, value, args):
    return f"--learning-rate must be > 0, got {value}" if value <= 0 else None


def _warmup_steps(name, value, args):
    if value is not None and not 0 <= value <= args.max_train_steps:
        return f"--warmup-steps must be between 0 and --max-train-steps ({args.max_train_steps}), got {value}"
    return None


def _compile(name, value, args):
    if value and args.activation_checkpointing:
        return (
            "--compile with --activation-checkpointing is not supported (under compilation the checkpointed "
            "attention would be recomputed, untested); drop one of them"
        )
    return None


def _lora_r(name, value, args):
    if value is None:
        return None
    errors = [f"--lora-r must be >= 1, got {value}"] if value < 1 else []
    if args.from_scratch or args.from_config:
        errors.append(
            "--lora-r needs pretrained weights to adapt (the adapter is saved against them); "
            f"{'--from-scratch' if args.from_scratch else '--from-config'} starts from random ones"
        )
    return "; ".join(errors) or None


def _lora_alpha(name, value, args):
    if value is not None and not value > 0:
        return f"--lora-alpha must be > 0 (the adapters' scale is alpha / r), got {value}"
    return None


def _lora_options(name, value, args):
    if args.lora_r is None and (args.lora_alpha is not None or args.lora_targets is not None):
        return "--lora-alpha and --lora-targets need --lora-r (the adapters' rank)"
    return None


# ---------------------------------------------------------------------------------- sections
@dataclass
class ModelConfig:
    title: ClassVar[str] = "model"
    model: str | None = option(
        None,
        f"hub name, local path, or a downloadable model ({', '.join(DOWNLOADS)}: python -m recipes.models get "
        "NAME); default: the shipped demo base (models/demo-base), extended to --seq-length",
        _model,
    )
    from_scratch: bool = option(
        False,
        "train the tiny Llama of configs/tiny-llama from random weights, with a byte tokenizer, instead",
        _from_scratch,
    )
    from_config: str | None = option(
        None,
        "build the model from a config.json (a file, a folder, or a shipped preset under configs/: llama-3.1-8b, "
        "qwen3-8b, mistral-7b, tiny-llama, ...) with random weights, directly on the device in --param-dtype, and "
        "a byte tokenizer; no weights are read",
        _from_config,
        metavar="PATH|NAME",
    )
    param_dtype: str = option(
        "fp32",
        "the parameters' dtype (fp32: the default; bf16 halves weights, gradients and optimizer state; DeepSpeed "
        "keeps its own fp32 master weights whatever this says)",
        choices=["fp32", "bf16"],
    )
    rope_theta: float | None = option(
        None, "override the model's RoPE base (default: 160000 for the default job, else the model's)"
    )
    lora_r: int | None = option(
        None,
        "train rank-R LoRA adapters (peft) instead of every weight; saves only the adapter (not --from-scratch)",
        _lora_r,
        metavar="R",
    )
    lora_alpha: float | None = option(None, "the adapters' scale is alpha / R (default 2R; with --lora-r)", _lora_alpha)
    lora_targets: str | None = option(
        None,
        "comma-separated linear layers to adapt, e.g. q_proj,v_proj (default: the attention projections)",
        _lora_options,
        metavar="NAMES",
    )


@dataclass
class DataConfig:
    title: ClassVar[str] = "data"
    dataset: str | None = option(
        None,
        "hub name, save_to_disk folder or .jsonl/.parquet/.txt file, with an input_ids column (rows >= "
        "--seq-length + 1 tokens) or a text column (tokenized and packed); default: the embedded corpus (byte "
        "tokenizer: the standard library's sources with needle documents; any other tokenizer: needle documents "
        "over the Python docs, the loss on the answers)",
    )
    text_column: str = option("text", "the text column of a --dataset without input_ids")
    streaming: bool = option(
        False,
        "stream --dataset (read in order; each data-parallel group its own part)",
        needs("--dataset", " (the embedded corpus is built in memory)"),
    )
    retrieval_fraction: float | None = option(
        None,
        "the byte-level embedded corpus only (--from-scratch): share of rows rewritten as needle retrieval "
        f"documents in eval_needle.py's format (default {DEFAULT_RETRIEVAL_FRACTION})",
        _retrieval_fraction,
    )
    seq_length: int = option(2048, "tokens per training sequence", at_least(1))
    batch_size: int = option(1, "sequences per micro-batch per sequence-parallel group", at_least(1))
    max_rows: int | None = option(None, "use at most this many dataset rows", optional_at_least(1))
    document_masking: bool = option(False, "restart positions after each EOS: no token attends across a document")
    balance_documents: str | None = option(
        None,
        "with --document-masking: the same attention work on every rank, results unchanged. cut (the bare flag): "
        "every document cut over the ring (document_split=True); workload: each document whole on one rank or cut "
        "over as few ranks as the balance needs, less traffic (document_split='workload'). ulysses_attn is "
        "balanced already",
        needs("--document-masking", " (it balances documents)"),
        nargs="?",
        const="cut",
        choices=["cut", "workload"],
    )
    data_order: str = option(
        "balanced",
        "with --document-masking over several data-parallel groups: balanced (default) gives the groups of each "
        "step rows of equal attention work (the same rows per epoch, reordered within windows of steps); random: "
        "the epoch's random order as it is",
        choices=["balanced", "random"],
    )
    seed: int = option(42, "the seed of the data order and of random weights")


@dataclass
class MemoryConfig:
    title: ClassVar[str] = "memory"
    activation_checkpointing: bool = option(False, "recompute each decoder layer in the backward")
    offload_checkpoints: bool = option(
        False,
        "keep checkpointed layer inputs in host memory (with --activation-checkpointing)",
        needs("--activation-checkpointing"),
    )
    tiled_mlp: int = option(
        0, "run MLPs over sequence tiles of this many tokens (0: off)", at_least(0), metavar="TOKENS"
    )
    loss_chunk_size: int = option(4096, "tokens per chunk of the output layer + loss", at_least(1))
    compile: bool = option(
        False,
        "torch.compile the decoder after patching (the sequence-parallel attention is one opaque operator)",
        _compile,
    )


@dataclass
class OptimisationConfig:
    title: ClassVar[str] = "optimisation"
    max_train_steps: int | None = option(
        None, "optimizer steps (default: 300 for the default job, else 60)", at_least(1)
    )
    gradient_accumulate_every: int = option(1, "micro-batches per optimizer step", at_least(1))
    learning_rate: float | None = option(None, "default: 3e-4 for the default job, else 1e-3", _learning_rate)
    warmup_steps: int | None = option(
        None, "linear warm-up steps (default: 10% of the steps), then linear decay to 0", _warmup_steps
    )
    weight_decay: float = option(0.0, "AdamW's decoupled weight decay")
    optimizer: str = option(
        "adamw",
        "adamw (default; two states per parameter) or sgd (plain, no state: the memory headline's)",
        choices=["adamw", "sgd"],
    )
    skip_nonfinite_steps: int = option(
        0,
        "skip up to K steps whose loss is inf/NaN, counted over the whole run (resumes included); default 0: stop "
        "at the first, after saving a checkpoint",
        at_least(0),
        metavar="K",
    )


@dataclass
class CheckpointConfig:
    title: ClassVar[str] = "checkpoints"
    output_dir: str = option("outputs/tiny-llama", "where checkpoints, the log and the model go", writable_folder)
    no_save: bool = option(False, "do not save the model at the end (benchmarks of an 8B shape: 16-32 GB each)")
    checkpointing_steps: int = option(0, "save a resumable checkpoint every N steps (0: only at the end)", at_least(0))
    save_total_limit: int | None = option(
        None,
        "keep the current checkpoint and the N-1 newest before it (default: all)",
        optional_at_least(1),
        metavar="N",
    )
    resume_from_checkpoint: str | None = option(
        None,
        "a checkpoint folder; 'latest' in --output-dir; or 'auto': the newest whole one there, else start (the "
        "same command for the first attempt and every restart under torchrun --max-restarts)",
    )


@dataclass
class LoggingConfig:
    title: ClassVar[str] = "logging"
    wandb: str | None = option(None, "log to Weights & Biases (project name)", metavar="PROJECT")
    log_with: str = option(
        "auto", "tracker (auto: tensorboard when installed)", choices=["auto", "none", "tensorboard", "wandb"]
    )


@dataclass
class TrainConfig:
    """A training run's settings, by concern."""

    model: ModelConfig
    data: DataConfig
    parallelism: ParallelismConfig
    memory: MemoryConfig
    optimisation: OptimisationConfig
    checkpoints: CheckpointConfig
    logging: LoggingConfig

    @property
    def job(self) -> str:
        """ "demo" (the shipped base extended) or "other" (--model, --from-config, --from-scratch)."""
        model = self.model
        return "demo" if model.model is None and not model.from_scratch and model.from_config is None else "other"


SECTIONS = sections_of(TrainConfig)


def parser(description: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, SECTIONS.values())
    return p


def _job_defaults(config: TrainConfig) -> None:
    for name, value in JOB_DEFAULTS[config.job].items():
        section = next(s for s in vars(config).values() if hasattr(s, name))
        if getattr(section, name) is None:
            setattr(section, name, value)


def parse_config(argv=None, description: str | None = None) -> TrainConfig:
    """The command line as a TrainConfig, each job's defaults filled in; a failed check exits 2
    with every reason in one line."""
    config = parse(TrainConfig, parser(description), argv, fill=_job_defaults)
    model, optimisation = config.model, config.optimisation
    if config.job == "demo":
        model.model = str(DEMO_BASE)
    model.model = model_source(model.model)  # a downloadable model's name: its folder (checked by _model)
    if model.from_scratch:
        model.from_config = str(SCRATCH_CONFIG)
    if optimisation.warmup_steps is None:
        optimisation.warmup_steps = max(1, optimisation.max_train_steps // 10)
    return config


if __name__ == "__main__":  # python -m recipes.training.config: the docs' flag table (docs/guides/train-py.md)
    from recipes.configuration import flag_table

    print(flag_table(SECTIONS))
