"""The public functions. Names and signatures follow EasyContext so existing scripts keep working.

Options shared by every function (keyword-only):
  sp_size      ranks that share one sequence (default: the whole world); world = dp x sp
  ring_degree  the ring part of an SP group under usp_attn (default 1: pure Ulysses)
  document_split  ring modes (zigzag_ring_attn, usp_attn, dist_flash_attn) with packed rows:
               each row gets a layout of its own (every document cut over the ring the way the
               mode cuts one causal row) so every rank does the same work; the model is then
               called with seq_parallel_index=local["local_token_index"]
Functions called after apply_seq_parallel_monkey_patch default to the options it was given.
"""

from __future__ import annotations

import itertools
from typing import Optional

import torch
import torch.distributed as dist

from easy_context.hf import architectures

from easy_context.core.global_mask import check_padding
from easy_context.hf import patch as hf
from easy_context.modes import SeqParallelMode, get_mode, modes_with
from easy_context.core.groups import get_groups

__all__ = [
    "apply_seq_parallel_monkey_patch",
    "remove_seq_parallel_monkey_patch",
    "prepare_seq_parallel_inputs",
    "prepare_dataloader",
    "gather_seq_parallel_outputs",
]
_OPTIONS = ("sp_size", "ring_degree", "document_split")


def _check_option_names(where: str, options: dict) -> None:
    unknown = set(options) - set(_OPTIONS)
    if unknown:
        raise TypeError(f"{where}: unknown option(s) {sorted(unknown)}; supported: {list(_OPTIONS)}")


def _options(where: str, mode: SeqParallelMode, options: dict) -> dict:
    """The caller's options, defaulting to (and never contradicting) the active patch's."""
    _check_option_names(where, options)
    active = hf.active_patch()
    resolved = {}
    for name in _OPTIONS:
        given = options.get(name)
        patched = getattr(active, name) if active is not None and active.mode is mode else None
        if given is not None and patched is not None and given != patched:
            raise ValueError(f"{where}: {name}={given} differs from {name}={patched} given to apply_seq_parallel_monkey_patch")
        resolved[name] = given if given is not None else patched
    return resolved


def _topology(where: str, mode: SeqParallelMode, world: int, options: dict):
    """(topology, resolved options) for a call with `options`."""
    resolved = _options(where, mode, options)
    return mode.topology(world, resolved["sp_size"], resolved["ring_degree"]), resolved


def apply_seq_parallel_monkey_patch(mode: str, model_or_type, **options) -> None:
    """Make models of a type run `mode`'s sequence-parallel attention.

    model_or_type: a model type ("llama", see SUPPORTED_MODEL_TYPES) or a model instance (or
    its config), whose decoder's type is used (a multimodal wrapper's text config included).
    Affects models whose attn_implementation is sdpa, eager or flash_attention_2, created
    before or after this call. Process groups are created here when torch.distributed is
    initialised, else at the first forward. Calling it again with the same mode and options
    adds model types; with others it switches every patched type. Undo with
    remove_seq_parallel_monkey_patch().
    """
    resolved = get_mode(mode)
    _check_option_names("apply_seq_parallel_monkey_patch", options)
    model_types = architectures.model_types_of(model_or_type)
    for model_type in model_types:
        architectures.check_model_type(model_type)
    sp_size, ring_degree, split = options.get("sp_size"), options.get("ring_degree"), options.get("document_split")
    resolved.topology(hf.world_size(), sp_size, ring_degree)  # impossible combinations fail now
    if split:
        _check_split(mode)
    if resolved.attention is None:  # data_parallel: models keep their own attention
        remove_seq_parallel_monkey_patch()
        return
    types = set(model_types)
    active = hf.active_patch()
    if active is not None and (active.mode, active.sp_size, active.ring_degree, active.document_split) == (
        resolved, sp_size, ring_degree, split
    ):
        types |= active.model_types
    patch = hf.ActivePatch(resolved, frozenset(types), sp_size, ring_degree, split)
    hf.install(patch)
    if hf.world_size() > 1:
        patch.groups()  # collective: every rank calls apply, so create the groups now


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
    mode: str, input_ids, position_ids, target_ids, rank: int, world_size: int, device, attention_mask=None, **options
) -> dict:
    """Keep this rank's share of a batch of full sequences.

    rank/world_size are global; the rank's place in its SP group follows from sp_size.
    input_ids (B, S); position_ids (B, S), (1, S) or None (0..S-1): packed documents restart
    their positions (HF's convention: a document starts where position_ids[i] !=
    position_ids[i-1] + 1); target_ids (B, S) are next-token targets already aligned with
    input_ids (shift before sharding; -100 is ignored by losses) or None; attention_mask
    (B, S) 0/1 marks padding (zeros at the start and/or end of a row) or None.
    Returns local_input_ids, local_position_ids (the positions of the local tokens, so RoPE
    is right), local_target_ids and local_attention_mask, on `device`. Pass
    attention_mask=local["local_attention_mask"] and position_ids=local["local_position_ids"]
    to the model. data_parallel returns the inputs unchanged (moved to `device`).

    document_split=True: each row gets a layout of its own; the result also has
    local_token_index (B, S_local), each local token's position in its row, for the model
    (seq_parallel_index=) and gather_seq_parallel_outputs (token_index=).
    """
    resolved = get_mode(mode)
    topology, resolved_options = _topology("prepare_seq_parallel_inputs", resolved, world_size, options)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")

    def to_device(x):
        return None if x is None else x.to(device)

    names = ("local_input_ids", "local_position_ids", "local_target_ids", "local_attention_mask")
    if resolved.attention is None:
        return dict(zip(names, map(to_device, (input_ids, position_ids, target_ids, attention_mask))))
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape (batch, seq_len), got {tuple(input_ids.shape)}")
    batch, seq_len = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=input_ids.device)
    position_ids = _as_batch("position_ids", position_ids, batch, seq_len)
    target_ids = _as_batch("target_ids", target_ids, batch, seq_len)
    attention_mask = _as_batch("attention_mask", attention_mask, batch, seq_len)
    if attention_mask is not None:
        check_padding(attention_mask.cpu())
    layout, sp_rank = resolved.layout(topology), topology.sp_rank(rank)
    rows = (input_ids, position_ids, target_ids, attention_mask)
    if resolved_options["document_split"]:
        _check_split(mode)
        index = _split_index(resolved, topology, position_ids, attention_mask, sp_rank)
        result = {name: None if x is None else to_device(x.gather(1, index)) for name, x in zip(names, rows)}
        result["local_token_index"] = to_device(index)
        return result

    def local(x):
        return None if x is None else to_device(layout.shard(x, sp_rank, dim=1))

    return dict(zip(names, map(local, rows)))


