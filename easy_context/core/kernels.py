"""Local attention kernels: one block of attention returning (out, lse), and its backward.

Every sequence-parallel algorithm in this package is built from these two calls. The
backward takes the *global* (merged) output and log-sum-exp, which is what lets a ring
compute exact gradients block by block.

Layout everywhere: q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D) with Hq % Hkv == 0 (GQA is never
materialised by the caller), lse (B, Hq, Sq) in fp32 (fp64 for fp64 inputs), natural log.
q/k/v usually are (B, H, S, D) views of (B, S, H, D)-dense tensors (HF transposes its
projections); no backend copies them unless its kernel needs another layout.

Masks: `mask` is a bool tensor broadcastable to (B, 1, Sq, Sk), True where the query may
attend the key, and never given together with causal=True. A query row with no allowed key
gets out 0 and lse -inf on every backend, and zero gradients (never NaN).

Softcapping (Gemma 2): `softcap` c turns each logit s = scale * q.k into c * tanh(s / c)
before the softmax; the lse is over the capped logits, so blocks still merge exactly.
math (any device), flash_attn and flex (CUDA) have it; a softcapped call picks the best of
those (on CPU: math, which holds one tile of logits at a time).

Windows: a backend with supports_window takes window=(left, right), flash_attn's rule
(bottom-right aligned: query i sees key j iff i + Sk - Sq - left <= j <= i + Sk - Sq + right,
-1 unlimited), alone or with a mask.

Documents: a backend with supports_segments takes segments=(0, s1, ..., Sq) for a square block
(Sq == Sk): rows [s_i, s_i+1) attend only keys [s_i, s_i+1), each square causal or in the
window as the call says (flash's variable-length call, cu_seqlens). No other backend takes
them: the caller runs such a block one document at a time (masking.Block.split).

Backends, picked per call from the tensors' device, dtype and head dim (override with
EASY_CONTEXT_KERNEL):
  cpu_flash       torch's fused CPU flash-attention op (private aten op, pinned by tests); masks;
                  windows in tiles of the band (backends.band)
  flash_attn      Dao-AILab flash_attn on CUDA, fp16/bf16 (optional dependency); softcap
  flex            torch's FlexAttention, compiled, on CUDA: masks, softcap, windows, any mix of
                  them (softcap with a mask, documents inside a window); on CPU only when forced
                  (eager, the whole score matrix at once: for tests of its algebra)
  cuda_flash      torch's fused CUDA flash op, fp16/bf16
  cuda_efficient  torch's fused CUDA memory-efficient op, fp32/fp16/bf16; masks; windows in
                  tiles of the band (backends.band), as cpu_flash
  math            pure torch, fp32 accumulation, any device; masks, softcap; the reference and
                  the fallback; computed in tiles of query rows (backends.math_tiles.tile_logits: on
                  CPU MATH_TILE_LOGITS logits at a time, on CUDA sized from the free memory)
Order on CUDA: fp16/bf16 flash_attn, cuda_flash, cuda_efficient, flex, math; fp32
cuda_efficient, flex, math (flex sits before math so a masked or softcapped call that no fused
kernel serves never reaches math there). The two flash backends need compute capability
>= 8.0 and a head dim <= 256 that is a multiple of 8. A masked call uses the best backend that
takes a mask: a forced EASY_CONTEXT_KERNEL that cannot (flash_attn, cuda_flash) still serves
every unmasked call, and masked calls fall back to the best masked backend. flex on CPU is
forced only (FORCED_ONLY): EASY_CONTEXT_KERNEL=flex sends every CPU call there.

`causal=True` is only used with Sq == Sk (diagonal blocks), so top-left vs bottom-right
alignment of the backends never matters.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import NamedTuple

import torch

from easy_context.core.backends import (
    HALF,
    accumulation_dtype,
    band_mask,
    cpu_flash_backward,
    cpu_flash_forward,
    cuda_efficient_backward,
    cuda_efficient_forward,
    cuda_flash_backward,
    cuda_flash_forward,
    flash_attn_backward,
    flash_attn_forward,
    flash_attn_has_softcap,
    flash_attn_has_window,
    flash_attn_usable,
    flex_backward,
    flex_compilable,
    flex_forward,
    flex_usable,
    math_backward,
    math_forward,
)
from easy_context.core.call_counts import FORWARD_CALLS

__all__ = [
    "attention_forward",
    "attention_backward",
    "select_backend",
    "available_backends",
    "accumulation_dtype",
    "Backend",
    "BACKENDS",
    "FORWARD_CALLS",
    "band_mask",
]


class Backend(NamedTuple):
    name: str
    forward: Callable  # (q, k, v, causal, scale[, mask][, softcap=c]) -> (out, lse)
    backward: Callable  # (dout, q, k, v, out, lse, causal, scale[, mask][, softcap=c]) -> (dq, dk, dv)
    supports_mask: bool = False  # forward/backward take a (B or 1, 1, Sq, Sk) bool mask last
    supports_softcap: bool = False  # forward/backward take softcap=c (logits c * tanh(s / c))
    supports_window: bool = False  # forward/backward take window=(left, right) (see masking.Block)
    supports_segments: bool = False  # forward/backward take segments=(0, ..., Sq) (see masking.Block)


# -------------------------------------------------------------------------- masks
def _checked_mask(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    """The mask as a (B or 1, 1, Sq, Sk) bool view (broadcast dims expanded, nothing copied)."""
    if causal:
        raise ValueError("causal must be False when a mask is given (put causality in the mask)")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor (True = may attend), got {mask.dtype}")
    b, sq, sk = q.shape[0], q.shape[2], k.shape[2]
    m = mask[(None,) * (4 - mask.dim())] if mask.dim() <= 4 else mask
    if m.dim() != 4 or any(n not in (1, full) for n, full in zip(m.shape, (b, 1, sq, sk))):
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to (B, 1, Sq, Sk) = ({b}, 1, {sq}, {sk})"
        )
    return m.expand(m.shape[0], 1, sq, sk)


# ---------------------------------------------------------------------- selection
BACKENDS = {
    "math": Backend("math", math_forward, math_backward, supports_mask=True, supports_softcap=True),
    "cpu_flash": Backend(
        "cpu_flash",
        cpu_flash_forward,
        cpu_flash_backward,
        supports_mask=True,
        supports_window=True,
        supports_segments=True,  # one call per document, concatenated (no CPU variable-length kernel)
    ),
    "cuda_flash": Backend(
        "cuda_flash", cuda_flash_forward, cuda_flash_backward, supports_window=True, supports_segments=True
    ),
    "cuda_efficient": Backend(
        "cuda_efficient", cuda_efficient_forward, cuda_efficient_backward, supports_mask=True, supports_window=True
    ),
    "flash_attn": Backend(
        "flash_attn", flash_attn_forward, flash_attn_backward, supports_softcap=True, supports_window=True
    ),
    "flex": Backend(
        "flex", flex_forward, flex_backward, supports_mask=True, supports_softcap=True, supports_window=True
    ),
}

# Backends usable on a device only when EASY_CONTEXT_KERNEL names them: eager FlexAttention on
# CPU holds the whole (B, H, Sq, Sk) score matrix and is slower than math; forced, its CPU path
# is what tests check the CUDA backend's algebra on.
FORCED_ONLY = {"cpu": ("flex",)}


def _has(name: str, masked: bool, softcap: bool, window: bool = False, segments: bool = False) -> bool:
    """Whether backend `name` can run a call with a mask / softcap / window / segments; a window
    is also served by a backend that takes a mask (the band, written as one), segments only
    natively."""
    backend = BACKENDS[name]
    if segments and not backend.supports_segments:
        return False
    if softcap and name == "flash_attn" and not flash_attn_has_softcap():
        return False
    native_window = backend.supports_window and (name != "flash_attn" or not window or flash_attn_has_window())
    window_ok = native_window or backend.supports_mask or not window
    return (backend.supports_mask or not masked) and (backend.supports_softcap or not softcap) and window_ok


def _flash_fits(head_dim, capability) -> bool:
    """Limits shared by flash_attn and torch's flash op: sm80+ kernels, head dims up to 256."""
    return (capability is None or capability >= (8, 0)) and (
        head_dim is None or (head_dim <= 256 and head_dim % 8 == 0)
    )


