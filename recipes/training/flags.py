"""train.py's flags, declared once, by group: each flag with its argparse settings and its check.

argparse is generated from these declarations (`--help` lists them by group), and the checks
run after parsing, before anything loads: every failed check joins one `train.py: error:` line
(exit 2). Why not transformers' HfArgumentParser: from dataclasses it adds `--seq_length` beside
`--seq-length` and gives each switch an optional value, so the command line would change, and a
flag with an optional value (`--balance-documents [cut|workload]`) has no dataclass form.
"""

from __future__ import annotations

import argparse

from easy_context.mixers import STRATEGIES as MIXER_STRATEGIES
from recipes import fsdp
from recipes.launch import add_dist_timeout_flag, add_parallel_mode_flags, ring_degree_error
from recipes.training.flag_declaration import Group, at_least, flag, needs, optional_at_least
from recipes.training.sources import DEMO_BASE, SCRATCH_CONFIG, config_path, presets

DEFAULT_RETRIEVAL_FRACTION = 0.5  # the byte-level corpus: half the rows teach retrieval (the demo's numbers)
# Flags that default differently per job: the default job extends the shipped base from 512 to
# 2,048 tokens. Its RoPE base: in single-process probes at 2,048 tokens (the same data and
# steps), needle accuracy plateaued at 0.53-0.56 with 40,000 and 80,000 and reached 0.88 with
# 160,000, which answers 0.41 even before training (40,000: 0.00).
JOB_DEFAULTS = {
    "demo": {"rope_theta": 160000.0, "learning_rate": 3e-4, "max_train_steps": 300},
    "other": {"learning_rate": 1e-3, "max_train_steps": 60},  # --from-scratch, and any --model
}


# ---------------------------------------------------------------------------------- checks
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
    if config_path(value) is None:
        return f"--from-config {value}: no such config.json, folder or preset (presets: {', '.join(presets())})"
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


def _lora_options(args):
    if args.lora_r is None and (args.lora_alpha is not None or args.lora_targets is not None):
        return "--lora-alpha and --lora-targets need --lora-r (the adapters' rank)"
    return None


def _fsdp(args):
    return "; ".join(fsdp.flag_errors(args)) or None


