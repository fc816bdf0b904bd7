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
Only math (any device) and flash_attn (CUDA) have it; a softcapped call picks the best of
those (on CPU: math, which holds one tile of logits at a time).

Backends, picked per call from the tensors' device, dtype and head dim (override with
EASY_CONTEXT_KERNEL):
  cpu_flash       torch's fused CPU flash-attention op (private aten op, pinned by tests); masks
  flash_attn      Dao-AILab flash_attn on CUDA, fp16/bf16 (optional dependency); softcap
  cuda_flash      torch's fused CUDA flash op, fp16/bf16
  cuda_efficient  torch's fused CUDA memory-efficient op, fp32/fp16/bf16; masks
  math            pure torch, fp32 accumulation, any device; masks, softcap; the reference and
                  the fallback; computed in tiles of query rows (MATH_TILE_LOGITS logits at a time)
Order on CUDA: fp16/bf16 flash_attn, cuda_flash, cuda_efficient, math; fp32 cuda_efficient,
math. The two flash backends need compute capability >= 8.0 and a head dim <= 256 that is a
multiple of 8. A masked call uses the best backend that takes a mask: a forced
EASY_CONTEXT_KERNEL that cannot (flash_attn, cuda_flash) still serves every unmasked call,
and masked calls fall back to the best masked backend.

