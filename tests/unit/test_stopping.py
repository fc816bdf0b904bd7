"""recipes/stopping.py without a distributed run: the resume command an interrupt prints, and
SIGINT / SIGTERM as one Interrupted. (Under torchrun, the interrupt's line, the resumed log and
the quiet peers: tests/distributed/test_reliability.py.)"""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from recipes.stopping import Interrupted, same_command

ROOT = Path(__file__).resolve().parents[2]
RESUME = {"--resume-from-checkpoint": "out/checkpoint-6"}


def test_the_resume_command_is_the_runs_own_with_the_flag_replaced():
    argv = ["train.py", "--seq-length", "256", "--resume-from-checkpoint", "out/checkpoint-3", "--name", "a b"]
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    assert same_command(RESUME, argv, torchrun) == (
        "torchrun --standalone --nproc_per_node=2 train.py --seq-length 256 --name 'a b' "
        "--resume-from-checkpoint out/checkpoint-6"
    )
    python = Path(sys.executable).name
    assert same_command(RESUME, ["train.py", "--resume-from-checkpoint=auto"], {}) == (
        f"{python} train.py --resume-from-checkpoint out/checkpoint-6"
    )
    assert same_command({}, ["train.py", "--seq-length", "256"], {}) == f"{python} train.py --seq-length 256"
    # several nodes, or accelerate launch: their flags are not the ranks' to know
    nodes = {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    assert same_command(RESUME, ["train.py"], nodes).startswith("<launcher> train.py --resume-from-checkpoint")
    accelerate = {**torchrun, "ACCELERATE_MIXED_PRECISION": "bf16"}
    assert same_command(RESUME, ["train.py"], accelerate).startswith("<launcher> train.py")


def test_an_interrupt_names_its_signal_and_exits_with_the_shells_code():
    assert (Interrupted(2).name, Interrupted(2).code) == ("SIGINT", 130)
    assert (Interrupted(15).name, Interrupted(15).code) == ("SIGTERM", 143)
    assert isinstance(Interrupted(2), KeyboardInterrupt)


@pytest.mark.slow  # starts a process
@pytest.mark.timeout(60)
def test_sigint_and_sigterm_raise_one_interrupt_and_a_second_signal_changes_nothing():
    program = textwrap.dedent(
        """
        import os, signal, time
        from recipes.stopping import Interrupted, install_signal_handlers
        install_signal_handlers()
        for signum in (signal.SIGTERM, signal.SIGINT):
            try:
                os.kill(os.getpid(), signum)
                time.sleep(5)
            except Interrupted as interrupt:
                print(interrupt.name)
                break
        os.kill(os.getpid(), signal.SIGINT)  # after the first, ignored: the run is already stopping
        time.sleep(0.2)
        print("still here")
        """
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=50, cwd=ROOT)
    assert result.returncode == 0 and result.stdout.splitlines() == ["SIGTERM", "still here"], result.stderr