def _flex_fits(dtype, head_dim, capability) -> bool:
    """Where compiled FlexAttention is used on CUDA: Triton installed, sm80+, fp32/fp16/bf16, head
    dims 16..256 in multiples of 8. Narrower than what flex may take: a call outside goes to
    math, which is exact, rather than to a Triton kernel never checked there."""
    return (
        dtype in (torch.float32, *HALF)
        and (capability is None or capability >= (8, 0))
        and (head_dim is None or (16 <= head_dim <= 256 and head_dim % 8 == 0))
        and flex_compilable()
    )


def _efficient_fits(dtype, head_dim, capability) -> bool:
    """The checks torch's own SDPA dispatcher makes before it picks the efficient op
    (sdp_utils.cpp): bf16 needs sm80, the head dim a multiple of the GEMM alignment."""
    if dtype not in (torch.float32, *HALF):
        return False
    if capability is not None and (capability < (5, 0) or (dtype == torch.bfloat16 and capability < (8, 0))):
        return False
    alignment = 8 if dtype in HALF else 4 if capability is None or capability >= (8, 0) else 1
    return head_dim is None or head_dim % alignment == 0


def available_backends(
    device_type: str,
    dtype: torch.dtype,
    head_dim: int | None = None,
    capability: tuple[int, int] | None = None,
    masked: bool = False,
    softcap: bool = False,
    window: bool = False,
    segments: bool = False,
) -> list[str]:
    """Backends usable for this device and dtype, fastest first; 'math' is last, except with
    segments=True (math takes none).

    On CUDA the fused kernels' limits are checked against `head_dim` and the device's compute
    `capability` (None: not checked). masked=True keeps the backends that take a mask,
    softcap=True those that softcap logits, window=True those that run a window (natively or
    as a mask), segments=True those that take packed documents in one call (an empty list:
    such blocks run one call per document)."""
    names = []
    if device_type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        names.append("cpu_flash")
    if device_type == "cuda":
        if dtype in HALF and _flash_fits(head_dim, capability):
            if flash_attn_usable():
                names.append("flash_attn")
            if torch.backends.cuda.is_flash_attention_available():  # False for builds without it
                names.append("cuda_flash")
        if _efficient_fits(dtype, head_dim, capability):
            names.append("cuda_efficient")
        if _flex_fits(dtype, head_dim, capability):  # masks and softcaps no fused kernel takes
            names.append("flex")
    names.append("math")
    return [n for n in names if _has(n, masked, softcap, window, segments)]


