"""Train a Hugging Face causal LM on long sequences with sequence parallelism.

    # CPU, 2 processes, zigzag ring attention, the default job: the shipped demo base
    # (models/demo-base, a tiny Llama that retrieves needles at 512 tokens) extended to
    # 2,048 tokens with its RoPE base raised, on needle documents with the loss on the answers
    torchrun --standalone --nproc_per_node 2 train.py

    # The from-scratch job: a random tiny Llama on the Python standard library's sources
    # (byte tokenizer, half the rows needle retrieval documents); about a minute, loss falls
    torchrun --standalone --nproc_per_node 2 train.py --from-scratch

    # A text dataset (tokenized once into datasets' cache, packed, read lazily), or a stream
    torchrun --standalone --nproc_per_node 2 train.py --model PATH --dataset corpus.jsonl --text-column text

    # GPUs, DeepSpeed ZeRO-3 with CPU offload (see accelerate_configs/ and scripts/)
    accelerate launch --config_file accelerate_configs/single_node.yaml train.py \
        --model meta-llama/Llama-2-7b-hf --dataset PATH --seq-length 65536 --parallel_mode zigzag_ring_attn

Read top to bottom: arguments -> accelerator -> model -> data -> optimizer/schedule ->
resume -> loop (shard, chunked loss, backward, step, log, checkpoint) -> save_pretrained.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

import easy_context as ec
from easy_context.core.work_order import balanced_epoch_order
from easy_context.hf.accelerate_parallelism import check_accelerate_parallelism
from easy_context.hf.architectures import check_training_config
from easy_context.hf.context import placement_of
from easy_context.mixers import STRATEGIES as MIXER_STRATEGIES
from easy_context.modes import get_mode
from easy_context.programs import fsdp
from easy_context.programs.checkpointing import CheckpointError, Checkpoints
from easy_context.programs.data import (
    BYTE_EOS_ID,
    StreamedRows,
    byte_tokenizer,
    document_positions,
    open_rows,
    stdlib_token_stream,
    windows,
    with_retrieval_rows,
)
from easy_context.programs.demo_data import NeedleAnswerRows
from easy_context.programs.launch import (
    EXIT_BAD_INPUT,
    EXIT_NONFINITE_LOSS,
    Stage,
    add_dist_timeout_flag,
    add_parallel_mode_flags,
    injected_fault,
    ring_degree_error,
    run_job,
    run_main,
)
from easy_context.programs.launch import fail as launch_fail
from easy_context.programs.lora import adapter_base, add_lora
from easy_context.programs.loss import CausalLMLoss, global_token_mean
from easy_context.programs.models import check_config, load_config, load_pretrained
from easy_context.programs.tiled_mlp import tile_mlps
from easy_context.versions import enable_activation_checkpointing

ROOT = Path(__file__).parent
DEMO_BASE = ROOT / "models" / "demo-base"  # scripts/pretrain_demo_base.py's model, shipped
SCRATCH_CONFIG = ROOT / "configs" / "tiny-llama"  # --from-scratch: random weights, byte tokenizer
DEFAULT_RETRIEVAL_FRACTION = 0.5  # the byte-level corpus: half the rows teach retrieval (README numbers)
# Flags that default differently per job (README numbers): the default job extends the shipped
# base from 512 to 2,048 tokens. Its RoPE base: in single-process probes at 2,048 tokens (the
# same data and steps), needle accuracy plateaued at 0.53-0.56 with 40,000 and 80,000 and
# reached 0.88 with 160,000, which answers 0.41 even before training (40,000: 0.00).
JOB_DEFAULTS = {
    "demo": {"rope_theta": 160000.0, "learning_rate": 3e-4, "max_train_steps": 300},
    "other": {"learning_rate": 1e-3, "max_train_steps": 60},  # --from-scratch, and any --model
}


# ----------------------------------------------------------------------------- arguments
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default=None,
        help="hub name or local path; default: the shipped demo base (models/demo-base), extended to --seq-length",
    )
    p.add_argument(
        "--from-scratch",
        action="store_true",
        help="train the tiny Llama of configs/tiny-llama from random weights, with a byte tokenizer, instead",
    )
    p.add_argument(
        "--dataset",
        default=None,
        help="hub name, save_to_disk folder or .jsonl/.parquet/.txt file, with an input_ids column "
        "(rows >= --seq-length + 1 tokens) or a text column (tokenized and packed); default: the embedded "
        "corpus (byte tokenizer: the standard library's sources with needle documents; any other tokenizer: "
        "needle documents over the Python docs, the loss on the answers)",
    )
    p.add_argument("--text-column", default="text", help="the text column of a --dataset without input_ids")
    p.add_argument(
        "--streaming",
        action="store_true",
        help="stream --dataset (read in order; each data-parallel group its own part)",
    )
    p.add_argument(
        "--retrieval-fraction",
        type=float,
        default=None,
        help=f"the byte-level embedded corpus only (--from-scratch): share of rows rewritten as needle "
        f"retrieval documents in eval_needle.py's format (default {DEFAULT_RETRIEVAL_FRACTION})",
    )
    p.add_argument("--seq-length", type=int, default=2048, help="tokens per training sequence")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per micro-batch per sequence-parallel group")
    p.add_argument("--gradient-accumulate-every", type=int, default=1)
    p.add_argument(
        "--max-train-steps",
        type=int,
        default=None,
        help="optimizer steps (default: 300 for the default job, else 60)",
    )
    p.add_argument("--learning-rate", type=float, default=None, help="default: 3e-4 for the default job, else 1e-3")
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="linear warm-up steps (default: 10%% of the steps), then linear decay to 0",
    )
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument(
        "--rope-theta",
        type=float,
        default=None,
        help="override the model's RoPE base (default: 160000 for the default job, else the model's)",
    )
    add_parallel_mode_flags(p)
    p.add_argument(
        "--sp-size", type=int, default=None, help="ranks sharing one sequence (default: all); world = dp x sp"
    )
    p.add_argument(
        "--mixer-strategy",
        default="auto",
        choices=["auto", *MIXER_STRATEGIES],
        help="hybrid models' recurrent layers: state passing, head exchange, or auto (head exchange where the "
        "heads split over the sequence-parallel group)",
    )
    p.add_argument(
        "--activation-checkpointing", action="store_true", help="recompute each decoder layer in the backward"
    )
    p.add_argument(
        "--offload-checkpoints",
        action="store_true",
        help="keep checkpointed layer inputs in host memory (with --activation-checkpointing)",
    )
    p.add_argument(
        "--tiled-mlp",
        type=int,
        default=0,
        metavar="TOKENS",
        help="run MLPs over sequence tiles of this many tokens (0: off)",
    )
    p.add_argument(
        "--lora-r",
        type=int,
        default=None,
        metavar="R",
        help="train rank-R LoRA adapters (peft) instead of every weight; saves only the adapter (not --from-scratch)",
    )
    p.add_argument(
        "--lora-alpha", type=float, default=None, help="the adapters' scale is alpha / R (default 2R; with --lora-r)"
    )
    p.add_argument(
        "--lora-targets",
        default=None,
        metavar="NAMES",
        help="comma-separated linear layers to adapt, e.g. q_proj,v_proj (default: the attention projections)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the decoder after patching (the sequence-parallel attention is one opaque operator)",
    )
    p.add_argument(
        "--document-masking",
        action="store_true",
        help="restart positions after each EOS: no token attends across a document",
    )
    p.add_argument(
        "--balance-documents",
        nargs="?",
        const="cut",
        choices=["cut", "workload"],
        help="with --document-masking: the same attention work on every rank, results unchanged. cut (the "
        "bare flag): every document cut over the ring (document_split=True); workload: documents whole on "
        "one rank each, only the longest cut, less traffic (document_split='workload'). "
        "ulysses_attn is balanced already",
    )
    p.add_argument(
        "--data-order",
        choices=["balanced", "random"],
        default="balanced",
        help="with --document-masking over several data-parallel groups: balanced (default) gives the groups "
        "of each step rows of equal attention work (the same rows per epoch, reordered within windows of "
        "steps); random: the epoch's random order as it is",
    )
    p.add_argument("--loss-chunk-size", type=int, default=4096, help="tokens per chunk of the output layer + loss")
    p.add_argument("--output-dir", default="outputs/tiny-llama")
    p.add_argument(
        "--checkpointing-steps",
        type=int,
        default=0,
        help="save a resumable checkpoint every N steps (0: only at the end)",
    )
    p.add_argument(
        "--save-total-limit",
        type=int,
        default=None,
        metavar="N",
        help="keep the current checkpoint and the N-1 newest before it (default: all)",
    )
    p.add_argument(
        "--skip-nonfinite-steps",
        type=int,
        default=0,
        metavar="K",
        help="skip up to K steps whose loss is inf/NaN, counted over the whole run (resumes included); "
        "default 0: stop at the first, after saving a checkpoint",
    )
    p.add_argument(
        "--resume-from-checkpoint",
        default=None,
        help="a checkpoint folder; 'latest' in --output-dir; or 'auto': the newest whole one there, else start "
        "(the same command for the first attempt and every restart under torchrun --max-restarts)",
    )
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--wandb", default=None, metavar="PROJECT", help="log to Weights & Biases (project name)")
    p.add_argument(
        "--log-with",
        default="auto",
        choices=["auto", "none", "tensorboard", "wandb"],
        help="tracker (auto: tensorboard when installed)",
    )
    p.add_argument("--max-rows", type=int, default=None, help="use at most this many dataset rows")
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="shard weights, gradients and optimizer state over every rank with PyTorch FSDP2 (fully_shard per "
        "decoder layer, then the root); launch with torchrun",
    )
    p.add_argument("--fsdp-offload", action="store_true", help="with --fsdp: keep the sharded state in host memory")
    add_dist_timeout_flag(p)
    args = p.parse_args(argv)
    job = "demo" if args.model is None and not args.from_scratch else "other"
    for name, value in JOB_DEFAULTS[job].items():
        if getattr(args, name) is None:
            setattr(args, name, value)

    errors = []
    if args.from_scratch and args.model is not None:
        errors.append(
            f"--from-scratch trains configs/tiny-llama from random weights; drop --model {args.model} or --from-scratch"
        )
    for name in ("seq_length", "batch_size", "gradient_accumulate_every", "max_train_steps", "loss_chunk_size"):
        if getattr(args, name) < 1:
            errors.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.learning_rate <= 0:
        errors.append(f"--learning-rate must be > 0, got {args.learning_rate}")
    if args.balance_documents and not args.document_masking:
        errors.append("--balance-documents needs --document-masking (it balances documents)")
    if args.offload_checkpoints and not args.activation_checkpointing:
        errors.append("--offload-checkpoints needs --activation-checkpointing")
    if args.warmup_steps is not None and not 0 <= args.warmup_steps <= args.max_train_steps:
        errors.append(
            f"--warmup-steps must be between 0 and --max-train-steps ({args.max_train_steps}), got {args.warmup_steps}"
        )
    if args.checkpointing_steps < 0:
        errors.append(f"--checkpointing-steps must be >= 0, got {args.checkpointing_steps}")
    if args.max_rows is not None and args.max_rows < 1:
        errors.append(f"--max-rows must be >= 1, got {args.max_rows}")
    if args.save_total_limit is not None and args.save_total_limit < 1:
        errors.append(f"--save-total-limit must be >= 1, got {args.save_total_limit}")
    if args.skip_nonfinite_steps < 0:
        errors.append(f"--skip-nonfinite-steps must be >= 0, got {args.skip_nonfinite_steps}")
    if args.compile and args.activation_checkpointing:
        errors.append(
            "--compile with --activation-checkpointing is not supported (under compilation the checkpointed "
            "attention would be recomputed, untested); drop one of them"
        )
    if args.tiled_mlp < 0:
        errors.append(f"--tiled-mlp must be >= 0, got {args.tiled_mlp}")
    errors += fsdp.flag_errors(args)
    if args.lora_r is not None and args.lora_r < 1:
        errors.append(f"--lora-r must be >= 1, got {args.lora_r}")
    if args.lora_alpha is not None and not args.lora_alpha > 0:
        errors.append(f"--lora-alpha must be > 0 (the adapters' scale is alpha / r), got {args.lora_alpha}")
    if args.lora_r is None and (args.lora_alpha is not None or args.lora_targets is not None):
        errors.append("--lora-alpha and --lora-targets need --lora-r (the adapters' rank)")
    if args.lora_r is not None and args.from_scratch:
        errors.append(
            "--lora-r needs pretrained weights to adapt (the adapter is saved against them); --from-scratch "
            "starts from random ones"
        )
    if ring_error := ring_degree_error(args):
        errors.append(ring_error)
    if args.streaming and args.dataset is None:
        errors.append("--streaming needs --dataset (the embedded corpus is built in memory)")
    if args.retrieval_fraction is not None and (args.dataset is not None or not 0 <= args.retrieval_fraction <= 1):
        errors.append(
            "--retrieval-fraction applies to the embedded corpus (no --dataset) and must be in [0, 1], "
            f"got {args.retrieval_fraction}"
        )
    if errors:
        p.error("; ".join(errors))
    if job == "demo":
        args.model = str(DEMO_BASE)
    if args.warmup_steps is None:
        args.warmup_steps = max(1, args.max_train_steps // 10)
    return args


def fail(message: str, code: int = EXIT_BAD_INPUT):
    launch_fail("train.py", message, code)


# --------------------------------------------------------------------------------- main
# train() is the outline; the functions after it are its steps, in the order it calls them.
def main(argv=None):
    args = parse_args(argv)
    tracker = "wandb" if args.wandb else args.log_with
    if tracker == "auto":
        import importlib.util

        tracker = (
            "tensorboard"
            if importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX")
            else "none"
        )
    return run_job(
        "train.py",
        lambda args, accelerator, stage: train(args, accelerator, tracker, stage),
        args,
        gradient_accumulation_steps=args.gradient_accumulate_every,
        log_with=None if tracker == "none" else tracker,
        project_dir=args.output_dir,
        # accelerate would step the schedule once per process (it assumes a sharded loader)
        step_scheduler_with_optimizer=False,
    )


def train(args, accelerator, tracker: str, stage: Stage) -> float:
    run = set_up_run(args, accelerator, stage)
    trainable, tokenizer = build_model(run)
    batches = build_data(run, tokenizer, trainable.config.vocab_size)
    optimizer, scheduler = build_optimizer(run, trainable)
    # DDP (MULTI_CPU / MULTI_GPU), DeepSpeed or --fsdp: gradients are averaged over every rank.
    stage.at("preparing the model (DDP / DeepSpeed)")
    if args.fsdp:  # sharded already: accelerate would wrap it in DDP
        optimizer, scheduler = fsdp.prepare(accelerator, trainable, optimizer, scheduler)
    else:
        trainable, optimizer, scheduler = accelerator.prepare(trainable, optimizer, scheduler)
    checkpoints = Checkpoints(accelerator, args)
    step, skipped, resumed = resume_run(run, checkpoints)
    log = TrainingLog(run, tracker, step, resumed)

    trainable.train()
    loss = float("nan")  # the last finite step's
    while step < args.max_train_steps:
        started = time.perf_counter()
        step_loss, nonfinite = optimizer_step(run, trainable, optimizer, scheduler, batches, step)
        if nonfinite is not None:
            skipped += 1
            if skipped > args.skip_nonfinite_steps:
                stop_on_nonfinite_loss(run, checkpoints, step, skipped - 1, *nonfinite)
            accelerator.print(
                f"step {step + 1}: non-finite loss {nonfinite[0]}, step skipped "
                f"({skipped} of --skip-nonfinite-steps {args.skip_nonfinite_steps})"
            )
        step += 1
        elapsed = time.perf_counter() - started
        if step_loss is not None:
            loss = step_loss
        log.step(step, step_loss, scheduler.get_last_lr()[0], elapsed)
        if args.checkpointing_steps and step % args.checkpointing_steps == 0 and step < args.max_train_steps:
            stage.at("checkpoint save", step)
            checkpoints.save(step, skipped)
    log.close()

    write_summary(run, step, loss, skipped)
    save_model(run, trainable, tokenizer, loss)
    ec.remove_seq_parallel_monkey_patch()
    return loss


# ------------------------------------------------------------------------------ the run
class Run:
    """What the steps of a run share: its flags, the accelerator, where this rank sits."""

    def __init__(self, args: argparse.Namespace, accelerator, stage: Stage, topology, deepspeed, document_split):
        self.args, self.accelerator, self.stage = args, accelerator, stage
        self.topology = topology  # easy_context.core.groups.Topology
        self.deepspeed = deepspeed  # accelerate's DeepSpeed plugin, None without DeepSpeed
        self.document_split = document_split  # None, True or "workload" (--balance-documents)

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def dp_rank(self) -> int:
        return self.topology.dp_rank(self.rank)

    @property
    def dp_size(self) -> int:
        return self.topology.dp_size


def set_up_run(args, accelerator, stage: Stage) -> Run:
    """The seed, and the parallel layout of this many processes; what cannot run is refused."""
    from accelerate.utils import set_seed

    world = accelerator.num_processes
    set_seed(args.seed)
    mode = get_mode(args.parallel_mode)
    try:
        topology = mode.topology(world, args.sp_size, args.ring_degree)
        mode.layout(topology).check_length(args.seq_length)
    except ValueError as error:
        fail(f"{error} (--parallel_mode {args.parallel_mode}, {world} processes, --seq-length {args.seq_length})")
    if mode.sequence_parallel:
        try:
            check_accelerate_parallelism(accelerator, args.parallel_mode)
        except ValueError as error:
            fail(str(error))
    deepspeed = accelerator.state.deepspeed_plugin
    if deepspeed is not None and args.skip_nonfinite_steps:
        # accelerate's DeepSpeed wrapper steps the engine inside backward at the accumulation
        # boundary, and the engine's gradients cannot be zeroed from here: a step cannot be
        # dropped once some of its micro-batches went backward. (Stopping needs neither.)
        fail(
            "--skip-nonfinite-steps is not supported under DeepSpeed; without it, training stops at a non-finite loss "
            "after saving a checkpoint of the last good step"
        )
    if deepspeed is not None and args.compile:
        fail("--compile is not supported under DeepSpeed (its engine wraps the model); drop --compile")
    if refusal := fsdp.refusal(args, accelerator):
        fail(refusal)
    # --balance-documents: a layout per row (document_split); Ulysses alone is balanced already.
    split = {None: None, "cut": True, "workload": "workload"}[args.balance_documents] if mode.document_split else None
    return Run(args, accelerator, stage, topology, deepspeed, split)


# ---------------------------------------------------------------------------- the model
def build_model(run: Run):
    """(the model with its loss, patched for sequence parallelism; the tokenizer)."""
    args, accelerator = run.args, run.accelerator
    run.stage.at("loading the model")
    # bf16 weights only where DeepSpeed keeps fp32 master weights; otherwise fp32 weights
    # (with --mixed_precision bf16, accelerate autocasts the compute).
    deepspeed_bf16 = run.deepspeed is not None and accelerator.mixed_precision == "bf16"
    model, tokenizer = load_model(args, torch.bfloat16 if deepspeed_bf16 else torch.float32, accelerator.device)
    if args.offload_checkpoints and accelerator.device.type == "cpu":
        accelerator.print(
            "--offload-checkpoints: the device is the CPU, so checkpointed layer inputs already live in host "
            "memory; nothing to offload"
        )
    try:
        # the split for this model's heads on these nodes: what the patch's context derives too
        run.topology = get_mode(args.parallel_mode).topology(
            run.world, args.sp_size, args.ring_degree, placement_of(model, run.world)
        )
        get_mode(args.parallel_mode).layout(run.topology).check_length(args.seq_length)
        check_config(model.config, run.topology, args.seq_length, args.parallel_mode)
        check_training_config(model.config)
    except ValueError as error:
        fail(str(error))
    if args.document_masking and tokenizer.eos_token_id is None:
        fail("--document-masking needs a tokenizer with an EOS token (documents are separated by EOS)")
    if args.lora_r is not None:
        targets = args.lora_targets.split(",") if args.lora_targets else None
        try:
            model = add_lora(model, args.lora_r, args.lora_alpha, targets)
        except (ValueError, ImportError) as error:
            fail(f"--lora-r {args.lora_r}: {error}")
    ec.apply_seq_parallel_monkey_patch(
        args.parallel_mode,
        model,
        sp_size=args.sp_size,
        ring_degree=args.ring_degree,
        document_split=run.document_split or None,
        mixer_strategy=args.mixer_strategy,
    )
    trainable = CausalLMLoss(model, args.loss_chunk_size)
    if args.fsdp:
        run.stage.at("sharding the model (FSDP2)")
        fsdp.shard_model(
            trainable, model.get_decoder().layers, accelerator.device, accelerator.mixed_precision, args.fsdp_offload
        )
    if args.compile:
        # In place: parameter names, and so checkpoints, stay those of the eager model. The
        # decoder is what the loss calls; the output layer runs in chunks under checkpointing.
        model.get_decoder().compile()
    return trainable, tokenizer


def load_model(args, dtype, device):
    from transformers import AutoModelForCausalLM

    try:
        if args.from_scratch:  # random weights, byte tokenizer
            config = load_config(str(SCRATCH_CONFIG), args.rope_theta)
            torch.manual_seed(args.seed)
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(dtype)
            tokenizer = byte_tokenizer()
        elif adapter_base(args.model) is not None:
            fail(
                f"--model {args.model} holds a LoRA adapter, not a model: pass its base "
                f"({adapter_base(args.model)}) as --model (with --lora-r to train a new adapter)"
            )
        else:
            model, tokenizer = load_pretrained(args.model, args.rope_theta, dtype)
    except (ValueError, OSError) as error:
        fail(f"--model {args.model or SCRATCH_CONFIG}: {error}")
    if args.activation_checkpointing:
        # On a CPU device the checkpointed inputs already live in host memory, and transformers'
        # offload pins its copies, which needs an accelerator: there the flag changes nothing.
        try:
            enable_activation_checkpointing(model, offload=args.offload_checkpoints and device.type != "cpu")
        except ValueError as error:
            fail(f"--offload-checkpoints: {error}")
    if args.tiled_mlp:
        tile_mlps(model, args.tiled_mlp)
    return model, tokenizer


# ----------------------------------------------------------------------------- the data
def build_data(run: Run, tokenizer, vocab_size: int) -> ShardedBatches:
    args, accelerator = run.args, run.accelerator
    micro_batches = args.max_train_steps * args.gradient_accumulate_every
    # The main process first: it downloads and tokenizes into datasets' cache, the others then
    # read the cache. They wait in a collective, so a first tokenization longer than
    # --dist-timeout stops them; the phase name says so.
    run.stage.at("loading the data (the main process tokenizes --dataset first; the others wait up to --dist-timeout)")
    with accelerator.main_process_first():
        rows = load_rows(args, micro_batches * args.batch_size * run.dp_size, tokenizer, run.dp_rank, run.dp_size)
    if not isinstance(rows, StreamedRows) and len(rows) < args.batch_size * run.dp_size:
        fail(
            f"{len(rows)} rows of {args.seq_length + 1} tokens are fewer than one step needs "
            f"({args.batch_size * run.dp_size})"
        )
    # The order this run reads in, as checkpoints record it (RESUME_KEYS): by work only where
    # that applies (document masking, several DP groups, rows that know their documents).
    if not (args.document_masking and run.dp_size > 1 and hasattr(rows, "row_products")):
        args.data_order = "random"
    return ShardedBatches(run, rows, tokenizer.eos_token_id, vocab_size)


def load_rows(args, rows_needed: int, tokenizer, dp_rank: int, dp_size: int):
    """Rows of seq_length + 1 tokens (inputs and their next-token targets): for the embedded
    corpus, a tensor (byte tokenizer) or NeedleAnswerRows, whose rows come with labels (any other
    tokenizer); for --dataset, rows read lazily from its Arrow storage (or its stream)."""
    length = args.seq_length + 1
    if args.dataset is None and len(tokenizer) == BYTE_EOS_ID + 1 and tokenizer.eos_token_id == BYTE_EOS_ID:
        stream = stdlib_token_stream(max_tokens=rows_needed * length)
        rows = windows(stream, length, args.max_rows)
        if len(rows) == 0:
            fail(f"the embedded corpus is shorter than one sequence of {length} tokens")
        fraction = DEFAULT_RETRIEVAL_FRACTION if args.retrieval_fraction is None else args.retrieval_fraction
        return with_retrieval_rows(rows, fraction, args.seed)
    if args.dataset is None:
        if args.retrieval_fraction is not None:
            fail(
                f"--retrieval-fraction {args.retrieval_fraction}: the embedded corpus of a model with its own "
                "tokenizer is all needle documents; the fraction applies to the byte-level corpus (--from-scratch)"
            )
        if tokenizer.eos_token_id is None:
            fail(f"--model {args.model}: the embedded needle corpus separates documents by EOS; the tokenizer has none")
        count = rows_needed if args.max_rows is None else min(rows_needed, args.max_rows)
        return NeedleAnswerRows(tokenizer, length, count, args.seed)
    try:
        return open_rows(
            args.dataset,
            length,
            tokenizer,
            text_column=args.text_column,
            max_rows=args.max_rows,
            streaming=args.streaming,
            dp_rank=dp_rank,
            dp_size=dp_size,
        )
    except (ValueError, OSError) as error:
        fail(f"--dataset {args.dataset}: {error}")


@functools.lru_cache(maxsize=2)  # one permutation per epoch, not one per micro-batch (10M rows: 80 MB)
def epoch_order(rows: int, seed: int) -> torch.Tensor:
    return torch.randperm(rows, generator=torch.Generator().manual_seed(seed))


@functools.lru_cache(maxsize=2)
def balanced_order(rows, seed: int, dp_size: int, batch_size: int) -> torch.Tensor:
    """The epoch's order with equal attention work per DP group in each step (core/work_order.py),
    from the rows' document lengths (rows: PackedRows, hashed by identity)."""
    return balanced_epoch_order(epoch_order(len(rows), seed), rows.row_products(), dp_size, batch_size, seed)