`causal=True` is only used with Sq == Sk (diagonal blocks), so top-left vs bottom-right
alignment of the backends never matters.
"""

from __future__ import annotations

import functools
import inspect
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

_HALF = (torch.float16, torch.bfloat16)
_INF = float("inf")


class Backend(NamedTuple):
    name: str
    forward: Callable  # (q, k, v, causal, scale[, mask][, softcap=c]) -> (out, lse)
    backward: Callable  # (dout, q, k, v, out, lse, causal, scale[, mask][, softcap=c]) -> (dq, dk, dv)
    supports_mask: bool = False  # forward/backward take a (B or 1, 1, Sq, Sk) bool mask last
    supports_softcap: bool = False  # forward/backward take softcap=c (logits c * tanh(s / c))


class _ForwardCounter:
    """Forward kernel calls and query x key products computed (a causal square block of n
    rows counts n(n+1)/2; a masked block counts its allowed (query, key) pairs summed over the
    mask's batch rows and divided by their number, rounded, so batch and heads never count);
    tests use it to prove what was recomputed and how work is spread.

    A masked count is a reduction on the mask's device, added up lazily: reading `products`
    is the only host sync. `enabled = False` skips counting altogether."""

    def __init__(self) -> None:
        self.enabled = True
        self.reset()

    def reset(self) -> None:
        self.calls = 0
        self._products = 0
        self._masked_products = None  # 0-dim tensor on the masks' device, not yet read

    @property
    def products(self) -> int:
        self._fold()
        return self._products

    def _fold(self) -> None:
        if self._masked_products is not None:
            self._products += int(self._masked_products)
            self._masked_products = None

    def add(self, q_len: int, k_len: int, causal: bool, mask: torch.Tensor | None = None) -> None:
        if not self.enabled:
            return
        self.calls += 1
        if mask is None:
            self._products += q_len * (q_len + 1) // 2 if causal else q_len * k_len
            return
        rows = mask.shape[0]
        allowed = (mask.sum() * 2 + rows) // (2 * rows)  # mean over batch rows, rounded half up
        if self._masked_products is not None and self._masked_products.device != allowed.device:
            self._fold()  # masks on two devices: add the older count up on the host (rare)
        self._masked_products = allowed if self._masked_products is None else self._masked_products + allowed


FORWARD_CALLS = _ForwardCounter()


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


def _empty_rows(mask: torch.Tensor) -> torch.Tensor:
    """(B or 1, 1, Sq): query rows with no allowed key."""
    return ~mask.any(-1)


def _additive_bias(mask: torch.Tensor, dtype: torch.dtype, key_align: int = 1) -> torch.Tensor:
    """0 where `mask` allows, -inf where it forbids, in `dtype`. The bias is a slice of storage
    whose key dim is padded up to a multiple of `key_align` (row starts stay aligned)."""
    *lead, sk = mask.shape
    storage = torch.zeros(*lead, -(-sk // key_align) * key_align, dtype=dtype, device=mask.device)
    return storage[..., :sk].masked_fill_(~mask, -_INF)


def _clear_empty_rows(out, lse, mask, clear_out: bool = True):
    """The contract for rows with no allowed key: out 0, lse -inf, whatever the kernel gave."""
    empty = _empty_rows(mask)
    if clear_out:  # where, not masked_fill: it keeps out's (B, S, H, D) memory layout
        out = torch.where(empty.unsqueeze(-1), 0, out)
    return out, lse.masked_fill(empty, -_INF)


def _backward_lse(lse: torch.Tensor) -> torch.Tensor:
    """lse for a masked backward: rows with no allowed key (-inf) get +inf, so every
    probability exp(score - lse) of theirs is 0 and so are their gradients (-inf - -inf
    would be NaN). The CUDA efficient kernel pads its own lse with +inf for the same reason."""
    return lse.masked_fill(lse == -_INF, _INF)


# --------------------------------------------------------------------------- math
def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half types, else the input's own (fp64 stays fp64 for exactness checks)."""
    return torch.promote_types(dtype, torch.float32)


# Logits the math backend holds at once (fp32: 8 MiB per temporary); longer blocks run in tiles of
# query rows. Measured on 2 cores at S=4K: as fast as 4x larger tiles, and less memory.
MATH_TILE_LOGITS = 1 << 21


def _row_tiles(q, k) -> list[slice]:
    b, h, sq, _ = q.shape
    rows = max(1, MATH_TILE_LOGITS // max(1, b * h * k.shape[2]))
    return [slice(start, min(start + rows, sq)) for start in range(0, sq, rows)]


def _math_logits(q, k, causal, scale, mask, softcap, rows: slice, keys: slice, grad: bool = False):
    """Logits of q's `rows` (a tile) against k's `keys` in the accumulation dtype, shaped
    (B, Hkv, G * rows, keys): the G query heads reading one KV head share its matmul. Also
    returns the tile's grouped queries and, with grad=True and a softcap, d(capped)/d(logit)
    = 1 - tanh^2 for the backward's chain rule."""
    acc = accumulation_dtype(q.dtype)
    b, h, _, d = q.shape
    n_kv = k.shape[1]
    q_tile = q[:, :, rows].to(acc).reshape(b, n_kv, -1, d)
    logits = torch.matmul(q_tile, k[:, :, keys].to(acc).transpose(-1, -2)).mul_(scale)
    slope = None
    if softcap:
        capped = logits.div_(softcap).tanh_()
        slope = 1 - capped * capped if grad else None
        logits = capped.mul_(softcap)
    by_row = logits.view(b, n_kv, h // n_kv, -1, logits.shape[-1])  # (B, Hkv, G, rows, keys)
    if causal:  # square block: query i of the block sees keys <= i
        query = torch.arange(rows.start, rows.stop, device=q.device)
        by_row.masked_fill_(torch.arange(keys.start or 0, keys.stop, device=q.device) > query[:, None], -_INF)
    if mask is not None:  # (B, 1, Sq, Sk) -> (B, 1, 1, rows, keys)
        by_row.masked_fill_(~mask[:, :, rows, keys].unsqueeze(2), -_INF)
    return q_tile, logits, slope


def _tiles(q, k, causal):
    """(query rows, keys) of each tile; a causal tile needs no key after its last row."""
    return [(rows, slice(0, rows.stop) if causal else slice(0, k.shape[2])) for rows in _row_tiles(q, k)]


def _math_forward(q, k, v, causal, scale, mask=None, softcap=None):
    b, h = q.shape[:2]
    n_kv = k.shape[1]
    outs, lses = [], []
    for rows, keys in _tiles(q, k, causal):
        _, logits, _ = _math_logits(q, k, causal, scale, mask, softcap, rows, keys)
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        # A row with no allowed key has lse -inf: subtract 0 there, so its probabilities are 0, not NaN.
        shift = lse if mask is None else lse.masked_fill(lse == -_INF, 0)
        probs = logits.sub_(shift).exp_()
        out = torch.matmul(probs, v[:, :, keys].to(probs.dtype))
        outs.append(out.reshape(b, h, -1, v.shape[-1]))
        lses.append(lse.reshape(b, h, -1))
    return torch.cat(outs, 2).to(q.dtype), torch.cat(lses, 2)


def _math_backward(dout, q, k, v, out, lse, causal, scale, mask=None, softcap=None):
    b, h, _, d = q.shape
    n_kv = k.shape[1]
    if mask is not None:
        lse = _backward_lse(lse)
    acc = accumulation_dtype(q.dtype)
    grouped = lambda x, rows: x[:, :, rows].to(acc).reshape(b, n_kv, -1, x.shape[-1])  # noqa: E731
    dq, dk, dv = torch.empty_like(q, dtype=acc), torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)
    for rows, keys in _tiles(q, k, causal):
        q_tile, logits, slope = _math_logits(q, k, causal, scale, mask, softcap, rows, keys, grad=True)
        probs = logits.sub_(grouped(lse.unsqueeze(-1), rows)).exp_()
        dout_tile = grouped(dout, rows)
        delta = (dout_tile * grouped(out, rows)).sum(-1, keepdim=True)
        dv[:, :, keys] += torch.matmul(probs.transpose(-1, -2), dout_tile)  # sums over the G heads too
        dlogits = torch.matmul(dout_tile, v[:, :, keys].to(acc).transpose(-1, -2)).sub_(delta).mul_(probs).mul_(scale)
        if slope is not None:
            dlogits.mul_(slope)
        dq[:, :, rows] = torch.matmul(dlogits, k[:, :, keys].to(acc)).reshape(b, h, -1, d)
        dk[:, :, keys] += torch.matmul(dlogits.transpose(-1, -2), q_tile)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---------------------------------------------------------------------- cpu_flash
# The CPU op takes K/V with fewer heads, strided (B, H, S, D) views and a broadcastable additive
# float mask as they are, in both directions (pinned by tests): nothing is copied here.
def _cpu_flash_forward(q, k, v, causal, scale, mask=None):
    bias = None if mask is None else _additive_bias(mask, q.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=bias, scale=scale
    )
    lse = lse.to(accumulation_dtype(q.dtype))
    if mask is not None:  # the op gives rows with no allowed key out 0 already, but lse 0
        out, lse = _clear_empty_rows(out, lse, mask, clear_out=False)
    return out, lse


def _cpu_flash_backward(dout, q, k, v, out, lse, causal, scale, mask=None):
    bias = None
    if mask is not None:
        bias, lse = _additive_bias(mask, q.dtype), _backward_lse(lse)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
    )


# --------------------------------------------------------------------- cuda_flash
# The op takes K/V with fewer heads (GQA) and strided (B, H, S, D) views; it makes dout and out
# contiguous itself, in the (B, S, H, D) layout its kernel wants (a .contiguous() here would
# produce the (B, H, S, D) layout and a second copy).
def _cuda_flash_forward(q, k, v, causal, scale):
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return res[0], res[1]


def _flash_rng_placeholders(device: torch.device):
    """What the forward returns as (rng_state, unused) with dropout 0: uint64 (2,) and () (int64
    () on ROCm). The backward reads them only when dropout_p > 0; passing the forward's shapes
    makes the call the one SDPA's own autograd makes."""
    if torch.version.hip:
        return (torch.empty((), dtype=torch.int64, device=device),) * 2
    return torch.empty(2, dtype=torch.uint64, device=device), torch.empty((), dtype=torch.uint64, device=device)


def _cuda_flash_backward(dout, q, k, v, out, lse, causal, scale):
    seed, offset = _flash_rng_placeholders(q.device)
    # cum_seq_q/k None (undefined), as the forward returns them: a defined tensor sends the kernel
    # down its variable-length path, which wants int32 cu_seqlens of B + 1 entries.
    # lse is made contiguous because the kernel indexes it as a dense (B, H, Sq) array.
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset,
        scale=scale,
    )


