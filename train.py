"""Train a Hugging Face causal LM on long sequences with sequence parallelism.

    # CPU, 2 processes, zigzag ring attention, the embedded default (tiny Llama on the
    # Python standard library's sources, byte tokenizer, half the rows needle retrieval
    # documents): about a minute, loss falls.
    torchrun --standalone --nproc_per_node 2 train.py --parallel_mode zigzag_ring_attn

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
import re
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

import easy_context as ec
from easy_context.programs.data import (BYTE_EOS_ID, StreamedRows, byte_tokenizer, document_positions, open_rows, stdlib_token_stream,
                               windows, with_retrieval_rows)
from easy_context.programs.launch import (EXIT_BAD_INPUT, EXIT_NONFINITE_LOSS, Stage, add_dist_timeout_flag, injected_fault,
                                 run_job, run_main)
from easy_context.programs.launch import fail as launch_fail
from easy_context.programs.loss import chunked_cross_entropy_sum, global_token_mean
from easy_context.hf.architectures import check_training_config, logits_head
from easy_context.programs.models import check_config, load_config, load_pretrained
from easy_context.modes import get_mode, modes_with
from easy_context.programs.tiled_mlp import tile_mlps
from easy_context.versions import enable_activation_checkpointing

DEFAULT_MODEL = Path(__file__).parent / "configs" / "tiny-llama"
DEFAULT_RETRIEVAL_FRACTION = 0.5  # the embedded corpus: half the rows teach retrieval (README numbers)


# ----------------------------------------------------------------------------- arguments
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="hub name or local path; default: the tiny Llama config in configs/ (random init)")
    p.add_argument("--dataset", default=None, help="hub name, save_to_disk folder or .jsonl/.parquet/.txt file, with an input_ids column "
                   "(rows >= --seq-length + 1 tokens) or a text column (tokenized and packed); default: the embedded corpus")
    p.add_argument("--text-column", default="text", help="the text column of a --dataset without input_ids")
    p.add_argument("--streaming", action="store_true", help="stream --dataset (read in order; each data-parallel group its own part)")
    p.add_argument("--retrieval-fraction", type=float, default=None, help=f"embedded corpus only: share of rows rewritten as needle "
                   f"retrieval documents in eval_needle.py's format (default {DEFAULT_RETRIEVAL_FRACTION})")
    p.add_argument("--seq-length", type=int, default=2048, help="tokens per training sequence")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per micro-batch per sequence-parallel group")
    p.add_argument("--gradient-accumulate-every", type=int, default=1)
    p.add_argument("--max-train-steps", type=int, default=60, help="optimizer steps")
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up steps (default: 10%% of the steps), then linear decay to 0")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--rope-theta", type=float, default=None, help="override the model's RoPE base")
    p.add_argument("--parallel_mode", "--parallel-mode", dest="parallel_mode", default="zigzag_ring_attn", choices=ec.MODE_NAMES)
    p.add_argument("--ring_degree", "--ring-degree", dest="ring_degree", type=int, default=None, help="usp_attn: ring part of the SP group")
    p.add_argument("--sp-size", type=int, default=None, help="ranks sharing one sequence (default: all); world = dp x sp")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute each decoder layer in the backward")
    p.add_argument("--offload-checkpoints", action="store_true", help="keep checkpointed layer inputs in host memory (with --activation-checkpointing)")
    p.add_argument("--tiled-mlp", type=int, default=0, metavar="TOKENS", help="run MLPs over sequence tiles of this many tokens (0: off)")
    p.add_argument("--document-masking", action="store_true", help="restart positions after each EOS: no token attends across a document")
    p.add_argument("--balance-documents", action="store_true", help="with --document-masking: the same attention work on every rank (document_split: every document cut over the ring; ulysses_attn is balanced already); results unchanged")
    p.add_argument("--loss-chunk-size", type=int, default=4096, help="tokens per chunk of the output layer + loss")
    p.add_argument("--output-dir", default="outputs/tiny-llama")
    p.add_argument("--checkpointing-steps", type=int, default=0, help="save a resumable checkpoint every N steps (0: only at the end)")
    p.add_argument("--save-total-limit", type=int, default=None, metavar="N", help="keep the current checkpoint and the N-1 newest before it (default: all)")
    p.add_argument("--skip-nonfinite-steps", type=int, default=0, metavar="K",
                   help="skip up to K steps whose loss is inf/NaN, counted over the whole run (resumes included); "
                        "default 0: stop at the first, after saving a checkpoint")
    p.add_argument("--resume-from-checkpoint", default=None, help="a checkpoint folder, or 'latest' in --output-dir")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--wandb", default=None, metavar="PROJECT", help="log to Weights & Biases (project name)")
    p.add_argument("--log-with", default="auto", choices=["auto", "none", "tensorboard", "wandb"], help="tracker (auto: tensorboard when installed)")
    p.add_argument("--max-rows", type=int, default=None, help="use at most this many dataset rows")
    add_dist_timeout_flag(p)
    args = p.parse_args(argv)

    errors = []
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
        errors.append(f"--warmup-steps must be between 0 and --max-train-steps ({args.max_train_steps}), got {args.warmup_steps}")
    if args.checkpointing_steps < 0:
        errors.append(f"--checkpointing-steps must be >= 0, got {args.checkpointing_steps}")
    if args.max_rows is not None and args.max_rows < 1:
        errors.append(f"--max-rows must be >= 1, got {args.max_rows}")
    if args.save_total_limit is not None and args.save_total_limit < 1:
        errors.append(f"--save-total-limit must be >= 1, got {args.save_total_limit}")
    if args.skip_nonfinite_steps < 0:
        errors.append(f"--skip-nonfinite-steps must be >= 0, got {args.skip_nonfinite_steps}")
    if args.tiled_mlp < 0:
        errors.append(f"--tiled-mlp must be >= 0, got {args.tiled_mlp}")
    if args.ring_degree is not None and not get_mode(args.parallel_mode).takes_ring_degree:
        errors.append(f"--ring_degree applies to {' / '.join(modes_with('takes_ring_degree'))} only (got --parallel_mode {args.parallel_mode})")
    if args.streaming and args.dataset is None:
        errors.append("--streaming needs --dataset (the embedded corpus is built in memory)")
    if args.retrieval_fraction is not None and (args.dataset is not None or not 0 <= args.retrieval_fraction <= 1):
        errors.append(f"--retrieval-fraction applies to the embedded corpus (no --dataset) and must be in [0, 1], got {args.retrieval_fraction}")
    if errors:
        p.error("; ".join(errors))
    if args.retrieval_fraction is None and args.dataset is None:
        args.retrieval_fraction = DEFAULT_RETRIEVAL_FRACTION
    if args.warmup_steps is None:
        args.warmup_steps = max(1, args.max_train_steps // 10)
    return args


def fail(message: str, code: int = EXIT_BAD_INPUT):
    launch_fail("train.py", message, code)


# ---------------------------------------------------------------------------- the model
class CausalLMLoss(torch.nn.Module):
    """The model plus its loss: returns this rank's loss sum, computed in chunks so the
    full-vocabulary logits of the local sequence never exist at once."""

    def __init__(self, model, loss_chunk_size: int):
        super().__init__()
        self.model, self.loss_chunk_size = model, loss_chunk_size

    @property
    def config(self):  # accelerate reads hidden_size from here to size DeepSpeed's buckets
        return self.model.config

    def forward(self, input_ids, position_ids, target_ids, **attention_kwargs):
        hidden = self.model.get_decoder()(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                          **attention_kwargs).last_hidden_state
        return chunked_cross_entropy_sum(hidden, logits_head(self.model), target_ids, self.loss_chunk_size)


def load_model(args, dtype, device):
    from transformers import AutoModelForCausalLM

    try:
        if args.model is None:  # the embedded default: random weights, byte tokenizer
            config = load_config(str(DEFAULT_MODEL), args.rope_theta)
            torch.manual_seed(args.seed)
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(dtype)
            tokenizer = byte_tokenizer()
        else:
            model, tokenizer = load_pretrained(args.model, args.rope_theta, dtype)
    except (ValueError, OSError) as error:
        fail(f"--model {args.model or DEFAULT_MODEL}: {error}")
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
def load_rows(args, rows_needed: int, tokenizer, dp_rank: int, dp_size: int):
    """Rows of seq_length + 1 tokens (inputs and their next-token targets): a tensor for the
    embedded default; for --dataset, rows read lazily from its Arrow storage (or its stream)."""
    length = args.seq_length + 1
    if args.dataset is None:
        if len(tokenizer) != BYTE_EOS_ID + 1 or tokenizer.eos_token_id != BYTE_EOS_ID:
            fail(f"--model {args.model}: the embedded corpus is byte tokens, for the byte-level default model; "
                 "with another tokenizer give --dataset (text is tokenized with the model's tokenizer)")
        stream = stdlib_token_stream(max_tokens=rows_needed * length)
        rows = windows(stream, length, args.max_rows)
        if len(rows) == 0:
            fail(f"the embedded corpus is shorter than one sequence of {length} tokens")
        return with_retrieval_rows(rows, args.retrieval_fraction, args.seed)
    try:
        return open_rows(args.dataset, length, tokenizer, text_column=args.text_column, max_rows=args.max_rows,
                         streaming=args.streaming, dp_rank=dp_rank, dp_size=dp_size)
    except (ValueError, OSError) as error:
        fail(f"--dataset {args.dataset}: {error}")


@functools.lru_cache(maxsize=2)  # one permutation per epoch, not one per micro-batch (10M rows: 80 MB)
def epoch_order(rows: int, seed: int) -> torch.Tensor:
    return torch.randperm(rows, generator=torch.Generator().manual_seed(seed))


def micro_batch(rows: torch.Tensor, index: int, batch_size: int, dp_rank: int, dp_size: int, seed: int) -> torch.Tensor:
    """Micro-batch `index` of data-parallel group `dp_rank`: a pure function of its arguments,
    so a resumed run reads exactly what the uninterrupted run would have read."""
    if isinstance(rows, StreamedRows):  # in stream order; each DP group streams its own part
        return rows.read(index * batch_size, batch_size)
    per_epoch = len(rows) // (batch_size * dp_size)
    epoch, within = divmod(index, per_epoch)
    order = epoch_order(len(rows), seed + epoch)
    start = (within * dp_size + dp_rank) * batch_size
    return rows[order[start:start + batch_size]]


# ----------------------------------------------------------------------- checkpoints
CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)")


def checkpoint_dirs(output_dir: str) -> list[Path]:
    """Complete checkpoints, oldest first. A save in progress (or killed) lives in a
    `checkpoint-N.partial` folder, which never matches."""
    found = [p for p in Path(output_dir).glob("checkpoint-*")
             if CHECKPOINT_NAME.fullmatch(p.name) and (p / "trainer_state.json").exists()]
    return sorted(found, key=lambda p: int(CHECKPOINT_NAME.fullmatch(p.name)[1]))


def resolve_resume(args) -> Path | None:
    if args.resume_from_checkpoint is None:
        return None
    if args.resume_from_checkpoint == "latest":
        found = checkpoint_dirs(args.output_dir)
        if not found:
            fail(f"--resume-from-checkpoint latest: no checkpoint in {args.output_dir}")
        return found[-1]
    path = Path(args.resume_from_checkpoint)
    if not (path / "trainer_state.json").exists():
        fail(f"--resume-from-checkpoint {path}: not a checkpoint folder (no trainer_state.json)")
    return path


def read_trainer_state(path: Path) -> dict:
    try:
        state = json.loads((path / "trainer_state.json").read_text())
    except ValueError as error:
        fail(f"--resume-from-checkpoint {path}: trainer_state.json is not valid JSON ({error})")
    if not (isinstance(state, dict) and isinstance(state.get("step"), int) and isinstance(state.get("args"), dict)):
        fail(f"--resume-from-checkpoint {path}: not a train.py checkpoint (its trainer_state.json has no 'step' and 'args'; "
             "an HF Trainer checkpoint cannot be resumed here)")
    return state


# These shape the data order, the schedule or the model: a resumed run must use the same
# values (and the same number of processes) to continue exactly.
RESUME_KEYS = ("seq_length", "batch_size", "gradient_accumulate_every", "parallel_mode", "sp_size", "ring_degree",
               "seed", "dataset", "text_column", "streaming", "retrieval_fraction", "model", "max_rows", "max_train_steps",
               "learning_rate", "warmup_steps", "weight_decay", "rope_theta", "world_size", "document_masking",
               "balance_documents")


def legacy_resume_values(saved: dict) -> dict:
    """What checkpoints written before a flag existed were trained with."""
    return {"text_column": "text", "streaming": False, "retrieval_fraction": 0.0 if saved.get("dataset") is None else None}


def save_checkpoint(accelerator, args, step: int, skipped: int) -> Path:
    """Atomic: every rank writes into checkpoint-N.partial; when all are done, rank 0 adds
    trainer_state.json and renames the folder to checkpoint-N (a rename within a folder is
    atomic on POSIX). A kill at any moment leaves `latest` on a complete checkpoint: the
    previous one, or this one. Folders to delete are renamed aside first (`.stale`, never
    matched) and deleted in the background, so the other ranks do not wait on rank 0's rmtree."""
    final = Path(args.output_dir) / f"checkpoint-{step}"
    partial = final.with_name(final.name + ".partial")
    if accelerator.is_main_process and partial.exists():
        shutil.rmtree(partial)  # left by a save that was killed
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))
    if injected_fault("die_in_save", step, accelerator.process_index) is not None:
        os._exit(1)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        args.world_size = accelerator.num_processes
        state = {"step": step, "skipped_steps": skipped, "args": {k: getattr(args, k) for k in RESUME_KEYS}}
        (partial / "trainer_state.json").write_text(json.dumps(state, indent=1))
        doomed = []
        if final.exists():  # the same step saved by an earlier run of this output dir
            doomed.append(set_aside(final))
        os.replace(partial, final)
        doomed += [set_aside(old) for old in checkpoints_to_prune(args, step)]
        # left by killed saves, or by deletions a finished process did not complete
        doomed += [*Path(args.output_dir).glob("checkpoint-*.partial"), *Path(args.output_dir).glob("checkpoint-*.stale-*")]
        threading.Thread(target=lambda: [shutil.rmtree(d, ignore_errors=True) for d in doomed], daemon=True).start()
    accelerator.wait_for_everyone()
    return final


