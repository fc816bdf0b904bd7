"""The roofline: seconds per step and tokens/s (docs/planner.md). The attention's
communication is the mode's own count (SeqParallelMode.traffic)."""

from __future__ import annotations

from easy_context.modes import get_mode
from easy_context.programs.plan.catalogue import Device, ModelShape, Options
from easy_context.programs.plan.memory import attention_shape
from easy_context.programs.plan.sharding import SHARDINGS

__all__ = ["EFFICIENCY", "sharding_seconds", "throughput"]

EFFICIENCY = 0.5  # achieved fraction of the device's peak on the FLOPs actually executed


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


def throughput(model: ModelShape, seq: int, gpus: int, o: Options, device: Device, dtype: str = "bf16") -> dict:
    """Seconds per step (one sequence of `seq` tokens per SP group) and tokens/s of the job."""
    a = 4 if dtype == "fp32" else 2
    s = seq // o.sp
    L, h, q = model.layers, model.hidden, model.q
    mode = get_mode(o.mode)
    P = model.matmul_params_per_token
    attn_fwd = 2 * seq * q * L  # causal QK^T + PV per token, all layers
    flops = 6 * P + 3.5 * attn_fwd  # fwd + bwd (flash backward recomputes the scores)
    if o.checkpointing:
        flops += 2 * (P - model.vocab * h)  # layers' forward again
        if not mode.keeps_attention_output:
            flops += attn_fwd  # attention forward again
    if 0 < o.tiled_mlp < s:
        flops += 2 * 3 * h * model.active_intermediate * L  # each tile's MLP forward again
    if mode.sequence_parallel or o.loss_chunk:
        flops += 2 * model.vocab * h  # output layer forward again (train.py checkpoints each loss chunk)
    t_compute = s * flops / (device.tflops * 1e12 * EFFICIENCY)

    # Ranks fill nodes in order, min(per_node, gpus) to a node. A group of `group` ranks `stride`
    # apart starts at a multiple of its span (group x stride consecutive ranks): it stays on one
    # node when its span divides the node's ranks, and else crosses the network, whose
    # bandwidth then bounds it (a ring runs at its slowest hop; an all-to-all waits for its
    # slowest pair). usp_attn's ring (stride u) with Ulysses (u | node) inside a node is the case
    # this prices: the all-to-all on the node's links, only the ring on the network.
    node = min(device.per_node, gpus)

    def bw(group: int, stride: int = 1) -> float:
        span = group * stride
        return (device.link_gbs if span <= node and node % span == 0 else device.network_gbs) * 1e9

    traffic = mode.traffic(attention_shape(model, o, a, seq))
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
    if o.checkpointing and o.offload_checkpoints:  # on the compute stream (transformers): not overlapped
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