@functools.cache
def _usable_backends(device_type: str, device_index: int | None, dtype: torch.dtype, head_dim: int) -> tuple:
    """available_backends for one device, queried once per (device, dtype, head dim)."""
    capability = torch.cuda.get_device_capability(device_index) if device_type == "cuda" else None
    return tuple(available_backends(device_type, dtype, head_dim, capability))


def select_backend(
    q: torch.Tensor, masked: bool = False, softcap: bool = False, window: bool = False, segments: bool = False
) -> Backend | None:
    """The backend for attention on tensors like `q`; masked=True: the best that takes a mask;
    softcap=True: the best that softcaps logits; window=True: the best that runs a window
    (natively, or as a mask); segments=True: the best that runs documents in one call (with a
    window), or None when none does here (the caller splits the block)."""
    choices = _usable_backends(q.device.type, q.device.index, q.dtype, q.shape[-1])
    forced = os.environ.get("EASY_CONTEXT_KERNEL")  # read per call: tests set it
    if forced:
        if forced not in choices and not _forced_only_usable(forced, q.device.type):
            raise ValueError(
                f"EASY_CONTEXT_KERNEL={forced!r} cannot run {q.dtype} (head dim {q.shape[-1]}) on "
                f"{q.device}; usable here: {list(choices) + _forced_only(q.device.type)}"
            )
        if _has(forced, masked, softcap, window, segments):
            return BACKENDS[forced]
        if segments:  # the forced backend serves the documents one by one
            return None
    return next((BACKENDS[n] for n in choices if _has(n, masked, softcap, window, segments)), None)


def _forced_only(device_type: str) -> list[str]:
    return [n for n in FORCED_ONLY.get(device_type, ()) if n != "flex" or flex_usable()]


def _forced_only_usable(name: str, device_type: str) -> bool:
    return name in _forced_only(device_type)