def set_aside(path: Path) -> Path:
    aside = path.with_name(f"{path.name}.stale-{time.time_ns()}")
    os.replace(path, aside)
    return aside


def checkpoints_to_prune(args, step: int) -> list[Path]:
    """With --save-total-limit N: all but checkpoint-`step` and the N - 1 newest before it.
    Checkpoints after `step` (left by a run this one resumed before) are not ours to judge."""
    if args.save_total_limit is None:
        return []
    older = [p for p in checkpoint_dirs(args.output_dir) if int(CHECKPOINT_NAME.fullmatch(p.name)[1]) < step]
    return older[:max(0, len(older) - (args.save_total_limit - 1))]


def peak_rss_mib() -> float | None:
    """This process's peak resident memory (None where the OS does not report it)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)


# --------------------------------------------------------------------------- main
def main(argv=None):
    args = parse_args(argv)
    tracker = "wandb" if args.wandb else args.log_with
    if tracker == "auto":
        import importlib.util

        tracker = "tensorboard" if importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX") else "none"
    return run_job(
        "train.py", lambda args, accelerator, stage: train(args, accelerator, tracker, stage), args,
        gradient_accumulation_steps=args.gradient_accumulate_every,
        log_with=None if tracker == "none" else tracker,
        project_dir=args.output_dir,
        # accelerate would step the schedule once per process (it assumes a sharded loader)
        step_scheduler_with_optimizer=False,
    )


def train(args, accelerator, tracker: str, stage: Stage) -> float:
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    rank, world = accelerator.process_index, accelerator.num_processes
    set_seed(args.seed)

    mode = get_mode(args.parallel_mode)
    try:
        topology = mode.topology(world, args.sp_size, args.ring_degree)
        mode.layout(topology).check_length(args.seq_length)
    except ValueError as error:
        fail(f"{error} (--parallel_mode {args.parallel_mode}, {world} processes, --seq-length {args.seq_length})")
    dp_rank, dp_size = topology.dp_rank(rank), topology.dp_size
    deepspeed = accelerator.state.deepspeed_plugin
    if deepspeed is not None and args.skip_nonfinite_steps:
        # accelerate's DeepSpeed wrapper steps the engine inside backward at the accumulation
        # boundary, and the engine's gradients cannot be zeroed from here: a step cannot be
        # dropped once some of its micro-batches went backward. (Stopping needs neither.)
        fail("--skip-nonfinite-steps is not supported under DeepSpeed; without it, training stops at a non-finite loss "
             "after saving a checkpoint of the last good step")

    # ------------------------------------------------------------------------- model
    stage.at("loading the model")
    # bf16 weights only where DeepSpeed keeps fp32 master weights; otherwise fp32 weights
    # (with --mixed_precision bf16, accelerate autocasts the compute).
    deepspeed_bf16 = deepspeed is not None and accelerator.mixed_precision == "bf16"
    model, tokenizer = load_model(args, torch.bfloat16 if deepspeed_bf16 else torch.float32, accelerator.device)
    if args.offload_checkpoints and accelerator.device.type == "cpu":
        accelerator.print("--offload-checkpoints: the device is the CPU, so checkpointed layer inputs already live in host "
                          "memory; nothing to offload")
    try:
        check_config(model.config, topology, args.seq_length, args.parallel_mode)
        check_training_config(model.config)
    except ValueError as error:
        fail(str(error))
    eos_id, vocab_size = tokenizer.eos_token_id, model.config.vocab_size
    if args.document_masking and eos_id is None:
        fail("--document-masking needs a tokenizer with an EOS token (documents are separated by EOS)")
    # --balance-documents: every document is split over the ring (document_split); Ulysses alone is
    # balanced already.
    split = args.balance_documents and get_mode(args.parallel_mode).document_split
    ec.apply_seq_parallel_monkey_patch(args.parallel_mode, model, sp_size=args.sp_size, ring_degree=args.ring_degree,
                                       document_split=split or None)
    trainable = CausalLMLoss(model, args.loss_chunk_size)

    # -------------------------------------------------------------------------- data
    micro_batches = args.max_train_steps * args.gradient_accumulate_every
    # The main process first: it downloads and tokenizes into datasets' cache, the others then
    # read the cache. They wait in a collective, so a first tokenization longer than
    # --dist-timeout stops them; the phase name says so.
    stage.at("loading the data (the main process tokenizes --dataset first; the others wait up to --dist-timeout)")
    with accelerator.main_process_first():
        rows = load_rows(args, micro_batches * args.batch_size * dp_size, tokenizer, dp_rank, dp_size)
    if not isinstance(rows, StreamedRows) and len(rows) < args.batch_size * dp_size:
        fail(f"{len(rows)} rows of {args.seq_length + 1} tokens are fewer than one step needs ({args.batch_size * dp_size})")

    # ----------------------------------------------------------- optimizer, schedule
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
        scheduler = DummyScheduler(optimizer, total_num_steps=args.max_train_steps * world, warmup_num_steps=args.warmup_steps)
    else:
        from transformers import get_linear_schedule_with_warmup

        scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, args.max_train_steps)
    # DDP (MULTI_CPU / MULTI_GPU) or DeepSpeed: gradients are averaged over every rank.
    stage.at("preparing the model (DDP / DeepSpeed)")
    trainable, optimizer, scheduler = accelerator.prepare(trainable, optimizer, scheduler)

    # ------------------------------------------------------------------------ resume
    step, skipped, last_saved = 0, 0, None  # last_saved: (step, folder) of the newest checkpoint of this run
    resume = resolve_resume(args)
    if resume is not None:
        stage.at(f"resuming from {resume}")
        state = read_trainer_state(resume)
        args.world_size = world
        saved = {**legacy_resume_values(state["args"]), **state["args"]}
        changed = {k: (saved.get(k), getattr(args, k)) for k in RESUME_KEYS if saved.get(k) != getattr(args, k)}
        if changed:
            fail(f"cannot resume {resume}: these flags differ from the checkpoint (checkpoint, now): {changed}")
        try:
            accelerator.load_state(str(resume))
        except (OSError, RuntimeError, ValueError) as error:  # a folder with missing or truncated files
            fail(f"--resume-from-checkpoint {resume}: cannot load it ({' '.join(str(error).split())[:300]})")
        step, skipped = state["step"], state.get("skipped_steps", 0)
        last_saved = (step, resume)
        accelerator.print(f"resumed from {resume} at step {step}")

    log_path = Path(args.output_dir) / "train_log.jsonl"
    if accelerator.is_main_process:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        if resume is None:
            log_path.unlink(missing_ok=True)  # a fresh run starts a fresh log
    if accelerator.is_main_process and tracker != "none":
        accelerator.init_trackers(args.wandb or "easy-context", config={k: v for k, v in vars(args).items() if v is not None})

    # -------------------------------------------------------------------------- loop
    tokens_per_step = args.seq_length * args.batch_size * args.gradient_accumulate_every * dp_size
    bar = tqdm(total=args.max_train_steps, initial=step, disable=not accelerator.is_local_main_process, desc="train")
    trainable.train()
    loss = float("nan")
    while step < args.max_train_steps:
        started, step_sum, step_count, nonfinite = time.perf_counter(), 0.0, 0.0, None
        for micro in range(args.gradient_accumulate_every):
            stage.at("preparing the batch", step + 1)
            batch = micro_batch(rows, step * args.gradient_accumulate_every + micro, args.batch_size, dp_rank, dp_size, args.seed)
            if batch.min() < 0 or batch.max() >= vocab_size:  # else an IndexError (CPU) or a device assert (CUDA)
                bad = batch.min().item() if batch.min() < 0 else batch.max().item()
                fail(f"step {step + 1}: the data holds token id {bad}, outside the model's vocabulary (0..{vocab_size - 1}); "
                     "was --dataset tokenized with another tokenizer?")
            positions = document_positions(batch[:, :-1], eos_id) if args.document_masking else None
            local = ec.prepare_seq_parallel_inputs(args.parallel_mode, batch[:, :-1], positions, batch[:, 1:], rank, world,
                                                   accelerator.device)
            extra = {"seq_parallel_index": local["local_token_index"]} if split else {}
            # Every micro-batch enters accumulate(), so accelerate's count of them stays aligned,
            # but after a non-finite one the step is lost and the rest do no work: no backward,
            # which under DeepSpeed would also step the engine at the boundary.
            with accelerator.accumulate(trainable):
                if (seconds := injected_fault("hang", step + 1, rank)) is not None:
                    time.sleep(float(seconds))
                if nonfinite is None:
                    stage.at("forward")
                    loss_sum = trainable(local["local_input_ids"], local["local_position_ids"], local["local_target_ids"], **extra)
                    if injected_fault("nonfinite_loss", step + 1, rank) in ("", str(micro)):
                        loss_sum = loss_sum * float("nan")
                    # Gradients are averaged over all ranks by DDP/DeepSpeed; scale so the result is
                    # the token-weighted mean over every token of every rank.
                    loss_for_backward, micro_mean = global_token_mean(loss_sum, local["local_target_ids"])
                    # micro_mean is already all-reduced: every rank sees the same value and takes
                    # the same branch, so checking it costs no collective.
                    mean = micro_mean.item()
                    if math.isfinite(mean):
                        stage.at("backward")
                        accelerator.backward(loss_for_backward)
                        step_sum, step_count = step_sum + mean, step_count + 1
                    else:
                        nonfinite = (mean, loss_sum.item())
                stage.at("optimizer step")
                if nonfinite is None:
                    optimizer.step()
                    if accelerator.sync_gradients:
                        scheduler.step()
                optimizer.zero_grad()  # at the step boundary this also drops a skipped step's gradients
        if nonfinite is not None:
            skipped += 1
            if skipped > args.skip_nonfinite_steps:
                stop_on_nonfinite_loss(accelerator, args, step, skipped - 1, last_saved, *nonfinite, stage)
            accelerator.print(f"step {step + 1}: non-finite loss {nonfinite[0]}, step skipped "
                              f"({skipped} of --skip-nonfinite-steps {args.skip_nonfinite_steps})")
        step += 1
        elapsed = time.perf_counter() - started
        lr = scheduler.get_last_lr()[0]
        bar.update(1)
        record = {"step": step, "lr": lr, "tokens_per_s": tokens_per_step / elapsed}
        if nonfinite is None:
            loss = step_sum / step_count
            record["loss"] = loss
            bar.set_postfix(loss=f"{loss:.4f}", ppl=f"{math.exp(min(loss, 50)):.2f}", tok_s=f"{tokens_per_step / elapsed:.0f}", lr=f"{lr:.2e}")
            accelerator.log({"loss": loss, "ppl": math.exp(min(loss, 50)), "tokens_per_s": tokens_per_step / elapsed, "lr": lr}, step=step)
        else:
            record.update(loss=None, skipped=True)
        if accelerator.is_main_process:
            with open(log_path, "a") as log:
                log.write(json.dumps(record) + "\n")
        if args.checkpointing_steps and step % args.checkpointing_steps == 0 and step < args.max_train_steps:
            stage.at("checkpoint save", step)
            last_saved = (step, save_checkpoint(accelerator, args, step, skipped))
    bar.close()
    # Each rank's peak resident memory so far (training, before the final save), one gather.
    from accelerate.utils import gather_object

    peak_rss = gather_object([peak_rss_mib()])
    device = accelerator.device
    peak_gpu = gather_object([round(torch.cuda.max_memory_allocated(device) / 2**20, 1) if device.type == "cuda" else None])
    if accelerator.is_main_process:
        summary = {"steps": step, "final_loss": loss if math.isfinite(loss) else None, "skipped_steps": skipped,
                   "peak_rss_mib_per_rank": peak_rss, "peak_cuda_allocated_mib_per_rank": peak_gpu}
        (Path(args.output_dir) / "train_summary.json").write_text(json.dumps(summary, indent=1))

    # -------------------------------------------------------------------------- save
    stage.at("saving the model")
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(trainable)
    if accelerator.is_main_process:
        state_dict = {k.removeprefix("model."): v for k, v in state_dict.items()}
        unwrapped = accelerator.unwrap_model(trainable).model
        unwrapped.save_pretrained(args.output_dir, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(args.output_dir)
        accelerator.print(f"saved the model to {args.output_dir} (final loss {loss:.4f})")
    ec.remove_seq_parallel_monkey_patch()
    return loss


def stop_on_nonfinite_loss(accelerator, args, step: int, skipped: int, last_saved, global_mean: float, local_sum: float,
                           stage: Stage):
    """Every rank gets here together (the loss mean is all-reduced). Keep the work: the weights
    are still those after `step` good steps, so save them as a checkpoint, then stop."""
    stage.at("stopping on a non-finite loss", step + 1)
    sums = accelerator.gather(torch.tensor([local_sum], dtype=torch.float64, device=accelerator.device)).tolist()
    culprits = {rank: value for rank, value in enumerate(sums) if not math.isfinite(value)}
    saved = last_saved[1] if last_saved is not None and last_saved[0] == step else None
    if step > 0 and saved is None:
        saved = save_checkpoint(accelerator, args, step, skipped)
    keep = (f"the weights of step {step} are in {saved}: resume it with --skip-nonfinite-steps {skipped + 1} to skip "
            "this step, or lower --learning-rate" if step > 0 else "nothing was trained yet")
    fail(f"step {step + 1}: non-finite loss on rank(s) {sorted(culprits)} (their loss sums: "
         f"{[culprits[r] for r in sorted(culprits)]}; mean over all ranks {global_mean}); stopped before the optimizer "
         f"step; {keep}", code=EXIT_NONFINITE_LOSS)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_main(main)  # exit code 0/2/3/4 without the interpreter's teardown (easy_context.programs.launch.exit_process)
