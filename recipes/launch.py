"""How the scripts start, fail and stop, the same way everywhere.

- dist_timeout_seconds, ring_degree_error: the values and the check of the flags every script
  shares (declared once in recipes/configuration.py's ParallelismConfig).
- make_accelerator: NCCL on GPUs, DDP over gloo on CPU, DeepSpeed kept, a bounded timeout.
- fail / exit codes: a one-line message, and every rank leaves (no peer left waiting).
- script_failures: a stuck or dead peer, or a refusal raised mid-run, becomes one line naming
  the step and the phase; a rank whose collective broke because a peer stopped on purpose (a
  refusal, an interrupt: recipes/stopping.py's record) does not report the broken connection.
- run_job: Ctrl-C or SIGTERM ends the run with one line (rank 0's), not a traceback per rank.
- shutdown, run_main: engines, then group handles and process groups torn down in order
  (easy_context.core.groups.destroy_groups), then the process ends with its exit code
  (easy_context.core.groups.exit_process), so a finished run exits 0 every time.

The tests' fault injector (EASY_CONTEXT_FAULT) is recipes/faults.py.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from pathlib import Path

import torch

from recipes import stopping

__all__ = [
    "make_accelerator",
    "dist_timeout_seconds",
    "ring_degree_error",
    "fail",
    "script_failures",
    "Stage",
    "run_job",
    "run_main",
    "shutdown",
    "EXIT_BAD_INPUT",
    "EXIT_NONFINITE_LOSS",
    "EXIT_DIST_FAILURE",
    "DEFAULT_DIST_TIMEOUT",
]

EXIT_BAD_INPUT = 2  # argparse's convention: nothing ran, fix the command
EXIT_NONFINITE_LOSS = 3  # training stopped on an inf/NaN loss (a checkpoint of the last good step was saved)
EXIT_DIST_FAILURE = 4  # a collective timed out or a peer died: worth a retry from the last checkpoint

# 10 minutes. A collective waits for the slowest peer, not for the step: at 1M tokens a step
# takes minutes but every rank runs it in lockstep. What legitimately holds one rank back
# while its peers wait is I/O on one rank: rank 0 writing a 7B model (14 GB in bf16) or its
# share of a ZeRO-3 checkpoint (84 GB over all ranks) to network storage takes 1-5 minutes.
# 10 minutes covers that twice, and is 3x shorter than gloo's default (30 min).
DEFAULT_DIST_TIMEOUT = 600.0


MAX_DIST_TIMEOUT = 1e6  # seconds (11.6 days): torch keeps timeouts in int32 milliseconds up to 2.1e6 s


def dist_timeout_seconds(text: str) -> float:
    """--dist-timeout's value: seconds in (0, MAX_DIST_TIMEOUT]."""
    import argparse
    import math

    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_DIST_TIMEOUT:
        raise argparse.ArgumentTypeError(f"must be a number of seconds in (0, {MAX_DIST_TIMEOUT:g}], got {text!r}")
    return seconds


def ring_degree_error(args) -> str | None:
    """The refusal of --ring-degree with a mode that has no ring part to size, or None."""
    from easy_context.modes import get_mode, modes_with

    if args.ring_degree is not None and not get_mode(args.parallel_mode).takes_ring_degree:
        modes = " / ".join(modes_with("takes_ring_degree"))
        return f"--ring-degree applies to {modes} only (got --parallel-mode {args.parallel_mode})"
    return None


def make_accelerator(dist_timeout: float | None = None, **kwargs):
    """An accelerate.Accelerator whose gradients are synchronised on every machine.

    Under torchrun on a machine without CUDA, a plain Accelerator reports DistributedType.NO
    and never wraps the model in DDP: every rank would step on its own shard's gradient.
    `cpu=True` gives MULTI_CPU (DDP over gloo) instead. DeepSpeed synchronises gradients
    itself, and cpu=True would silently drop it, so under `accelerate launch --use_deepspeed`
    we only ask for a gloo process group. `dist_timeout` (seconds) bounds every collective,
    ours included (our groups inherit it: process_groups.world_timeout).
    """
    from easy_context.versions import check_supported

    check_supported("accelerate")
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    init = {} if dist_timeout is None else {"timeout": datetime.timedelta(seconds=dist_timeout)}
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if launched and "TORCHELASTIC_RESTART_COUNT" in os.environ:
        _init_process_group_for_this_attempt(init.get("timeout"))
    if launched and not _has_accelerator():
        if _deepspeed_requested(kwargs):
            init["backend"] = "gloo"
        else:
            kwargs.setdefault("cpu", True)
    if init:
        kwargs["kwargs_handlers"] = [*kwargs.get("kwargs_handlers", []), InitProcessGroupKwargs(**init)]
    accelerator = Accelerator(**kwargs)
    if launched and accelerator.distributed_type.name == "NO":
        raise ValueError(
            f"accelerate runs each of the {os.environ['WORLD_SIZE']} processes on its own "
            "(DistributedType.NO): gradients would never be averaged"
        )
    return accelerator


