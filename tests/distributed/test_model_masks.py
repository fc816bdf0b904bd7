"""Masks from the model (issue 56): configs as users load them, where the attention call's
sliding_window argument and the model's own mask disagree, or where the model hands its
attention no position_ids. Each runs the model sweep's check (tools/sweep_models.run_type) on 2
gloo ranks: every mode family against the unpatched model in one process (logits, loss, every
gradient), and for the hybrid, packed documents and generation (tools/hybrid_checks.py).

On the code before the fix: phimoe and olmoe with a window were off by 0.2 in logits (the patch
took the argument), Granite 4.0-H with attention layers raised that the model passed no
position_ids."""

import pytest
from ranks import run_ranks

from tools import sweep_models

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)

WINDOW = 40  # tools/tiny_configs.WINDOW: shorter than the sweep's sequence
CASES = {
    # windows in the mask only (create_sliding_window_causal_mask), no argument
    "phimoe-window": ("phimoe", dict(sliding_window=WINDOW)),
    # a window argument from the config, a mask without it: the unpatched model is full causal
    "olmoe-window": ("olmoe", dict(sliding_window=WINDOW)),
    # Granite 4.0-H: attention among Mamba-2 layers, NoPE as released, no position_ids to its layers
    "granite-4.0-h": (
        "granitemoehybrid",
        dict(
            layer_types=["mamba", "attention", "mamba"],
            num_hidden_layers=3,
            position_embedding_type="nope",
        ),
    ),
    "granite-4.0-h-rope": (
        "granitemoehybrid",
        dict(layer_types=["mamba", "attention"], num_hidden_layers=2, position_embedding_type="rope"),
    ),
}


def worker(rank, world_size):
    return {name: sweep_models.run_type(t, rank, world_size, **overrides) for name, (t, overrides) in CASES.items()}


@pytest.mark.timeout(600)
def test_configs_where_the_mask_and_the_argument_disagree_are_exact():
    results = run_ranks(worker, 2, timeout=560)[0]
    for name, modes in results.items():
        ran = [key for key in modes if not key.startswith("_")]
        found = sweep_models.classify(name, modes)
        assert found[0] == "exact", (name, found, modes)
        assert {"zigzag_ring_attn", "ulysses_attn", "dist_flash_attn"} <= {k.split("+")[0] for k in ran}, ran
        if CASES[name][0] == "granitemoehybrid":  # packed documents and generation ran, not skipped
            assert any(k.startswith("packed+") for k in ran) and any(k.startswith("generate+") for k in ran), modes
