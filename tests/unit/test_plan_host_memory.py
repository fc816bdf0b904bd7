"""The planner's host memory (recipes/plan/memory.py: host_memory): what a node
pins for offloaded checkpoints and CPU-offloaded ZeRO / FSDP states, the --host-memory check,
its default, and the roofline's efficiency constants. Arithmetic only."""

import re
from pathlib import Path

import pytest

from recipes import plan as P
from recipes.plan import catalogue

ROOT = Path(__file__).resolve().parents[2]
LLAMA = P.PRESETS["llama-3-8b"]
H100 = P.get_device("h100-80g")
S = 524288
CKPT_BYTES = 32 * S * 4096 * 2  # layers x tokens x hidden x bf16: one layer input per layer


def offload(zero: str, sp: int = 1, mode: str = "data_parallel") -> P.Options:
    """Checkpointing with offload, tiled MLP and loss chunks (ALST's single-GPU recipe)."""
    return P.Options(mode, sp, sp, True, True, 4096, 1024, zero)


def test_the_8b_shape_at_524k_offloads_128_gib_of_checkpoints():
    assert CKPT_BYTES == 128 * P.GIB
    # states on the device: the checkpoints are all the host holds
    host = P.host_memory(LLAMA, S, 1, offload("zero3"), H100)
    assert host["terms"] == {"offloaded checkpoints": CKPT_BYTES}
    assert host["per_node"] == host["per_rank"] == CKPT_BYTES and host["ranks_per_node"] == 1
    # the recipe that fits one 80 GB GPU also keeps ZeRO-3's parameters (bf16) and its fp32
    # gradients, master, m, v on the host: 2 + 4 + 12 bytes per parameter
    host = P.host_memory(LLAMA, S, 1, offload("zero3-offload"), H100)
    assert host["terms"]["offloaded checkpoints"] == CKPT_BYTES
    assert host["per_node"] == pytest.approx(CKPT_BYTES + 18 * LLAMA.params)
    assert host["per_node"] / P.GIB == pytest.approx(262.6, abs=0.05)
    assert P.host_memory(LLAMA, S, 1, offload("zero3-opt-offload"), H100)["per_node"] == pytest.approx(
        CKPT_BYTES + 16 * LLAMA.params
    )


def test_host_memory_per_node_rank_and_setting():
    # sequence parallelism over a node of 8: each rank offloads S / 8 tokens, the node the same 128 GiB;
    # ZeRO-3's host states are N / W per rank, N per node
    host = P.host_memory(LLAMA, S, 8, offload("zero3-offload", 8, "ulysses_attn"), H100)
    assert host["terms"]["offloaded checkpoints"] == CKPT_BYTES / 8 and host["ranks_per_node"] == 8
    assert host["per_node"] == pytest.approx(CKPT_BYTES + 18 * LLAMA.params)
    # two nodes of 8: each holds half
    two = P.host_memory(LLAMA, S, 16, offload("zero3-offload", 16, "ulysses_attn"), H100)
    assert two["per_node"] == pytest.approx(host["per_node"] / 2)
    # DDP keeps an fp32 residual stream: its checkpoints are 4 bytes an element; nothing else on the host
    assert P.host_memory(LLAMA, S, 1, offload("none"), H100)["terms"] == {"offloaded checkpoints": 2 * CKPT_BYTES}
    # FSDP2 with CPU offload: fp32 params, gradients, m, v (16 N / W) on the host
    fsdp = P.host_memory(LLAMA, S, 2, P.Options("ulysses_attn", 2, 1, zero="fsdp2-offload"), H100)
    assert fsdp["per_node"] == pytest.approx(16 * LLAMA.params) and "offloaded checkpoints" not in fsdp["terms"]
    # no checkpoint offload, no host states: nothing
    kept = P.Options("data_parallel", 1, 1, True, False, zero="zero3")
    assert P.host_memory(LLAMA, S, 1, kept, H100) == {"per_node": 0, "per_rank": 0, "ranks_per_node": 1, "terms": {}}


def test_on_the_cpu_offloaded_checkpoints_stay_in_the_ranks_memory():
    """train.py offloads nothing on the CPU: the checkpoints count in the peak, not as host extra."""
    cpu, model = P.get_device("cpu"), P.PRESETS["tiny-bench"]
    kept = P.Options("zigzag_ring_attn", 2, 2, True, False, 0, 1024, "noopt")
    offloaded = P.Options("zigzag_ring_attn", 2, 2, True, True, 0, 1024, "noopt")
    assert (
        P.estimate(model, 65536, 2, offloaded, cpu)["peak_bytes"]
        == P.estimate(model, 65536, 2, kept, cpu)["peak_bytes"]
    )
    assert P.host_memory(model, 65536, 2, offloaded, cpu)["per_node"] == 0
    assert P.throughput(model, 65536, 2, offloaded, cpu)["t_offload"] == 0


