"""Run a function on N gloo ranks (spawned processes) and collect what each returns.

Every run has a deadline: a rank that fails makes its peers hang in the next collective,
so on timeout all ranks are killed and the test fails with the tracebacks gathered so far.
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


def _entry(fn, rank, world_size, workdir, args):
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
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as workdir:
        procs = [ctx.Process(target=_entry, args=(fn, r, world_size, workdir, args)) for r in range(world_size)]
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
