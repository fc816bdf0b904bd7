"""Train a Hugging Face causal LM on long sequences with sequence parallelism.

    # CPU, 2 processes, zigzag ring attention, the default job: the shipped demo base
    # (models/demo-base, a tiny Llama that retrieves needles at 512 tokens) extended to
    # 2,048 tokens with its RoPE base raised, on needle documents with the loss on the answers
    torchrun --standalone --nproc_per_node 2 train.py

    # The from-scratch job: a random tiny Llama on the Python standard library's sources
    # (byte tokenizer, half the rows needle retrieval documents); about a minute, loss falls
    torchrun --standalone --nproc_per_node 2 train.py --from-scratch

    # A model shape from a config, random weights built on the GPU in bf16 (configs/ has presets)
    python train.py --from-config llama-3.1-8b --param-dtype bf16 --optimizer sgd --no-save \
        --seq-length 131072 --activation-checkpointing --max-train-steps 3

    # A text dataset (tokenized once into datasets' cache, packed, read lazily), or a stream
    torchrun --standalone --nproc_per_node 2 train.py --model PATH --dataset corpus.jsonl --text-column text

    # GPUs, DeepSpeed ZeRO-3 with CPU offload (see accelerate_configs/ and scripts/)
    accelerate launch --config_file accelerate_configs/single_node.yaml train.py \
        --model meta-llama/Llama-2-7b-hf --dataset PATH --seq-length 65536 --parallel-mode zigzag_ring_attn

Read top to bottom: arguments -> accelerator -> model -> data -> optimizer/schedule ->
resume -> loop (shard, chunked loss, backward, step, log, checkpoint) -> save_pretrained.
The steps it calls live in recipes/training/; its configuration (one dataclass per concern,
each field with its default, doc and check; the flags are generated from them) in
training/config.py.
"""

from __future__ import annotations

import math
import os
import time

import easy_context as ec
from easy_context.hf.loss import global_token_mean
from recipes import fsdp
from recipes.checkpointing import Checkpoints, resume_record
from recipes.configuration import values_of
from recipes.faults import injected_fault
from recipes.launch import Stage, run_job, run_main
from recipes.stopping import Interrupted
from recipes.training.batches import ShardedBatches, build_data
from recipes.training.config import TrainConfig, parse_config
from recipes.training.model import build_model, build_optimizer, load_model  # noqa: F401
from recipes.training.report import TrainingLog, save_model, write_summary
from recipes.training.run import Run, resume_run, set_up_run, stop_on_interrupt, stop_on_nonfinite_loss
from recipes.training.sources import DEMO_BASE  # noqa: F401 (the default model, for tests and tools)


def parse_args(argv=None) -> TrainConfig:
    """The command line as the run's configuration (every script's parse_args parses its own)."""
    return parse_config(argv, description=__doc__)


# --------------------------------------------------------------------------------- main
def main(argv=None):
    config = parse_args(argv)
    tracker = "wandb" if config.logging.wandb else config.logging.log_with
    if tracker == "auto":
        import importlib.util

        tracker = (
            "tensorboard"
            if importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX")
            else "none"
        )
    return run_job(
        "train.py",
        lambda accelerator, stage: train(config, accelerator, tracker, stage),
        config.parallelism.dist_timeout,
        gradient_accumulation_steps=config.optimisation.gradient_accumulate_every,
        log_with=None if tracker == "none" else tracker,
        project_dir=config.checkpoints.output_dir,
        # accelerate would step the schedule once per process (it assumes a sharded loader)
        step_scheduler_with_optimizer=False,
    )


def train(config: TrainConfig, accelerator, tracker: str, stage: Stage) -> float:
    run = set_up_run(config, accelerator, stage)
    steps, checkpoint_every = config.optimisation.max_train_steps, config.checkpoints.checkpointing_steps
    trainable, tokenizer = build_model(run)
    batches = build_data(run, tokenizer, trainable.config.vocab_size)
    optimizer, scheduler = build_optimizer(run, trainable)
    # DDP (MULTI_CPU / MULTI_GPU), DeepSpeed or --fsdp: gradients are averaged over every rank.
    stage.at("preparing the model (DDP / DeepSpeed)")
    if config.parallelism.fsdp:  # sharded already: accelerate would wrap it in DDP
        optimizer, scheduler = fsdp.prepare(accelerator, trainable, optimizer, scheduler)
    else:
        trainable, optimizer, scheduler = accelerator.prepare(trainable, optimizer, scheduler)
    # after build_data, which settles the data order the checkpoints record
    checkpoints = Checkpoints(accelerator, config.checkpoints, resume_record(values_of(config), run.world))
    step, skipped, resumed = resume_run(run, checkpoints)
    log = TrainingLog(run, tracker, step, resumed)

    trainable.train()
    loss = float("nan")  # the last finite step's
    try:  # Ctrl-C or SIGTERM: one line (where, the last checkpoint, the resume command), not a traceback per rank
        while step < steps:
            started = time.perf_counter()
            step_loss, nonfinite = optimizer_step(run, trainable, optimizer, scheduler, batches, step)
            if nonfinite is not None:
                skipped += 1
                if skipped > config.optimisation.skip_nonfinite_steps:
                    stop_on_nonfinite_loss(run, checkpoints, step, skipped - 1, *nonfinite)
                accelerator.print(
                    f"step {step + 1}: non-finite loss {nonfinite[0]}, step skipped "
                    f"({skipped} of --skip-nonfinite-steps {config.optimisation.skip_nonfinite_steps})"
                )
            step += 1
            elapsed = time.perf_counter() - started
            if step_loss is not None:
                loss = step_loss
            log.step(step, step_loss, scheduler.get_last_lr()[0], elapsed)
            if checkpoint_every and step % checkpoint_every == 0 and step < steps:
                stage.at("checkpoint save", step)
                checkpoints.save(step, skipped)
    except Interrupted as interrupt:
        stop_on_interrupt(run, checkpoints, step, interrupt)
    log.close()

    write_summary(run, step, loss, skipped)
    if config.checkpoints.no_save:
        accelerator.print(f"not saving the model (--no-save; final loss {loss:.4f})")
    else:
        save_model(run, trainable, tokenizer, loss)
    ec.remove_seq_parallel_monkey_patch()
    return loss


# ------------------------------------------------------------------- one optimizer step
def optimizer_step(run: Run, trainable, optimizer, scheduler, batches: ShardedBatches, step: int):
    """Step `step` + 1 over --gradient-accumulate-every micro-batches: (the mean of their
    losses, None), or (None, (global mean, this rank's loss sum)) of a non-finite one, after
    which the step is lost: no update and no schedule step."""
    config, accelerator, stage = run.config, run.accelerator, run.stage
    step_sum, step_count, nonfinite = 0.0, 0.0, None
    for micro in range(config.optimisation.gradient_accumulate_every):
        stage.at("preparing the batch", step + 1)
        inputs = batches.shard(step * config.optimisation.gradient_accumulate_every + micro, step + 1)
        # Every micro-batch enters accumulate(), so accelerate's count of them stays aligned,
        # but after a non-finite one the step is lost and the rest do no work: no backward,
        # which under DeepSpeed would also step the engine at the boundary.
        with accelerator.accumulate(trainable):
            if (seconds := injected_fault("hang", step + 1, run.rank)) is not None:
                time.sleep(float(seconds))
            if injected_fault("refusal", step + 1, run.rank) is not None:
                raise ValueError("a refusal injected on this rank only (EASY_CONTEXT_FAULT)")
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


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_main(main)  # exit code 0/2/3/4 without the interpreter's teardown (easy_context.core.groups.exit_process)