# ----------------------------------------------------------------- cuda_efficient
# Its kernel pads the lse to a multiple of 32 queries (with +inf) and its backward reads the lse
# of a block of queries rounded up to 32 without bounds checks (mem_eff_attention's
# accumApplyLSEToSmem); ROCm's kernels neither pad nor accept padding (they view it as Sq).
_EFFICIENT_LSE_ALIGN = 1 if torch.version.hip else 32
# attn_bias rows must start aligned (bias.stride(2) % alignment == 0, alignment <= 16 elements).
_EFFICIENT_BIAS_ALIGN = 16


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


def _efficient_bias(mask, q):
    """The mask as the op's attn_bias: (B, Hq, Sq, Sk) in q's dtype, broadcast dims stride 0."""
    if mask is None:
        return None
    return _additive_bias(mask, q.dtype, _EFFICIENT_BIAS_ALIGN).expand(q.shape[0], q.shape[1], -1, -1)


def _efficient_backward_lse(lse: torch.Tensor, masked: bool) -> torch.Tensor:
    """The lse in the padded (B, H, Sq rounded up to 32) layout the forward hands to the backward,
    padding +inf like the kernel's own."""
    b, h, sq = lse.shape
    padded = lse.new_full((b, h, -(-sq // _EFFICIENT_LSE_ALIGN) * _EFFICIENT_LSE_ALIGN), _INF, dtype=torch.float32)
    padded[..., :sq] = _backward_lse(lse) if masked else lse
    return padded


def _with_dense_rows(out: torch.Tensor) -> torch.Tensor:
    """`out` as a view of a (B, S, H, D)-dense tensor (row slices of one qualify). The backward
    kernel reads out with a query stride of H * D whatever the tensor's strides say (o_strideM
    in mem_eff_attention's kernel_backward.h) and torch does not check it."""
    _, h, _, d = out.shape
    if out.stride(3) == 1 and out.stride(2) == h * d:
        return out
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def _cuda_efficient_forward(q, k, v, causal, scale, mask=None):
    # The op wants equal head counts: repeat K/V for GQA here only.
    n_rep = q.shape[1] // k.shape[1]
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, _repeat_kv(k, n_rep), _repeat_kv(v, n_rep), _efficient_bias(mask, q), True, 0.0, causal, scale=scale
    )
    lse = lse[..., : q.shape[2]]
    if mask is not None:  # unverified what the kernel gives rows with no allowed key: overwrite it
        out, lse = _clear_empty_rows(out, lse, mask)
    return out, lse


def _cuda_efficient_backward(dout, q, k, v, out, lse, causal, scale, mask=None):
    n_rep = q.shape[1] // k.shape[1]
    seed = offset = torch.empty((), dtype=torch.int64, device=q.device)  # read only with dropout
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, _repeat_kv(k, n_rep), _repeat_kv(v, n_rep), _efficient_bias(mask, q), _with_dense_rows(out),
        _efficient_backward_lse(lse, mask is not None), seed, offset, 0.0, [True, True, True, False], causal,
        scale=scale,
    )
    if n_rep > 1:  # each KV head's gradient is the sum over the query heads that read it
        dk = dk.unflatten(1, (k.shape[1], n_rep)).sum(2)
        dv = dv.unflatten(1, (v.shape[1], n_rep)).sum(2)
    return dq, dk, dv


# --------------------------------------------------------------------- flash_attn
@functools.lru_cache(maxsize=None)
def _flash_attn_module():
    from flash_attn import flash_attn_interface  # optional, CUDA only

    return flash_attn_interface


@functools.lru_cache(maxsize=None)
def _flash_attn_usable() -> bool:
    try:
        _flash_attn_module()
    except ImportError:  # not installed, or built for another torch (undefined symbols)
        return False
    return True


@functools.lru_cache(maxsize=None)
def _flash_attn_has_softcap() -> bool:
    """flash_attn >= 2.6 takes softcap in both directions."""
    fa = _flash_attn_module()
    return "softcap" in _parameter_names(fa.flash_attn_func) and "softcap" in _parameter_names(fa._flash_attn_backward)


@functools.lru_cache(maxsize=None)
def _parameter_names(fn) -> frozenset:
    """Names `fn` takes. flash_attn >= 2.7 declares its private ops with torch.library.custom_op,
    whose Python signature is (*args, **kwargs): the op's schema has the real names."""
    schema = getattr(getattr(fn, "_opoverload", None), "_schema", None)
    if schema is not None:
        return frozenset(arg.name for arg in schema.arguments)
    return frozenset(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)


@functools.lru_cache(maxsize=None)
def _flash_attn_backward_options(fn) -> tuple:
    """(name, value) pairs that turn off the features this release's backward asks about; the
    private signature changed across flash_attn releases."""
    params = _parameter_names(fn)
    options = {}
    if "window_size_left" in params:  # >= 2.7
        options.update(window_size_left=-1, window_size_right=-1)
    elif "window_size" in params:  # 2.3 - 2.6
        options.update(window_size=(-1, -1))
    for name, value in (("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("rng_state", None)):
        if name in params:
            options[name] = value
    return tuple(options.items())


def _flash_attn_forward(q, k, v, causal, scale, softcap=None):
    fa = _flash_attn_module()
    # flash_attn wants (B, S, H, D); HF's q/k/v are transposes of exactly that layout (no copy).
    capped = {"softcap": softcap} if softcap else {}  # releases before 2.6 have no softcap
    out, lse, *_ = fa.flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        softmax_scale=scale, causal=causal, return_attn_probs=True, **capped,
    )
    return out.transpose(1, 2), lse.float()


def _flash_attn_backward(dout, q, k, v, out, lse, causal, scale, softcap=None):
    fa = _flash_attn_module()
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    dq, dk, dv = torch.empty_like(t(q)), torch.empty_like(t(k)), torch.empty_like(t(v))
    # flash_attn copies dout/out itself only if their last dim is strided; the lse it indexes
    # as a dense (B, H, Sq) array.
    options = dict(_flash_attn_backward_options(fa._flash_attn_backward))
    if softcap:
        options["softcap"] = softcap
    fa._flash_attn_backward(
        t(dout), t(q), t(k), t(v), t(out), lse.contiguous(), dq, dk, dv,
        dropout_p=0.0, softmax_scale=scale, causal=causal, **options,
    )
    return t(dq), t(dk), t(dv)


# ---------------------------------------------------------------------- selection
BACKENDS = {
    "math": Backend("math", _math_forward, _math_backward, supports_mask=True, supports_softcap=True),
    "cpu_flash": Backend("cpu_flash", _cpu_flash_forward, _cpu_flash_backward, supports_mask=True),
    "cuda_flash": Backend("cuda_flash", _cuda_flash_forward, _cuda_flash_backward),
    "cuda_efficient": Backend("cuda_efficient", _cuda_efficient_forward, _cuda_efficient_backward, supports_mask=True),
    "flash_attn": Backend("flash_attn", _flash_attn_forward, _flash_attn_backward, supports_softcap=True),
}


def _has(name: str, masked: bool, softcap: bool) -> bool:
    backend = BACKENDS[name]
    if softcap and name == "flash_attn" and not _flash_attn_has_softcap():
        return False
    return (backend.supports_mask or not masked) and (backend.supports_softcap or not softcap)


def _flash_fits(head_dim, capability) -> bool:
    """Limits shared by flash_attn and torch's flash op: sm80+ kernels, head dims up to 256."""
    return (capability is None or capability >= (8, 0)) and (
        head_dim is None or (head_dim <= 256 and head_dim % 8 == 0)
    )


def _efficient_fits(dtype, head_dim, capability) -> bool:
    """The checks torch's own SDPA dispatcher makes before it picks the efficient op
    (sdp_utils.cpp): bf16 needs sm80, the head dim a multiple of the GEMM alignment."""
    if dtype not in (torch.float32, *_HALF):
        return False
    if capability is not None and (capability < (5, 0) or (dtype == torch.bfloat16 and capability < (8, 0))):
        return False
    alignment = 8 if dtype in _HALF else 4 if capability is None or capability >= (8, 0) else 1
    return head_dim is None or head_dim % alignment == 0


def available_backends(
    device_type: str,
    dtype: torch.dtype,
    head_dim: int | None = None,
    capability: tuple[int, int] | None = None,
    masked: bool = False,
    softcap: bool = False,
) -> list[str]:
    """Backends usable for this device and dtype, fastest first; 'math' is always last.

    On CUDA the fused kernels' limits are checked against `head_dim` and the device's compute
    `capability` (None: not checked). masked=True keeps the backends that take a mask,
    softcap=True those that softcap logits."""
    names = []
    if device_type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        names.append("cpu_flash")
    if device_type == "cuda":
        if dtype in _HALF and _flash_fits(head_dim, capability):
            if _flash_attn_usable():
                names.append("flash_attn")
            if torch.backends.cuda.is_flash_attention_available():  # False for builds without it
                names.append("cuda_flash")
        if _efficient_fits(dtype, head_dim, capability):
            names.append("cuda_efficient")
    names.append("math")
    return [n for n in names if _has(n, masked, softcap)]


@functools.lru_cache(maxsize=None)
def _usable_backends(device_type: str, device_index: int | None, dtype: torch.dtype, head_dim: int) -> tuple:
    """available_backends for one device, queried once per (device, dtype, head dim)."""
    capability = torch.cuda.get_device_capability(device_index) if device_type == "cuda" else None
    return tuple(available_backends(device_type, dtype, head_dim, capability))


def select_backend(q: torch.Tensor, masked: bool = False, softcap: bool = False) -> Backend:
    """The backend for attention on tensors like `q`; masked=True: the best that takes a mask;
    softcap=True: the best that softcaps logits."""
    choices = _usable_backends(q.device.type, q.device.index, q.dtype, q.shape[-1])
    forced = os.environ.get("EASY_CONTEXT_KERNEL")  # read per call: tests set it
    if forced:
        if forced not in choices:
            raise ValueError(
                f"EASY_CONTEXT_KERNEL={forced!r} cannot run {q.dtype} (head dim {q.shape[-1]}) on "
                f"{q.device}; usable here: {list(choices)}"
            )
        if _has(forced, masked, softcap):
            return BACKENDS[forced]
    return BACKENDS[next(n for n in choices if _has(n, masked, softcap))]


def _checked_backend(backend: Backend | None, q: torch.Tensor, masked: bool, softcap) -> Backend:
    backend = backend or select_backend(q, masked=masked, softcap=bool(softcap))
    if masked and not backend.supports_mask:
        raise ValueError(f"backend {backend.name!r} cannot take a mask; use select_backend(q, masked=True)")
    if softcap and not _has(backend.name, masked, True):
        raise ValueError(f"backend {backend.name!r} cannot softcap logits (here); use select_backend(q, softcap=True)")
    return backend


def _extra(mask, softcap) -> tuple[tuple, dict]:
    """The optional trailing arguments of a backend call: (mask,) and softcap=c when given."""
    return ((mask,) if mask is not None else ()), ({"softcap": softcap} if softcap else {})


def attention_forward(q, k, v, causal: bool, scale: float, backend: Backend | None = None, mask=None, softcap=None):
    """One attention block. Returns out (B, Hq, Sq, Dv) in q's dtype and lse (B, Hq, Sq) in
    accumulation_dtype(q.dtype). `mask`, `softcap`: see the module docstring."""
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal blocks must be square, got Sq={q.shape[2]} Sk={k.shape[2]}")
    if mask is not None:
        mask = _checked_mask(mask, q, k, causal)
    backend = _checked_backend(backend, q, mask is not None, softcap)
    FORWARD_CALLS.add(q.shape[2], k.shape[2], causal, mask)
    args, kwargs = _extra(mask, softcap)
    return backend.forward(q, k, v, causal, scale, *args, **kwargs)


def attention_backward(
    dout, q, k, v, out, lse, causal: bool, scale: float, backend: Backend | None = None, mask=None, softcap=None
):
    """Gradients of one block given the global out/lse of the rows it covers (and the same
    mask and softcap as its forward)."""
    if mask is not None:
        mask = _checked_mask(mask, q, k, causal)
    backend = _checked_backend(backend, q, mask is not None, softcap)
    args, kwargs = _extra(mask, softcap)
    return backend.backward(dout, q, k, v, out, lse, causal, scale, *args, **kwargs)
