"""benchmarks/bench_long_context.py's logic without a GPU: an out-of-memory is a row and the
run goes on, its memory let go of after the `except` block; the ceiling search doubles (never
past the first length the planner rules out) then bisects to the resolution; a probe's model is
freed when deleted, without a garbage collection; the pinned column reads active bytes; the
card's peak comes from its name; the FLOP counts that MFU and HFU divide (speed.step_flops)."""

import gc
import sys
import time
import weakref

import pytest
import torch

from benchmarks import bench_long_context as bench
from recipes.plan import catalogue, memory, speed
from recipes.training.sources import config_path


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


def released_outside_except(calls):
    """bench.release, recording whether an exception was being handled when it ran (inside the
    `except` block the traceback holds the failed step's activations)."""

    def release(setup, optimizer):
        calls.append(sys.exc_info()[0])

    return release


def test_an_out_of_memory_length_is_a_row_and_the_run_goes_on(setup, monkeypatch):
    args, built = setup
    args.lengths = [256, 4096, 512]
    monkeypatch.setattr(bench, "step", fake_step(1000))
    calls = []
    monkeypatch.setattr(bench, "release", released_outside_except(calls))
    rows = bench.full_depth(args, built, catalogue.get_device("cpu"), time.monotonic() + 60)
    assert [r["result"] for r in rows] == ["trained", "out of memory", "trained"]
    assert rows[0]["mfu"] < rows[0]["hfu"] and rows[2]["tokens_per_s"] == 512 / 0.01
    assert calls == [None], calls  # released once, after the except block


def test_the_ceiling_doubles_then_bisects_to_the_resolution(setup, monkeypatch):
    args, built = setup
    monkeypatch.setattr(bench, "step", fake_step(1000))
    calls = []
    monkeypatch.setattr(bench, "release", released_outside_except(calls))
    top = bench.ceiling(args, built, 256, time.monotonic() + 60, catalogue.get_device("cpu"))
    assert [p["seq"] for p in top["probes"]][:3] == [256, 512, 1024]
    assert 1000 - args.resolution < top["longest_seq"] <= 1000 < top["first_out_of_memory"]
    assert not top["capped"] and top["probe_layers"] == 2 and top["planner_limit"] is None
    assert calls and set(calls) == {None}
    # the memory in use before the ballast, and before each probe, recorded beside it
    assert top["in_use_before_ballast"]["allocated_bytes"] > 0
    assert all(p["in_use_before"]["allocated_bytes"] > 0 and p["planner_peak_bytes"] > 0 for p in top["probes"])


def test_the_ceiling_probes_the_planners_limit_instead_of_doubling_past_it(setup, monkeypatch):
    """The planner rules out 640 and up: 512 doubles to 640, not 1024; the gap 512..640 is then
    bisected. Where the planner is wrong (640 trains), the doubling goes on from there."""
    args, built = setup
    monkeypatch.setattr(bench, "planner_limit", lambda *a: 640)
    monkeypatch.setattr(bench, "step", fake_step(600))
    top = bench.ceiling(args, built, 256, time.monotonic() + 60, catalogue.get_device("cpu"))
    assert [p["seq"] for p in top["probes"]] == [256, 512, 640, 576], top["probes"]
    assert top["longest_seq"] == 576 and top["first_out_of_memory"] == 640
    monkeypatch.setattr(bench, "step", fake_step(1500))
    top = bench.ceiling(args, built, 256, time.monotonic() + 60, catalogue.get_device("cpu"))
    assert [p["seq"] for p in top["probes"]][:4] == [256, 512, 640, 1280], top["probes"]


