"""The roofline: seconds per step and tokens/s (docs/planner.md). The attention's
communication is the mode's own count (SeqParallelMode.traffic)."""

from __future__ import annotations

from easy_context.modes import get_mode
from recipes.plan.catalogue import Device, ModelShape, Options
from recipes.plan.memory import attention_shape, offloads_checkpoints
from recipes.plan.sharding import SHARDINGS

__all__ = ["ATTENTION_EFFICIENCY", "EFFICIENCY", "efficiency", "group_bandwidth", "sharding_seconds", "throughput"]

# The roofline's efficiency: the achieved fraction of a device's peak on the FLOPs executed.
# Its one place; docs/planner.md ("Roofline") repeats it.
#
# EFFICIENCY: the layers' matmuls, the output layer and, on devices without a measurement
# below, the attention. UNCALIBRATED: no training step of a model has run on a GPU here
# (docs/benchmarks.md has none), so 0.5 is an assumption. With it the roofline is within
# 0.87-0.98 of EasyContext's published A100 tokens/s at four lengths of five (planner.md,
# table 3): a check, not a fit. Recalibrate from a measured step's MFU when there is one (issue
# 57's long-context benchmark).
EFFICIENCY = 0.5
# ATTENTION_EFFICIENCY: causal attention, forward + backward, calibrated from the first GPU run
# (one H200, docs/benchmarks.md, "The first GPU run": `scripts/gpu_check.sh`'s bench, bf16,
# 32 x 128 query heads over 8 KV heads, S = 32K, the FLOPs counted as here, 3.5 x 2 S^2 q):
# flash SDPA 327 TFLOP/s, the cuda_flash kernel the modes run 1.00x of it, zigzag_ring_attn and
# dist_flash_attn at P = 1 1.01x, i.e. 324-327 of the 989 TFLOPS peak = 0.33 (0.28 at S = 8K;
# the long sequences the planner is for are nearer the 32K figure). The H100 is the same chip
# at the same peak; its figure is assumed equal, not measured, and so is the PCIe and NVL
# boards' (the same chip at lower clocks: the fraction of their own peaks). A100: not measured
# (EFFICIENCY).
ATTENTION_EFFICIENCY = {name: 0.33 for name in ("h200", "h200-nvl", "h100-80g", "h100-pcie", "h100-nvl")}


def efficiency(device: Device) -> tuple[float, float]:
    """(matmuls and the rest, attention): the fractions of `device`'s peak the roofline assumes."""
    return EFFICIENCY, ATTENTION_EFFICIENCY.get(device.name, EFFICIENCY)


def group_bandwidth(device: Device, gpus: int, group: int, stride: int = 1) -> float:
    """Bytes/s one way per rank of a group of `group` ranks `stride` apart among `gpus`.

    Ranks fill nodes in order, min(per_node, gpus) to a node. A group starts at a multiple of
    its span (group x stride consecutive ranks): it stays on one node when its span divides the
    node's ranks, and else crosses the network, whose bandwidth then bounds it (a ring runs at
    its slowest hop; an all-to-all waits for its slowest pair). usp_attn's ring (stride u) with
    Ulysses (u | node) inside a node is the case this prices: the all-to-all on the node's
    links, only the ring on the network."""
    node, span = min(device.per_node, gpus), group * stride
    return (device.link_gbs if span <= node and node % span == 0 else device.network_gbs) * 1e9


def sharding_seconds(model: ModelShape, gpus: int, o: Options, device: Device, a: int, link_bytes_per_s: float):
    """(seconds of the weight gathers and gradient reduce-scatters, overlapped with compute;
    seconds of a host optimizer, not overlapped) for o's ZeRO / FSDP setting.

    Sharded weights are all-gathered (in the compute dtype) for the forward and the backward,
    and again for a checkpointed layer's recompute where the setting's hooks fire there
    (ZeRO-3); gradients are reduce-scattered once; a ring moves (W - 1) / W of each over
    every rank's link. Weights on the host cross PCIe each gather. A host optimizer steps
    N / W parameters, after the gradients came down (and the weights went back up where they
    live on the device)."""
    setting, N, W = SHARDINGS[o.zero], model.params, gpus
    if not setting.sharded:
        return 0.0, 0.0
    gathers = 3 if o.checkpointing and setting.regathers_on_recompute else 2
    reduce_bytes = 4 if setting.reduce_dtype == "fp32" else a
    t_sharding = (gathers * a + reduce_bytes) * N * (W - 1) / W / link_bytes_per_s
    pcie = device.pcie_gbs * 1e9
    host_weights = [t.bytes_per_param(a) for t in setting.states if t.kind == "weights" and t.host]
    if host_weights:
        t_sharding = max(t_sharding, gathers * host_weights[0] * N / W / pcie)
    t_optim = 0.0
    if setting.optimizer_on_host():
        copies = reduce_bytes + (0 if host_weights else a)  # gradients down, (weights up)
        t_optim = N / W / device.optimizer_params_per_s + copies * N / W / pcie
    return t_sharding, t_optim


