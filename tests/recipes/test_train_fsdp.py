"""train.py --fsdp (FSDP2, fully_shard per decoder layer and the root) trains like one process
in every mode: per-step losses and the saved (gathered) weights. Gradient scale:
tests/distributed/test_fsdp.py compares the gradients themselves, which Adam's updates hide."""

import pytest
from safetensors.torch import load_file
from script_runs import train

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)

STEPS = ["--max-train-steps", "4", "--gradient-accumulate-every", "2"]
LOSS_TOL, WEIGHT_TOL = 1e-5, 1e-6  # measured: losses 4.8e-7, weights 3.3e-7


def _differences(got_run, want_run):
    (got, got_dir), (want, want_dir) = got_run, want_run
    assert len(got) == len(want) == 4, (got, want)
    got_weights, want_weights = load_file(got_dir / "model.safetensors"), load_file(want_dir / "model.safetensors")
    assert set(got_weights) == set(want_weights)
    loss = max(abs(a - b) for a, b in zip(got, want))
    weights = max((got_weights[k] - w).abs().max().item() for k, w in want_weights.items())
    return loss, weights


@pytest.mark.timeout(900)
def test_every_mode_under_fsdp_trains_like_one_process(tmp_path):
    want = train(tmp_path, "one-process", 1, "--parallel-mode", "data_parallel", *STEPS)
    runs = {
        "zigzag": ["--parallel-mode", "zigzag_ring_attn", "--checkpointing-steps", "2"],
        "ulysses": ["--parallel-mode", "ulysses_attn"],
        # MLPs over tiles and the loss over chunks, each under checkpointing inside the FSDP units
        "usp+tiles": [
            "--parallel-mode",
            "usp_attn",
            "--ring-degree",
            "2",
            "--tiled-mlp",
            "48",
            "--loss-chunk-size",
            "50",
        ],
        # with checkpointing (dist_flash's recompute-free backward) and the offload policy
        "dist_flash+checkpointing+offload": [
            "--parallel-mode",
            "dist_flash_attn",
            "--activation-checkpointing",
            "--fsdp-offload",
        ],
    }
    for name, flags in runs.items():
        loss, weights = _differences(train(tmp_path, name, 2, "--fsdp", *flags, *STEPS), want)
        print(f"{name}: loss difference {loss:.1e}, weight difference {weights:.1e}")
        assert loss <= LOSS_TOL and weights <= WEIGHT_TOL, (name, loss, weights)

    # Resumed from zigzag's checkpoint of step 2 (the shards of the weights and of Adam's state),
    # with rank 1's loss NaN in step 3: the step is skipped as in one process with the same fault.
    fault = "nonfinite_loss@3:{rank}:0"
    skip = ["--skip-nonfinite-steps", "1"]
    want = train(
        tmp_path,
        "one-process-skip",
        1,
        "--parallel-mode",
        "data_parallel",
        *STEPS,
        *skip,
        env={"EASY_CONTEXT_FAULT": fault.format(rank=0)},
    )
    resume = ["--resume-from-checkpoint", str(tmp_path / "zigzag" / "checkpoint-2")]
    got = train(
        tmp_path,
        "resumed-skip",
        2,
        "--fsdp",
        "--parallel-mode",
        "zigzag_ring_attn",
        *STEPS,
        *skip,
        *resume,
        env={"EASY_CONTEXT_FAULT": fault.format(rank=1)},
    )
    (got, got_dir), (want, want_dir) = got, want
    assert len(got) == 2 and got[0] is None and want[2] is None, (got, want)  # step 3 skipped in both
    loss = abs(got[1] - want[3])
    got_weights, want_weights = load_file(got_dir / "model.safetensors"), load_file(want_dir / "model.safetensors")
    weights = max((got_weights[k] - w).abs().max().item() for k, w in want_weights.items())
    print(f"resumed, step 3 skipped: step 4 loss difference {loss:.1e}, weight difference {weights:.1e}")
    assert loss <= LOSS_TOL and weights <= WEIGHT_TOL, (loss, weights)


@pytest.mark.timeout(600)
def test_sp2_by_dp_shard2_under_fsdp_trains_like_one_process(tmp_path):
    """World 4: two data-parallel groups of two sequence-parallel ranks, all four one FSDP shard
    group; one process reads both groups' rows as a batch of 2."""
    want = train(tmp_path, "one-process", 1, "--parallel-mode", "data_parallel", "--batch-size", "2", *STEPS)
    got = train(tmp_path, "sp2-dp2", 4, "--fsdp", "--parallel-mode", "zigzag_ring_attn", "--sp-size", "2", *STEPS)
    loss, weights = _differences(got, want)
    print(f"world 4, sp 2 x dp 2: loss difference {loss:.1e}, weight difference {weights:.1e}")
    assert loss <= LOSS_TOL and weights <= WEIGHT_TOL, (loss, weights)
