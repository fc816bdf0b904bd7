"""cpu_flash: torch's fused CPU flash-attention op (a private aten op, pinned by tests); masks,
and windows through its band path."""

from __future__ import annotations

import torch

from easy_context.core.backends.masks import (
    accumulation_dtype,
    additive_bias,
    backward_lse,
    band_bias,
    band_mask,
    clear_empty_rows,
)
from easy_context.core.backends.segments import segments_backward, segments_forward

__all__ = ["BAND_TILE_ROWS", "BAND_WHOLE_PRODUCTS", "band_tiles", "cpu_flash_forward", "cpu_flash_backward"]


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
    bias = band_bias(q.shape[2], k.shape[2], window, q.dtype, q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias, scale=scale)


def cpu_flash_forward(q, k, v, causal, scale, mask=None, window=None, segments=None):
    if segments is not None:  # no variable-length CPU kernel: a call per document, never a wasted pair
        return segments_forward(cpu_flash_forward, q, k, v, causal, scale, segments, window=window)
    mask = _window_as_mask(q, k, mask, window)
    if mask is None and window is not None:
        tiles = band_tiles(q.shape[2], k.shape[2], window)
        if len(tiles) == 1:  # one tile: the whole block (its few unreachable keys cost less than slicing)
            out, lse = _band_call(q, k, v, scale, window)
        else:
            parts = [_band_call(q[:, :, rows], k[:, :, keys], v[:, :, keys], scale, w) for rows, keys, w in tiles]
            out, lse = (torch.cat(x, dim=2) for x in zip(*parts))
        return out, lse.to(accumulation_dtype(q.dtype))
    bias = None if mask is None else additive_bias(mask, q.dtype)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=bias, scale=scale
    )
    lse = lse.to(accumulation_dtype(q.dtype))
    if mask is not None:  # the op gives rows with no allowed key out 0 already, but lse 0
        out, lse = clear_empty_rows(out, lse, mask, clear_out=False)
    return out, lse


def _cpu_flash_band_backward(dout, q, k, v, out, lse, scale, window):
    tiles = band_tiles(q.shape[2], k.shape[2], window)
    if len(tiles) == 1:
        bias = band_bias(q.shape[2], k.shape[2], window, q.dtype, q.device)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, False, attn_mask=bias, scale=scale
        )
    dqs, dk, dv = [], torch.zeros_like(k), torch.zeros_like(v)
    for rows, keys, w in tiles:
        bias = band_bias(rows.stop - rows.start, keys.stop - keys.start, w, q.dtype, q.device)
        tile_dq, tile_dk, tile_dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows], lse[:, :, rows],
            0.0, False, attn_mask=bias, scale=scale,
        )  # fmt: skip
        dqs.append(tile_dq)
        dk[:, :, keys] += tile_dk
        dv[:, :, keys] += tile_dv
    return torch.cat(dqs, dim=2), dk, dv


def cpu_flash_backward(dout, q, k, v, out, lse, causal, scale, mask=None, window=None, segments=None):
    if segments is not None:
        return segments_backward(cpu_flash_backward, dout, q, k, v, out, lse, causal, scale, segments, window=window)
    mask = _window_as_mask(q, k, mask, window)
    if mask is None and window is not None:
        return _cpu_flash_band_backward(dout, q, k, v, out, lse, scale, window)
    bias = None
    if mask is not None:
        bias, lse = additive_bias(mask, q.dtype), backward_lse(lse)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale
    )
