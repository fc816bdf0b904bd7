"""The recipe the project is named for, on CPU: train.py under `accelerate launch` with DeepSpeed
ZeRO-3 and CPU offload of parameters and optimizer (accelerate_configs/cpu_zero3_offload.yaml),
2 processes, gloo. A finished run exits 0 every time, resume continues exactly, a non-finite
loss stops with a checkpoint. (Evaluation under ZeRO-3: tests/recipes/test_eval.py.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ranks import require_deepspeed
from safetensors.torch import load_file

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "accelerate_configs" / "cpu_zero3_offload.yaml"
SMALL = ["--seq-length", "256", "--max-rows", "16", "--log-with", "none", "--from-scratch"]
ACCUMULATE = ["--gradient-accumulate-every", "2"]  # DeepSpeed counts micro-batches itself: exercise it


@pytest.fixture(autouse=True)
def deepspeed_installed():
    require_deepspeed()


def launch(out, *flags, fault=None, timeout=300):
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(CONFIG),
        str(ROOT / "train.py"),
        "--output-dir",
        str(out),
        *SMALL,
        *flags,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("EASY_CONTEXT_FAULT", None)
    if fault:
        env["EASY_CONTEXT_FAULT"] = fault
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "train_log.jsonl").read_text().splitlines()]


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(1200)
def test_zero3_offload_exits_0_five_times_in_a_row_and_resumes_exactly(tmp_path):
    flags = ["--max-train-steps", "4", "--checkpointing-steps", "2", *ACCUMULATE]
    runs = []
    for attempt in range(5):
        out = tmp_path / f"run{attempt}"
        result = launch(out, *flags)
        assert result.returncode == 0, (attempt, result.stderr[-3000:])
        assert "terminate called" not in result.stderr and (out / "checkpoint-2" / "trainer_state.json").exists()
        runs.append((losses(out), load_file(out / "model.safetensors")))
    first_losses, first_model = runs[0]
    assert len(first_losses) == 4 and first_losses[-1] < first_losses[0]
    for other_losses, other_model in runs[1:]:  # the same recipe gives the same run, bit for bit
        assert other_losses == first_losses and same_tensors(other_model, first_model)

    resumed = tmp_path / "resumed"
    result = launch(resumed, *flags, "--resume-from-checkpoint", str(tmp_path / "run0" / "checkpoint-2"))
    assert result.returncode == 0, result.stderr[-3000:]
    # Step 3 runs on the restored weights: bit for bit. After it, the last bits only:
    # DeepSpeed's cpu_adam keeps beta^t as a running product, and a fresh process recomputes it
    # with pow() at the resumed step, so the step-3 update differs by an ulp although the Adam
    # moments are bit-equal (measured: weights 1.2e-7 apart after step 3, 1.7e-6 after step 4,
    # step-4 loss 1e-6). DDP's resume is bit-exact (test_reliability).
    resumed_losses = losses(resumed)
    assert len(resumed_losses) == 2 and resumed_losses[0] == first_losses[2]
    assert abs(resumed_losses[1] - first_losses[3]) <= 1e-5
    resumed_model = load_file(resumed / "model.safetensors")
    assert resumed_model.keys() == first_model.keys()
    assert max((resumed_model[k] - first_model[k]).abs().max().item() for k in first_model) <= 1e-5


def zero_shards(checkpoint) -> list[torch.Tensor]:
    """The fp32 master weights of each rank's ZeRO-3 partition in an accelerate checkpoint."""
    files = sorted((checkpoint / "pytorch_model").glob("zero_pp_rank_*_optim_states.pt"))
    return [t for f in files for t in torch.load(f, weights_only=False)["optimizer_state_dict"]["fp32_flat_groups"]]


@pytest.mark.timeout(900)
def test_zero3_offload_stops_on_a_nonfinite_loss_before_any_update_and_refuses_skipping(tmp_path):
    straight = tmp_path / "straight"  # the reference: a checkpoint after step 2
    assert launch(straight, "--max-train-steps", "4", "--checkpointing-steps", "2", *ACCUMULATE).returncode == 0
    # Rank 0's loss is NaN in the first of step 3's two micro-batches. A backward on the second
    # would step DeepSpeed's engine at the accumulation boundary: it must not happen.
    out = tmp_path / "run"
    result = launch(out, "--max-train-steps", "4", *ACCUMULATE, fault="nonfinite_loss@3:0:0")
    assert result.returncode != 0
    assert "train.py: error: step 3: non-finite loss on rank(s) [0]" in result.stderr, result.stderr[-3000:]
    assert "exitcode  : 3" in result.stderr
    stopped, reference = zero_shards(out / "checkpoint-2"), zero_shards(straight / "checkpoint-2")
    assert len(stopped) == len(reference) == 2 and all(torch.equal(a, b) for a, b in zip(stopped, reference))

    result = launch(
        out, "--max-train-steps", "4", *ACCUMULATE, "--resume-from-checkpoint", "latest", "--skip-nonfinite-steps", "1"
    )
    assert "train.py: error: --skip-nonfinite-steps is not supported under DeepSpeed" in result.stderr
    assert "exitcode  : 2" in result.stderr and "Traceback" not in result.stderr.split("train.py: error")[0]
