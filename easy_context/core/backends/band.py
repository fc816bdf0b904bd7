"""The band path: a window computed in tiles of query rows, each against only the keys its rows
may attend, so a narrow band does not cost a full block (cpu_flash, cuda_efficient: kernels
that take an additive bias but no window). A window with Sq <= Sk leaves no row empty, so each
tile needs only its band's bias; interior tiles share one shape and window, so that bias is
built once (masks.band_bias)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from easy_context.core.backends.masks import band_bias, band_mask

__all__ = ["BAND_TILE_ROWS", "BAND_WHOLE_PRODUCTS", "band_tiles", "band_forward", "band_backward", "window_as_mask"]

BAND_TILE_ROWS = 256  # at least; a quarter of the band's width when that is more
BAND_WHOLE_PRODUCTS = 1 << 21  # a block of at most this many (query, key) pairs runs whole


def window_as_mask(q, k, mask, window):
    """A window the band path cannot serve (with a mask, or more queries than keys, where rows
    may be empty) folded into the mask; None: the band path serves it."""
    if window is None or (mask is None and q.shape[2] <= k.shape[2]):
        return mask
    band = band_mask(q.shape[2], k.shape[2], window, q.device)
    return band if mask is None else mask & band


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


# call(q, k, v, scale, bias) -> (out, lse); call_backward(dout, q, k, v, out, lse, scale, bias)
# -> (dq, dk, dv): a kernel given an additive bias, on the tile's rows and keys.
def band_forward(call: Callable, q, k, v, scale, window, key_align: int = 1):
    """(out, lse) of a window block with Sq <= Sk, tile by tile."""
    tiles = band_tiles(q.shape[2], k.shape[2], window)
    if len(tiles) == 1:  # the whole block (its few unreachable keys cost less than slicing)
        rows, keys, w = tiles[0]
        return call(q, k, v, scale, _bias(rows, keys, w, q, key_align))
    parts = [
        call(q[:, :, rows], k[:, :, keys], v[:, :, keys], scale, _bias(rows, keys, w, q, key_align))
        for rows, keys, w in tiles
    ]
    out, lse = (torch.cat(x, dim=2) for x in zip(*parts))
    return out, lse


def band_backward(call_backward: Callable, dout, q, k, v, out, lse, scale, window, key_align: int = 1):
    """(dq, dk, dv) of a window block with Sq <= Sk, tile by tile; a key reached by several tiles
    sums their gradients."""
    tiles = band_tiles(q.shape[2], k.shape[2], window)
    if len(tiles) == 1:
        rows, keys, w = tiles[0]
        return call_backward(dout, q, k, v, out, lse, scale, _bias(rows, keys, w, q, key_align))
    dqs, dk, dv = [], torch.zeros_like(k), torch.zeros_like(v)
    for rows, keys, w in tiles:
        tile_dq, tile_dk, tile_dv = call_backward(
            dout[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows], lse[:, :, rows],
            scale, _bias(rows, keys, w, q, key_align),
        )  # fmt: skip
        dqs.append(tile_dq)
        dk[:, :, keys] += tile_dk
        dv[:, :, keys] += tile_dv
    return torch.cat(dqs, dim=2), dk, dv


def _bias(rows: slice, keys: slice, window, q, key_align: int) -> torch.Tensor:
    return band_bias(rows.stop - rows.start, keys.stop - keys.start, window, q.dtype, q.device, key_align)
