"""flash_attn: Dao-AILab's flash_attn package on CUDA, fp16/bf16 (an optional dependency,
imported on first use); softcap and windows where the installed release has them."""

from __future__ import annotations

import functools
import inspect

import torch

__all__ = [
    "flash_attn_forward",
    "flash_attn_backward",
    "flash_attn_usable",
    "flash_attn_has_softcap",
    "flash_attn_has_window",
    "flash_attn_backward_options",
    "parameter_names",
]


@functools.cache
def _flash_attn_module():
    from flash_attn import flash_attn_interface  # optional, CUDA only

    return flash_attn_interface


@functools.cache
def flash_attn_usable() -> bool:
    try:
        _flash_attn_module()
    except ImportError:  # not installed, or built for another torch (undefined symbols)
        return False
    return True


@functools.cache
def flash_attn_has_softcap() -> bool:
    """flash_attn >= 2.6 takes softcap in both directions."""
    fa = _flash_attn_module()
    return "softcap" in parameter_names(fa.flash_attn_func) and "softcap" in parameter_names(fa._flash_attn_backward)


@functools.cache
def flash_attn_has_window() -> bool:
    """flash_attn >= 2.3 takes a sliding window in both directions."""
    fa = _flash_attn_module()
    backward = parameter_names(fa._flash_attn_backward)
    return "window_size" in parameter_names(fa.flash_attn_func) and bool({"window_size", "window_size_left"} & backward)


@functools.cache
def parameter_names(fn) -> frozenset:
    """Names `fn` takes. flash_attn >= 2.7 declares its private ops with torch.library.custom_op,
    whose Python signature is (*args, **kwargs): the op's schema has the real names."""
    schema = getattr(getattr(fn, "_opoverload", None), "_schema", None)
    if schema is not None:
        return frozenset(arg.name for arg in schema.arguments)
    return frozenset(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)


@functools.cache
def flash_attn_backward_options(fn) -> tuple:
    """(name, value) pairs that turn off the features this release's backward asks about; the
    private signature changed across flash_attn releases."""
    params = parameter_names(fn)
    options = {}
    if "window_size_left" in params:  # >= 2.7
        options.update(window_size_left=-1, window_size_right=-1)
    elif "window_size" in params:  # 2.3 - 2.6
        options.update(window_size=(-1, -1))
    for name, value in (("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("rng_state", None)):
        if name in params:
            options[name] = value
    return tuple(options.items())


def flash_attn_forward(q, k, v, causal, scale, softcap=None, window=None):
    fa = _flash_attn_module()
    # flash_attn wants (B, S, H, D); HF's q/k/v are transposes of exactly that layout (no copy).
    capped = {"softcap": softcap} if softcap else {}  # releases before 2.6 have no softcap
    if window is not None:  # flash_attn's own convention (bottom-right aligned), since 2.3
        capped["window_size"] = tuple(window)
    out, lse, *_ = fa.flash_attn_func(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        softmax_scale=scale,
        causal=causal,
        return_attn_probs=True,
        **capped,
    )
    return out.transpose(1, 2), lse.float()


def flash_attn_backward(dout, q, k, v, out, lse, causal, scale, softcap=None, window=None):
    fa = _flash_attn_module()
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    dq, dk, dv = torch.empty_like(t(q)), torch.empty_like(t(k)), torch.empty_like(t(v))
    # flash_attn copies dout/out itself only if their last dim is strided; the lse it indexes
    # as a dense (B, H, Sq) array.
    options = dict(flash_attn_backward_options(fa._flash_attn_backward))
    if softcap:
        options["softcap"] = softcap
    if window is not None and "window_size" in options:
        options["window_size"] = tuple(window)
    elif window is not None:
        options.update(window_size_left=window[0], window_size_right=window[1])
    fa._flash_attn_backward(
        t(dout),
        t(q),
        t(k),
        t(v),
        t(out),
        lse.contiguous(),
        dq,
        dk,
        dv,
        dropout_p=0.0,
        softmax_scale=scale,
        causal=causal,
        **options,
    )
    return t(dq), t(dk), t(dv)