# ---------------------------------------------------------------------------------- flags
GROUPS = [
    Group(
        "model",
        [
            flag(
                "--model",
                default=None,
                help="hub name or local path; default: the shipped demo base (models/demo-base), extended to "
                "--seq-length",
            ),
            flag(
                "--from-scratch",
                _from_scratch,
                action="store_true",
                help="train the tiny Llama of configs/tiny-llama from random weights, with a byte tokenizer, instead",
            ),
            flag(
                "--from-config",
                _from_config,
                default=None,
                metavar="PATH|NAME",
                help="build the model from a config.json (a file, a folder, or a shipped preset under configs/: "
                "llama-3.1-8b, qwen3-8b, mistral-7b, tiny-llama, ...) with random weights, directly on the device in "
                "--param-dtype, and a byte tokenizer; no weights are read",
            ),
            flag(
                "--param-dtype",
                choices=["fp32", "bf16"],
                default="fp32",
                help="the parameters' dtype (fp32: the default; bf16 halves weights, gradients and optimizer "
                "state; DeepSpeed keeps its own fp32 master weights whatever this says)",
            ),
            flag(
                "--rope-theta",
                type=float,
                default=None,
                help="override the model's RoPE base (default: 160000 for the default job, else the model's)",
            ),
            flag(
                "--lora-r",
                _lora_r,
                type=int,
                default=None,
                metavar="R",
                help="train rank-R LoRA adapters (peft) instead of every weight; saves only the adapter (not "
                "--from-scratch)",
            ),
            flag(
                "--lora-alpha",
                _lora_alpha,
                type=float,
                default=None,
                help="the adapters' scale is alpha / R (default 2R; with --lora-r)",
            ),
            flag(
                "--lora-targets",
                default=None,
                metavar="NAMES",
                help="comma-separated linear layers to adapt, e.g. q_proj,v_proj (default: the attention projections)",
            ),
        ],
        shared_checks=[_lora_options],
    ),
    Group(
        "data",
        [
            flag(
                "--dataset",
                default=None,
                help="hub name, save_to_disk folder or .jsonl/.parquet/.txt file, with an input_ids column "
                "(rows >= --seq-length + 1 tokens) or a text column (tokenized and packed); default: the embedded "
                "corpus (byte tokenizer: the standard library's sources with needle documents; any other "
                "tokenizer: needle documents over the Python docs, the loss on the answers)",
            ),
            flag("--text-column", default="text", help="the text column of a --dataset without input_ids"),
            flag(
                "--streaming",
                needs("--dataset", " (the embedded corpus is built in memory)"),
                action="store_true",
                help="stream --dataset (read in order; each data-parallel group its own part)",
            ),
            flag(
                "--retrieval-fraction",
                _retrieval_fraction,
                type=float,
                default=None,
                help="the byte-level embedded corpus only (--from-scratch): share of rows rewritten as needle "
                f"retrieval documents in eval_needle.py's format (default {DEFAULT_RETRIEVAL_FRACTION})",
            ),
            flag("--seq-length", at_least(1), type=int, default=2048, help="tokens per training sequence"),
            flag(
                "--batch-size",
                at_least(1),
                type=int,
                default=1,
                help="sequences per micro-batch per sequence-parallel group",
            ),
            flag("--max-rows", optional_at_least(1), type=int, default=None, help="use at most this many dataset rows"),
            flag(
                "--document-masking",
                action="store_true",
                help="restart positions after each EOS: no token attends across a document",
            ),
            flag(
                "--balance-documents",
                needs("--document-masking", " (it balances documents)"),
                nargs="?",
                const="cut",
                choices=["cut", "workload"],
                help="with --document-masking: the same attention work on every rank, results unchanged. cut (the "
                "bare flag): every document cut over the ring (document_split=True); workload: documents whole on "
                "one rank each, only the longest cut, less traffic (document_split='workload'). "
                "ulysses_attn is balanced already",
            ),
            flag(
                "--data-order",
                choices=["balanced", "random"],
                default="balanced",
                help="with --document-masking over several data-parallel groups: balanced (default) gives the "
                "groups of each step rows of equal attention work (the same rows per epoch, reordered within "
                "windows of steps); random: the epoch's random order as it is",
            ),
            flag("--seed", type=int, default=42),
        ],
    ),
    Group(
        "parallelism",
        [
            flag(
                "--sp-size",
                type=int,
                default=None,
                help="ranks sharing one sequence (default: all); world = dp x sp",
            ),
            flag(
                "--mixer-strategy",
                default="auto",
                choices=["auto", *MIXER_STRATEGIES],
                help="hybrid models' recurrent layers: state passing, head exchange, or auto (head exchange where "
                "the heads split over the sequence-parallel group)",
            ),
            flag(
                "--fsdp",
                action="store_true",
                help="shard weights, gradients and optimizer state over every rank with PyTorch FSDP2 (fully_shard "
                "per decoder layer, then the root); launch with torchrun",
            ),
            flag("--fsdp-offload", action="store_true", help="with --fsdp: keep the sharded state in host memory"),
        ],
        shared=[add_parallel_mode_flags, add_dist_timeout_flag],
        shared_checks=[ring_degree_error, _fsdp],
    ),
    Group(
        "memory",
        [
            flag(
                "--activation-checkpointing",
                action="store_true",
                help="recompute each decoder layer in the backward",
            ),
            flag(
                "--offload-checkpoints",
                needs("--activation-checkpointing"),
                action="store_true",
                help="keep checkpointed layer inputs in host memory (with --activation-checkpointing)",
            ),
            flag(
                "--tiled-mlp",
                at_least(0),
                type=int,
                default=0,
                metavar="TOKENS",
                help="run MLPs over sequence tiles of this many tokens (0: off)",
            ),
            flag(
                "--loss-chunk-size",
                at_least(1),
                type=int,
                default=4096,
                help="tokens per chunk of the output layer + loss",
            ),
            flag(
                "--compile",
                _compile,
                action="store_true",
                help="torch.compile the decoder after patching (the sequence-parallel attention is one opaque "
                "operator)",
            ),
        ],
    ),
    Group(
        "optimisation",
        [
            flag(
                "--max-train-steps",
                at_least(1),
                type=int,
                default=None,
                help="optimizer steps (default: 300 for the default job, else 60)",
            ),
            flag("--gradient-accumulate-every", at_least(1), type=int, default=1),
            flag(
                "--learning-rate",
                _learning_rate,
                type=float,
                default=None,
                help="default: 3e-4 for the default job, else 1e-3",
            ),
            flag(
                "--warmup-steps",
                _warmup_steps,
                type=int,
                default=None,
                help="linear warm-up steps (default: 10%% of the steps), then linear decay to 0",
            ),
            flag("--weight-decay", type=float, default=0.0),
            flag(
                "--optimizer",
                choices=["adamw", "sgd"],
                default="adamw",
                help="adamw (default; two states per parameter) or sgd (plain, no state: the memory headline's)",
            ),
            flag(
                "--skip-nonfinite-steps",
                at_least(0),
                type=int,
                default=0,
                metavar="K",
                help="skip up to K steps whose loss is inf/NaN, counted over the whole run (resumes included); "
                "default 0: stop at the first, after saving a checkpoint",
            ),
        ],
    ),
    Group(
        "checkpoints",
        [
            flag("--output-dir", default="outputs/tiny-llama"),
            flag(
                "--no-save",
                action="store_true",
                help="do not save the model at the end (benchmarks of an 8B shape: 16-32 GB each)",
            ),
            flag(
                "--checkpointing-steps",
                at_least(0),
                type=int,
                default=0,
                help="save a resumable checkpoint every N steps (0: only at the end)",
            ),
            flag(
                "--save-total-limit",
                optional_at_least(1),
                type=int,
                default=None,
                metavar="N",
                help="keep the current checkpoint and the N-1 newest before it (default: all)",
            ),
            flag(
                "--resume-from-checkpoint",
                default=None,
                help="a checkpoint folder; 'latest' in --output-dir; or 'auto': the newest whole one there, else "
                "start (the same command for the first attempt and every restart under torchrun --max-restarts)",
            ),
        ],
    ),
    Group(
        "logging",
        [
            flag("--wandb", default=None, metavar="PROJECT", help="log to Weights & Biases (project name)"),
            flag(
                "--log-with",
                default="auto",
                choices=["auto", "none", "tensorboard", "wandb"],
                help="tracker (auto: tensorboard when installed)",
            ),
        ],
    ),
]


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    for group in GROUPS:
        arguments = p.add_argument_group(group.title)
        for declared in group.flags:
            arguments.add_argument(declared.name, **declared.options)
        for add in group.shared:
            add(arguments)
    return p


def parse_args(argv=None, description: str | None = None) -> argparse.Namespace:
    """The flags, with each job's defaults filled in; a failed check exits 2 with every reason."""
    p = parser(description)
    args = p.parse_args(argv)
    job = "demo" if args.model is None and not args.from_scratch and args.from_config is None else "other"
    for name, value in JOB_DEFAULTS[job].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    errors = []
    for group in GROUPS:
        for declared in group.flags:
            if declared.check and (error := declared.check(declared.name, getattr(args, declared.dest), args)):
                errors.append(error)
        errors += [error for check in group.shared_checks if (error := check(args))]
    if errors:
        p.error("; ".join(errors))
    if job == "demo":
        args.model = str(DEMO_BASE)
    if args.from_scratch:
        args.from_config = str(SCRATCH_CONFIG)
    if args.warmup_steps is None:
        args.warmup_steps = max(1, args.max_train_steps // 10)
    return args
