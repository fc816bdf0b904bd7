"""The attention backends behind core/kernels.py: one block -> (out, lse), and its backward.

Each backend takes q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D), a scale and causal, and where it
can, a bool mask (True: may attend) and a softcap; kernels.py checks the arguments, picks the
backend and counts the work. Conventions (layouts, empty rows, softcap): kernels.py's docstring.
"""

from __future__ import annotations

import functools
import inspect

import torch

__all__ = [
    "HALF",
    "accumulation_dtype",
    "MATH_TILE_LOGITS",
    "MATH_TILE_TEMPORARIES",
    "MATH_CUDA_FREE_FRACTION",
    "MATH_CUDA_MAX_TILE_LOGITS",
    "tile_logits",
    "row_tiles",
    "math_forward",
    "math_backward",
    "cpu_flash_forward",
    "cpu_flash_backward",
    "cuda_flash_forward",
    "cuda_flash_backward",
    "cuda_efficient_forward",
    "cuda_efficient_backward",
    "flash_attn_forward",
    "flash_attn_backward",
    "flash_attn_usable",
    "flash_attn_has_softcap",
    "flash_attn_backward_options",
    "parameter_names",
]

HALF = (torch.float16, torch.bfloat16)
_INF = float("inf")


# -------------------------------------------------------------------------- masks
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


# Logits the math backend holds at once on CPU (fp32: 8 MiB per temporary); longer blocks run in
# tiles of query rows. Measured on 2 cores at S=4K: as fast as 4x larger tiles, and less memory.
# It is also the smallest tile on CUDA.
MATH_TILE_LOGITS = 1 << 21
# On CUDA the tile is sized from the memory free when the call starts: a tile's temporaries
# (logits/probabilities, logsumexp's shifted copy, the backward's dlogits, a softcap's slope)
# are at most MATH_TILE_TEMPORARIES tile-sized tensors, and they may take MATH_CUDA_FREE_FRACTION
# of the free memory: the rest is headroom for the caller (a ring's prefetched K/V, the
# allocator's rounding). At most MATH_CUDA_MAX_TILE_LOGITS: past it the matmuls are saturated
# anyway, and every temporary stays below 2^31 elements (32-bit indexing in every kernel).
MATH_TILE_TEMPORARIES = 4
MATH_CUDA_FREE_FRACTION = 0.5
MATH_CUDA_MAX_TILE_LOGITS = 1 << 30


def tile_logits(device: torch.device, dtype: torch.dtype) -> int:
    """Logits one math tile may hold for inputs of `dtype` on `device`. On CUDA this reads the
    device's free memory (one driver call): call it once per kernel call, not per tile."""
    if device.type != "cuda":
        return MATH_TILE_LOGITS
    free, _ = torch.cuda.mem_get_info(device)
    per_logit = accumulation_dtype(dtype).itemsize * MATH_TILE_TEMPORARIES
    budget = int(free * MATH_CUDA_FREE_FRACTION) // per_logit
    return max(MATH_TILE_LOGITS, min(budget, MATH_CUDA_MAX_TILE_LOGITS))


def row_tiles(q, k, logits: int | None = None) -> list[slice]:
    """Query-row slices of q, each holding at most `logits` logits (default: tile_logits)."""
    b, h, sq, _ = q.shape
    logits = tile_logits(q.device, q.dtype) if logits is None else logits
    rows = max(1, logits // max(1, b * h * k.shape[2]))
    return [slice(start, min(start + rows, sq)) for start in range(0, sq, rows)]


def _math_logits(q, k_acc, causal, scale, mask, softcap, rows: slice, keys: slice, grad: bool = False):
    """Logits of q's `rows` (a tile) against `keys` of k_acc (K already in the accumulation
    dtype) in the accumulation dtype, shaped (B, Hkv, G * rows, keys): the G query heads
    reading one KV head share its matmul. Also returns the tile's grouped queries and, with
    grad=True and a softcap, d(capped)/d(logit) = 1 - tanh^2 for the backward's chain rule."""
    b, h, _, d = q.shape
    n_kv = k_acc.shape[1]
    q_tile = q[:, :, rows].to(k_acc.dtype).reshape(b, n_kv, -1, d)
    logits = torch.matmul(q_tile, k_acc[:, :, keys].transpose(-1, -2)).mul_(scale)
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
    return [(rows, slice(0, rows.stop) if causal else slice(0, k.shape[2])) for rows in row_tiles(q, k)]


def math_forward(q, k, v, causal, scale, mask=None, softcap=None):
    b, h = q.shape[:2]
    acc = accumulation_dtype(q.dtype)
    # K/V in the accumulation dtype once per call (no copy when they already are); every tile
    # reads slices of these. Converted before the tiles are sized, so the size sees them.
    k_acc, v_acc = k.to(acc), v.to(acc)
    outs, lses = [], []
    for rows, keys in _tiles(q, k, causal):
        _, logits, _ = _math_logits(q, k_acc, causal, scale, mask, softcap, rows, keys)
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        # A row with no allowed key has lse -inf: subtract 0 there, so its probabilities are 0, not NaN.
        shift = lse if mask is None else lse.masked_fill(lse == -_INF, 0)
        probs = logits.sub_(shift).exp_()
        out = torch.matmul(probs, v_acc[:, :, keys])
        outs.append(out.reshape(b, h, -1, v.shape[-1]))
        lses.append(lse.reshape(b, h, -1))
    return torch.cat(outs, 2).to(q.dtype), torch.cat(lses, 2)


def math_backward(dout, q, k, v, out, lse, causal, scale, mask=None, softcap=None):
    b, h, _, d = q.shape
    n_kv = k.shape[1]
    if mask is not None:
        lse = _backward_lse(lse)
    acc = accumulation_dtype(q.dtype)
    grouped = lambda x, rows: x[:, :, rows].to(acc).reshape(b, n_kv, -1, x.shape[-1])  # noqa: E731
    k_acc, v_acc = k.to(acc), v.to(acc)  # once per call, as in the forward
    dq, dk, dv = torch.empty_like(q, dtype=acc), torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)
    for rows, keys in _tiles(q, k, causal):
        q_tile, logits, slope = _math_logits(q, k_acc, causal, scale, mask, softcap, rows, keys, grad=True)
        probs = logits.sub_(grouped(lse.unsqueeze(-1), rows)).exp_()
        dout_tile = grouped(dout, rows)
        delta = (dout_tile * grouped(out, rows)).sum(-1, keepdim=True)
        dv[:, :, keys] += torch.matmul(probs.transpose(-1, -2), dout_tile)  # sums over the G heads too
        dlogits = torch.matmul(dout_tile, v_acc[:, :, keys].transpose(-1, -2)).sub_(delta).mul_(probs).mul_(scale)
        if slope is not None:
            dlogits.mul_(slope)
        dq[:, :, rows] = torch.matmul(dlogits, k_acc[:, :, keys]).reshape(b, h, -1, d)
        dk[:, :, keys] += torch.matmul(dlogits.transpose(-1, -2), q_tile)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ---------------------------------------------------------------------- cpu_flash
