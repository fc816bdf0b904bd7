"""The distributed attention functions alone (zigzag ring, DistFlashAttn schedule), on P gloo
ranks, against SDPA on the full sequence: output and dq/dk/dv."""

import os

import pytest
import torch
import torch.nn.functional as F
from ranks import run_ranks

from easy_context.core.layout import Layout
from easy_context.modes.dist_flash_attn import dist_flash_attention
from easy_context.modes.zigzag_ring_attn import zigzag_ring_attention

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)

# name -> (function(q, k, v, scale, group), zigzag layout?)
FUNCTIONS = {"zigzag": (zigzag_ring_attention, True), "dist_flash": (dist_flash_attention, False)}

# (label, heads, kv heads, head dim, dtype, kernel)
CASES = [
    ("mha-fp32", 4, 4, 16, torch.float32, "cpu_flash"),
    ("gqa-fp32", 4, 2, 32, torch.float32, "cpu_flash"),
    ("mqa-fp32", 4, 1, 16, torch.float32, "cpu_flash"),
    ("gqa-fp32-math", 4, 2, 16, torch.float32, "math"),
    ("gqa-fp64-math", 4, 2, 16, torch.float64, "math"),
    ("gqa-bf16", 4, 2, 64, torch.bfloat16, "cpu_flash"),
]
SEQ, BATCH = 240, 2  # local shares of 120/80/60 (contiguous) or 2 x 60/40/30 (zigzag): not multiples of 32


def full_inputs(hq, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(BATCH, h, SEQ, d, generator=g).to(dtype)  # noqa: E731
    return make(hq), make(hkv), make(hkv), make(hq)


def worker(rank, world_size):
    """Each function x case: fwd+bwd on this rank's shard; returns local out and grads."""
    results = {}
    for name, (function, zigzag) in FUNCTIONS.items():
        layout = Layout(zigzag=zigzag, ring_degree=world_size)
        for label, hq, hkv, d, dtype, kernel in CASES:
            os.environ["EASY_CONTEXT_KERNEL"] = kernel
            q, k, v, dout = (layout.shard(x, rank, dim=2) for x in full_inputs(hq, hkv, d, dtype))
            q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
            out = function(q, k, v, d**-0.5, torch.distributed.group.WORLD)
            out.backward(dout)
            results[name, label] = [out.detach(), q.grad, k.grad, v.grad]
    return results


def sdpa(q, k, v, dout, d, dtype):
    """Single-process SDPA fwd+bwd in `dtype`: (out, dq, dk, dv)."""
    q, k, v = (x.to(dtype).detach().requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d**-0.5, enable_gqa=True)
    out.backward(dout.to(dtype))
    return out.detach(), q.grad, k.grad, v.grad


def rel_err(got, want):
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp(min=1)).item()


