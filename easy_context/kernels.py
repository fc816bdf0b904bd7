"""Local attention kernels: one block of attention returning (out, lse), and its backward.

Every sequence-parallel algorithm in this package is built from these two calls. The
backward takes the *global* (merged) output and log-sum-exp, which is what lets a ring
compute exact gradients block by block.

Layout everywhere: q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D) with Hq % Hkv == 0 (GQA is never
materialised by the caller), lse (B, Hq, Sq) in fp32 (fp64 for fp64 inputs), natural log.

Backends, picked per call from the tensors' device (override with EASY_CONTEXT_KERNEL):
  cpu_flash    torch's fused CPU flash-attention op (private aten op, pinned by tests)
  flash_attn   Dao-AILab flash_attn on CUDA, fp16/bf16 (optional dependency)
  cuda_flash   torch's fused CUDA flash op, fp16/bf16
  math         pure torch, fp32 accumulation, any device; the reference and the fallback

`causal=True` is only used with Sq == Sk (diagonal blocks), so top-left vs bottom-right
alignment of the backends never matters.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Callable, NamedTuple

import torch

__all__ = [
    "attention_forward",
    "attention_backward",
    "select_backend",
    "available_backends",
    "FORWARD_CALLS",
]


class Backend(NamedTuple):
    name: str
    forward: Callable  # (q, k, v, causal, scale) -> (out, lse)
    backward: Callable  # (dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)


class _ForwardCounter:
    """Forward kernel calls and query x key products computed (a causal square block of n
    rows counts n(n+1)/2); tests use it to prove what was recomputed and how work is spread."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.calls = self.products = 0

    def add(self, q_len: int, k_len: int, causal: bool) -> None:
        self.calls += 1
        self.products += q_len * (q_len + 1) // 2 if causal else q_len * k_len


FORWARD_CALLS = _ForwardCounter()


# --------------------------------------------------------------------------- math
def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half types, else the input's own (fp64 stays fp64 for exactness checks)."""
    return torch.promote_types(dtype, torch.float32)


def _grouped(q: torch.Tensor, n_kv: int) -> torch.Tensor:
    """(B, Hq, S, D) -> (B, Hkv, G, S, D): query heads grouped by the KV head they read."""
    b, h, s, d = q.shape
    return q.reshape(b, n_kv, h // n_kv, s, d)


def _math_scores(q, k, causal, scale):
    acc = accumulation_dtype(q.dtype)
    qg = _grouped(q.to(acc), k.shape[1])
    scores = torch.matmul(qg, k.to(acc).unsqueeze(2).transpose(-1, -2)) * scale
    if causal:
        sq, sk = scores.shape[-2:]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return qg, scores


def _math_forward(q, k, v, causal, scale):
    _, scores = _math_scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    out = torch.matmul(probs, v.to(probs.dtype).unsqueeze(2))
    b, h, s, d = q.shape
    return out.reshape(b, h, s, -1).to(q.dtype), lse.reshape(b, h, s)


def _math_backward(dout, q, k, v, out, lse, causal, scale):
    n_kv = k.shape[1]
    qg, scores = _math_scores(q, k, causal, scale)
    acc = scores.dtype
    probs = torch.exp(scores - _grouped(lse.to(acc).unsqueeze(-1), n_kv))
    dout_g = _grouped(dout.to(acc), n_kv)
    delta = (dout_g * _grouped(out.to(acc), n_kv)).sum(-1, keepdim=True)
    dv = torch.matmul(probs.transpose(-1, -2), dout_g).sum(2)
    dp = torch.matmul(dout_g, v.to(acc).unsqueeze(2).transpose(-1, -2))
    ds = probs * (dp - delta) * scale
    dq = torch.matmul(ds, k.to(acc).unsqueeze(2)).reshape(q.shape)
    dk = torch.matmul(ds.transpose(-1, -2), qg).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---------------------------------------------------------------------- cpu_flash
def _cpu_flash_forward(q, k, v, causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale
    )
    return out, lse.to(accumulation_dtype(q.dtype))


def _cpu_flash_backward(dout, q, k, v, out, lse, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), 0.0, causal, scale=scale
    )


# --------------------------------------------------------------------- cuda_flash
def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def _cuda_flash_forward(q, k, v, causal, scale):
    # torch's fused CUDA flash op wants equal head counts: repeat K/V for GQA here only.
    n_rep = q.shape[1] // k.shape[1]
    res = torch.ops.aten._scaled_dot_product_flash_attention(
        q, _repeat_kv(k, n_rep), _repeat_kv(v, n_rep), 0.0, causal, False, scale=scale
    )
    return res[0], res[1][..., : q.shape[2]].float()


