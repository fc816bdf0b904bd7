"""User scripts exit clean: a plain Trainer script with prepare_trainer and a plain custom loop
with the patch, neither of which tears anything down, exit 0 every time under torchrun on gloo
(the library's exit teardown, easy_context.core.groups.register_exit_teardown). Without
it about 1 run in 24 aborted after finishing ("terminate called without an active exception").

The teardown itself is tested deterministically (tests/unit/test_exit_teardown.py); these runs
check, end to end, that each script's path registers it and that it runs: a hook installed
before the script (a sitecustomize on PYTHONPATH, so its exit hook runs after every other one)
reports whether the process group is still up at the very end of each worker. Each run also
says what runs in one line at setup (easy_context's log line, rank 0 only). A path that does
not register the teardown leaves it up in every run (and aborted in about 1 run in 24), so a few
runs of each script suffice (EASY_CONTEXT_EXIT_TEARDOWN=0 fails every one).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "user_scripts"
RUNS = 3
# tests/user_scripts/exit_report/sitecustomize.py: each worker's exit hook that runs last writes
# whether its process group is still up.
EXIT_REPORT = SCRIPTS / "exit_report"
SETUP_LINE = (
    "easy_context: zigzag_ring_attn on 2 ranks: sequence parallel 2 x data parallel 1, ring degree 2, Ulysses "
    "degree 1 (zigzag ring x2); shard length: S/2 of each S-token row (S a multiple of 4); masks: checked, the "
    "patch's agree with the model's (1 kind of layer mask)"
)


def _torchrun(script: Path, cwd: Path, reports: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    # the tree under test first (the scripts run from another folder, where an installed copy would win)
    path = os.pathsep.join(p for p in (str(EXIT_REPORT), str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(
        os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=path, EXIT_REPORT_DIR=str(reports)
    )
    return subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, cwd=cwd)


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
        reports = tmp_path / f"reports-{run}"
        reports.mkdir()
        result = _torchrun(SCRIPTS / script, tmp_path, reports)
        said = {path.name: path.read_text() for path in sorted(reports.iterdir())}
        torn_down = {f"rank{rank}": "process group up: False" for rank in (0, 1)}
        if result.returncode != 0 or said != torn_down:
            failures.append(f"run {run}: exit {result.returncode}, {said}\n{_why(result.stderr)}")
        # what runs, said once (rank 0) at setup: the custom loop's patch, the Trainer's prepare_trainer
        setup_lines = [line for line in result.stderr.splitlines() if line.startswith("easy_context: ")]
        if setup_lines != [SETUP_LINE]:
            failures.append(f"run {run}: the setup lines are {setup_lines}")
    assert not failures, f"{len(failures)} of {RUNS} runs of {script} failed:\n" + "\n".join(failures)
