"""Run a function on N gloo ranks (spawned processes) and collect what each returns.

Every run has a deadline: a rank that fails makes its peers hang in the next collective,
so on timeout all ranks are killed and the test fails with the tracebacks gathered so far.

Every run gets fresh processes, so one test's patches and failures never reach the next. They
are forked from multiprocessing's fork server, which imports torch, transformers and
easy_context once per session: a rank then starts in about 0.2 s instead of the 4-7 s a spawned
one spends importing them again on 2 cores (a few seconds of CI per run, about 150 runs).
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def require_deepspeed():
    """DeepSpeed is an optional extra: its tests skip where it is not installed, except under
    EASY_CONTEXT_REQUIRE_DEEPSPEED=1 (CI installs it), where a missing DeepSpeed fails them."""
    if os.environ.get("EASY_CONTEXT_REQUIRE_DEEPSPEED") == "1":
        import deepspeed  # noqa: F401  (an ImportError here fails the test)
    else:
        pytest.importorskip("deepspeed", reason="the optional deepspeed extra is not installed")


# What the fork server imports once; everything else a rank imports itself, as a spawned one would.
_PRELOAD = ["torch", "torch.distributed", "transformers", "transformers.modeling_utils", "easy_context"]
_context = None


def _rank_context():
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
    return _context


def _entry(fn, rank, world_size, workdir, args, environ):
    # The fork server's environment is the session's at its start; a rank sees the test's, as
    # a spawned rank would (tests set variables such as EASY_CONTEXT_KERNEL before a run).
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(max(1, 2 // world_size))
    dist.init_process_group(
        "gloo",
        init_method=f"file://{workdir}/rendezvous",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=90),
    )
    try:
        torch.save(fn(rank, world_size, *args), f"{workdir}/result{rank}.pt")
        dist.barrier()  # nobody leaves while a peer may still talk to it
    except BaseException:
        with open(f"{workdir}/error{rank}.txt", "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()
    # The results are on disk. Rarely, gloo's threads abort the interpreter's own teardown
    # ("terminate called without an active exception", issue 17); skip that teardown.
    os._exit(0)


def run_ranks(fn, world_size: int, *args, timeout: float = 240.0) -> list:
    """fn(rank, world_size, *args) on each rank; returns the per-rank results (rank order)."""
    ctx, environ = _rank_context(), dict(os.environ)
    with tempfile.TemporaryDirectory() as workdir:
        procs = [
            ctx.Process(target=_entry, args=(fn, rank, world_size, workdir, args, environ))
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = ""
        for r in range(world_size):
            path = f"{workdir}/error{r}.txt"
            if os.path.exists(path):
                with open(path) as f:
                    errors += f"--- rank {r} ---\n" + f.read()
        if hung or errors or any(p.exitcode for p in procs):
            raise RuntimeError(
                f"distributed run failed (hung ranks: {hung}, exit codes: {[p.exitcode for p in procs]})\n{errors}"
            )
        return [torch.load(f"{workdir}/result{r}.pt", weights_only=False) for r in range(world_size)]