def _init_process_group_for_this_attempt(timeout) -> None:
    """The default process group, over a store whose keys belong to this attempt of torchrun.

    Why not accelerate's (env://) initialisation: torchrun's agent keeps one TCPStore for all
    attempts (measured with torch 2.13: MASTER_PORT is the same on every restart, although
    torch's rendezvous assumes a fresh store per attempt and adds no prefix). A restarted
    rank then reads the addresses the dead attempt's ranks published and gloo fails in
    connectFullMesh ("Connection refused"), or NCCL reads a stale unique id and hangs. Keys
    under "attempt_<TORCHELASTIC_RESTART_COUNT>/" are this attempt's only; accelerate (and
    DeepSpeed) then use the group as it is. Every group made later (ours included) goes
    through this store."""
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else None if _has_accelerator() else "gloo"
    if dist.is_initialized() or backend is None:  # another device: accelerate's own initialisation
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timeout or datetime.timedelta(minutes=30)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)  # else rank 0 hosts it
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=not agent_store and rank == 0,
        timeout=timeout,
        multi_tenant=not agent_store,
    )
    store = dist.PrefixStore(f"easy_context/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}/", store)
    if backend == "nccl":  # not run here (one GPU cannot hold two NCCL ranks): bind the device first
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def _has_accelerator() -> bool:
    """CUDA, or another device torch knows (XPU, NPU, ...): accelerate picks its backend."""
    if torch.cuda.is_available():
        return True
    device_api = getattr(torch, "accelerator", None)  # torch >= 2.6
    return bool(device_api is not None and device_api.is_available())


def _deepspeed_requested(kwargs) -> bool:
    from accelerate.utils import str_to_bool

    return kwargs.get("deepspeed_plugin") is not None or bool(
        str_to_bool(os.environ.get("ACCELERATE_USE_DEEPSPEED", "false"))
    )


