"""The recipes' scripts run as users run them, for the tests under tests/recipes/: train.py under
torchrun (`train`, its small job in `SMALL`), any script or module (`run_script`), and what
they wrote (`read_csv`)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--seq-length", "256", "--max-rows", "16", "--log-with", "none", "--learning-rate", "1e-3"]


def train(tmp_path, name, processes, *flags, timeout=240, env=None):
    """train.py under torchrun: the from-scratch job (random tiny Llama, byte tokenizer, the
    embedded corpus) unless `flags` name a --model. Returns (per-step losses, output folder)."""
    out = tmp_path / name
    job = [] if "--model" in flags or "--from-config" in flags else ["--from-scratch"]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={processes}",
        str(ROOT / "train.py"),
        "--output-dir",
        str(out),
        *SMALL,
        *job,
        *flags,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    return [entry["loss"] for entry in log], out


def run_script(script, *flags, processes=1, cwd=ROOT):
    if processes > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    else:
        command = [sys.executable]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    target = [str(ROOT / script)] if script.endswith(".py") else ["-m", script]  # a module: from ROOT
    result = subprocess.run([*command, *target, *flags], capture_output=True, text=True, timeout=240, env=env, cwd=cwd)
    return result


def ok(result):
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def read_csv(path, reader=csv.DictReader) -> list:
    """Every row of a CSV file a script wrote (csv.DictReader: dicts; csv.reader: lists)."""
    with open(path) as f:
        return list(reader(f))
