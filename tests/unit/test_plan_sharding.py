"""The planner's model-state settings (recipes/plan/sharding.py): DDP, DeepSpeed
ZeRO-3 and train.py's FSDP2, each priced from its row of the one table. Arithmetic only."""

import pytest

from recipes import plan as P

LLAMA = P.PRESETS["llama-3-8b"]
H100 = P.get_device("h100-80g")


def options(setting: str, sp: int = 8, checkpointing: bool = True) -> P.Options:
    return P.Options("zigzag_ring_attn", sp, sp, checkpointing, False, 0, 4096, setting)


def states(setting: str, gpus: int = 8, dtype: str = "bf16", device=H100, model=LLAMA) -> float:
    """Per-rank bytes of the model states at the end of a backward: those kept between steps
    and the gradients rebuilt in each backward."""
    kept, rebuilt = P.SHARDINGS[setting].state_bytes(2 if dtype == "bf16" else 4, gpus, device.memory_is_host)
    return (sum(kept.values()) + sum(rebuilt.values())) * model.params


def test_the_table_names_every_setting_once_and_the_planner_offers_the_planned_ones():
    assert P.ZERO_CHOICES == ("none", "zero3", "zero3-opt-offload", "zero3-offload", "fsdp2", "fsdp2-offload")
    # noopt: the validation's one-step runs; bf16-sgd: the long-context headline's (bench_long_context.py)
    assert set(P.SHARDINGS) == {*P.ZERO_CHOICES, "noopt", "bf16-sgd"}
    for name, setting in P.SHARDINGS.items():
        assert setting.name == name and setting.gathers in P.IN_FLIGHT
        assert {t.kind for t in setting.states} <= {"weights", "gradients", "optimizer"}
    assert P.parse_args(["--model", "x", "--seq-length", "1", "--zero", "fsdp2-offload"]).zero == ["fsdp2-offload"]
    with pytest.raises(P.PlanError, match="unknown ZeRO / FSDP setting 'fsdp3'; choose from"):
        P.Options("zigzag_ring_attn", 2, 2, zero="fsdp3")


@pytest.mark.parametrize("gpus", [2, 8])
def test_fsdp2_states_are_zero3s_shard_arithmetic(gpus):
    """bf16: ZeRO-3's bf16 params + bf16 grads + fp32 master, m, v (2 + 2 + 12) and FSDP2's fp32
    params + fp32 grads + m, v (4 + 4 + 8) are both 16 N / W per rank."""
    assert states("fsdp2", gpus) == pytest.approx(states("zero3", gpus))
    assert states("fsdp2", gpus) == pytest.approx(16 * LLAMA.params / gpus)
    # fp32: FSDP2 the same (its weights are fp32 either way); DeepSpeed updates its fp32
    # partitions in place, so no master copy there either
    assert states("fsdp2", gpus, "fp32") == pytest.approx(16 * LLAMA.params / gpus)
    assert states("zero3", gpus, "fp32") == pytest.approx(16 * LLAMA.params / gpus)


def test_ddp_holds_every_state_and_a_second_gradient_copy_in_its_buckets():
    assert states("none", 8) == pytest.approx(20 * LLAMA.params)  # weights, grads, buckets, Adam m, v
    assert states("none", 1, model=P.PRESETS["tiny-bench"]) == pytest.approx(16 * P.PRESETS["tiny-bench"].params)


def test_torch_optimizers_gradients_are_rebuilt_in_each_backward_deepspeeds_are_kept():
    """zero_grad(set_to_none=True) frees DDP's and FSDP2's gradients between steps: they count
    at the end of the backward, not in the loss; DeepSpeed's flat partitions stay."""
    n, w = LLAMA.params, 8
    for setting, kept_between_steps in (("none", 16 * n), ("fsdp2", 12 * n / w), ("zero3", 16 * n / w)):
        result = P.estimate(LLAMA, 65536, w, options(setting), H100)
        assert result["persistent"] - H100.runtime_gib * P.GIB == pytest.approx(kept_between_steps), setting
    fsdp2 = P.estimate(LLAMA, 65536, w, options("fsdp2"), H100)
    assert fsdp2["phases"]["end of backward"] - fsdp2["persistent"] >= 4 * n / w  # the gradient shards are back


@pytest.mark.parametrize("gpus", [2, 8])
def test_offload_lowers_the_device_peak_and_on_cpu_moves_nothing(gpus):
    for on_device, offloaded in (("fsdp2", "fsdp2-offload"), ("zero3", "zero3-offload")):
        a = P.estimate(LLAMA, 65536, gpus, options(on_device, gpus), H100)
        b = P.estimate(LLAMA, 65536, gpus, options(offloaded, gpus), H100)
        assert b["peak_bytes"] < a["peak_bytes"] and b["persistent"] == pytest.approx(H100.runtime_gib * P.GIB)
    cpu, tiny = P.get_device("cpu"), P.PRESETS["tiny-bench"]
    # on cpu the host is the rank's memory: FSDP2's offloaded shards are still there
    assert states("fsdp2-offload", gpus, "fp32", cpu, tiny) == pytest.approx(states("fsdp2", gpus, "fp32", cpu, tiny))
    assert states("zero3-offload", gpus, "fp32", cpu, tiny) > 0


