"""Every local kernel backend against a float64 reference: out, lse and gradients."""

import math

import pytest
import torch

from easy_context import kernels
from easy_context.ring import merge_block

CPU_BACKENDS = kernels.available_backends("cpu", torch.float32)


def reference(q, k, v, causal, scale):
    """float64 attention with autograd; returns out and lse."""
    q, k, v = (x.double() for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) * scale
    if causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(), -math.inf)
    lse = scores.logsumexp(-1)
    return torch.softmax(scores, -1) @ v, lse


def inputs(hq, hkv, sq, sk, dtype, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda h, s: torch.randn(2, h, s, d, generator=g).to(dtype)  # noqa: E731
    return make(hq, sq), make(hkv, sk), make(hkv, sk), make(hq, sq)


def test_cpu_flash_backend_is_available_here():
    # Pins the private aten op this package relies on; the CI torch must have it.
    assert CPU_BACKENDS == ["cpu_flash", "math"]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize(
    "hq,hkv,sq,sk,causal",
    [(4, 4, 64, 64, True), (4, 2, 64, 64, True), (4, 1, 48, 48, True), (4, 2, 32, 96, False), (4, 4, 96, 32, False)],
)
def test_backend_matches_reference(backend, dtype, tol, hq, hkv, sq, sk, causal):
    q, k, v, dout = inputs(hq, hkv, sq, sk, dtype)
    scale = 0.3
    be = kernels._BACKENDS[backend]
    out, lse = kernels.attention_forward(q, k, v, causal, scale, be)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (2, hq, sq)
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = reference(qr, kr, vr, causal, scale)
    ref_out.backward(dout.double())
    assert (out.double() - ref_out).abs().max() <= tol
    assert (lse.double() - ref_lse).abs().max() <= tol
    dq, dk, dv = kernels.attention_backward(dout, q, k, v, out, lse, causal, scale, be)
    assert dk.shape == k.shape and dv.shape == v.shape  # GQA: grads keep the KV-head shape
    for got, want in ((dq, qr.grad), (dk, kr.grad), (dv, vr.grad)):
        assert (got.double() - want).abs().max() <= tol * max(1.0, want.abs().max().item())


def test_merge_of_two_halves_equals_full_attention():
    q, k, v, _ = inputs(4, 2, 32, 64, torch.float64)
    be = kernels._BACKENDS["math"]
    full_out, full_lse = kernels.attention_forward(q, k, v, False, 0.25, be)
    out, lse = kernels.attention_forward(q, k[:, :, :40], v[:, :, :40], False, 0.25, be)
    out, lse = out.clone(), lse.clone()
    merge_block(out, lse, *kernels.attention_forward(q, k[:, :, 40:], v[:, :, 40:], False, 0.25, be))
    assert torch.allclose(out, full_out, atol=1e-6) and torch.allclose(lse, full_lse, atol=1e-12)


def test_forced_backend_that_cannot_run_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("EASY_CONTEXT_KERNEL", "flash_attn")
    with pytest.raises(ValueError, match="usable here"):
        kernels.select_backend(torch.zeros(1, 1, 1, 8))


def test_causal_blocks_must_be_square():
    q, k, v, _ = inputs(4, 2, 32, 64, torch.float32)
    with pytest.raises(ValueError, match="square"):
        kernels.attention_forward(q, k, v, True, 0.25)
