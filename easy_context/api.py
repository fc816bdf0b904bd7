"""The public functions. Names and signatures follow EasyContext so existing scripts keep working."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import hf
from .modes import get_mode

__all__ = [
    "apply_seq_parallel_monkey_patch",
    "remove_seq_parallel_monkey_patch",
    "prepare_seq_parallel_inputs",
    "prepare_dataloader",
    "gather_seq_parallel_outputs",
]


def _no_unknown_options(where: str, options: dict) -> None:
    if options:
        raise TypeError(f"{where}: unknown option(s) {sorted(options)}; supported: process_group")


def apply_seq_parallel_monkey_patch(mode: str, model_type: str, *, process_group=None, **options) -> None:
    """Make `model_type` models run `mode`'s sequence-parallel attention.

    Affects models whose attn_implementation is sdpa, eager or flash_attention_2, created
    before or after this call. The sequence-parallel group is `process_group`, or else the
    default (world) group, looked up at the first forward, so this may be called before
    torch.distributed is initialised. Calling it again adds model types (same mode) or
    switches every patched model type to a new mode. Undo with
    remove_seq_parallel_monkey_patch().
    """
    _no_unknown_options("apply_seq_parallel_monkey_patch", options)
    resolved = get_mode(mode)
    if model_type not in hf.SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model type {model_type!r} is not supported; supported: {list(hf.SUPPORTED_MODEL_TYPES)}"
        )
    if resolved.attention is None:  # data_parallel: models keep their own attention
        remove_seq_parallel_monkey_patch()
        return
    active = hf.active_patch()
    types = {model_type}
    if active is not None and active.mode is resolved and active.process_group is process_group:
        types |= active.model_types
    hf.install(resolved, types, process_group)


def remove_seq_parallel_monkey_patch() -> None:
    """Restore transformers' own attention and mask functions."""
    hf.uninstall()


def _as_batch(name: str, x: Optional[torch.Tensor], batch: int, seq_len: int) -> Optional[torch.Tensor]:
    if x is None:
        return None
    if x.dim() == 1:
        x = x.unsqueeze(0)
    if x.dim() != 2 or x.shape[-1] != seq_len or x.shape[0] not in (1, batch):
        raise ValueError(f"{name} must have shape (batch, seq_len) = ({batch}, {seq_len}), got {tuple(x.shape)}")
    return x.expand(batch, seq_len)


def prepare_seq_parallel_inputs(
    mode: str, input_ids, position_ids, target_ids, rank: int, world_size: int, device, **options
) -> dict:
    """Keep this rank's share of a batch of full sequences.

    input_ids (B, S); position_ids (B, S), (1, S) or None (0..S-1); target_ids (B, S) are
    next-token targets already aligned with input_ids (shift before sharding; -100 is
    ignored by losses) or None. Returns local_input_ids, local_position_ids (the GLOBAL
    positions of the local tokens) and local_target_ids, on `device`.
    """
    _no_unknown_options("prepare_seq_parallel_inputs", {k: v for k, v in options.items() if k != "process_group"})
    layout = get_mode(mode).layout
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape (batch, seq_len), got {tuple(input_ids.shape)}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    batch, seq_len = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=input_ids.device)
    position_ids = _as_batch("position_ids", position_ids, batch, seq_len)
    target_ids = _as_batch("target_ids", target_ids, batch, seq_len)
    if seq_len > 1 and not bool((position_ids.diff(dim=-1) == 1).all()):
        raise ValueError(
            "position_ids must count up by one along each row (one contiguous sequence per row); "
            "packed sequences are not supported yet"
        )
    layout.check_length(seq_len, world_size)

    def local(x):
        return None if x is None else layout.shard(x, rank, world_size, dim=1).to(device)

    return {
        "local_input_ids": local(input_ids),
        "local_position_ids": local(position_ids),
        "local_target_ids": local(target_ids),
    }


def prepare_dataloader(mode: str, dataloader, accelerator):
    """data_parallel: shard batches over ranks (accelerator.prepare); sequence-parallel modes:
    every rank reads the same full batches and keeps its share via prepare_seq_parallel_inputs."""
    if get_mode(mode).layout.chunks_per_rank == 0:
        return accelerator.prepare(dataloader)
    return dataloader


def gather_seq_parallel_outputs(mode: str, local: torch.Tensor, dim: int = 1, process_group=None) -> torch.Tensor:
    """All-gather per-rank local tensors (logits, predictions) back into sequence order.

    Not differentiable; every rank gets the full tensor. `process_group` defaults to the
    patched sequence-parallel group, else the world.
    """
    layout = get_mode(mode).layout
    active = hf.active_patch()
    group = hf.resolve_group(process_group or (active.process_group if active else None))
    if group is None or layout.chunks_per_rank == 0:
        return local
    local = local.contiguous()
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local, group=group)
    return layout.unshard(pieces, dim=dim)
