"""The README's demo, as a newcomer runs it: train.py's default job extends the shipped base
(models/demo-base, trained at 512 tokens) to 2,048 tokens over 2 ranks, and eval_needle.py
then finds the needles at every length up to 2,048, where the base alone does not.

The numbers the README shows (0.96 extended, teacher-forced and generated; the base 1.00 up to
512 tokens and 0.26 overall) came from these commands; the bounds here are the issue's goal."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]


def torchrun(script, *flags):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script, *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def needle_scores(tmp_path, model: Path, name: str) -> dict:
    """eval_needle.py's default sweep (256-2,048 tokens, 5 depths, 2 samples) with --generate:
    its summary JSON."""
    out = tmp_path / name
    torchrun("eval_needle.py", "--model", str(model), "--generate", "--hide-progress", "--output-dir", str(out))
    return json.loads((out / f"needle_{model.name}.json").read_text())


def accuracy_where(summary: dict, field: str, keep) -> float:
    cells = [value for cell, value in summary[field].items() if keep(int(cell.split("/")[0]))]
    return sum(cells) / len(cells)


@pytest.mark.timeout(1500)
def test_default_job_extends_the_base_to_2k_and_the_needles_are_found(tmp_path):
    base = needle_scores(tmp_path, ROOT / "models" / "demo-base", "base")
    for field in ("accuracy", "generate_accuracy"):
        assert accuracy_where(base, field, lambda n: n <= 512) >= 0.9, field
        assert accuracy_where(base, field, lambda n: n > 512) <= 0.2, field

    model = tmp_path / "extended"
    torchrun("train.py", "--output-dir", str(model), "--log-with", "none")
    extended = needle_scores(tmp_path, model, "extended")
    assert extended["overall_accuracy"] >= 0.9 and extended["generate_overall_accuracy"] >= 0.9, (
        extended["accuracy"],
        extended["generate_accuracy"],
    )
    assert accuracy_where(extended, "accuracy", lambda n: n > 512) >= 0.9
