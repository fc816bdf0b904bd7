"""flex: torch's FlexAttention; masks, softcap and windows in any mix."""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from collections.abc import Callable

import torch

from easy_context.core.backends.flash_attn import parameter_names
from easy_context.core.backends.masks import INF, accumulation_dtype, backward_lse

__all__ = ["flex_forward", "flex_backward", "flex_usable", "flex_compilable", "flex_window_rule"]

# torch's FlexAttention, for the masks and logit transforms no fused kernel serves (softcap with a
# mask, documents inside a window): a bool mask and a (left, right) window become its mask_mod and
# a block mask (key blocks the mask forbids entirely are skipped), softcap its score_mod. On CUDA
# it runs compiled (Triton kernels); eager flex materialises the whole score matrix, which is
# what it does on CPU, where it is only used when forced (EASY_CONTEXT_KERNEL=flex) for tests.
_LN2 = math.log(2.0)


@functools.cache
def _flex_module():
    from torch.nn.attention import flex_attention  # a prototype API: its features are checked

    return flex_attention


@functools.cache
def flex_usable() -> bool:
    """FlexAttention imports with what this backend calls: create_block_mask, GQA and an lse."""
    try:
        flex = _flex_module()
    except ImportError:
        return False
    params = parameter_names(flex.flex_attention)
    return hasattr(flex, "create_block_mask") and "enable_gqa" in params and bool({"return_aux", "return_lse"} & params)


@functools.cache
def flex_compilable() -> bool:
    """flex can run compiled on CUDA: it imports and Triton (its kernels' compiler) is installed."""
    return flex_usable() and importlib.util.find_spec("triton") is not None


# Compiled graphs are bounded by the call's structure, not its values: window bounds, softcap
# and masks reach the mask/score functions as tensors (Dynamo guards a Python number in a
# closure by value, a tensor by its metadata), the functions come from the fixed set below, and
# the block mask is built inside the compiled call (its lengths stay symbolic). So each distinct
# (structure, dtype, grad mode) compiles a few graphs (Dynamo makes a length symbolic once it
# has changed) and then none, whatever the windows, lengths or documents. Past torch.compile's
# recompile limit flex would run eager, materialising the whole score matrix: the limit of this
# one callable is raised to cover every structure.
RECOMPILE_LIMIT = 64
# EASY_CONTEXT_FLEX_COMPILE=BACKEND runs flex compiled on any device with that torch.compile
# backend ("eager" or "aot_eager" on CPU: Dynamo's graphs and guards without Triton, to count
# compiles where there is no GPU); "off" never compiles. Default: compiled on CUDA (inductor).
FLEX_COMPILE_ENV = "EASY_CONTEXT_FLEX_COMPILE"


def flex_compile_backend(device: torch.device) -> str | None:
    """The torch.compile backend flex calls on `device` run under, or None (eager)."""
    chosen = os.environ.get(FLEX_COMPILE_ENV, "").strip()
    if chosen == "off":
        return None
    if chosen:
        return chosen
    return "inductor" if device.type == "cuda" else None


@functools.cache
def _compiled_flex(backend: str):
    """_flex_attend compiled once per process and backend; its graphs are cached per call
    structure (see RECOMPILE_LIMIT)."""
    if "recompile_limit" in parameter_names(torch.compile):
        return torch.compile(_flex_attend, backend=backend, dynamic=True, recompile_limit=RECOMPILE_LIMIT)
    compiled = torch.compile(_flex_attend, backend=backend, dynamic=True)
    config = torch._dynamo.config

    def call(*args, **kwargs):
        # A torch.compile without a limit of its own (torch 2.11) reads Dynamo's global one when it
        # compiles: it is raised for these calls only.
        with config.patch(recompile_limit=max(RECOMPILE_LIMIT, config.recompile_limit)):
            return compiled(*args, **kwargs)

    return call


@functools.cache
def _flex_operator():
    """The operator behind flex_attention. The public function refuses inputs that require grad
    on CPU (its compiled CPU kernels have no backward), while the operator's own autograd
    (the lse included) runs there on its dense implementation."""
    from torch._higher_order_ops.flex_attention import flex_attention

    return flex_attention


_UNBOUNDED = 2**30  # a window side that binds nothing (key - query offsets stay far below it)


