"""Bytes one rank sends per fwd+bwd: from the algorithm (analytic) and as counted by wrapping
torch.distributed's collectives (CommCounter)."""

from __future__ import annotations

import math

from benchmarks.attention_config import BASELINE, DEEPSPEED, DTYPE_BYTES


def analytic_comm_bytes(config, S, P, B, Hq, Hkv, D, dtype):
    """Bytes one rank sends per fwd+bwd, from the algorithm (None when not derived).

    ring (zigzag_ring_attn, and the ring part of usp_attn):
        forward   K and V shards rotate P-1 times                 2 (P-1) kv
        backward  K and V rotate P-1 times again                  2 (P-1) kv
                  dK/dV accumulators (fp32) go straight back      2 (P-1) kv_acc
                  to their owner, once per borrowed K/V block
        (causal, unmasked: every step is needed; masks skip steps and transfers)
    Ulysses (ulysses_attn, usp_attn's Ulysses part, deepspeed_ulysses):
        forward   all-to-all of q, k, v and the output            4 x (P-1)/P of each
        backward  all-to-all of dout, dq, dk, dv                  4 x (P-1)/P of each
        K/V heads are replicated first when Hkv does not split over P.
    deepspeed_ulysses also all-gathers position_ids (int64) once per forward.
    """
    if config == BASELINE or P == 1:
        return 0
    e = DTYPE_BYTES[dtype]
    acc = max(e, 4)  # accumulation dtype: promote(dtype, fp32)
    S_l = S // P
    q_elems = B * Hq * S_l * D

    def ulysses(U):
        rep = math.lcm(Hkv, U) // Hkv
        kv_elems = B * Hkv * rep * S_l * D
        frac = (U - 1) / U
        return 2 * frac * (q_elems + 2 * kv_elems + q_elems) * e, rep

    def ring(R, kv_elems):
        if R == 1:
            return 0
        return 2 * (R - 1) * kv_elems * e * 2 + 2 * (R - 1) * kv_elems * acc

    if config == "zigzag_ring_attn":
        return ring(P, B * Hkv * S_l * D)
    if config in ("ulysses_attn", "usp_attn"):  # usp_attn is run with its default ring_degree=1
        return ulysses(P)[0]
    if config == DEEPSPEED:
        rep = max(1, P // Hkv)  # DeepSpeed replicates K/V heads by P // Hkv when P > Hkv
        kv_elems = B * Hkv * rep * S_l * D
        frac = (P - 1) / P
        return 2 * frac * (2 * q_elems + 2 * kv_elems) * e + (P - 1) * B * S_l * 8
    return None


def dist_flash_comm_bytes(rounds, S, P, B, Hq, Hkv, D, dtype):
    """Bytes per rank (the busiest) per fwd+bwd for dist_flash_attn, walking its schedule.

    Every round t >= 1, for each unit whose worker is not the owner of its queries or K/V:
        forward   q-owner -> worker: its query rows;  kv-owner -> worker: K and V
                  worker -> q-owner: partial out rows + their lse (fp32)
        backward  q-owner -> worker: q, dout, out rows + lse;  kv-owner -> worker: K and V
                  worker -> q-owner: dq rows (fp32);  worker -> kv-owner: dK and dV (fp32)
    """
    e, acc = DTYPE_BYTES[dtype], max(DTYPE_BYTES[dtype], 4)
    S_l = S // P
    sent = [0] * P
    for units in rounds[1:]:
        for u in units:
            rows = len(range(S_l)[u.rows(S_l)])
            q_rows, lse_rows, kv = B * Hq * rows * D, B * Hq * rows, B * Hkv * S_l * D
            if u.q_owner != u.worker:
                sent[u.q_owner] += q_rows * e + (3 * q_rows * e + lse_rows * 4)
                sent[u.worker] += q_rows * e + lse_rows * 4 + q_rows * acc
            if u.kv_owner != u.worker:
                sent[u.kv_owner] += 2 * kv * e * 2
                sent[u.worker] += 2 * kv * acc
    return max(sent)


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

        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
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
            return orig_a2a(output, input, output_split_sizes=output_split_sizes,
                            input_split_sizes=input_split_sizes, group=group, async_op=async_op)

        def all_gather(tensor_list, tensor, group=None, async_op=False):
            if counter.enabled:
                counter.bytes += (dist.get_world_size(group) - 1) * tensor.numel() * tensor.element_size()
            return orig_ag(tensor_list, tensor, group=group, async_op=async_op)

        dist.batch_isend_irecv = batch_isend_irecv
        dist.all_to_all_single = all_to_all_single
        dist.all_gather = all_gather