def test_a_row_the_host_cannot_hold_does_not_fit_and_says_why():
    row = lambda o, host: P.row_of(LLAMA, S, 1, o, H100, "bf16", 0.10, host_memory_gib=host)  # noqa: E731
    # 128 GiB of checkpoints: refused on a 64 GiB host, held by a 256 GiB one (the device verdict is apart:
    # ZeRO-3 without offload keeps 16 N = 120 GiB of states on the one GPU)
    small, large = row(offload("zero3"), 64), row(offload("zero3"), 256)
    assert small["host_gib"] == large["host_gib"] == 128.0
    assert small["host_why"] == (
        "needs 128.0 GiB of host memory per node, the host has 64.0 GiB (57.6 within the 10% margin)"
    )
    assert large["host_why"] is None and not small["fits"] and not small["fits_device"]
    assert small["host_terms_gib"] == {"offloaded checkpoints": 128.0}
    # the recipe that fits the GPU needs 262.6 GiB: refused on 64 and on 256 GiB, fits on 512
    for host, fits in ((64, False), (256, False), (512, True), (None, True)):
        r = row(offload("zero3-offload"), host)
        assert r["fits_device"] and r["fits"] == fits, host
        assert (r["host_why"] is None) == fits and r["host_gib"] == pytest.approx(262.62, abs=0.01)
    assert (
        "needs 262.6 GiB of host memory per node, the host has 256.0 GiB"
        in row(offload("zero3-offload"), 256)["host_why"]
    )


def test_plan_refuses_what_the_host_cannot_hold():
    small = P.plan(LLAMA, S, 1, H100, host_memory_gib=64)
    assert small["recommendation"] is None and small["host_memory_gib"] == 64
    assert small["smallest"]["host_why"].startswith("needs 262.6 GiB of host memory per node, the host has 64.0 GiB")
    assert small["smallest"]["host_gib"] == pytest.approx(262.62 / 0.9, abs=0.1)  # what would fit, margin included
    large = P.plan(LLAMA, S, 1, H100, host_memory_gib=512)
    best = large["recommendation"]
    assert best and best["offload_checkpoints"] and best["host_terms_gib"]["offloaded checkpoints"] == 128.0
    assert best == P.plan(LLAMA, S, 1, H100)["recommendation"]  # None: not checked (the API's default)
    with pytest.raises(P.PlanError, match="--host-memory must be positive"):
        P.plan(LLAMA, S, 1, H100, host_memory_gib=0)


def test_default_host_memory(monkeypatch):
    ram = P.machine_memory_gib()
    assert ram and ram > 0
    assert P.default_host_memory(P.get_device("cpu"), 2) == (ram, "this machine's RAM")
    monkeypatch.setattr(catalogue, "local_gpus", lambda: [])
    gib, source = P.default_host_memory(H100, 1)
    assert gib == 2048.0 and source.startswith("the default for a node of h100-80g")
    assert P.default_host_memory(P.get_device("a100-40g"), 8)[0] == 1024.0
    # this machine has the named GPU: its RAM, when it has a node's worth of them
    monkeypatch.setattr(catalogue, "local_gpus", lambda: ["h100-80g"])
    assert P.default_host_memory(H100, 1) == (ram, "this machine's RAM")
    assert P.default_host_memory(H100, 8)[0] == 2048.0
    assert P.default_host_memory(P.get_device("h200"), 1)[0] == 2048.0


def test_efficiency_is_calibrated_from_the_h200_run():
    """Attention on sm_90 from the first GPU run's kernel bench (docs/benchmarks.md: flash SDPA's
    TFLOP/s at S = 32K over the 989 TFLOPS peak); the rest, and the A100, the uncalibrated 0.5."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    measured = re.search(r"\| 32768 \| [\d.]+ \((\d+) TFLOP/s\)", text)
    assert measured, "docs/benchmarks.md no longer has the H200 bench row the attention efficiency comes from"
    h200 = P.get_device("h200")
    assert P.ATTENTION_EFFICIENCY["h200"] == pytest.approx(int(measured.group(1)) / h200.tflops, abs=0.005)
    assert P.efficiency(h200) == P.efficiency(H100) == (P.EFFICIENCY, P.ATTENTION_EFFICIENCY["h200"])
    assert P.efficiency(P.get_device("a100-80g")) == (0.5, 0.5)
    # the roofline prices the attention FLOPs at it: at 524K they are most of the step
    o = offload("zero3-offload")
    t = P.throughput(LLAMA, S, 1, o, H100)
    attn = (3.5 + 1) * 2 * S * LLAMA.q * LLAMA.layers  # fwd + bwd, and the checkpoint recompute
    rest = t["flops_per_token"] - attn
    expected = S * (rest / P.EFFICIENCY + attn / P.ATTENTION_EFFICIENCY["h100-80g"]) / (H100.tflops * 1e12)
    assert t["t_compute"] == pytest.approx(expected)