def _window_bounds(sq: int, sk: int, window) -> tuple[int, int] | None:
    """(lo, hi): a flash_attn window (left, right), bottom-right aligned, as the offsets
    kv_idx - q_idx it allows, lo <= offset <= hi; None when it allows every key."""
    left, right = window
    if left < 0 and right < 0:
        return None
    shift = sk - sq
    return (shift - left if left >= 0 else -_UNBOUNDED), (shift + right if right >= 0 else _UNBOUNDED)


def flex_window_rule(sq: int, sk: int, window, device: torch.device | str = "cpu") -> Callable | None:
    """The mask_mod (b, h, q_idx, kv_idx) -> allowed that flex calls get for a flash_attn window
    (left, right), bottom-right aligned: query i sees key j iff i + sk - sq - left <= j <=
    i + sk - sq + right (-1: unlimited); None when the window allows every key."""
    bounds = _window_bounds(sq, sk, window)
    return None if bounds is None else _banded(_constant(bounds, torch.int64, torch.device(device)))


def _flex_window(causal: bool, window):
    """The (left, right) window a call asks for; causal is the window (-1, 0) (square blocks)."""
    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


@functools.lru_cache(maxsize=256)
def _constant(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small constant on the device, made once (no host-to-device copy per call)."""
    return torch.tensor(values, dtype=dtype, device=device)


# The mask and score functions: module-level factories, so that their code objects are fixed
# and every value they use is a tensor. bounds = (lo, hi) offsets; plane = bool (Sq, Sk) or
# (B, Sq, Sk).
def _banded(bounds):
    def mask_mod(b, h, q_idx, kv_idx):
        offset = kv_idx - q_idx
        return (offset >= bounds[0]) & (offset <= bounds[1])

    return mask_mod


def _shared_plane(plane, bounds):
    def mask_mod(b, h, q_idx, kv_idx):
        offset = kv_idx - q_idx
        return plane[q_idx, kv_idx] & (offset >= bounds[0]) & (offset <= bounds[1])

    return mask_mod


def _plane_per_row(plane, bounds):
    def mask_mod(b, h, q_idx, kv_idx):
        offset = kv_idx - q_idx
        return plane[b, q_idx, kv_idx] & (offset >= bounds[0]) & (offset <= bounds[1])

    return mask_mod


def _softcapped(cap):
    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap

    return score_mod


def _flex_inputs(q, k, causal, mask, softcap, window):
    """(plane, bounds, cap) of a call, each a tensor or None: the mask's bool plane ((Sq, Sk)
    shared by the rows, or (B, Sq, Sk)), the window's offset bounds (unbounded when only a
    mask is given; None when nothing is masked) and the softcap."""
    device = q.device
    cap = _constant((float(softcap),), torch.float32, device)[0] if softcap else None
    bounds = _window_bounds(q.shape[2], k.shape[2], _flex_window(causal, window))
    if mask is None and bounds is None:
        return None, None, cap
    bounds = _constant(bounds or (-_UNBOUNDED, _UNBOUNDED), torch.int64, device)
    plane = None if mask is None else (mask[0, 0] if mask.shape[0] == 1 else mask[:, 0])
    return plane, bounds, cap


def _flex_mods(plane, bounds, cap):
    """(score_mod, mask_mod, block-mask rows) of a call's inputs; None where there is none."""
    score_mod = None if cap is None else _softcapped(cap)
    if bounds is None:
        return score_mod, None, None
    if plane is None:
        return score_mod, _banded(bounds), None  # a window alone is the same in every row
    if plane.dim() == 2:
        return score_mod, _shared_plane(plane, bounds), None
    return score_mod, _plane_per_row(plane, bounds), plane.shape[0]