# ------------------------------------------------------------------------------- failing
def fail(script: str, message: str, code: int = EXIT_BAD_INPUT):
    """A clear message instead of a traceback, then SystemExit(code): every rank runs the same
    checks and leaves the same way; a peer left in a collective with this rank sees it go
    and stops too (script_failures). `run_main` turns the SystemExit into the exit code."""
    stopping.record_stop("collective" if code == EXIT_DIST_FAILURE else "failed", code)  # before the peers see it go
    stopping.mark_stopping()
    print(f"{script}: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def run_main(main) -> None:
    """A script's `__main__`: run main(), then end the process with its exit code (0, or the
    SystemExit's) without the interpreter's teardown (easy_context.core.groups.exit_process).
    SIGINT and SIGTERM interrupt the run (recipes/stopping.py): one line from rank 0, exit
    128 + the signal; a SIGTERM from torchrun after a peer failed stops this rank quietly, with
    its stack when the peer saw a collective fail (this rank may be the stuck one)."""
    from easy_context.core.groups import exit_process

    stopping.install_signal_handlers()
    try:
        main()
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except stopping.Interrupted as interrupt:  # before run_job started, or after it ended
        code = interrupt.code
    except stopping.StoppedByPeer as stop:
        code = stop.peer.code
    stopping.mark_stopping()
    exit_process(code)


class Stage:
    """Where a script is (step and phase), for the message when a run ends early."""

    def __init__(self, phase: str = "setup"):
        self.step, self.phase = None, phase

    def at(self, phase: str, step: int | None = None) -> Stage:
        self.phase = phase
        if step is not None:
            self.step = step
        return self

    def __str__(self):
        return self.phase if self.step is None else f"step {self.step} ({self.phase})"


# What gloo and NCCL say when a peer is late or gone (gloo raises plain RuntimeErrors).
_BACKEND_FAILURES = (
    "Timed out",
    "timed out",
    "Connection closed by peer",
    "pair closure",
    "Connection reset by peer",
    "gloo/transport",
    "NCCL error",
)


def _is_backend_failure(error: BaseException) -> bool:
    import torch.distributed as dist

    return isinstance(error, getattr(dist, "DistError", ())) or any(s in str(error) for s in _BACKEND_FAILURES)


def _origin(error: BaseException) -> str:
    """file:line where an exception was raised: one line stays one line, and a ValueError
    that is a bug rather than a refusal can still be found."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"


@contextlib.contextmanager
def script_failures(script: str, stage: Stage, timeout: float | None):
    """One line, never a traceback, for the ways a started run ends early:
    - a refusal (ValueError) raised by the library mid-run, e.g. a prompt that does not fit
      or a kernel forced by EASY_CONTEXT_KERNEL that cannot run here, and an OSError (a
      missing or unreadable file, a full disk): exit EXIT_BAD_INPUT, naming the phase and
      where it was raised;
    - a collective that times out (a stuck peer) or breaks (a dead peer): exit
      EXIT_DIST_FAILURE, naming the rank, the step and the phase. On gloo, that is; NCCL's
      watchdog aborts the process itself (see --dist-timeout in docs/bad_inputs.md)."""
    try:
        yield
    except (ValueError, OSError) as error:
        fail(script, f"{stage}: {error} (raised at {_origin(error)})")
    except RuntimeError as error:
        if not _is_backend_failure(error):
            raise
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        peer = stopping.peer_stop()
        if peer is not None:  # it stopped on purpose and said why; the broken connection is not the cause
            peer_stopped(script, stage, peer)
        limit = f"--dist-timeout {timeout:g} s" if timeout is not None else "the backend's timeout"
        detail = " ".join(str(error).split())[:300]
        # No teardown of the broken group: run_main ends the process without it.
        fail(
            script,
            f"rank {rank}, {stage}: a collective failed ({detail}). A peer is stuck past {limit} or died "
            "(a stuck rank stopped by the launcher prints its stack); resume from the last checkpoint.",
            EXIT_DIST_FAILURE,
        )


# ----------------------------------------------------------------------- a script's run
def run_job(script: str, job, dist_timeout: float, **accelerator_kwargs):
    """The scripts' frame: make the accelerator, run job(accelerator, stage), shut down cleanly;
    a refusal or a failed collective anywhere in it ends as one line (script_failures).
    `dist_timeout`: --dist-timeout, the longest wait in any collective."""
    stage = Stage()
    try:
        with script_failures(script, stage, dist_timeout):
            accelerator = make_accelerator(dist_timeout=dist_timeout, **accelerator_kwargs)
            result = job(accelerator, stage)
            stage.at("shutdown")
            shutdown(accelerator)
    except stopping.Interrupted as interrupt:  # a job that says more catches it first (train.py)
        stopping.mark_stopping()
        if stopping.this_rank() == 0:
            print(f"{script}: interrupted ({interrupt.name}) at {stage}", file=sys.stderr)
        raise SystemExit(interrupt.code) from None
    except stopping.StoppedByPeer as stop:  # torchrun's SIGTERM after the peer stopped
        peer_stopped(script, stage, stop.peer)
    return result


def peer_stopped(script: str, stage: Stage, peer: stopping.PeerStop):
    """This rank stops because `peer` did (its line says why): rank 0 says which rank that was,
    the other ranks nothing; the peer's exit code."""
    stopping.mark_stopping()
    if stopping.this_rank() == 0:
        print(f"{script}: rank 0 stopped at {stage}: {peer}", file=sys.stderr)
    raise SystemExit(peer.code) from None


# ------------------------------------------------------------------------------ stopping
def shutdown(accelerator=None) -> None:
    """Stop cleanly: wait for every peer (rank 0 may still be saving), release the models and
    the DeepSpeed engine, then the library's destroy_groups: our group handles forgotten and
    the process groups destroyed while the interpreter is fully alive."""
    from easy_context.core.groups import destroy_groups

    if accelerator is not None:
        accelerator.wait_for_everyone()
        for tracker in accelerator.trackers:
            tracker.finish()
        accelerator.free_memory()  # destroys the DeepSpeed engine too
    destroy_groups()