def _checked_backend(
    backend: Backend | None, q: torch.Tensor, masked: bool, softcap, window=False, segments=False
) -> Backend:
    backend = backend or select_backend(q, masked=masked, softcap=bool(softcap), window=window, segments=segments)
    if backend is None:
        raise ValueError("no backend here takes segments; run the block one segment at a time (masking.Block.split)")
    if window and not (backend.supports_window or backend.supports_mask):
        raise ValueError(
            f"backend {backend.name!r} can take neither a window nor a mask; use select_backend(q, window=True)"
        )
    if masked and not backend.supports_mask:
        raise ValueError(f"backend {backend.name!r} cannot take a mask; use select_backend(q, masked=True)")
    if softcap and not _has(backend.name, masked, True):
        raise ValueError(f"backend {backend.name!r} cannot softcap logits (here); use select_backend(q, softcap=True)")
    return backend


def _checked_segments(segments, q, k, backend: Backend) -> tuple[int, ...] | None:
    if segments is None:
        return None
    segments = tuple(int(s) for s in segments)
    n = q.shape[2]
    if k.shape[2] != n or len(segments) < 2 or segments[0] != 0 or segments[-1] != n:
        raise ValueError(f"segments must run from 0 to Sq = Sk = {n} (Sk = {k.shape[2]}), got {segments}")
    if any(b <= a for a, b in zip(segments, segments[1:])):
        raise ValueError(f"segments must be increasing, got {segments}")
    if not backend.supports_segments:
        raise ValueError(
            f"backend {backend.name!r} cannot take segments; use select_backend(q, segments=True), or one call "
            "per segment (masking.Block.split)"
        )
    return segments


def _checked_window(window, causal) -> tuple[int, int] | None:
    """window as (left, right) ints, or None when it limits nothing."""
    if window is None or tuple(window) == (-1, -1):
        return None
    left, right = window
    if causal or min(left, right) < -1:
        raise ValueError(f"window must be (left, right) with each >= -1 (-1: no limit) and causal=False, got {window}")
    return int(left), int(right)


def _extra(backend: Backend, q, k, mask, softcap, window, segments=None) -> tuple[tuple, dict]:
    """The optional trailing arguments of a backend call: (mask,), softcap=c, window=(l, r) and
    segments when given; a window goes to a backend without a native one as (part of) its mask."""
    kwargs = {"softcap": softcap} if softcap else {}
    if segments is not None:
        kwargs["segments"] = segments
    if window is not None and backend.supports_window:  # _has checked this release has it
        kwargs["window"] = window
    elif window is not None:
        band = band_mask(q.shape[2], k.shape[2], window, q.device)
        mask = band if mask is None else mask & band
    return ((mask,) if mask is not None else ()), kwargs


def _checked_call(backend, q, k, causal, mask, softcap, window, segments, count=False):
    """(the backend, its extra positional and keyword arguments) for one block, every input
    checked; count: record the call in FORWARD_CALLS (forwards only)."""
    if mask is not None:
        mask = _checked_mask(mask, q, k, causal)
    window = _checked_window(window, causal)
    backend = _checked_backend(backend, q, mask is not None, softcap, window is not None, segments is not None)
    segments = _checked_segments(segments, q, k, backend)
    if count and FORWARD_CALLS.enabled:
        FORWARD_CALLS.add(q.shape[2], k.shape[2], causal, mask, window, segments)
    args, kwargs = _extra(backend, q, k, mask, softcap, window, segments)
    return backend, args, kwargs


def attention_forward(
    q,
    k,
    v,
    causal: bool,
    scale: float,
    backend: Backend | None = None,
    mask=None,
    softcap=None,
    window=None,
    segments=None,
):
    """One attention block. Returns out (B, Hq, Sq, Dv) in q's dtype and lse (B, Hq, Sq) in
    accumulation_dtype(q.dtype). `mask`, `softcap`: see the module docstring; `window` (left,
    right) and `segments`: masking.Block's convention."""
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal blocks must be square, got Sq={q.shape[2]} Sk={k.shape[2]}")
    backend, args, kwargs = _checked_call(backend, q, k, causal, mask, softcap, window, segments, count=True)
    return backend.forward(q, k, v, causal, scale, *args, **kwargs)


def attention_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    causal: bool,
    scale: float,
    backend: Backend | None = None,
    mask=None,
    softcap=None,
    window=None,
    segments=None,
):
    """Gradients of one block given the global out/lse of the rows it covers (and the same
    mask, softcap, window and segments as its forward)."""
    backend, args, kwargs = _checked_call(backend, q, k, causal, mask, softcap, window, segments)
    return backend.backward(dout, q, k, v, out, lse, causal, scale, *args, **kwargs)
