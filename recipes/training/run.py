"""The run's setup (seed, parallel layout, what cannot run refused), where it resumes, and how it
stops on a non-finite loss."""

from __future__ import annotations

import math
import os
import sys

import torch

from easy_context.hf.accelerate_parallelism import check_accelerate_parallelism
from easy_context.modes import get_mode
from recipes import fsdp
from recipes.checkpointing import CheckpointError, Checkpoints
from recipes.launch import EXIT_BAD_INPUT, EXIT_NONFINITE_LOSS, Stage
from recipes.launch import fail as launch_fail
from recipes.stopping import Interrupted, mark_stopping, same_command
from recipes.training.config import TrainConfig


def fail(message: str, code: int = EXIT_BAD_INPUT):
    launch_fail("train.py", message, code)


class Run:
    """What the steps of a run share, built once and passed to each: its configuration, the
    accelerator, where this rank sits."""

    def __init__(self, config: TrainConfig, accelerator, stage: Stage, topology, deepspeed, document_split):
        self.config, self.accelerator, self.stage = config, accelerator, stage
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


def set_up_run(config: TrainConfig, accelerator, stage: Stage) -> Run:
    """The seed, and the parallel layout of this many processes; what cannot run is refused."""
    from accelerate.utils import set_seed

    world = accelerator.num_processes
    set_seed(config.data.seed)
    mode = get_mode(config.parallelism.parallel_mode)
    try:
        topology = mode.topology(world, config.parallelism.sp_size, config.parallelism.ring_degree)
        mode.layout(topology).check_length(config.data.seq_length)
    except ValueError as error:
        fail(
            f"{error} (--parallel-mode {config.parallelism.parallel_mode}, {world} processes, "
            f"--seq-length {config.data.seq_length})"
        )
    if mode.sequence_parallel:
        try:
            check_accelerate_parallelism(accelerator, config.parallelism.parallel_mode)
        except ValueError as error:
            fail(str(error))
    deepspeed = accelerator.state.deepspeed_plugin
    if deepspeed is not None and config.optimisation.skip_nonfinite_steps:
        # accelerate's DeepSpeed wrapper steps the engine inside backward at the accumulation
        # boundary, and the engine's gradients cannot be zeroed from here: a step cannot be
        # dropped once some of its micro-batches went backward. (Stopping needs neither.)
        fail(
            "--skip-nonfinite-steps is not supported under DeepSpeed; without it, training stops at a non-finite loss "
            "after saving a checkpoint of the last good step"
        )
    if deepspeed is not None and config.memory.compile:
        fail("--compile is not supported under DeepSpeed (its engine wraps the model); drop --compile")
    if refusal := fsdp.refusal(config.parallelism.fsdp, accelerator):
        fail(refusal)
    # --balance-documents: a layout per row (document_split); Ulysses alone is balanced already.
    split = (
        {None: None, "cut": True, "workload": "workload"}[config.data.balance_documents]
        if mode.document_split
        else None
    )
    return Run(config, accelerator, stage, topology, deepspeed, split)


def resume_run(run: Run, checkpoints: Checkpoints) -> tuple[int, int, bool]:
    """(step, skipped steps, resumed): where --resume-from-checkpoint left off, or the start."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # torchrun's restarts of this job
    try:
        run.stage.at("finding the checkpoint to resume")
        path = checkpoints.find(run.config.checkpoints.resume_from_checkpoint)
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


def stop_on_interrupt(run: Run, checkpoints: Checkpoints, step: int, interrupt: Interrupted):
    """Ctrl-C or SIGTERM during training: one line from the main process (where it stopped, the
    last checkpoint, the command that resumes from it), then exit 128 + the signal. Nothing is
    saved now: the ranks were interrupted at different points, and the checkpoint already on disk
    resumes exactly."""
    mark_stopping()
    if run.accelerator.is_main_process:
        config = run.config
        if checkpoints.newest is None:
            every = config.checkpoints.checkpointing_steps
            keep = " (--checkpointing-steps N saves one every N steps)" if not every else ""
            kept = f"no checkpoint was saved{keep}; run it again with: {same_command({})}"
        else:
            at, path = checkpoints.newest
            resume = same_command({"--resume-from-checkpoint": str(path)})
            kept = f"the last checkpoint is {path} (step {at}); resume with: {resume}"
        print(
            f"train.py: interrupted ({interrupt.name}) in {run.stage}, after {step} of "
            f"{config.optimisation.max_train_steps} steps; {kept}",
            file=sys.stderr,
            flush=True,
        )
    raise SystemExit(interrupt.code)