def test_the_planners_limit_for_the_8b_shape_on_an_h100_lies_between_512k_and_1m():
    """The docs' table: 512K predicted to fit one H100 80GB (73 GiB), 1M not (128 GiB). The search
    after 512K then probes the planner's limit, not 1M."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(config_path("llama-3.1-8b")))
    shape = catalogue.shape_from_config(config, "llama-3.1-8b")
    tile, chunk = memory.default_tile(shape), memory.default_chunk(shape)
    setup = bench.Setup(config, shape, torch.device("cuda"), torch.bfloat16, tile, chunk, offload=True)
    h100 = catalogue.get_device("h100-80g")
    limit = bench.planner_limit(setup, h100, 65536, 16384, 1 << 22)
    assert 524288 < limit < 1048576 and limit % 16384 == 0, limit
    over = bench.predicted(setup, limit, h100)["peak_bytes"]
    under = bench.predicted(setup, limit - 16384, h100)["peak_bytes"]
    assert under <= h100.memory_gib * catalogue.GIB < over
    args = bench.parse_args(["--dry-run", "--resolution", "16384", "--max-length", str(1 << 22)])
    assert bench.next_probe(524288, 524288, None, limit, args) == limit


def test_a_probes_model_is_freed_without_a_garbage_collection(setup):
    """After a step, `del` of the probe's model and optimizer frees every weight at once: no
    reference cycle keeps any (the tiled MLPs' forwards held their modules: 6 of 21 tensors
    here, every MLP weight, stayed until gc.collect(), so the next probe ran beside them)."""
    args, built = setup
    trainable, optimizer = bench.build_model(built, 2)
    bench.step(built, trainable, optimizer, 256)
    weights = {name: weakref.ref(p) for name, p in trainable.named_parameters()}
    gc.disable()
    try:
        del trainable, optimizer
        alive = [name for name, ref in weights.items() if ref() is not None]
    finally:
        gc.enable()
    assert not alive, f"{len(alive)} of {len(weights)} weights outlive their model: {alive[:4]}"


def test_the_pinned_column_reads_the_host_allocators_active_bytes():
    stats = {"allocated_bytes.peak": 24 << 30, "active_bytes.peak": 16 << 30, "active_bytes.current": 0}
    assert bench.pinned_bytes(stats) == 16 << 30
    assert bench.pinned_bytes({"active_bytes.all.peak": 5}) == 5 and bench.pinned_bytes({}) == 0


@pytest.mark.parametrize(
    "name, key, tflops",
    [
        ("NVIDIA H100 80GB HBM3", "h100-80g", 989),
        ("NVIDIA H100 PCIe", "h100-pcie", 756),
        ("NVIDIA H100 NVL", "h100-nvl", 835),
        ("NVIDIA H200", "h200", 989),
        ("NVIDIA H200 NVL", "h200-nvl", 835),
        ("NVIDIA A100-SXM4-40GB", "a100-40g", 312),
    ],
)
def test_the_cards_peak_comes_from_its_name(name, key, tflops):
    assert catalogue.device_of_gpu(name) == key and catalogue.get_device(key).tflops == tflops


def test_the_allocator_is_asked_for_expandable_segments_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv(bench.ALLOCATOR_VARIABLE, raising=False)
    assert bench.use_expandable_segments().startswith("expandable_segments:True")
    monkeypatch.setenv(bench.ALLOCATOR_VARIABLE, "max_split_size_mb:512")
    assert bench.use_expandable_segments() == "max_split_size_mb:512,expandable_segments:True"
    monkeypatch.setenv(bench.ALLOCATOR_VARIABLE, "expandable_segments:False")
    assert bench.use_expandable_segments() == "expandable_segments:False"


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


@pytest.mark.parametrize("seq", [8192, 131072, 1 << 20])
def test_the_executed_flops_hfu_divides_hold_attention_and_its_recompute(seq):
    """bench_long_context's executed FLOPs per token against the model FLOPs (MFU's), counted
    here from the shape: above them by at least the checkpointed layers' matmuls run again and
    attention's 1.5 extra forwards (flash's backward recomputes the scores, 3.5 forwards in all
    against the model's 3; the checkpointed forward runs attention again). Executed FLOPs
    without attention fall below the model's once attention is most of the work."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(config_path("llama-3.1-8b")))
    shape = catalogue.shape_from_config(config, "llama-3.1-8b")
    setup = bench.Setup(config, shape, torch.device("cuda"), torch.bfloat16, 4096, 8192, offload=True)
    model, executed = bench.flops_per_token(setup, seq)
    attention_forward = 2 * seq * shape.q * shape.layers  # causal QK^T + PV, per token
    assert model == 6 * shape.matmul_params_per_token + 3 * attention_forward
    layers_again = 2 * (shape.matmul_params_per_token - shape.vocab * shape.hidden)
    assert executed - model >= layers_again + 1.5 * attention_forward, (seq, model, executed)
