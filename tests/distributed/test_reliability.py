"""Failure paths of train.py under torchrun (gloo): a stuck rank is bounded by --dist-timeout,
a save killed midway never becomes `latest`, a full disk in a save stops every rank with one
line, a non-finite loss stops training (or is skipped),
and our process groups inherit the script's timeout. Failures are made deterministic with
EASY_CONTEXT_FAULT (recipes.faults.injected_fault)."""

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ranks import run_ranks
from safetensors.torch import load_file

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--from-scratch", "--seq-length", "256", "--max-rows", "16", "--log-with", "none"]
SMALL += ["--parallel-mode", "zigzag_ring_attn"]


def torchrun(out, *flags, fault=None, timeout=240):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "train.py"),
        "--output-dir",
        str(out),
        *SMALL,
        *flags,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("EASY_CONTEXT_FAULT", None)
    if fault:
        env["EASY_CONTEXT_FAULT"] = fault
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def log(out) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(300)
def test_a_stuck_rank_stops_every_rank_within_the_timeout(tmp_path):
    timeout = 15
    started = time.monotonic()
    # rank 1 sleeps well past the limit before its step-3 forward; rank 0 waits for it there
    result = torchrun(
        tmp_path / "run",
        "--max-train-steps",
        "4",
        "--dist-timeout",
        str(timeout),
        fault=f"hang@3:1:{timeout + 120}",
        timeout=timeout + 200,
    )
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    assert elapsed < timeout + 60, elapsed
    assert "train.py: error: rank 0, step 3 (forward): a collective failed" in result.stderr, result.stderr[-3000:]
    assert f"--dist-timeout {timeout} s" in result.stderr and "Timed out waiting 15000ms" in result.stderr
    assert "exitcode  : 4" in result.stderr  # EXIT_DIST_FAILURE, not a traceback
    assert "(most recent call first)" in result.stderr  # rank 1, stopped by torchrun, shows where it was stuck


