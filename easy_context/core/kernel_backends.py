"""The attention backends behind core/kernels.py: one block -> (out, lse), and its backward.

Each backend takes q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D), a scale and causal, and where it
can, a bool mask (True: may attend) and a softcap; kernels.py checks the arguments, picks the
backend and counts the work. Conventions (layouts, empty rows, softcap): kernels.py's docstring.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math
from collections.abc import Callable

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
    "flash_attn_has_window",
    "band_mask",
    "band_tiles",
    "BAND_TILE_ROWS",
    "BAND_WHOLE_PRODUCTS",
    "flash_attn_backward_options",
    "parameter_names",
    "flex_forward",
    "flex_backward",
    "flex_usable",
    "flex_compilable",
    "flex_window_rule",
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


@functools.lru_cache(maxsize=32)
def band_mask(sq: int, sk: int, window: tuple[int, int], device: torch.device) -> torch.Tensor:
    """A window (left, right), masking.Block's convention, as a bool (1, 1, Sq, Sk) mask. It
    depends on the block's shape only (plans cut the same few band shapes for every shard pair
    and layer), so backends without a native window reuse a handful: none is built per call."""
    left, right = window
    offset = torch.arange(sk, device=device)[None, :] - torch.arange(sq, device=device)[:, None] - (sk - sq)
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        allowed &= offset >= -left
    if right >= 0:
        allowed &= offset <= right
    return allowed[None, None]


@functools.lru_cache(maxsize=32)
def _band_bias(sq: int, sk: int, window: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return _additive_bias(band_mask(sq, sk, window, device), dtype)


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
    """fp32 for half types, else the input's own (fp64 stays fp64 for exactness checks).
    Plain Python: torch.promote_types is a dispatched op, and this runs for every block."""
    return torch.float64 if dtype == torch.float64 else torch.float32


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
def _window_as_mask(q, k, mask, window):
    """A window the bias cache cannot serve (with a mask, or more queries than keys, where rows
    may be empty) folded into the mask; None: serve it from the cache."""
    if window is None or (mask is None and q.shape[2] <= k.shape[2]):
        return mask
    band = band_mask(q.shape[2], k.shape[2], window, q.device)
    return band if mask is None else mask & band


# CPU's band path. A window with Sq <= Sk leaves no row empty, so a bias is all the kernel needs;
# a large block runs in tiles of rows, each against only the keys its rows reach, so a narrow
# band does not cost a full block (S=4K, window 1K: 0.63 s fwd+bwd instead of 3.1 s). Interior
# tiles share one shape and window: their bias is built once.
BAND_TILE_ROWS = 256  # at least; a quarter of the band's width when that is more
BAND_WHOLE_PRODUCTS = 1 << 21  # a block of at most this many (query, key) pairs runs whole


def band_tiles(sq: int, sk: int, window: tuple[int, int]) -> list[tuple[slice, slice, tuple[int, int]]]:
    """(rows, keys, window of the tile) covering a window block: each tile's keys are the ones
    its rows may attend, its window the block's rule in the tile's own coordinates."""
    left, right = window
    offset = sk - sq  # query r's diagonal is key r + offset
    if sq * sk <= BAND_WHOLE_PRODUCTS:
        return [(slice(0, sq), slice(0, sk), window)]
    step = max(BAND_TILE_ROWS, (left + 1) // 4)
    tiles = []
    for r0 in range(0, sq, step):
        r1 = min(sq, r0 + step)
        lo = max(0, r0 + offset - left) if left >= 0 else 0
        hi = min(sk, r1 - 1 + offset + right + 1) if right >= 0 else sk
        n, m = r1 - r0, hi - lo
        tile_left = (m - n) - (r0 + offset - left - lo) if left >= 0 else -1
        tile_right = (r0 + offset + right - lo) - (m - n) if right >= 0 else -1
        tiles.append((slice(r0, r1), slice(lo, hi), (tile_left, tile_right)))
    return tiles


def _band_call(q, k, v, scale, window):
    bias = _band_bias(q.shape[2], k.shape[2], window, q.dtype, q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias, scale=scale)


def cpu_flash_forward(q, k, v, causal, scale, mask=None, window=None):
    mask = _window_as_mask(q, k, mask, window)
    if mask is None and window is not None:
        tiles = band_tiles(q.shape[2], k.shape[2], window)
        if len(tiles) == 1:  # one tile: the whole block (its few unreachable keys cost less than slicing)
            out, lse = _band_call(q, k, v, scale, window)
        else:
            parts = [_band_call(q[:, :, rows], k[:, :, keys], v[:, :, keys], scale, w) for rows, keys, w in tiles]
            out, lse = (torch.cat(x, dim=2) for x in zip(*parts))
        return out, lse.to(accumulation_dtype(q.dtype))
    bias = None if mask is None else _additive_bias(mask, q.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=bias, scale=scale
    )
    lse = lse.to(accumulation_dtype(q.dtype))
    if mask is not None:  # the op gives rows with no allowed key out 0 already, but lse 0
        out, lse = _clear_empty_rows(out, lse, mask, clear_out=False)
    return out, lse


def _cpu_flash_band_backward(dout, q, k, v, out, lse, scale, window):
    tiles = band_tiles(q.shape[2], k.shape[2], window)
    if len(tiles) == 1:
        bias = _band_bias(q.shape[2], k.shape[2], window, q.dtype, q.device)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, False, attn_mask=bias, scale=scale
        )
    dqs, dk, dv = [], torch.zeros_like(k), torch.zeros_like(v)
    for rows, keys, w in tiles:
        bias = _band_bias(rows.stop - rows.start, keys.stop - keys.start, w, q.dtype, q.device)
        tile_dq, tile_dk, tile_dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows], lse[:, :, rows],
            0.0, False, attn_mask=bias, scale=scale,
        )  # fmt: skip
        dqs.append(tile_dq)
        dk[:, :, keys] += tile_dk
        dv[:, :, keys] += tile_dv
    return torch.cat(dqs, dim=2), dk, dv


def cpu_flash_backward(dout, q, k, v, out, lse, causal, scale, mask=None, window=None):
    mask = _window_as_mask(q, k, mask, window)
    if mask is None and window is not None:
        return _cpu_flash_band_backward(dout, q, k, v, out, lse, scale, window)
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
def cuda_flash_forward(q, k, v, causal, scale, window=None):
    if window is not None:
        return _cuda_flash_window_forward(q, k, v, scale, window)
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return res[0], res[1]


# A window needs the op under SDPA's, which takes window_size_left/right (bottom-right aligned, as
# masking.Block's windows are) and wants (B, S, H, D): HF's q/k/v are transposes of exactly that.
def _cuda_flash_window_forward(q, k, v, scale, window):
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        t(q), t(k), t(v), None, None, q.shape[2], k.shape[2], 0.0, False, False,
        scale=scale, window_size_left=window[0], window_size_right=window[1],
    )  # fmt: skip
    return t(out), lse


def _flash_rng_placeholders(device: torch.device):
    """What the forward returns as (rng_state, unused) with dropout 0: uint64 (2,) and () (int64
    () on ROCm). The backward reads them only when dropout_p > 0; passing the forward's shapes
    makes the call the one SDPA's own autograd makes."""
    if torch.version.hip:
        return (torch.empty((), dtype=torch.int64, device=device),) * 2
    return torch.empty(2, dtype=torch.uint64, device=device), torch.empty((), dtype=torch.uint64, device=device)


def cuda_flash_backward(dout, q, k, v, out, lse, causal, scale, window=None):
    seed, offset = _flash_rng_placeholders(q.device)
    if window is not None:
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            t(dout), t(q), t(k), t(v), t(out), lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, False,
            seed, offset, scale=scale, window_size_left=window[0], window_size_right=window[1],
        )  # fmt: skip
        return t(dq), t(dk), t(dv)
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


# --------------------------------------------------------------------------- flex
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
        out = torch.where((lse == -_INF).unsqueeze(-1), 0, out)
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
    weight = torch.exp(lse_b.detach() - _backward_lse(lse).to(acc)).unsqueeze(-1)
    g = (dout.to(acc) * weight).to(out_b.dtype)
    delta = (dout.to(acc) * out.to(acc)).sum(-1, keepdim=True)
    h = (g.to(acc) * out_b.detach().to(acc)).sum(-1, keepdim=True) - weight * delta
    dq, dk, dv = torch.autograd.grad((out_b, lse_b), leaves, (g, h.squeeze(-1)))
    return dq, dk, dv
