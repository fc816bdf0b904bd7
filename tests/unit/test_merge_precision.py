"""The log-sum-exp merge of ring partials runs in fp32 (fp64 for fp64 inputs), whatever the
input dtype. With a few merges per row the final bf16 rounding hides a bf16 merge; with 32
key blocks per row (what a ring of 32 ranks, or 8 ranks with a few blocks each, merges) it
does not: merging in bf16 roughly doubles the error. So: bf16 inputs, every query row merges
32 key blocks, and the error against fp64 must stay within 1.5x the error of one bf16 SDPA
call over the whole sequence (out and every gradient)."""

import pytest
import torch
import torch.nn.functional as F

from easy_context.core.masking import Block
from easy_context.core.ring import ring_attention

BLOCKS, BLOCK_LEN, QUERIES, HEADS, KV_HEADS, DIM = 32, 64, 128, 4, 2, 64


class KeyBlocksSteps:
    """Ring steps (a ring.RingSteps) of one process, one step: each query row attends to the keys
    in BLOCKS separate blocks."""

    masked = False

    def needs(self, step, rank, size):
        return step == 0

    def keys(self, step, rank, size):
        return slice(None)

    def blocks(self, step, rank, size, q_len, kv_len):
        return [Block(slice(None), slice(i * BLOCK_LEN, (i + 1) * BLOCK_LEN), causal=False) for i in range(BLOCKS)]


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    make = lambda h, s: torch.randn(2, h, s, DIM, generator=g)  # noqa: E731
    q, k, v = make(HEADS, QUERIES), make(KV_HEADS, BLOCKS * BLOCK_LEN), make(KV_HEADS, BLOCKS * BLOCK_LEN)
    return q * 2, k, v, make(HEADS, QUERIES)  # larger logits: sharper softmax, weights far from uniform


def _attend(function, q, k, v, dout, dtype):
    q, k, v = (x.to(dtype, copy=True).requires_grad_() for x in (q, k, v))
    out = function(q, k, v)
    out.backward(dout.to(dtype))
    return [t.double() for t in (out.detach(), q.grad, k.grad, v.grad)]


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, scale=DIM**-0.5, enable_gqa=True)


def _merged(q, k, v):
    return ring_attention(q, k, v, DIM**-0.5, KeyBlocksSteps())


def _error(got, want):
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_merge_of_32_blocks_is_as_accurate_as_one_bf16_kernel(seed):
    inputs = [x.to(torch.bfloat16).double() for x in _inputs(seed)]  # exactly representable in bf16
    truth = _attend(_sdpa, *inputs, torch.float64)
    single = _attend(_sdpa, *inputs, torch.bfloat16)
    merged = _attend(_merged, *inputs, torch.bfloat16)
    for name, s, m, t in zip(("out", "dq", "dk", "dv"), single, merged, truth):
        single_err, merged_err = _error(s, t), _error(m, t)
        print(f"{name}: one bf16 SDPA {single_err:.2e}, 32 merged bf16 blocks {merged_err:.2e}")
        assert merged_err <= 1.5 * single_err, f"{name}: {merged_err:.2e} > 1.5 x {single_err:.2e}"
