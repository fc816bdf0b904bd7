"""The zigzag ring attention function alone, on P gloo ranks, against SDPA on the full sequence."""

import os

import pytest
import torch
import torch.nn.functional as F

from distributed import run_ranks
from easy_context.layout import Layout
from easy_context.zigzag_ring_attn import zigzag_ring_attention

# (label, heads, kv heads, head dim, dtype, kernel)
CASES = [
    ("mha-fp32", 4, 4, 16, torch.float32, "cpu_flash"),
    ("gqa-fp32", 4, 2, 32, torch.float32, "cpu_flash"),
    ("mqa-fp32", 4, 1, 16, torch.float32, "cpu_flash"),
    ("gqa-fp32-math", 4, 2, 16, torch.float32, "math"),
    ("gqa-fp64-math", 4, 2, 16, torch.float64, "math"),
    ("gqa-bf16", 4, 2, 64, torch.bfloat16, "cpu_flash"),
]
SEQ, BATCH = 256, 2


def full_inputs(hq, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(BATCH, h, SEQ, d, generator=g).to(dtype)  # noqa: E731
    return make(hq), make(hkv), make(hkv), make(hq)


def ring_worker(rank, world_size):
    """Each case: local fwd+bwd on this rank's zigzag shard; returns local out and grads."""
    results = {}
    for label, hq, hkv, d, dtype, kernel in CASES:
        os.environ["EASY_CONTEXT_KERNEL"] = kernel
        layout = Layout(zigzag=True, ring_degree=world_size)
        q, k, v, dout = (layout.shard(x, rank, dim=2) for x in full_inputs(hq, hkv, d, dtype))
        q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
        out = zigzag_ring_attention(q, k, v, d**-0.5, torch.distributed.group.WORLD)
        out.backward(dout)
        results[label] = [out.detach(), q.grad, k.grad, v.grad]
    return results


def tolerance(dtype):
    return {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2}[dtype]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_zigzag_ring_matches_full_sdpa(world_size):
    per_rank = run_ranks(ring_worker, world_size)
    for label, hq, hkv, d, dtype, _ in CASES:
        got = [Layout(zigzag=True, ring_degree=world_size).unshard([r[label][i] for r in per_rank], dim=2) for i in range(4)]
        q, k, v, dout = (x.double().requires_grad_() for x in full_inputs(hq, hkv, d, dtype))
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d**-0.5, enable_gqa=True)
        want.backward(dout.detach())
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, (want, q.grad, k.grad, v.grad)):
            assert g.dtype == dtype and g.shape == w.shape, (label, name)
            err = ((g.double() - w).abs().max() / w.abs().max().clamp(min=1)).item()
            assert err <= tolerance(dtype), f"{label} P={world_size} {name}: rel err {err:.2e}"
