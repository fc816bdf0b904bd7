"""Tiled MLP: run each decoder layer's MLP over tiles of the sequence.

The MLP's intermediate activations (S x intermediate_size, often 3-4x the hidden size,
several of them) are the largest per-layer tensors after attention is made flash. Each
tile runs under activation checkpointing, so only one tile's intermediates exist at a time
(RingAttention's blockwise feedforward; DeepSpeed ALST's TiledMLP). Under sequence
parallelism every rank has the same local length, hence the same number of tiles, so ZeRO-3
parameter gathers stay in step across ranks.

The MLP modules are kept (only their forward is replaced), so parameter names and
checkpoints are unchanged.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["tile_mlps"]


def _tiled_forward(forward, tile_size: int, hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.shape[1] <= tile_size:
        return forward(hidden_states)
    tiles = hidden_states.split(tile_size, dim=1)
    if not torch.is_grad_enabled():
        return torch.cat([forward(t) for t in tiles], dim=1)
    return torch.cat([checkpoint(forward, t, use_reentrant=False) for t in tiles], dim=1)


def tile_mlps(model, tile_size: int) -> int:
    """Make the `mlp` of every decoder layer of a HF causal LM run over sequence tiles of
    `tile_size` tokens; returns how many MLPs were tiled."""
    if tile_size < 1:
        raise ValueError(f"tile size must be positive, got {tile_size}")
    tiled = 0
    for layer in model.get_decoder().layers:
        mlp = layer.mlp
        original = getattr(mlp, "_untiled_forward", mlp.forward)
        mlp._untiled_forward = original
        mlp.forward = functools.partial(_tiled_forward, original, tile_size)
        tiled += 1
    if not tiled:
        raise ValueError("found no decoder layers with an `mlp` to tile")
    return tiled
