"""User scripts exit clean: a plain Trainer script with prepare_trainer and a plain custom loop
with the patch, neither of which tears anything down, exit 0 every time under torchrun on gloo
(the library's exit teardown, easy_context.core.groups.register_exit_teardown). Without
it about 1 run in 24 aborted after finishing ("terminate called without an active exception").

The teardown itself is tested deterministically (tests/unit/test_exit_teardown.py); these runs
check, end to end, that the scripts' paths register it. 10 runs of each script (each run is
about 10 s of the CI budget) catch a 1-in-24 abort with probability 1 - (23/24)^20 = 57% per
CI run, and with 82% over two."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "user_scripts"
RUNS = 10


def _torchrun(script: Path, port_dir) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=port_dir)


def _why(stderr: str) -> str:
    """The workers' own last words (an abort's C++ message, a traceback's last line), which
    torchrun's failure summary at the end of stderr leaves out, then that summary."""
    markers = ("terminate called", "what():", "Fatal Python error", "Error:", "Aborted", "Exception")
    lines = [line for line in stderr.splitlines() if any(marker in line for marker in markers)]
    return "\n".join(lines[-20:]) + "\n...\n" + stderr[-1500:]


@pytest.mark.timeout(RUNS * 2 * 60)
@pytest.mark.parametrize("script", ["plain_trainer.py", "plain_loop.py"])
def test_user_scripts_exit_0_every_time(script, tmp_path):
    failures = []
    for run in range(RUNS):
        result = _torchrun(SCRIPTS / script, tmp_path)
        if result.returncode != 0:
            failures.append(f"run {run}: exit {result.returncode}\n{_why(result.stderr)}")
    assert not failures, f"{len(failures)} of {RUNS} runs of {script} failed:\n" + "\n".join(failures)