def micro_batch(rows, index: int, batch_size: int, dp_rank: int, dp_size: int, seed: int, balanced=False):
    """Micro-batch `index` of data-parallel group `dp_rank`: a pure function of its arguments,
    so a resumed run reads exactly what the uninterrupted run would have read. `balanced`: the
    epoch's order gives the DP groups of a step rows of equal attention work (rows that know
    their documents: PackedRows)."""
    if isinstance(rows, StreamedRows):  # in stream order; each DP group streams its own part
        return rows.read(index * batch_size, batch_size)
    per_epoch = len(rows) // (batch_size * dp_size)
    epoch, within = divmod(index, per_epoch)
    if balanced:
        order = balanced_order(rows, seed + epoch, dp_size, batch_size)
    else:
        order = epoch_order(len(rows), seed + epoch)
    start = (within * dp_size + dp_rank) * batch_size
    return rows[order[start : start + batch_size]]


class ShardedBatches:
    """The run's micro-batches, each cut into this rank's part of the sequence."""

    def __init__(self, run: Run, rows, eos_id: int | None, vocab_size: int):
        self.run, self.rows, self.eos_id, self.vocab_size = run, rows, eos_id, vocab_size

    def shard(self, index: int, step: int):
        """Micro-batch `index` (of step `step`) on this rank: (input_ids, position_ids,
        target_ids, the model's extra attention arguments)."""
        run, args = self.run, self.run.args
        balanced = args.data_order == "balanced"
        batch = micro_batch(self.rows, index, args.batch_size, run.dp_rank, run.dp_size, args.seed, balanced)
        batch, labels = batch if isinstance(batch, tuple) else (batch, batch)  # labels: -100 where not trained
        if batch.min() < 0 or batch.max() >= self.vocab_size:  # else an IndexError (CPU) or a device assert (CUDA)
            bad = batch.min().item() if batch.min() < 0 else batch.max().item()
            fail(
                f"step {step}: the data holds token id {bad}, "
                f"outside the model's vocabulary (0..{self.vocab_size - 1}); "
                "was --dataset tokenized with another tokenizer?"
            )
        positions = document_positions(batch[:, :-1], self.eos_id) if args.document_masking else None
        local = ec.prepare_seq_parallel_inputs(
            args.parallel_mode, batch[:, :-1], positions, labels[:, 1:], run.rank, run.world, run.accelerator.device
        )
        extra = {"seq_parallel_index": local["local_token_index"]} if run.document_split else {}
        return local["local_input_ids"], local["local_position_ids"], local["local_target_ids"], extra