def step_flops(model: ModelShape, seq: int, o: Options) -> dict:
    """FLOPs per token of a training step at `seq` tokens (per sequence), by what runs them:
      model      the model's math, what MFU counts: 6 x the weights a token multiplies, and 3 x
                 causal attention's forward (QK^T and PV over half the S x S pairs)
      matmuls    executed outside attention: the model's, plus the forwards run again
                 (checkpointed layers, MLP tiles, loss chunks)
      attention  executed in attention: flash's backward recomputes the scores (3.5 x the
                 forward), a checkpointed layer's forward runs twice unless the mode keeps it
    matmuls + attention is what HFU counts."""
    L, h, q = model.layers, model.hidden, model.q
    mode = get_mode(o.mode)
    P = model.matmul_params_per_token
    attn_fwd = 2 * seq * q * L  # causal QK^T + PV per token, all layers
    attention = 3.5 * attn_fwd  # fwd + bwd (flash backward recomputes the scores)
    matmuls = 6 * P
    if o.checkpointing:
        matmuls += 2 * (P - model.vocab * h)  # layers' forward again
        if not mode.keeps_attention_output:
            attention += attn_fwd  # attention forward again
    if 0 < o.tiled_mlp < seq // o.sp:
        matmuls += 2 * 3 * h * model.active_intermediate * L  # each tile's MLP forward again
    if mode.sequence_parallel or o.loss_chunk:
        matmuls += 2 * model.vocab * h  # output layer forward again (train.py checkpoints each loss chunk)
    return {"model": 6 * P + 3 * attn_fwd, "matmuls": matmuls, "attention": attention}


def throughput(model: ModelShape, seq: int, gpus: int, o: Options, device: Device, dtype: str = "bf16") -> dict:
    """Seconds per step (one sequence of `seq` tokens per SP group) and tokens/s of the job."""
    a = 4 if dtype == "fp32" else 2
    s = seq // o.sp
    L, h = model.layers, model.hidden
    mode = get_mode(o.mode)
    counted = step_flops(model, seq, o)
    eff, attn_eff = efficiency(device)
    shape = attention_shape(model, o, a, seq)
    # the busiest rank sets the pace: Ulysses over query heads that do not split evenly gives it more
    attention = counted["attention"] * mode.attention_load(shape)
    t_compute = s * (counted["matmuls"] / eff + attention / attn_eff) / (device.tflops * 1e12)
    flops = counted["matmuls"] + counted["attention"]

    def bw(group: int, stride: int = 1) -> float:
        return group_bandwidth(device, gpus, group, stride)

    traffic = mode.traffic(shape)
    forwards = 2 if o.checkpointing and not mode.keeps_attention_output else 1
    t_ring = t_a2a = 0.0
    ring_bytes = traffic.p2p_forward * forwards + traffic.p2p_backward
    if ring_bytes:
        t_ring = L * ring_bytes / bw(o.ring_degree, o.ulysses_degree)
    all_to_all_bytes = traffic.all_to_all_forward * forwards + traffic.all_to_all_backward
    if all_to_all_bytes:
        t_a2a = L * all_to_all_bytes / bw(o.ulysses_degree)
    t_zero, t_optim = sharding_seconds(model, gpus, o, device, a, bw(gpus))
    t_offload = 0.0
    if offloads_checkpoints(o, device):  # on the compute stream (transformers): not overlapped
        t_offload = 2 * L * a * h * s / (device.pcie_gbs * 1e9)
    bound = {"compute": t_compute, "ring P2P": t_ring, "ZeRO-3 / FSDP2 gathers": t_zero}
    overlapped = max(bound.values())
    step = overlapped + t_a2a + t_offload + t_optim
    dp = gpus // o.sp
    limiter = max(bound, key=bound.get)
    if t_a2a + t_offload + t_optim > overlapped:
        limiter = max(
            {"all-to-all": t_a2a, "checkpoint offload": t_offload, "CPU optimizer": t_optim}.items(),
            key=lambda kv_: kv_[1],
        )[0]
    return {
        "step_s": step,
        "tokens_per_s": seq * dp / step,
        "limiter": limiter,
        "flops_per_token": flops,
        "t_compute": t_compute,
        "t_ring": t_ring,
        "t_a2a": t_a2a,
        "t_zero": t_zero,
        "t_offload": t_offload,
        "t_optimizer": t_optim,
    }