def _check_split(mode: str) -> None:
    if not get_mode(mode).document_split:
        raise ValueError(f"document_split=True works with {list(modes_with('document_split'))}, not {mode!r} (ulysses_attn is balanced "
                         "already: every rank attends the whole sequence for its heads)")


def _split_index(mode, topology, position_ids, attention_mask, sp_rank) -> torch.Tensor:
    """document_split: this SP rank's rows, (B, S_local) global positions: per row, its ring
    rank's share of every document (balance.split_documents), cut into Ulysses pieces."""
    from easy_context.core.layout import RowLayout

    zigzag = topology.ring_degree > 1 and mode.zigzag
    layout = RowLayout.of_documents(position_ids, attention_mask, topology.ring_degree, topology.ulysses_degree, zigzag)
    return layout.local_indices(sp_rank).to(position_ids.device)


class DataParallelShard:
    """Batch i of the wrapped loader goes to data-parallel group i % dp_size.

    Every rank of one SP group reads the same batches; all groups get the same number of
    batches (the tail that does not divide is dropped) so no group waits on another.
    """

    def __init__(self, loader, dp_rank: int, dp_size: int):
        self.loader, self.dp_rank, self.dp_size = loader, dp_rank, dp_size

    def __len__(self) -> int:
        return len(self.loader) // self.dp_size

    def __iter__(self):
        stop = len(self) * self.dp_size if hasattr(self.loader, "__len__") else None
        return itertools.islice(self.loader, self.dp_rank, stop, self.dp_size)


def prepare_dataloader(mode: str, dataloader, accelerator, **options):
    """data_parallel: the accelerator shards batches over all ranks. Sequence-parallel modes:
    batches are split over the data-parallel groups only (every rank of an SP group reads
    the same full sequences and keeps its share through prepare_seq_parallel_inputs)."""
    resolved = get_mode(mode)
    if resolved.attention is None:
        return accelerator.prepare(dataloader)
    world, rank = getattr(accelerator, "num_processes", hf.world_size()), getattr(accelerator, "process_index", 0)
    topology, _ = _topology("prepare_dataloader", resolved, world, options)
    if topology.dp_size == 1:
        return dataloader
    return DataParallelShard(dataloader, topology.dp_rank(rank), topology.dp_size)


def gather_seq_parallel_outputs(mode: str, local: torch.Tensor, dim: int = 1, token_index=None, **options) -> torch.Tensor:
    """All-gather the SP group's local tensors (logits, predictions) back into sequence order.

    Not differentiable; every rank of the SP group gets its group's full tensor. Under
    document_split pass token_index=local["local_token_index"] (dim must be 1).
    """
    resolved = get_mode(mode)
    topology, resolved_options = _topology("gather_seq_parallel_outputs", resolved, hf.world_size(), options)
    if resolved_options["document_split"] and token_index is None:
        raise ValueError("document_split=True: pass token_index=local['local_token_index'] to gather_seq_parallel_outputs")
    groups = get_groups(topology)
    if groups.sp is None:
        return local
    pieces = _all_gather(local, topology, groups)
    if token_index is None:
        return resolved.layout(topology).unshard(pieces, dim=dim)
    if dim != 1:
        raise ValueError(f"token_index orders dim 1 (the sequence), got dim={dim}")
    index = torch.cat(_all_gather(token_index.to(local.device), topology, groups), dim=1)
    index = index.reshape(*index.shape, *([1] * (local.dim() - 2))).expand(*index.shape, *local.shape[2:])
    return torch.empty_like(torch.cat(pieces, dim=1)).scatter_(1, index, torch.cat(pieces, dim=1))


def _all_gather(local, topology, groups) -> list:
    local = local.contiguous()
    pieces = [torch.empty_like(local) for _ in range(topology.sp_size)]
    dist.all_gather(pieces, local, group=groups.sp)
    return pieces