# ------------------------------------------------------------------ optimizer, schedule
def build_optimizer(run: Run, trainable):
    args, deepspeed = run.args, run.deepspeed
    ds_config = deepspeed.deepspeed_config if deepspeed is not None else {}
    if deepspeed is not None:
        ds_config["train_micro_batch_size_per_gpu"] = args.batch_size
    params = [p for p in trainable.parameters() if p.requires_grad]
    if "optimizer" in ds_config:  # the DeepSpeed json builds it; "auto" values come from our flags
        from accelerate.utils import DummyOptim  # exported only when deepspeed is installed

        optimizer = DummyOptim(params, lr=args.learning_rate, weight_decay=args.weight_decay)
    else:
        optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay)
    if "scheduler" in ds_config:
        from accelerate.utils import DummyScheduler

        # accelerate divides total_num_steps by the process count (it assumes every process
        # reads its own batches); our step count is global, so undo that.
        scheduler = DummyScheduler(
            optimizer, total_num_steps=args.max_train_steps * run.world, warmup_num_steps=args.warmup_steps
        )
    else:
        from transformers import get_linear_schedule_with_warmup

        scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, args.max_train_steps)
    return optimizer, scheduler


# ------------------------------------------------------------------------------- resume
def resume_run(run: Run, checkpoints: Checkpoints) -> tuple[int, int, bool]:
    """(step, skipped steps, resumed): where --resume-from-checkpoint left off, or the start."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # torchrun's restarts of this job
    try:
        run.stage.at("finding the checkpoint to resume")
        path = checkpoints.find(run.args.resume_from_checkpoint)
        if path is None:
            if attempt:
                run.accelerator.print(f"restart {attempt}: no checkpoint to resume, starting at step 0")
            return 0, 0, False
        run.stage.at(f"resuming from {path}")
        step, skipped = checkpoints.resume(path)
    except CheckpointError as error:
        fail(str(error))
    run.accelerator.print(f"{f'restart {attempt}: ' if attempt else ''}resumed from {path} at step {step}")
    return step, skipped, True


# ------------------------------------------------------------------- one optimizer step
def optimizer_step(run: Run, trainable, optimizer, scheduler, batches: ShardedBatches, step: int):
    """Step `step` + 1 over --gradient-accumulate-every micro-batches: (the mean of their
    losses, None), or (None, (global mean, this rank's loss sum)) of a non-finite one, after
    which the step is lost: no update and no schedule step."""
    args, accelerator, stage = run.args, run.accelerator, run.stage
    step_sum, step_count, nonfinite = 0.0, 0.0, None
    for micro in range(args.gradient_accumulate_every):
        stage.at("preparing the batch", step + 1)
        inputs = batches.shard(step * args.gradient_accumulate_every + micro, step + 1)
        # Every micro-batch enters accumulate(), so accelerate's count of them stays aligned,
        # but after a non-finite one the step is lost and the rest do no work: no backward,
        # which under DeepSpeed would also step the engine at the boundary.
        with accelerator.accumulate(trainable):
            if (seconds := injected_fault("hang", step + 1, run.rank)) is not None:
                time.sleep(float(seconds))
            if nonfinite is None:
                mean, loss_sum = forward_backward(run, trainable, inputs, step, micro)
                if math.isfinite(mean):
                    step_sum, step_count = step_sum + mean, step_count + 1
                else:
                    nonfinite = (mean, loss_sum.item())
            stage.at("optimizer step")
            if nonfinite is None:
                optimizer.step()
                if accelerator.sync_gradients:
                    scheduler.step()
            optimizer.zero_grad()  # at the step boundary this also drops a skipped step's gradients
    return (step_sum / step_count, None) if nonfinite is None else (None, nonfinite)


def forward_backward(run: Run, trainable, inputs, step: int, micro: int):
    """(the micro-batch's loss mean over every rank, this rank's loss sum); the backward runs
    when the mean is finite."""
    input_ids, position_ids, target_ids, extra = inputs
    run.stage.at("forward")
    loss_sum = trainable(input_ids, position_ids, target_ids, **extra)
    if injected_fault("nonfinite_loss", step + 1, run.rank) in ("", str(micro)):
        loss_sum = loss_sum * float("nan")
    # Gradients are averaged over all ranks by DDP/DeepSpeed; scale so the result is
    # the token-weighted mean over every token of every rank.
    loss_for_backward, micro_mean = global_token_mean(loss_sum, target_ids)
    # micro_mean is already all-reduced: every rank sees the same value and takes
    # the same branch, so checking it costs no collective.
    mean = micro_mean.item()
    if math.isfinite(mean):
        run.stage.at("backward")
        run.accelerator.backward(loss_for_backward)
    return mean, loss_sum


def stop_on_nonfinite_loss(
    run: Run, checkpoints: Checkpoints, step: int, skipped: int, global_mean: float, local_sum: float
):
    """Every rank gets here together (the loss mean is all-reduced). Keep the work: the weights
    are still those after `step` good steps, so save them as a checkpoint, then stop."""
    accelerator = run.accelerator
    run.stage.at("stopping on a non-finite loss", step + 1)
    sums = accelerator.gather(torch.tensor([local_sum], dtype=torch.float64, device=accelerator.device)).tolist()
    culprits = {rank: value for rank, value in enumerate(sums) if not math.isfinite(value)}
    saved = checkpoints.keep_last_good_step(step, skipped)
    keep = (
        f"the weights of step {step} are in {saved}: resume it with --skip-nonfinite-steps {skipped + 1} to skip "
        "this step, or lower --learning-rate"
        if step > 0
        else "nothing was trained yet"
    )
    fail(
        f"step {step + 1}: non-finite loss on rank(s) {sorted(culprits)} (their loss sums: "
        f"{[culprits[r] for r in sorted(culprits)]}; mean over all ranks {global_mean}); stopped before the optimizer "
        f"step; {keep}",
        code=EXIT_NONFINITE_LOSS,
    )


# ------------------------------------------------------------------------------ logging
class TrainingLog:
    """Each step's loss, learning rate and throughput: on the progress bar, to the tracker, and
    one JSON line per step in <output-dir>/train_log.jsonl (written by the main process)."""

    def __init__(self, run: Run, tracker: str, first_step: int, resumed: bool):
        from tqdm.auto import tqdm

        args, accelerator = run.args, run.accelerator
        self.accelerator = accelerator
        self.path = Path(args.output_dir) / "train_log.jsonl"
        if accelerator.is_main_process:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not resumed:
                self.path.unlink(missing_ok=True)  # a fresh run starts a fresh log
        if accelerator.is_main_process and tracker != "none":
            accelerator.init_trackers(
                args.wandb or "easy-context", config={k: v for k, v in vars(args).items() if v is not None}
            )
        self.tokens_per_step = args.seq_length * args.batch_size * args.gradient_accumulate_every * run.dp_size
        self.bar = tqdm(
            total=args.max_train_steps, initial=first_step, disable=not accelerator.is_local_main_process, desc="train"
        )

    def step(self, step: int, loss: float | None, lr: float, elapsed: float) -> None:
        """Step `step` took `elapsed` seconds; its loss is None when it was skipped."""
        tokens_per_s = self.tokens_per_step / elapsed
        self.bar.update(1)
        record = {"step": step, "lr": lr, "tokens_per_s": tokens_per_s}
        if loss is not None:
            record["loss"] = loss
            self.bar.set_postfix(
                loss=f"{loss:.4f}", ppl=f"{math.exp(min(loss, 50)):.2f}", tok_s=f"{tokens_per_s:.0f}", lr=f"{lr:.2e}"
            )
            self.accelerator.log(
                {"loss": loss, "ppl": math.exp(min(loss, 50)), "tokens_per_s": tokens_per_s, "lr": lr}, step=step
            )
        else:
            record.update(loss=None, skipped=True)
        if self.accelerator.is_main_process:
            with open(self.path, "a") as log:
                log.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self.bar.close()


def write_summary(run: Run, step: int, loss: float, skipped: int) -> None:
    """<output-dir>/train_summary.json: steps, final loss, and each rank's peak memory so far
    (training, before the final save), in one gather."""
    from accelerate.utils import gather_object

    accelerator = run.accelerator
    peak_rss = gather_object([peak_rss_mib()])
    device = accelerator.device
    peak_gpu = gather_object(
        [round(torch.cuda.max_memory_allocated(device) / 2**20, 1) if device.type == "cuda" else None]
    )
    if accelerator.is_main_process:
        summary = {
            "steps": step,
            "final_loss": loss if math.isfinite(loss) else None,
            "skipped_steps": skipped,
            "peak_rss_mib_per_rank": peak_rss,
            "peak_cuda_allocated_mib_per_rank": peak_gpu,
        }
        (Path(run.args.output_dir) / "train_summary.json").write_text(json.dumps(summary, indent=1))


def peak_rss_mib() -> float | None:
    """This process's peak resident memory (None where the OS does not report it)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)


# ------------------------------------------------------------------------------- finish
def save_model(run: Run, trainable, tokenizer, loss: float) -> None:
    """The trained model (without the loss wrapper) and tokenizer, save_pretrained into --output-dir;
    with --lora-r the PeftModel's save_pretrained writes the adapter only."""
    accelerator, output_dir = run.accelerator, run.args.output_dir
    run.stage.at("saving the model")
    accelerator.wait_for_everyone()
    state_dict = fsdp.full_state_dict(trainable) if run.args.fsdp else accelerator.get_state_dict(trainable)
    if accelerator.is_main_process:
        state_dict = {k.removeprefix("model."): v for k, v in state_dict.items()}
        unwrapped = accelerator.unwrap_model(trainable).model
        unwrapped.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(output_dir)
        accelerator.print(f"saved the model to {output_dir} (final loss {loss:.4f})")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_main(main)  # exit code 0/2/3/4 without the interpreter's teardown (easy_context.programs.launch.exit_process)
