"""The roofline: seconds per step and tokens/s (docs/planner.md). The attention's
communication is the mode's own count (SeqParallelMode.traffic)."""

from __future__ import annotations

from easy_context.modes import get_mode
from easy_context.programs.plan.catalogue import Device, ModelShape, Options
from easy_context.programs.plan.memory import attention_shape

__all__ = ["EFFICIENCY", "throughput"]

EFFICIENCY = 0.5  # achieved fraction of the device's peak on the FLOPs actually executed


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

    passes = 3 if o.checkpointing else 2  # forward, (recompute,) backward
    traffic = mode.traffic(attention_shape(model, o, a, seq))
    forwards = 2 if o.checkpointing and not mode.keeps_attention_output else 1
    t_ring = t_a2a = 0.0
    ring_bytes = traffic.p2p_forward * forwards + traffic.p2p_backward
    if ring_bytes:
        t_ring = L * ring_bytes / bw(o.ring_degree, o.ulysses_degree)
    all_to_all_bytes = traffic.all_to_all_forward * forwards + traffic.all_to_all_backward
    if all_to_all_bytes:
        t_a2a = L * all_to_all_bytes / bw(o.ulysses_degree)
    t_zero = t_offload = t_optim = 0.0
    N = model.params
    if o.zero in ("zero3", "zero3-opt-offload", "zero3-offload") and gpus > 1:
        t_zero = passes * 2 * N * (gpus - 1) / gpus / bw(gpus)
    if o.zero == "zero3-offload":
        t_zero = max(t_zero, passes * 2 * N / gpus / (device.pcie_gbs * 1e9))
    if o.zero in ("zero3-opt-offload", "zero3-offload"):
        t_optim = N / gpus / device.optimizer_params_per_s + 2 * 2 * N / gpus / (device.pcie_gbs * 1e9)
    if o.checkpointing and o.offload_checkpoints:  # on the compute stream (transformers): not overlapped
        t_offload = 2 * L * a * h * s / (device.pcie_gbs * 1e9)
    bound = {"compute": t_compute, "ring P2P": t_ring, "ZeRO-3 gathers": t_zero}
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
