"""What one mixer layer costs one rank in bytes sent, forward and backward, per strategy.

Follows the code that runs (families.py over state_passing.py and core/exchange.py):
- every convolution: one all-gather of each run's last kernel - 1 inputs (its halo), padded to
  the most runs any rank holds; its gradient goes back by an all-to-all of the same size;
- state passing: one all-gather of each run's summary (the final state from a zero start and
  the transition, fp32), and its gradient back the same way; O(state) bytes, whatever S;
- head exchange: each scan input goes from sequence shards to head shards by an all-to-all
  ((P - 1) / P of it leaves the rank), the output comes back the same way, and the backward
  does both again; a single B/C group (Mamba-2) is all-gathered whole instead. O(S) bytes.
Once per forward besides, where the model passes position_ids: one all-gather of them (int64),
where documents start. Pure arithmetic, tested against bytes counted on a run
(tests/distributed/test_hybrids.py).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MixerShape", "positions_traffic", "traffic"]

FP32 = 4
INT64 = 8


@dataclass(frozen=True)
class MixerShape:
    """One mixer layer over one SP group. scan: "mamba2", "gated_delta_rule" or None (a
    convolution alone). Mamba-2: heads x head_dim values, state_dim = N, groups of B/C.
    Gated delta rule: heads value heads of head_dim, state_dim = dk, groups query/key heads."""

    batch: int
    seq_len: int
    sp_size: int
    max_runs: int  # the most runs of the sequence any rank holds (core/pieces.py)
    conv_channels: int
    conv_width: int  # kernel size - 1
    dtype_bytes: int  # the model's activations
    scan: str | None = None
    heads: int = 0
    head_dim: int = 0
    state_dim: int = 0
    groups: int = 0
    output_bytes: int = FP32  # the scan's output (transformers' torch SSD returns fp32)

    @property
    def local_len(self) -> int:
        return self.seq_len // self.sp_size


def traffic(strategy: str, shape: MixerShape) -> int:
    """Bytes one rank sends for one mixer layer, forward and backward together."""
    s, b, p = shape, shape.batch, shape.sp_size
    if p == 1:
        return 0
    gathers = (p - 1) * s.max_runs * b * s.conv_channels * s.conv_width * s.dtype_bytes
    if s.scan is None:
        return 2 * gathers
    if strategy == "state_passing":
        if s.scan == "mamba2":  # final (H, P, N) and the decay (H)
            summary = s.heads * (s.head_dim * s.state_dim + 1)
        else:  # final (H, dk, dv) and the transition (H, dk, dk)
            summary = s.heads * s.state_dim * (s.head_dim + s.state_dim)
        gathers += (p - 1) * s.max_runs * b * summary * FP32
        return 2 * gathers
    return 2 * (gathers + _exchanged(shape))


def positions_traffic(batch: int, seq_len: int, sp_size: int) -> int:
    """Bytes one rank sends once per forward: the all-gather of its position_ids (rows, S / P)
    that tells every rank where documents start (not differentiable: no backward)."""
    return (sp_size - 1) * batch * (seq_len // sp_size) * INT64


def _exchanged(shape: MixerShape) -> int:
    """Forward bytes of head exchange's all-to-alls (and the whole-sequence B/C gather)."""
    s, n = shape, shape.batch * shape.local_len
    share = (s.sp_size - 1) / s.sp_size
    if s.scan == "mamba2":
        x, dt, out = n * s.heads * s.head_dim, n * s.heads, n * s.heads * s.head_dim
        bc = 2 * n * s.groups * s.state_dim
        sent = share * ((x + dt) * s.dtype_bytes + out * s.output_bytes)
        if s.groups == 1:  # B and C whole on every rank
            return int(sent + (s.sp_size - 1) * bc * s.dtype_bytes)
        return int(sent + share * bc * s.dtype_bytes)
    # q, k (groups x dk), v and the output (heads x dv) in the model's dtype; g in fp32, beta not
    qk, v, heads = 2 * n * s.groups * s.state_dim, n * s.heads * s.head_dim, n * s.heads
    return int(share * ((qk + 2 * v + heads) * s.dtype_bytes + heads * FP32))