# The CPU op takes K/V with fewer heads, strided (B, H, S, D) views and a broadcastable additive
# float mask as they are, in both directions (pinned by tests): nothing is copied here.
def cpu_flash_forward(q, k, v, causal, scale, mask=None):
    bias = None if mask is None else _additive_bias(mask, q.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=bias, scale=scale
    )
    lse = lse.to(accumulation_dtype(q.dtype))
    if mask is not None:  # the op gives rows with no allowed key out 0 already, but lse 0
        out, lse = _clear_empty_rows(out, lse, mask, clear_out=False)
    return out, lse


def cpu_flash_backward(dout, q, k, v, out, lse, causal, scale, mask=None):
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
def cuda_flash_forward(q, k, v, causal, scale):
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return res[0], res[1]


def _flash_rng_placeholders(device: torch.device):
    """What the forward returns as (rng_state, unused) with dropout 0: uint64 (2,) and () (int64
    () on ROCm). The backward reads them only when dropout_p > 0; passing the forward's shapes
    makes the call the one SDPA's own autograd makes."""
    if torch.version.hip:
        return (torch.empty((), dtype=torch.int64, device=device),) * 2
    return torch.empty(2, dtype=torch.uint64, device=device), torch.empty((), dtype=torch.uint64, device=device)


def cuda_flash_backward(dout, q, k, v, out, lse, causal, scale):
    seed, offset = _flash_rng_placeholders(q.device)
    # cum_seq_q/k None (undefined), as the forward returns them: a defined tensor sends the kernel
    # down its variable-length path, which wants int32 cu_seqlens of B + 1 entries.
    # lse is made contiguous because the kernel indexes it as a dense (B, H, Sq) array.
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout,
        q,
        k,
        v,
        out,
        lse.contiguous(),
        None,
        None,
        q.shape[2],
        k.shape[2],
        0.0,
        causal,
        seed,
        offset,
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


def cuda_efficient_forward(q, k, v, causal, scale, mask=None):
    # The op wants equal head counts: repeat K/V for GQA here only.
    n_rep = q.shape[1] // k.shape[1]
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, _repeat_kv(k, n_rep), _repeat_kv(v, n_rep), _efficient_bias(mask, q), True, 0.0, causal, scale=scale
    )
    lse = lse[..., : q.shape[2]]
    if mask is not None:  # unverified what the kernel gives rows with no allowed key: overwrite it
        out, lse = _clear_empty_rows(out, lse, mask)
    return out, lse


def cuda_efficient_backward(dout, q, k, v, out, lse, causal, scale, mask=None):
    n_rep = q.shape[1] // k.shape[1]
    seed = offset = torch.empty((), dtype=torch.int64, device=q.device)  # read only with dropout
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout,
        q,
        _repeat_kv(k, n_rep),
        _repeat_kv(v, n_rep),
        _efficient_bias(mask, q),
        _with_dense_rows(out),
        _efficient_backward_lse(lse, mask is not None),
        seed,
        offset,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )
    if n_rep > 1:  # each KV head's gradient is the sum over the query heads that read it
        dk = dk.unflatten(1, (k.shape[1], n_rep)).sum(2)
        dv = dv.unflatten(1, (v.shape[1], n_rep)).sum(2)
    return dq, dk, dv


# --------------------------------------------------------------------- flash_attn
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


def flash_attn_forward(q, k, v, causal, scale, softcap=None):
    fa = _flash_attn_module()
    # flash_attn wants (B, S, H, D); HF's q/k/v are transposes of exactly that layout (no copy).
    capped = {"softcap": softcap} if softcap else {}  # releases before 2.6 have no softcap
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


def flash_attn_backward(dout, q, k, v, out, lse, causal, scale, softcap=None):
    fa = _flash_attn_module()
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    dq, dk, dv = torch.empty_like(t(q)), torch.empty_like(t(k)), torch.empty_like(t(v))
    # flash_attn copies dout/out itself only if their last dim is strided; the lse it indexes
    # as a dense (B, H, Sq) array.
    options = dict(flash_attn_backward_options(fa._flash_attn_backward))
    if softcap:
        options["softcap"] = softcap
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
