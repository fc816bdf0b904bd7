"""Blocks of packed documents (masking.Block.segments) for backends whose kernel takes no
document boundaries: one kernel call per document, the results concatenated, so the caller
still sees one block (one merge, one gradient accumulation, whatever the number of documents),
and no (query, key) pair outside a document is computed."""

from __future__ import annotations

import functools

import torch

__all__ = ["segments_forward", "segments_backward", "cu_seqlens"]


def _pieces(segments):
    return list(zip(segments, segments[1:]))


def segments_forward(forward, q, k, v, causal, scale, segments, **options):
    """forward(q, k, v, causal, scale, **options) -> (out, lse) run on each document's square."""
    parts = [forward(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], causal, scale, **options) for a, b in _pieces(segments)]
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat(x, dim=2) for x in zip(*parts))


def segments_backward(backward, dout, q, k, v, out, lse, causal, scale, segments, **options):
    """backward(dout, q, k, v, out, lse, causal, scale, **options) -> (dq, dk, dv) per document;
    the documents' keys are disjoint, so their dK/dV are concatenated, not added."""
    parts = [
        backward(*(x[:, :, a:b] for x in (dout, q, k, v, out, lse)), causal, scale, **options)
        for a, b in _pieces(segments)
    ]
    if len(parts) == 1:
        return parts[0]
    return tuple(torch.cat(x, dim=2) for x in zip(*parts))


@functools.lru_cache(maxsize=64)
def _boundaries(segments: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    host = torch.tensor(segments, dtype=torch.int32)
    if device.type != "cuda":
        return host.to(device), None
    # From pinned memory without a sync; the host copy stays cached (alive) with its device copy.
    host = host.pin_memory()
    return host.to(device, non_blocking=True), host


def cu_seqlens(segments: tuple, device: torch.device) -> torch.Tensor:
    """The documents' boundaries as flash's int32 cu_seqlens on `device`, built once per plan
    (every layer and the backward reuse it)."""
    return _boundaries(tuple(segments), device)[0]
