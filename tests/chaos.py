"""Run train.py under torchrun --max-restarts and kill ranks from outside (SIGKILL, SIGSTOP)
at chosen steps, as a node failure would; then the job must finish as if nothing happened.

The helper watches <output-dir>/train_log.jsonl (one line per step, rank 0) and the
checkpoint folders, finds the rank's process among torchrun's children by its RANK, and
signals it. A kill "in a save" uses EASY_CONTEXT_FAULT=pause_in_save to hold the rank inside
the save (after it wrote its part) long enough to be killed there.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Fault:
    step: int  # after the step's log line appears (in a save: when checkpoint-<step>.partial does)
    rank: int
    in_save: bool = False
    sig: int = signal.SIGKILL


def launcher(out: Path, flags: list, restarts: int, deepspeed_config: Path | None = None) -> list:
    if deepspeed_config is not None:
        head = ["-m", "accelerate.commands.launch", "--config_file", str(deepspeed_config)]
        head += ["--max_restarts", str(restarts), "--monitor_interval", "0.5"]
    else:
        head = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", f"--max-restarts={restarts}"]
        head += ["--monitor-interval=0.5"]
    return [sys.executable, *head, str(ROOT / "train.py"), "--output-dir", str(out), *flags]


def steps_logged(out: Path, since: int) -> tuple[list[int], int]:
    """Steps logged after byte `since` of train_log.jsonl, and the new end."""
    path = out / "train_log.jsonl"
    if not path.exists():
        return [], since
    data = path.read_bytes()
    if len(data) < since:  # a fresh log (the first attempt restarted before any checkpoint)
        since = 0
    lines = data[since:].decode(errors="replace").splitlines()
    done = [json.loads(line)["step"] for line in lines if line.endswith("}")]
    return done, since + sum(len(line) + 1 for line in lines if line.endswith("}"))


def worker(agent: psutil.Process, rank: int) -> psutil.Process | None:
    for child in agent.children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "train.py" in " ".join(child.cmdline()):
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def run(out: Path, flags: list, faults: list[Fault], restarts: int, timeout: float, deepspeed_config=None, env=None):
    """Start the job, deliver `faults` in order, wait for the end: (returncode, output)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    env.pop("EASY_CONTEXT_FAULT", None)
    saves = [(i, f) for i, f in enumerate(faults) if f.in_save]
    if saves:
        # held inside the save (shorter than --dist-timeout), in the attempt the fault is for
        # (each fault before it costs one restart)
        index, fault = saves[0]
        env["EASY_CONTEXT_FAULT"] = f"pause_in_save@{fault.step}:{fault.rank}:10"
        env["EASY_CONTEXT_FAULT_ATTEMPT"] = str(index)
    with open(out.with_suffix(".log"), "w") as log:
        job = subprocess.Popen(
            launcher(out, flags, restarts, deepspeed_config), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT
        )
        try:
            _deliver(job, psutil.Process(job.pid), out, faults, time.monotonic() + timeout)
        finally:
            if job.poll() is None:
                for child in psutil.Process(job.pid).children(recursive=True):
                    child.kill()
                job.kill()
                job.wait()
    return job.returncode, out.with_suffix(".log").read_text()


def _deliver(job, agent: psutil.Process, out: Path, faults: list[Fault], deadline: float) -> None:
    offset = 0
    for fault in faults:
        while time.monotonic() < deadline and job.poll() is None:
            if fault.in_save:
                ready = (out / f"checkpoint-{fault.step}.partial").exists()
            else:
                done, offset = steps_logged(out, offset)
                ready = fault.step in done
            target = worker(agent, fault.rank) if ready else None
            if target is not None:
                if fault.in_save:
                    time.sleep(1.0)  # inside the pause: the rank has written its part
                target.send_signal(fault.sig)
                print(f"chaos: signal {fault.sig} to rank {fault.rank} (pid {target.pid}) at step {fault.step}")
                _, offset = steps_logged(out, 0)
                break
            time.sleep(0.05)
    with contextlib.suppress(subprocess.TimeoutExpired):  # the caller kills what is left
        job.wait(max(1.0, deadline - time.monotonic()))