def _flex_attend(q, k, v, scale, plane, bounds, cap):
    """(out, lse) of flex_attention, the block mask built here: compiled, this whole function is
    one graph per structure, the mask's evaluation over the grid is fused (no Sq x Sk
    temporaries), and the lengths stay symbolic. (A block mask made outside carries its
    lengths as Python numbers, and the compiled call would specialise on each pair of them.)"""
    flex = _flex_module()
    score_mod, mask_mod, rows = _flex_mods(plane, bounds, cap)
    block_mask = None
    if mask_mod is not None:
        block_mask = flex.create_block_mask(mask_mod, rows, None, q.shape[2], k.shape[2], device=q.device)
    common = dict(score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    if _returns_aux():  # where it exists, return_lse is deprecated
        out, aux = flex.flex_attention(q, k, v, **common, return_aux=flex.AuxRequest(lse=True))
        return out, aux.lse
    return flex.flex_attention(q, k, v, **common, return_lse=True)


@functools.cache
def _returns_aux() -> bool:
    return "return_aux" in parameter_names(_flex_module().flex_attention)


def _flex_run(q, k, v, scale, plane, bounds, cap, differentiable: bool):
    """(out, lse) of one flex call, lse natural log in the accumulation dtype; with
    differentiable=True both are in q/k/v's autograd graph (q/k/v require grad)."""
    if differentiable and q.device.type == "cpu":
        flex = _flex_module()
        score_mod, mask_mod, rows = _flex_mods(plane, bounds, cap)
        block_mask = flex.create_block_mask(
            mask_mod or flex.noop_mask, rows, None, q.shape[2], k.shape[2], device=q.device
        )
        options = {"OUTPUT_LOGSUMEXP": True, "OUTPUT_MAX": False}  # all the dense path reads
        # The operator's lse is base 2 (its kernels use exp2); the public function converts it.
        out, lse2, _ = _flex_operator()(q, k, v, score_mod or _flex_identity, block_mask.as_tuple(), scale, options)
        lse = lse2 * _LN2
    else:
        backend = flex_compile_backend(q.device)
        call = _flex_attend if backend is None else _compiled_flex(backend)
        out, lse = call(q, k, v, scale, plane, bounds, cap)
    return out, lse.to(accumulation_dtype(q.dtype))


def _flex_identity(score, b, h, q_idx, kv_idx):
    return score


def flex_forward(q, k, v, causal, scale, mask=None, softcap=None, window=None):
    plane, bounds, cap = _flex_inputs(q, k, causal, mask, softcap, window)
    # Detached: a ring's autograd.Function hands its leaves over as they are, and flex refuses
    # CPU inputs that require grad (the backward recomputes this call under autograd).
    q, k, v = (x.detach() for x in (q, k, v))
    out, lse = _flex_run(q, k, v, scale, plane, bounds, cap, differentiable=False)
    if bounds is not None:  # rows with no allowed key: lse -inf from flex; out 0 whatever it gave
        out = torch.where((lse == -INF).unsqueeze(-1), 0, out)
    return out, lse


def flex_backward(dout, q, k, v, out, lse, causal, scale, mask=None, softcap=None, window=None):
    """Gradients given the global out/lse of the rows: the block's forward is recomputed under
    autograd and its (out_b, lse_b) are given the gradients that make flex's own backward compute
    the global ones. With w = exp(lse_b - lse), the global probabilities are w * p_b, and
    dS = w p_b (dout.v - delta), delta = rowsum(dout * out); autograd through (out_b, lse_b) with
    grad_outputs (g, h) gives dS = p_b (g.v - rowsum(g * out_b) + h). So g = w dout and
    h = rowsum(g * out_b) - w delta (g as rounded to out_b's dtype: the term flex's backward
    subtracts is cancelled with the very g it is given), and dV = p_b^T g = (w p_b)^T dout."""
    plane, bounds, cap = _flex_inputs(q, k, causal, mask, softcap, window)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    with torch.enable_grad():
        out_b, lse_b = _flex_run(*leaves, scale, plane, bounds, cap, differentiable=True)
    acc = lse_b.dtype
    # Rows with no allowed key anywhere (lse -inf) get w = 0, as do rows empty in this block.
    weight = torch.exp(lse_b.detach() - backward_lse(lse).to(acc)).unsqueeze(-1)
    g = (dout.to(acc) * weight).to(out_b.dtype)
    delta = (dout.to(acc) * out.to(acc)).sum(-1, keepdim=True)
    h = (g.to(acc) * out_b.detach().to(acc)).sum(-1, keepdim=True) - weight * delta
    dq, dk, dv = torch.autograd.grad((out_b, lse_b), leaves, (g, h.squeeze(-1)))
    return dq, dk, dv
