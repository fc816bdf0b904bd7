"""Sequence-parallel attention as one opaque operator for torch.compile.

The attention a mode runs is Python all the way down: process groups, kernel calls worked out
from the mask, point-to-point transfers, a data-dependent mask gathered once per forward. Traced by
Dynamo it breaks the graph in every decoder layer. Under compilation the dispatcher
(patch.py) calls `easy_context::sp_attention` instead, a torch.library custom op: Dynamo,
AOTAutograd and Inductor see one node per layer with a declared output shape, and at run
time the node calls the same mode attention that eager runs.

What cannot be an operator argument stays on the Python side: the installed context (mode,
groups) is read at run time, and the forward's whole-sequence mask lives in one slot. The
first attention call of a forward (`first`, decided while tracing from the forward's
ShardedMask, so it is the same on every rank) gathers the mask and runs the replica guard;
the following layers of that forward reuse it; data flow orders the layers.

The backward is the mode's own: the forward runs the mode attention under autograd on
detached inputs, keeps that graph under an integer handle (the op's second output, which
autograd saves for the backward), and `easy_context::sp_attention_backward` differentiates
it (executor.py's backward, the Ulysses all-to-alls' backward, all as in eager). A graph no
backward comes for is dropped with the handle that names it.

Eager calls do not go through the op: they keep the HF layer, which recompute-free
checkpointing (core/remat.py) needs and an operator cannot take, and skip the indirection.
Both paths run the same attention, so their results are bit for bit the same.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable

import torch

from easy_context.core.global_mask import gather_sequence_mask
from easy_context.core.masking import SequenceMask
from easy_context.hf.replicas import check_replica_weights

__all__ = ["register", "attention"]

_OP = "easy_context::sp_attention"
_BACKWARD_OP = "easy_context::sp_attention_backward"

_context_of: Callable | None = None  # -> the installed SequenceParallel (patch.active)
_forward_mask: SequenceMask | None = None  # the current forward's mask, set by its first call
_graphs: dict = {}  # handle -> (output attached to its graph, the detached inputs it was computed from)
_handles = itertools.count()
_autograd_keys = 0  # raw dispatch key bits of autograd, set by register


def _active():
    context = _context_of() if _context_of is not None else None
    if context is None:
        raise RuntimeError(
            f"{_OP} ran without an installed sequence-parallel patch; call apply_seq_parallel_monkey_patch "
            "(or easy_context.setup) before running the compiled model"
        )
    return context


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    position_ids: torch.Tensor | None,
    padding: torch.Tensor | None,
    token_index: torch.Tensor | None,
    sinks: torch.Tensor | None,
    weights: list[torch.Tensor],
    layer_name: str,
    scale: float,
    softcap: float | None,
    window: int | None,
    first: bool,
    needs_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    global _forward_mask
    context = _active()
    groups = context.groups()
    if first:
        _forward_mask = None  # a failed gather must not leave the last forward's mask behind
        layout = context.mode.layout(groups.topology)
        _forward_mask = gather_sequence_mask(position_ids, padding, groups, layout, token_index)
        check_replica_weights(weights, layer_name, groups.sp, groups.sp_rank, q.device)
    if _forward_mask is None:
        raise RuntimeError(f"{_OP}: a layer ran before the first attention call of its forward had gathered the mask")
    mask = _forward_mask.with_window(window)
    options = {name: x for name, x in (("softcap", softcap), ("sinks", sinks)) if x is not None}
    handle = torch.full((), -1, dtype=torch.int64)
    if not needs_grad:
        with torch.no_grad():
            out = context.mode.attention(q, k, v, scale, groups, mask=mask, **options)
        return out.contiguous(), handle
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    if sinks is not None:
        leaves.append(sinks.detach().requires_grad_())
        options["sinks"] = leaves[3]
    with _recording():
        out = context.mode.attention(*leaves[:3], scale, groups, mask=mask, **options).contiguous()
    key = next(_handles)
    _graphs[key] = (out, leaves)
    handle.fill_(key)
    weakref.finalize(handle, _graphs.pop, key, None)
    return out.detach(), handle


def _recording():
    """Autograd on inside the operator: the dispatcher runs an operator's implementation below
    autograd (its keys excluded), so turning grad mode on alone would record nothing."""
    excluded = torch._C._dispatch_tls_local_exclude_set().raw_repr() & ~_autograd_keys
    guard = torch._C._ForceDispatchKeyGuard(
        torch._C._dispatch_tls_local_include_set(), torch._C.DispatchKeySet.from_raw_repr(excluded)
    )
    stack = contextlib.ExitStack()
    stack.enter_context(guard)
    stack.enter_context(torch.enable_grad())
    return stack


def _below_autograd_keys() -> int:
    """The dispatch keys (raw bits) that running below autograd excludes; called outside any
    operator (register), where none of them is excluded yet."""
    outside = torch._C._dispatch_tls_local_exclude_set().raw_repr()
    with torch._C._AutoDispatchBelowAutograd():
        inside = torch._C._dispatch_tls_local_exclude_set().raw_repr()
    return inside & ~outside


def _attention_fake(
    q, k, v, position_ids, padding, token_index, sinks, weights, layer_name, scale, softcap, window, first, needs_grad
):
    return q.new_empty(q.shape), torch.empty((), dtype=torch.int64)


def _like(x: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor:
    """grad with x's dtype and strides (what the fake implementation declares)."""
    if grad is None:
        return torch.zeros_like(x)
    if grad.dtype == x.dtype and grad.stride() == x.stride():
        return grad
    return torch.empty_like(x).copy_(grad)