def tolerances(dtype, inputs, d):
    """fp64/fp32: fixed. bf16: at most 2x (plus 1/256) the error of single-process SDPA run in
    bf16 itself, per tensor: we may round differently, never worse in kind."""
    if dtype != torch.bfloat16:
        return [{torch.float64: 2e-14, torch.float32: 2e-5}[dtype]] * 4  # fp64 measured <= 1.4e-15
    truth, own = sdpa(*inputs, d, torch.float64), sdpa(*inputs, d, torch.bfloat16)
    return [2 * rel_err(o, t) + 1 / 256 for o, t in zip(own, truth)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_distributed_attention_matches_full_sdpa(world_size):
    per_rank = run_ranks(worker, world_size)
    assert len(per_rank[0]) == len(FUNCTIONS) * len(CASES)
    for (name, label), hq, hkv, d, dtype in (
        (key, *case[1:5]) for key in per_rank[0] for case in CASES if case[0] == key[1]
    ):
        layout = Layout(zigzag=FUNCTIONS[name][1], ring_degree=world_size)
        got = [layout.unshard([r[name, label][i] for r in per_rank], dim=2) for i in range(4)]
        inputs = full_inputs(hq, hkv, d, dtype)
        want = sdpa(*inputs, d, torch.float64)
        for tensor, g, w, tol in zip(("out", "dq", "dk", "dv"), got, want, tolerances(dtype, inputs, d)):
            assert g.dtype == dtype and g.shape == w.shape, (name, label, tensor)
            err = rel_err(g, w)
            print(f"{name} {label} P={world_size} {tensor}: rel err {err:.1e} (bound {tol:.1e})")
            assert err <= tol, f"{name} {label} P={world_size} {tensor}: rel err {err:.2e} > {tol:.2e}"


# ---------------------------------------------------------------------------- Ulysses
# (mode, world size, ring_degree); usp_attn at 4 = Ulysses 2 x ring 2
# Query heads that do not split over the Ulysses degree (SmolLM2's 9 / 3), split 5 + 4 at U = 2,
# 3 + 2 + 2 + 2 at U = 4, some ranks reading a K/V head that another rank reads too; fp64 bounds
# the exchange's exactness to rounding, bf16 to the single process's bf16 error.
UNEVEN_CASES = [
    ("9h-3kv-fp64-math", 9, 3, 16, torch.float64, "math"),
    ("9h-3kv-fp32", 9, 3, 16, torch.float32, "cpu_flash"),
    ("6h-2kv-fp32", 6, 2, 16, torch.float32, "cpu_flash"),
    ("5h-1kv-bf16", 5, 1, 64, torch.bfloat16, "cpu_flash"),
]
ULYSSES_CASES = CASES + UNEVEN_CASES
ULYSSES_RUNS = [("ulysses_attn", 2, None), ("ulysses_attn", 4, None), ("usp_attn", 4, 2)]


def _rows_dense_bshd(x):
    """Whether x (B, H, S, D) has the strides of (B, S, H, D)-dense memory within a batch row
    (a row slice of such a tensor, as the ring's blocks take, qualifies)."""
    _, h, s, d = x.shape
    return x.stride(3) == 1 and (h == 1 or x.stride(1) == d) and (s == 1 or x.stride(2) == h * d)


def ulysses_worker(rank, world_size, mode_name, ring_degree):
    """ulysses_attn / usp_attn on this rank's shard, inputs (B, H, S, D)-dense ("bhsd") and as
    HF hands them, (B, H, S, D) views of (B, S, H, D) memory ("bshd"). Records whether every
    dout the kernels' backward got was a view of (B, S, H, D)-dense memory (cpu_flash copies
    any other layout: one more tensor alive at the peak of the backward, issue 16)."""
    import easy_context.core.blocks as ring
    from easy_context.core.groups import get_groups
    from easy_context.modes import get_mode

    douts = []
    original = ring.attention_backward

    def recording(dout, *args, **kwargs):
        douts.append(_rows_dense_bshd(dout))
        return original(dout, *args, **kwargs)

    ring.attention_backward = recording
    mode = get_mode(mode_name)
    topology = mode.topology(world_size, ring_degree=ring_degree)
    groups, layout = get_groups(topology), mode.layout(topology)
    results = {}
    for label, hq, hkv, d, dtype, kernel in ULYSSES_CASES:
        os.environ["EASY_CONTEXT_KERNEL"] = kernel
        for memory in ("bhsd", "bshd"):
            q, k, v, dout = (layout.shard(x, groups.sp_rank, dim=2) for x in full_inputs(hq, hkv, d, dtype))
            if memory == "bshd":
                q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
            else:
                q, k, v = (x.contiguous() for x in (q, k, v))
            q, k, v = (x.requires_grad_() for x in (q, k, v))
            douts.clear()
            out = mode.attention(q, k, v, d**-0.5, groups)
            out.backward(dout)
            grads_keep_layout = all(x.grad.stride() == x.stride() for x in (q, k, v))
            results[label, memory] = [out.detach(), q.grad, k.grad, v.grad, grads_keep_layout, list(douts)]
    ring.attention_backward = original
    return results


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,world_size,ring_degree", ULYSSES_RUNS)
def test_ulysses_matches_full_sdpa_and_keeps_layouts(mode, world_size, ring_degree):
    """Exact against SDPA for MHA/GQA/MQA (K/V heads repeated when they don't split; query heads
    that don't split: UNEVEN_CASES), fp32, fp64 and bf16, both input layouts; every gradient has
    its input's strides (AccumulateGrad then keeps it without a copy) and every dout reaching the
    backward kernels is (B, S, H, D) memory."""
    from easy_context.modes import get_mode

    per_rank = run_ranks(ulysses_worker, world_size, mode, ring_degree)
    mode_obj = get_mode(mode)
    layout = mode_obj.layout(mode_obj.topology(world_size, ring_degree=ring_degree))
    for label, hq, hkv, d, dtype, _ in ULYSSES_CASES:
        inputs = full_inputs(hq, hkv, d, dtype)
        want = sdpa(*inputs, d, torch.float64)
        tols = tolerances(dtype, inputs, d)
        for memory in ("bhsd", "bshd"):
            ranks = [r[label, memory] for r in per_rank]
            assert all(r[4] for r in ranks), f"{mode} {label} {memory}: a gradient lost its input's layout"
            douts = [flag for r in ranks for flag in r[5]]
            assert douts and all(douts), f"{mode} {label} {memory}: dout layouts at the kernels {douts}"
            got = [layout.unshard([r[i] for r in ranks], dim=2) for i in range(4)]
            for tensor, g, w, tol in zip(("out", "dq", "dk", "dv"), got, want, tols):
                assert g.dtype == dtype and g.shape == w.shape, (mode, label, memory, tensor)
                err = rel_err(g, w)
                assert err <= tol, f"{mode} P={world_size} {label} {memory} {tensor}: rel err {err:.2e} > {tol:.2e}"
