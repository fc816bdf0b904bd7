"""benchmarks/bench_long_context.py's logic without a GPU: an out-of-memory is a row and the
run goes on; the ceiling search doubles then halves the gap to the resolution; the FLOP counts
that MFU and HFU divide (the planner's speed.step_flops)."""

import time

import pytest
import torch

from benchmarks import bench_long_context as bench
from recipes.plan import catalogue, speed


@pytest.fixture
def setup():
    args = bench.parse_args(["--dry-run", "--resolution", "64", "--max-length", "8192"])
    return args, bench.build_setup(args)


def fake_step(limit):
    """A step that runs out of memory above `limit` tokens (as torch raises it)."""

    def step(setup, trainable, optimizer, seq):
        if seq > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {seq} tokens")
        return {"seconds": 0.01, "peak_bytes": seq, "pinned_bytes": 0}

    return step


def test_an_out_of_memory_length_is_a_row_and_the_run_goes_on(setup, monkeypatch):
    args, built = setup
    args.lengths = [256, 4096, 512]
    monkeypatch.setattr(bench, "step", fake_step(1000))
    rows = bench.full_depth(args, built, catalogue.get_device("cpu"), time.monotonic() + 60)
    assert [r["result"] for r in rows] == ["trained", "out of memory", "trained"]
    assert rows[0]["mfu"] < rows[0]["hfu"] and rows[2]["tokens_per_s"] == 512 / 0.01


def test_the_ceiling_doubles_then_halves_to_the_resolution(setup, monkeypatch):
    args, built = setup
    monkeypatch.setattr(bench, "step", fake_step(1000))
    top = bench.ceiling(args, built, 256, time.monotonic() + 60, catalogue.get_device("cpu"))
    assert [p["seq"] for p in top["probes"]][:3] == [256, 512, 1024]
    assert 1000 - args.resolution < top["longest_seq"] <= 1000 < top["first_out_of_memory"]
    assert not top["capped"] and top["probe_layers"] == 2


def test_an_error_that_is_not_out_of_memory_is_raised(setup, monkeypatch):
    args, built = setup

    def broken(*_):
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(bench, "step", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        bench.ceiling(args, built, 256, time.monotonic() + 60, catalogue.get_device("cpu"))


def test_model_flops_are_6n_plus_causal_attention_and_executed_adds_the_recompute():
    shape = catalogue.PRESETS["llama-3.1-8b"]
    o = catalogue.Options("data_parallel", 1, 1, checkpointing=True, tiled_mlp=4096, loss_chunk=8192)
    seq = 131072
    counted = speed.step_flops(shape, seq, o)
    attention_forward = 2 * seq * shape.q * shape.layers
    assert counted["model"] == 6 * shape.matmul_params_per_token + 3 * attention_forward
    recompute = counted["matmuls"] + counted["attention"] - counted["model"]
    assert recompute >= 2 * (shape.matmul_params_per_token - shape.vocab * shape.hidden) + attention_forward
