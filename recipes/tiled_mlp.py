"""Tiled MLP: run each decoder layer's MLP over tiles of the sequence.

The MLP's intermediate activations (S x intermediate_size, often 3-4x the hidden size,
several of them) are the largest per-layer tensors after attention is made flash. Each
tile runs under activation checkpointing, so only one tile's intermediates exist at a time
(RingAttention's blockwise feedforward; DeepSpeed ALST's TiledMLP). Under sequence
parallelism every rank has the same local length, hence the same number of tiles, so ZeRO-3
parameter gathers stay in step across ranks.

The MLP modules are kept (only their forward is replaced), so parameter names and
checkpoints are unchanged. The replacement holds its MLP by a weak reference: a forward in the
module's own __dict__ that held the module (a bound method, a partial of one) would make every
tiled MLP a reference cycle, whose weights outlive `del model` until a full garbage collection
(the long-context benchmark's probes then measured the next model beside the last one's MLPs).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["TiledForward", "tile_mlps"]


class TiledForward:
    """An MLP's forward over tiles of `tile_size` tokens. `untiled` is a forward another wrapper
    set on the instance before (kept, and called as it was), or None for the class's own."""

    def __init__(self, mlp, tile_size: int, untiled=None):
        self.mlp = weakref.ref(mlp)
        self.tile_size = tile_size
        self.untiled = untiled

    def untiled_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.untiled is not None:
            return self.untiled(hidden_states)
        mlp = self.mlp()
        return type(mlp).forward(mlp, hidden_states)

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        forward = self.untiled_forward
        if hidden_states.shape[1] <= self.tile_size:
            return forward(hidden_states)
        tiles = hidden_states.split(self.tile_size, dim=1)
        if not torch.is_grad_enabled():
            return torch.cat([forward(t) for t in tiles], dim=1)
        return torch.cat([checkpoint(forward, t, use_reentrant=False) for t in tiles], dim=1)


def tile_mlps(model, tile_size: int) -> int:
    """Make the `mlp` of every decoder layer of a HF causal LM run over sequence tiles of
    `tile_size` tokens; returns how many MLPs were tiled. Tiling again changes the tile size."""
    if tile_size < 1:
        raise ValueError(f"tile size must be positive, got {tile_size}")
    tiled = 0
    for layer in model.get_decoder().layers:
        mlp = layer.mlp
        before = mlp.__dict__.get("forward")  # an instance-level forward: another wrapper's, or ours
        untiled = before.untiled if isinstance(before, TiledForward) else before
        mlp.forward = TiledForward(mlp, tile_size, untiled)
        tiled += 1
    if not tiled:
        raise ValueError("found no decoder layers with an `mlp` to tile")
    return tiled