def _backward(
    dout: torch.Tensor,
    handle: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    entry = _graphs.pop(int(handle), None)
    if entry is None:
        raise RuntimeError(
            f"{_BACKWARD_OP}: the forward graph of handle {int(handle)} is gone (a second backward through the "
            "same compiled forward); run the forward again, or keep the graph with retain_graph in one backward"
        )
    out, leaves = entry
    grads = torch.autograd.grad(out, leaves, dout, allow_unused=True)
    dq, dk, dv = (_like(x, g) for x, g in zip((q, k, v), grads))
    dsinks = _like(sinks, grads[3]) if sinks is not None else q.new_empty(0)
    return dq, dk, dv, dsinks


def _backward_fake(dout, handle, q, k, v, sinks):
    dsinks = torch.empty_like(sinks) if sinks is not None else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


def _setup_context(ctx, inputs, output):
    q, k, v, *_ = inputs
    sinks = inputs[6]
    ctx.save_for_backward(q, k, v, output[1], sinks)
    ctx.has_sinks, ctx.weights = sinks is not None, len(inputs[7])


def _autograd_backward(ctx, dout, dhandle):
    q, k, v, handle, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.easy_context.sp_attention_backward(dout, handle, q, k, v, sinks)
    weights = [None] * ctx.weights  # the replica guard's weights: read, never differentiated
    return dq, dk, dv, None, None, None, dsinks if ctx.has_sinks else None, weights, None, None, None, None, None, None


_registered = False


def register(context_of: Callable) -> None:
    """Define the two operators (once per process); `context_of()` gives the installed context."""
    global _context_of, _registered, _autograd_keys
    _context_of = context_of
    if _registered:
        return
    _autograd_keys = _below_autograd_keys()
    forward = torch.library.custom_op(_OP, mutates_args=())(_attention)
    forward.register_fake(_attention_fake)
    backward = torch.library.custom_op(_BACKWARD_OP, mutates_args=())(_backward)
    backward.register_fake(_backward_fake)
    forward.register_autograd(_autograd_backward, setup_context=_setup_context)
    _registered = True


def attention(
    q, k, v, scale, options: dict, *, position_ids, padding, token_index, window, first: bool, layer
) -> torch.Tensor:
    """The mode's attention of q/k/v through the operator: (B, Hq, S_local, D), contiguous.
    `first`: this call starts a forward (it gathers the mask); `layer` the HF attention module
    (its weights feed the replica guard at a forward's first call)."""
    sinks = options.get("sinks")
    needs_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, sinks))
    weights = list(layer.parameters()) if first else []
    out, _ = torch.ops.easy_context.sp_attention(
        q,
        k,
        v,
        position_ids,
        padding,
        token_index,
        sinks,
        weights,
        type(layer).__name__,
        float(scale),
        options.get("softcap"),
        window,
        first,
        needs_grad,
    )
    return out
