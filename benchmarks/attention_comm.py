"""Bytes one rank sends per fwd+bwd: from the algorithm (analytic) and as counted by wrapping
torch.distributed's collectives (CommCounter)."""

from __future__ import annotations

from benchmarks.attention_config import BASELINE, DEEPSPEED, DTYPE_BYTES


def analytic_comm_bytes(config, S, P, B, Hq, Hkv, D, dtype):
    """Bytes one rank (the busiest) sends per fwd+bwd, from the algorithm; None when not derived.

    Our modes declare their own traffic (SeqParallelMode.traffic, easy_context/modes/costs.py:
    the ring's K/V rotation and dK/dV sent back, the Ulysses all-to-alls, dist_flash's
    balanced schedule), run at their default split (usp_attn: ring_degree 1), causal.
    deepspeed_ulysses (a peer): all-to-alls of q, k, v, out and their gradients, K/V heads
    replicated by P // Hkv when P > Hkv, and position_ids (int64) all-gathered once per forward.
    """
    if config == BASELINE or P == 1:
        return 0
    e = DTYPE_BYTES[dtype]
    if config == DEEPSPEED:
        S_l = S // P
        rep = max(1, P // Hkv)
        q_elems, kv_elems = B * Hq * S_l * D, B * Hkv * rep * S_l * D
        return 2 * (P - 1) / P * (2 * q_elems + 2 * kv_elems) * e + (P - 1) * B * S_l * 8
    from easy_context.modes import BUILT_MODES, get_mode  # imports torch: the driver process stays without it
    from easy_context.modes.costs import AttentionShape

    if config not in BUILT_MODES:
        return None
    mode = get_mode(config)
    topology = mode.topology(P)
    return mode.traffic(AttentionShape(Hq, Hkv, D, e, topology.sp_size, topology.ring_degree, S, B)).total


class CommCounter:
    """Counts the bytes this rank sends through torch.distributed while enabled."""

    instance = None

    @classmethod
    def install(cls, dist):
        cls.instance = cls(dist)

    def __init__(self, dist):
        self.dist, self.bytes, self.enabled = dist, 0, False
        self._isend = dist.isend
        orig_batch, orig_a2a, orig_ag = dist.batch_isend_irecv, dist.all_to_all_single, dist.all_gather
        counter = self

        def batch_isend_irecv(ops):
            if counter.enabled:
                for op in ops:
                    if getattr(op.op, "__name__", "") == "isend":
                        counter.bytes += op.tensor.numel() * op.tensor.element_size()
            return orig_batch(ops)

        def all_to_all_single(
            output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False
        ):
            if counter.enabled:
                size = dist.get_world_size(group)
                me = dist.get_rank(group)
                total = input.numel() * input.element_size()
                if input_split_sizes:
                    row = total // max(1, input.shape[0])
                    kept = input_split_sizes[me] * row
                else:
                    kept = total // size
                counter.bytes += total - kept
            return orig_a2a(
                output,
                input,
                output_split_sizes=output_split_sizes,
                input_split_sizes=input_split_sizes,
                group=group,
                async_op=async_op,
            )

        def all_gather(tensor_list, tensor, group=None, async_op=False):
            if counter.enabled:
                counter.bytes += (dist.get_world_size(group) - 1) * tensor.numel() * tensor.element_size()
            return orig_ag(tensor_list, tensor, group=group, async_op=async_op)

        dist.batch_isend_irecv = batch_isend_irecv
        dist.all_to_all_single = all_to_all_single
        dist.all_gather = all_gather
