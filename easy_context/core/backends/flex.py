"""flex: torch's FlexAttention; masks, softcap and windows in any mix."""

from __future__ import annotations

import functools
import importlib.util
import math
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


@functools.cache
def _compiled_flex():
    """flex_attention compiled once per process; torch.compile caches a graph per mask/score
    function code and input shape, so one compiled callable serves every block."""
    return torch.compile(_flex_module().flex_attention)


@functools.cache
def _flex_operator():
    """The operator behind flex_attention. The public function refuses inputs that require grad
    on CPU (its compiled CPU kernels have no backward), while the operator's own autograd
    (the lse included) runs there on its dense implementation."""
    from torch._higher_order_ops.flex_attention import flex_attention

    return flex_attention


def flex_window_rule(sq: int, sk: int, window) -> Callable | None:
    """(q_idx, kv_idx) -> allowed for a flash_attn window (left, right), bottom-right aligned:
    query i sees key j iff i + sk - sq - left <= j <= i + sk - sq + right (-1: unlimited)."""
    left, right = window
    shift = sk - sq
    if left < 0 and right < 0:
        return None

    def rule(q_idx, kv_idx):
        diagonal = q_idx + shift
        allowed = kv_idx >= diagonal - left if left >= 0 else kv_idx >= 0
        return allowed & (kv_idx <= diagonal + right) if right >= 0 else allowed

    return rule


def _flex_window(causal: bool, window):
    """The (left, right) window a call asks for; causal is the window (-1, 0) (square blocks)."""
    left, right = (-1, -1) if window is None else window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def _flex_mods(q, k, causal, mask, softcap, window):
    """(score_mod, mask_mod) for a call; None where it has no softcap / nothing masked."""
    sq, sk = q.shape[2], k.shape[2]
    rule = flex_window_rule(sq, sk, _flex_window(causal, window))
    score_mod = None
    if softcap:
        cap = float(softcap)

        def score_mod(score, b, h, q_idx, kv_idx):
            return torch.tanh(score / cap) * cap

    if mask is None and rule is None:
        return score_mod, None
    plane = None if mask is None else mask[:, 0]  # (B or 1, Sq, Sk)
    per_row = plane is not None and plane.shape[0] > 1

    def mask_mod(b, h, q_idx, kv_idx):
        # A mask shared by the batch rows is read at row 0: the kernel calls this with every b.
        allowed = None if plane is None else plane[b if per_row else 0, q_idx, kv_idx]
        if rule is None:
            return allowed
        return rule(q_idx, kv_idx) if allowed is None else allowed & rule(q_idx, kv_idx)

    return score_mod, mask_mod


def _flex_block_mask(mask_mod, q, k, mask):
    if mask_mod is None:
        return None
    rows = None if mask is None else mask.shape[0]  # a window alone is the same in every row
    return _flex_module().create_block_mask(mask_mod, rows, None, q.shape[2], k.shape[2], device=q.device)


def _flex_run(q, k, v, scale, score_mod, mask_mod, mask, differentiable: bool):
    """(out, lse) of one flex call, lse natural log in the accumulation dtype; with
    differentiable=True both are in q/k/v's autograd graph (q/k/v require grad)."""
    flex = _flex_module()
    block_mask = _flex_block_mask(mask_mod, q, k, mask)
    if differentiable and q.device.type == "cpu":
        if block_mask is None:
            block_mask = flex.create_block_mask(flex.noop_mask, None, None, q.shape[2], k.shape[2], device=q.device)
        options = {"OUTPUT_LOGSUMEXP": True, "OUTPUT_MAX": False}  # all the dense path reads
        # The operator's lse is base 2 (its kernels use exp2); the public function converts it.
        out, lse2, _ = _flex_operator()(q, k, v, score_mod or _flex_identity, block_mask.as_tuple(), scale, options)
        lse = lse2 * _LN2
    else:
        call = _compiled_flex() if q.device.type == "cuda" else flex.flex_attention
        common = dict(score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        if "return_aux" in parameter_names(flex.flex_attention):  # where it exists, return_lse is deprecated
            out, aux = call(q, k, v, **common, return_aux=flex.AuxRequest(lse=True))
            lse = aux.lse
        else:
            out, lse = call(q, k, v, **common, return_lse=True)
    return out, lse.to(accumulation_dtype(q.dtype))


def _flex_identity(score, b, h, q_idx, kv_idx):
    return score


def flex_forward(q, k, v, causal, scale, mask=None, softcap=None, window=None):
    score_mod, mask_mod = _flex_mods(q, k, causal, mask, softcap, window)
    # Detached: a ring's autograd.Function hands its leaves over as they are, and flex refuses
    # CPU inputs that require grad (the backward recomputes this call under autograd).
    q, k, v = (x.detach() for x in (q, k, v))
    out, lse = _flex_run(q, k, v, scale, score_mod, mask_mod, mask, differentiable=False)
    if mask_mod is not None:  # rows with no allowed key: lse -inf from flex; out 0 whatever it gave
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
    score_mod, mask_mod = _flex_mods(q, k, causal, mask, softcap, window)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    with torch.enable_grad():
        out_b, lse_b = _flex_run(*leaves, scale, score_mod, mask_mod, mask, differentiable=True)
    acc = lse_b.dtype
    # Rows with no allowed key anywhere (lse -inf) get w = 0, as do rows empty in this block.
    weight = torch.exp(lse_b.detach() - backward_lse(lse).to(acc)).unsqueeze(-1)
    g = (dout.to(acc) * weight).to(out_b.dtype)
    delta = (dout.to(acc) * out.to(acc)).sum(-1, keepdim=True)
    h = (g.to(acc) * out_b.detach().to(acc)).sum(-1, keepdim=True) - weight * delta
    dq, dk, dv = torch.autograd.grad((out_b, lse_b), leaves, (g, h.squeeze(-1)))
    return dq, dk, dv