def test_fsdp2_keeps_the_root_unit_whole_and_reduces_its_gradients_at_the_end():
    model, a = LLAMA, 2
    root = 2 * model.embedding_params + model.hidden  # untied embeddings and output layer, final norm
    flight = P.in_flight(P.SHARDINGS["fsdp2"], model, 8, a)
    assert flight["loss"]["root unit gathered (embeddings, final norm, output layer)"] == a * root
    assert flight["layer"]["gathered layers (running + prefetched)"] == 2 * a * model.layer_params
    assert sum(flight["end"].values()) == pytest.approx((a + a + 4 * (1 + 1 / 8)) * root)
    result = P.estimate(model, 8192, 8, options("fsdp2"), H100)
    assert "end of backward" in result["phases"]  # priced, whichever phase peaks


def test_fsdp2_needs_two_ranks():
    tiny, cpu = P.PRESETS["tiny-bench"], P.get_device("cpu")
    one = P.plan(tiny, 4096, 1, cpu)
    assert not {r["zero"] for r in one["rows"]} & {"fsdp2", "fsdp2-offload"}
    assert {"fsdp2", "fsdp2-offload"} <= {r["zero"] for r in P.plan(tiny, 4096, 2, cpu)["rows"]}
    with pytest.raises(P.PlanError, match="--zero fsdp2 needs at least 2 GPUs"):
        P.plan(tiny, 4096, 1, cpu, zero_choices=["fsdp2"])


def test_gathers_fsdp2_skips_the_recompute_and_reduces_in_fp32():
    n, w, link = LLAMA.params, 8, 450e9
    share = (w - 1) / w / link
    for ckpt in (False, True):
        fsdp2, _ = P.sharding_seconds(LLAMA, w, options("fsdp2", checkpointing=ckpt), H100, 2, link)
        zero3, _ = P.sharding_seconds(LLAMA, w, options("zero3", checkpointing=ckpt), H100, 2, link)
        assert fsdp2 == pytest.approx((2 * 2 + 4) * n * share)  # gathers forward + backward, fp32 reduce-scatter
        assert zero3 == pytest.approx(((3 if ckpt else 2) * 2 + 2) * n * share)
    assert P.sharding_seconds(LLAMA, w, options("none"), H100, 2, link) == (0.0, 0.0)
    _, host_adam = P.sharding_seconds(LLAMA, w, options("fsdp2-offload"), H100, 2, link)
    assert host_adam > 0


def test_flags_render_the_fsdp_launch():
    tiny, cpu = P.PRESETS["tiny-bench"], P.get_device("cpu")
    for setting, flags in (("fsdp2", "--fsdp"), ("fsdp2-offload", "--fsdp --fsdp-offload")):
        result = P.plan(tiny, 8192, 2, cpu, zero_choices=[setting])
        line = P.flags_of(result["recommendation"], 8192)
        assert f" {flags}   [FSDP2: train.py {flags}]" in line and line.startswith("--parallel-mode")
    ddp = P.plan(tiny, 8192, 2, cpu, zero_choices=["none"])["recommendation"]
    assert "--fsdp" not in P.flags_of(ddp, 8192) and P.flags_of(ddp, 8192).endswith(
        "[DDP: no DeepSpeed config, no FSDP]"
    )


def test_cli_takes_fsdp2(capsys):
    code = P.main(["--model", "tiny-bench", "--seq-length", "8192", "--gpus", "2", "--gpu", "cpu", "--zero", "fsdp2"])
    out = capsys.readouterr().out
    assert code == 0 and "| fsdp2 |" in out and "--fsdp   [FSDP2: train.py --fsdp]" in out
    code = P.main(["--model", "tiny-bench", "--seq-length", "8192", "--gpus", "1", "--gpu", "cpu", "--zero", "fsdp2"])
    assert code == 2 and "needs at least 2 GPUs" in capsys.readouterr().err


def test_packed_documents_get_the_workload_layout_where_the_mode_takes_one():
    tiny, cpu = P.PRESETS["tiny-bench"], P.get_device("cpu")
    for mode, layout in (("zigzag_ring_attn", True), ("ulysses_attn", False)):
        best = P.plan(tiny, 8192, 2, cpu, modes=[mode], zero_choices=["none"])["recommendation"]
        line = P.flags_of(best, 8192, packed=True)
        assert "--document-masking" in line and ("--balance-documents workload" in line) == layout, line
        assert "--document-masking" not in P.flags_of(best, 8192)
