"""Long runs that survive faults: train.py under torchrun --max-restarts 3 with
--resume-from-checkpoint auto (the same command for every attempt), while tests/chaos.py kills
ranks from outside: SIGKILL at random steps, one of them inside a checkpoint save, and a rank
stopped with SIGSTOP. Each job finishes with the weights of an uninterrupted run, bit for bit,
under DDP and FSDP2. (DeepSpeed ZeRO-3's resume is tested in tests/recipes/test_deepspeed.py;
its chaos run is not in CI: CI time.) The kill steps and ranks are drawn at random; the seed is
printed, and CHAOS_SEED=n replays a run."""

import os
import random
import signal
from pathlib import Path

import pytest
import torch
from chaos import Fault, run
from safetensors.torch import load_file

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
STEPS, EVERY = 10, 2  # optimizer steps, and a checkpoint every EVERY steps
FLAGS = ["--from-scratch", "--seq-length", "256", "--max-rows", "16", "--log-with", "none"]
FLAGS += ["--max-train-steps", str(STEPS), "--checkpointing-steps", str(EVERY), "--resume-from-checkpoint", "auto"]
RESTARTS = 3
SETTINGS = {"ddp": [], "fsdp2": ["--fsdp"]}


def random_faults(seed: int, kills: int = 3) -> list[Fault]:
    """`kills` SIGKILLs of a random rank at increasing random steps, one inside a save."""
    draw = random.Random(seed)
    first = draw.randint(1, 3)
    save = draw.choice([s for s in range(first + 1, STEPS - 2) if s % EVERY == 0])
    faults = [Fault(first, draw.randint(0, 1)), Fault(save, draw.randint(0, 1), in_save=True)]
    if kills > 2:
        faults.append(Fault(draw.randint(save + 1, STEPS - 1), draw.randint(0, 1)))
    return faults


def seed() -> int:
    value = int(os.environ.get("CHAOS_SEED", random.SystemRandom().randrange(10**6)))
    print(f"CHAOS_SEED={value}")
    return value


def weights(out: Path) -> dict:
    return load_file(out / "model.safetensors")


def assert_resumed_after_each_fault(output: str, faults: list[Fault]):
    """One line per restart, naming the step it continued from: the newest checkpoint saved
    before the fault (a save killed midway is not one)."""
    restarts = [line for line in output.splitlines() if line.startswith("restart ")]
    assert [line.split(":")[0] for line in restarts] == [f"restart {n}" for n in range(1, len(faults) + 1)], output[
        -4000:
    ]
    for line, fault in zip(restarts, faults):
        step = int(line.split(" at step ")[1].split()[0])
        newest = (fault.step - 1 if fault.in_save else fault.step) // EVERY * EVERY
        assert newest - EVERY <= step <= newest, (line, fault)  # the kill may land before step's own save


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference runs, one per setting, made once."""
    found = {}

    def reference(setting, extra=(), deepspeed_config=None, env=None):
        key = (setting, tuple(extra))
        if key not in found:
            out = tmp_path_factory.mktemp("straight") / setting
            code, output = run(out, [*FLAGS, *extra], [], RESTARTS, 400, deepspeed_config, env)
            assert code == 0, output[-3000:]
            found[key] = weights(out)
        return found[key]

    return reference


@pytest.mark.timeout(900)
@pytest.mark.parametrize("setting", SETTINGS)
def test_random_kills_one_inside_a_save_end_with_the_uninterrupted_weights(tmp_path, setting, uninterrupted):
    faults = random_faults(seed())
    code, output = run(tmp_path / "chaos", [*FLAGS, *SETTINGS[setting]], faults, RESTARTS, 600)
    assert code == 0, output[-4000:]
    assert_resumed_after_each_fault(output, faults)
    got, want = weights(tmp_path / "chaos"), uninterrupted(setting, SETTINGS[setting])
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.timeout(900)
def test_a_stopped_rank_is_detected_within_the_timeout_and_the_job_continues(tmp_path, uninterrupted):
    """SIGSTOP: the rank neither dies nor answers. Its peer gives up after --dist-timeout (gloo;
    NCCL's watchdog aborts instead, see the README), torchrun replaces both and the job goes on."""
    timeout = 10
    faults = [Fault(random.Random(seed()).randint(2, STEPS - 2), 1, sig=signal.SIGSTOP)]
    code, output = run(tmp_path / "stopped", [*FLAGS, "--dist-timeout", str(timeout)], faults, 1, 600)
    assert code == 0, output[-4000:]
    assert f"Timed out waiting {timeout * 1000}ms" in output and f"--dist-timeout {timeout} s" in output
    assert_resumed_after_each_fault(output, faults)
    got, want = weights(tmp_path / "stopped"), uninterrupted("ddp")
    assert all(torch.equal(got[k], want[k]) for k in want)