@pytest.mark.timeout(600)
def test_a_save_killed_midway_resumes_from_the_previous_checkpoint_exactly(tmp_path):
    flags = ["--max-train-steps", "6", "--checkpointing-steps", "2", "--save-total-limit", "1"]
    straight = tmp_path / "straight"
    assert torchrun(straight, *flags).returncode == 0
    assert sorted(p.name for p in straight.glob("checkpoint-*")) == ["checkpoint-4"]  # checkpoint-2 pruned

    killed = tmp_path / "killed"
    result = torchrun(killed, *flags, fault="die_in_save@4:1")  # rank 1 dies after writing its part
    assert result.returncode != 0
    assert sorted(p.name for p in killed.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4.partial"]

    result = torchrun(killed, *flags, "--resume-from-checkpoint", "latest")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resumed from {killed / 'checkpoint-2'} at step 2" in result.stdout
    want = [e["loss"] for e in log(straight)]
    assert [e["loss"] for e in log(killed)[-4:]] == want[2:]  # steps 3-6, bit for bit
    assert same_tensors(load_file(straight / "model.safetensors"), load_file(killed / "model.safetensors"))
    assert sorted(p.name for p in killed.glob("checkpoint-*")) == ["checkpoint-4"]  # partial cleaned, limit kept


@pytest.mark.timeout(600)
def test_a_full_disk_in_a_save_stops_every_rank_with_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    """Rank 1's disk fills while it writes checkpoint-4: every rank stops with the same line
    (no rank left waiting), nothing is pruned, checkpoint-2 stays whole, and the same command
    with --resume-from-checkpoint auto continues from it to the uninterrupted run's weights."""
    flags = ["--max-train-steps", "6", "--checkpointing-steps", "2", "--save-total-limit", "1"]
    straight = tmp_path / "straight"
    assert torchrun(straight, *flags).returncode == 0
    out = tmp_path / "full"
    result = torchrun(out, *flags, fault="disk_full_in_save@4:1")
    assert result.returncode != 0
    message = (
        "train.py: error: step 4 (checkpoint save): checkpoint-4 was not saved (rank 1: [Errno 28] No space left on "
        f"device: '{out / 'checkpoint-4.partial' / 'model.safetensors'}'); checkpoint-2 is as it was. Free the space"
    )
    assert result.stderr.count(message) == 2 and "exitcode  : 2" in result.stderr, result.stderr[-3000:]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4.partial"]
    result = torchrun(out, *flags, "--resume-from-checkpoint", "auto")
    assert result.returncode == 0 and f"resumed from {out / 'checkpoint-2'} at step 2" in result.stdout
    assert same_tensors(load_file(straight / "model.safetensors"), load_file(out / "model.safetensors"))


@pytest.mark.timeout(600)
def test_a_nonfinite_loss_stops_after_a_checkpoint_and_can_be_skipped(tmp_path):
    out = tmp_path / "run"
    flags = ["--max-train-steps", "4", "--gradient-accumulate-every", "2"]
    # Rank 1's loss is NaN in the first of step 3's two micro-batches: the second must do no work.
    result = torchrun(out, *flags, fault="nonfinite_loss@3:1:0")
    assert result.returncode != 0  # torchrun's own code; each rank's is in its failure summary
    assert (
        "train.py: error: step 3: non-finite loss on rank(s) [1] (their loss sums: [nan]; mean over all ranks nan); "
        "stopped before the optimizer step"
    ) in result.stderr, result.stderr[-3000:]
    assert "resume it with --skip-nonfinite-steps 1" in result.stderr and "exitcode  : 3" in result.stderr
    assert (out / "checkpoint-2" / "trainer_state.json").exists()  # the last good step is kept

    # The same bad batch again, now allowed to skip one step, saving a checkpoint after each.
    result = torchrun(
        out,
        *flags,
        "--resume-from-checkpoint",
        "latest",
        "--skip-nonfinite-steps",
        "1",
        "--checkpointing-steps",
        "1",
        fault="nonfinite_loss@3:1:0",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    entries = log(out)
    assert [e["step"] for e in entries] == [1, 2, 3, 4] and entries[2]["skipped"] and entries[2]["loss"] is None
    assert entries[2]["lr"] == entries[1]["lr"] and entries[3]["loss"] is not None  # no schedule step either
    # A skipped step changes nothing: the weights and optimizer state after it are step 2's.
    before, after = out / "checkpoint-2", out / "checkpoint-3"
    assert same_tensors(load_file(before / "model.safetensors"), load_file(after / "model.safetensors"))
    opt_before = torch.load(before / "optimizer.bin", weights_only=False)["state"]
    opt_after = torch.load(after / "optimizer.bin", weights_only=False)["state"]
    assert opt_before.keys() == opt_after.keys() and all(same_tensors(opt_before[k], opt_after[k]) for k in opt_before)
    assert json.loads((after / "trainer_state.json").read_text())["skipped_steps"] == 1


def group_timeouts(rank, world_size):
    import torch.distributed as dist

    from easy_context.core.groups import Topology, get_groups, world_timeout

    groups = get_groups(Topology(world_size, 2, 1))  # two SP groups of 2: real subgroups
    backend = groups.sp._get_backend(torch.device("cpu"))
    return world_timeout(), backend.options._timeout, dist.get_world_size(groups.sp)


@pytest.mark.timeout(120)
def test_our_process_groups_inherit_the_scripts_timeout():
    for world, sub, size in run_ranks(group_timeouts, 4):  # run_ranks creates WORLD with a 90 s timeout
        assert world == sub == datetime.timedelta(seconds=90) and size == 2


def interrupted(out, flags, fault, logged, signum, group):
    """train.py under torchrun, sent `signum` once step `logged` is in its log (rank 0 then
    waits in the next step, held by the hang `fault`): to the whole process group as a terminal's
    Ctrl-C does (`group`), else to torchrun alone, as `kill` does. Returns (exit code, stderr)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "train.py"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "EASY_CONTEXT_FAULT": fault}
    run = subprocess.Popen(
        [*command, *flags],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 200
    while not ((out / "train_log.jsonl").exists() and log(out) and log(out)[-1]["step"] >= logged):
        assert time.monotonic() < deadline, f"train.py never logged step {logged}"
        time.sleep(0.2)
    (os.killpg if group else os.kill)(run.pid, signum)
    _, stderr = run.communicate(timeout=100)
    return run.returncode, stderr


@pytest.mark.timeout(400)
def test_an_interrupt_is_one_line_with_the_resume_command_and_the_log_keeps_each_step_once(tmp_path):
    """Ctrl-C in step 6 (checkpoint-3 saved): one line, no traceback from a rank, naming the step,
    the checkpoint and the command that resumes; that command, stopped by a SIGTERM in step 8,
    says the same of checkpoint-6, and its log holds steps 1-7 once each (4 and 5 ran twice)."""
    import shlex
    import signal

    out = tmp_path / "run"
    flags = ["--output-dir", str(out), *SMALL, "--max-train-steps", "8", "--checkpointing-steps", "3"]
    code, stderr = interrupted(out, flags, "hang@6:0:60", 5, signal.SIGINT, group=True)
    lines = [line for line in stderr.splitlines() if "train.py: interrupted" in line]
    assert len(lines) == 1 and "KeyboardInterrupt" not in stderr and 'train.py", line' not in stderr, stderr[-3000:]
    line, first = lines[0], [entry["loss"] for entry in log(out)]
    said = [line for line in stderr.splitlines() if line.startswith("easy_context: ")]  # rank 0's setup line
    assert len(said) == 1 and said[0].startswith("easy_context: zigzag_ring_attn on 2 ranks: sequence parallel 2"), said
    assert "shard length: S/2 of each S-token row" in said[0] and "masks: checked" in said[0]
    assert line.startswith("train.py: interrupted (SIGINT) in step 6 (") and "after 5 of 8 steps" in line, line
    assert f"the last checkpoint is {out / 'checkpoint-3'} (step 3); resume with: torchrun --standalone" in line
    resume = shlex.split(line.split("resume with: ")[1])
    assert resume[:4] == ["torchrun", "--standalone", "--nproc_per_node=2", str(ROOT / "train.py")], resume
    assert resume[4:] == [*flags, "--resume-from-checkpoint", str(out / "checkpoint-3")]

    code, stderr = interrupted(out, resume[4:], "hang@8:0:60", 7, signal.SIGTERM, group=False)
    lines = [line for line in stderr.splitlines() if "train.py: interrupted" in line]
    assert len(lines) == 1 and "KeyboardInterrupt" not in stderr and 'train.py", line' not in stderr, stderr[-3000:]
    assert lines[0].startswith("train.py: interrupted (SIGTERM) in step 8 (") and "after 7 of 8 steps" in lines[0]
    assert f"the last checkpoint is {out / 'checkpoint-6'} (step 6)" in lines[0]
    steps = log(out)
    assert [entry["step"] for entry in steps] == [1, 2, 3, 4, 5, 6, 7]
    assert [entry["loss"] for entry in steps[:5]] == first  # steps 4 and 5 again, bit for bit


@pytest.mark.timeout(300)
def test_the_peers_of_a_rank_that_refused_do_not_blame_the_connection(tmp_path):
    """Rank 1 refuses mid-run (a bad input only it sees); rank 0, whose collective then breaks
    (or whom torchrun then stops), does not report the broken connection but points at rank 1,
    and no rank prints its stack. (A rank other than 0 says nothing: the same path.)"""
    result = torchrun(tmp_path / "run", "--max-train-steps", "2", fault="refusal@1:1")
    assert result.returncode != 0
    refusal = "train.py: error: step 1 (preparing the batch): a refusal injected on this rank only"
    assert result.stderr.count(refusal) == 1, result.stderr[-3000:]
    assert "a collective failed" not in result.stderr and "(most recent call first)" not in result.stderr
    assert "train.py: rank 0 stopped at step 1 (forward): rank 1 failed" in result.stderr, result.stderr[-3000:]