def _cuda_flash_backward(dout, q, k, v, out, lse, causal, scale):
    n_rep = q.shape[1] // k.shape[1]
    kr, vr = _repeat_kv(k, n_rep), _repeat_kv(v, n_rep)
    empty = torch.empty(0, device=q.device, dtype=torch.int64)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.contiguous(), q, kr, vr, out.contiguous(), lse.contiguous(),
        empty, empty, q.shape[2], k.shape[2], 0.0, causal, empty, empty, scale=scale,
    )
    if n_rep > 1:
        b, h, s, d = k.shape
        dk = dk.reshape(b, h, n_rep, s, d).sum(2)
        dv = dv.reshape(b, h, n_rep, s, d).sum(2)
    return dq, dk, dv


# --------------------------------------------------------------------- flash_attn
@functools.lru_cache(maxsize=None)
def _flash_attn_module():
    from flash_attn import flash_attn_interface  # optional, CUDA only

    return flash_attn_interface


def _flash_attn_forward(q, k, v, causal, scale):
    fa = _flash_attn_module()
    # flash_attn wants (B, S, H, D); HF's q/k/v are transposes of exactly that layout.
    out, lse, *_ = fa.flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        softmax_scale=scale, causal=causal, return_attn_probs=True,
    )
    return out.transpose(1, 2), lse.float()


def _flash_attn_backward(dout, q, k, v, out, lse, causal, scale):
    import inspect

    fa = _flash_attn_module()
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    dq, dk, dv = torch.empty_like(t(q)), torch.empty_like(t(k)), torch.empty_like(t(v))
    params = inspect.signature(fa._flash_attn_backward).parameters
    kwargs = dict(dropout_p=0.0, softmax_scale=scale, causal=causal)
    # The private signature changed across flash_attn releases; pass what this one takes.
    if "window_size_left" in params:
        kwargs.update(window_size_left=-1, window_size_right=-1)
    elif "window_size" in params:
        kwargs.update(window_size=(-1, -1))
    for name, value in (("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("rng_state", None)):
        if name in params:
            kwargs[name] = value
    fa._flash_attn_backward(
        t(dout).contiguous(), t(q), t(k), t(v), t(out).contiguous(), lse.contiguous(), dq, dk, dv, **kwargs
    )
    return t(dq), t(dk), t(dv)


# ---------------------------------------------------------------------- selection
_BACKENDS = {
    "math": Backend("math", _math_forward, _math_backward),
    "cpu_flash": Backend("cpu_flash", _cpu_flash_forward, _cpu_flash_backward),
    "cuda_flash": Backend("cuda_flash", _cuda_flash_forward, _cuda_flash_backward),
    "flash_attn": Backend("flash_attn", _flash_attn_forward, _flash_attn_backward),
}


def available_backends(device_type: str, dtype: torch.dtype) -> list[str]:
    """Backends usable for this device and dtype, fastest first; 'math' is always last."""
    names = []
    half = dtype in (torch.float16, torch.bfloat16)
    if device_type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        names.append("cpu_flash")
    if device_type == "cuda" and half:
        if importlib.util.find_spec("flash_attn") is not None:
            names.append("flash_attn")
        names.append("cuda_flash")
    names.append("math")
    return names


def select_backend(q: torch.Tensor) -> Backend:
    forced = os.environ.get("EASY_CONTEXT_KERNEL")
    choices = available_backends(q.device.type, q.dtype)
    if forced:
        if forced not in choices:
            raise ValueError(
                f"EASY_CONTEXT_KERNEL={forced!r} cannot run {q.dtype} on {q.device.type}; "
                f"usable here: {choices}"
            )
        return _BACKENDS[forced]
    return _BACKENDS[choices[0]]


def attention_forward(q, k, v, causal: bool, scale: float, backend: Backend | None = None):
    """One attention block. Returns out (B, Hq, Sq, D) in q's dtype and lse (B, Hq, Sq) in
    accumulation_dtype(q.dtype)."""
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal blocks must be square, got Sq={q.shape[2]} Sk={k.shape[2]}")
    FORWARD_CALLS.add(q.shape[2], k.shape[2], causal)
    return (backend or select_backend(q)).forward(q, k, v, causal, scale)


def attention_backward(dout, q, k, v, out, lse, causal: bool, scale: float, backend: Backend | None = None):
    """Gradients of one block given the global out/lse of the rows it covers."""
    return (backend or select_backend(q)).backward(dout, q, k, v, out, lse, causal, scale)
