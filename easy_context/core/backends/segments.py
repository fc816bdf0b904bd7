"""Blocks of packed documents (masking.Block.segments) for backends whose kernel takes no
document boundaries: one kernel call per document, put together into one result, so the
caller still sees one block (one merge, one gradient accumulation, whatever the number of
documents), and no (query, key) pair outside a document is computed."""

from __future__ import annotations

import functools

import torch

__all__ = ["segments_forward", "segments_backward", "cu_seqlens", "CONCAT_ELEMENTS"]

# How the documents' results become one: a small block's are concatenated (one op per tensor:
# per-call overhead is what small blocks cost), a large block's are copied into one result
# document by document, so besides it only one document's result is alive (a concatenation
# holds every part and the result at once: twice the block's gradients at the peak).
CONCAT_ELEMENTS = 1 << 20  # elements of q's block (B x H x S x D) up to which parts are concatenated


def _joined(parts, q: torch.Tensor, n: int):
    """The per-document results `parts` (an iterator of tuples of (B, H, len, ...) tensors, in
    document order) as one tuple of (B, H, n, ...) tensors."""
    if q.numel() <= CONCAT_ELEMENTS:
        parts = list(parts)
        return parts[0] if len(parts) == 1 else tuple(torch.cat(x, dim=2) for x in zip(*parts))
    joined, at = None, 0
    for part in parts:
        if joined is None:
            joined = tuple(_stretched(x, n) for x in part)
        length = part[0].shape[2]
        for whole, piece in zip(joined, part):
            whole[:, :, at : at + length].copy_(piece)
        at += length
    return joined


def _stretched(x: torch.Tensor, n: int) -> torch.Tensor:
    """An empty (B, H, n, ...) tensor in x's memory order: the kernel's own output layout (HF's
    (B, S, H, D) for out, dQ, dK, dV), which what consumes the result expects without a copy."""
    order = sorted(range(x.dim()), key=lambda d: x.stride(d), reverse=True)
    shape = [*x.shape[:2], n, *x.shape[3:]]
    return x.new_empty([shape[d] for d in order]).permute([order.index(d) for d in range(x.dim())])


def _pieces(segments):
    return list(zip(segments, segments[1:]))


def segments_forward(forward, q, k, v, causal, scale, segments, **options):
    """forward(q, k, v, causal, scale, **options) -> (out, lse) run on each document's square."""
    if len(segments) == 2:
        return forward(q, k, v, causal, scale, **options)
    parts = (forward(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal, scale, **options) for a, b in _pieces(segments))
    return _joined(parts, q, q.shape[2])


def segments_backward(backward, dout, q, k, v, out, lse, causal, scale, segments, **options):
    """backward(dout, q, k, v, out, lse, causal, scale, **options) -> (dq, dk, dv) per document;
    the documents' keys are disjoint, so their dK/dV are put side by side, not added."""
    if len(segments) == 2:
        return backward(dout, q, k, v, out, lse, causal, scale, **options)
    parts = (
        backward(*(x[:, :, a:b] for x in (dout, q, k, v, out, lse)), causal, scale, **options)
        for a, b in _pieces(segments)
    )
    return _joined(parts, q, q.shape[2])


@functools.lru_cache(maxsize=64)
def _boundaries(segments: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    host = torch.tensor(segments, dtype=torch.int32)
    if device.type != "cuda":
        return host.to(device), None
    # From pinned memory without a sync; the host copy stays cached (alive) with its device copy.
    host = host.pin_memory()
    return host.to(device, non_blocking=True), host


def cu_seqlens(segments: tuple, device: torch.device) -> torch.Tensor:
    """The documents' boundaries as flash's int32 cu_seqlens on `device`, built once per set of
    kernel calls (every layer and the backward reuse it)."""
    return _boundaries(tuple(segments), device)[0]
