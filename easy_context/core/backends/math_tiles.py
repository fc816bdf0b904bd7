"""The math backend: pure torch in the accumulation dtype, any device; masks and softcap. The
reference and the fallback, computed in tiles of query rows."""

from __future__ import annotations

import math

import torch

from easy_context.core.backends.masks import INF, accumulation_dtype, backward_lse

__all__ = [
    "MATH_TILE_LOGITS",
    "MATH_TILE_TEMPORARIES",
    "MATH_CUDA_FREE_FRACTION",
    "MATH_CUDA_MAX_TILE_LOGITS",
    "tile_logits",
    "row_tiles",
    "math_forward",
    "math_backward",
]

# Logits the math backend holds at once on CPU (fp32: 8 MiB per temporary); longer blocks run in
# tiles of query rows. Measured on 2 cores at S=4K: as fast as 4x larger tiles, and less memory.
# It is also the smallest tile on CUDA.
MATH_TILE_LOGITS = 1 << 21
# On CUDA the tile is sized from the memory free when the call starts: a tile's temporaries
# (logits, turned into weights in place; the backward's dlogits, a softcap's slope)
# are at most MATH_TILE_TEMPORARIES tile-sized tensors, and they may take MATH_CUDA_FREE_FRACTION
# of the free memory: the rest is headroom for the caller (a ring's prefetched K/V, the
# allocator's rounding). At most MATH_CUDA_MAX_TILE_LOGITS: past it the matmuls are saturated
# anyway, and every temporary stays below 2^31 elements (32-bit indexing in every kernel).
MATH_TILE_TEMPORARIES = 4
MATH_CUDA_FREE_FRACTION = 0.5
MATH_CUDA_MAX_TILE_LOGITS = 1 << 30


# exp and tanh from exp2 and sigmoid, in place. Why: on CPU, torch's fp32 exp and tanh go through
# MKL's vector math, which was measured (torch 2.13, 2 busy cores) to return results off by up to
# 1.5e-4 relative on the first call after a matmul (exp: 5 runs in 40); exp2 and sigmoid have
# torch's own vectorized kernels and never varied (0 in 40, 0 in 30). This backend is the reference, so it keeps
# to ops whose precision does not vary. tanh(y) = 2 sigmoid(2y) - 1 loses up to an ulp of 1,
# times the cap: at most 8e-6 on a capped logit at cap 50 (tanh: 2e-6 when its precision holds),
# far below bf16's rounding; tanh in float64 would be exact but 3x slower.
_LOG2E = 1 / math.log(2)


def _exp_(x: torch.Tensor) -> torch.Tensor:
    return x.mul_(_LOG2E).exp2_()


def _tanh_(x: torch.Tensor) -> torch.Tensor:
    return x.mul_(2).sigmoid_().mul_(2).sub_(1)


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
        capped = _tanh_(logits.div_(softcap))
        slope = 1 - capped * capped if grad else None
        logits = capped.mul_(softcap)
    by_row = logits.view(b, n_kv, h // n_kv, -1, logits.shape[-1])  # (B, Hkv, G, rows, keys)
    if causal:  # square block: query i of the block sees keys <= i
        query = torch.arange(rows.start, rows.stop, device=q.device)
        by_row.masked_fill_(torch.arange(keys.start or 0, keys.stop, device=q.device) > query[:, None], -INF)
    if mask is not None:  # (B, 1, Sq, Sk) -> (B, 1, 1, rows, keys)
        by_row.masked_fill_(~mask[:, :, rows, keys].unsqueeze(2), -INF)
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
        # max + log(sum(exp(x - max))), with the exp above (not torch.logsumexp, which uses exp).
        row_max = logits.amax(-1, keepdim=True)
        # A row with no allowed key: shift by 0, so its weights are 0 (not NaN) and its lse -inf.
        row_max = row_max if mask is None else row_max.masked_fill_(row_max == -INF, 0)
        weights = _exp_(logits.sub_(row_max))
        total = weights.sum(-1, keepdim=True)
        lse = total.log().add_(row_max)
        # Normalized on the (rows, D) output, not the (rows, keys) weights; an empty row stays 0.
        out = torch.matmul(weights, v_acc[:, :, keys]).div_(total.clamp_(min=torch.finfo(acc).tiny))
        outs.append(out.reshape(b, h, -1, v.shape[-1]))
        lses.append(lse.reshape(b, h, -1))
    return torch.cat(outs, 2).to(q.dtype), torch.cat(lses, 2)


def math_backward(dout, q, k, v, out, lse, causal, scale, mask=None, softcap=None):
    b, h, _, d = q.shape
    n_kv = k.shape[1]
    if mask is not None:
        lse = backward_lse(lse)
    acc = accumulation_dtype(q.dtype)
    grouped = lambda x, rows: x[:, :, rows].to(acc).reshape(b, n_kv, -1, x.shape[-1])  # noqa: E731
    k_acc, v_acc = k.to(acc), v.to(acc)  # once per call, as in the forward
    dq, dk, dv = torch.empty_like(q, dtype=acc), torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)
    for rows, keys in _tiles(q, k, causal):
        q_tile, logits, slope = _math_logits(q, k_acc, causal, scale, mask, softcap, rows, keys, grad=True)
        probs = _exp_(logits.sub_(grouped(lse.unsqueeze(-1), rows)))
        dout_tile = grouped(dout, rows)
        delta = (dout_tile * grouped(out, rows)).sum(-1, keepdim=True)
        dv[:, :, keys] += torch.matmul(probs.transpose(-1, -2), dout_tile)  # sums over the G heads too
        dlogits = torch.matmul(dout_tile, v_acc[:, :, keys].transpose(-1, -2)).sub_(delta).mul_(probs).mul_(scale)
        if slope is not None:
            dlogits.mul_(slope)
        dq[:, :, rows] = torch.matmul(dlogits, k_acc[:, :, keys]).reshape(b, h, -1, d)
        dk[:, :, keys] += torch.matmul(dlogits.transpose(-1, -2), q_tile)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
