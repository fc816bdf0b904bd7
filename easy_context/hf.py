"""The one integration point with Hugging Face transformers (5.x attention registry).

We replace the `sdpa`, `eager` and `flash_attention_2` entries of transformers' attention
registry and of its mask registry with dispatchers. For a model type that was patched they
run the active mode's sequence-parallel attention; for every other model they call the
original function, so the patch is scoped to the model types named by the user. Models are
found at call time through the registry, so models created before or after the patch are
both covered, and nothing of the model code is forked.

The mask dispatcher exists because transformers builds masks over the *local* shard: it
would read the zigzag position jump as a packed-sequence boundary. Our attention needs no
mask for plain causal LM inputs, so the dispatcher returns None, and refuses (loudly)
masks it cannot honour instead of dropping them.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .layout import Layout
from .modes import SeqParallelMode
from .process_groups import SeqParallelGroups, get_groups

__all__ = ["SUPPORTED_MODEL_TYPES", "ActivePatch", "install", "uninstall", "active_patch", "world_size"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# Implementations a patched model may use (each becomes sequence parallel). Every other name
# in the registries is dispatched too, so a patched model on, say, flex_attention is refused
# instead of silently attending within its shard only.
SUPPORTED_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
_MISSING = object()


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@dataclass(frozen=True)
class ActivePatch:
    mode: SeqParallelMode
    model_types: frozenset
    sp_size: Optional[int] = None  # None: the whole world
    ring_degree: Optional[int] = None  # None: the mode's default

    def groups(self) -> SeqParallelGroups:
        """This rank's process groups; created at the first call, then cached."""
        return get_groups(self.mode.topology(world_size(), self.sp_size, self.ring_degree))


_active: Optional[ActivePatch] = None
_saved: dict = {}  # (registry mapping id, name) -> original function or _MISSING


def active_patch() -> Optional[ActivePatch]:
    return _active


def _is_patched(config) -> bool:
    return _active is not None and getattr(config, "model_type", None) in _active.model_types


# ----------------------------------------------------------------------- checks
def _raise_on_every_rank(ok: bool, message: str) -> None:
    """Raise `message` here if not ok, and on every other rank of the SP group too (one tiny
    all-reduce), so no rank is left waiting in the attention's collectives."""
    group = _active.groups().sp
    if group is not None:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        if not ok:
            raise ValueError(message)
        if not flag.item():
            raise ValueError("another rank of the sequence-parallel group refused its inputs; see that rank's error")
    elif not ok:
        raise ValueError(message)


def _check_positions(position_ids: torch.Tensor, layout: Layout, rank: int, size: int) -> None:
    """Local position_ids must be this rank's share of one contiguous sequence.

    Catches the silent failure modes: positions left to the model's default (arange over
    the local shard: wrong RoPE on every rank but the first) and packed sequences.
    """
    expected = layout.local_indices(position_ids.shape[-1] * size, rank).to(position_ids.device)
    offset = position_ids[..., :1] - expected[:1]
    ok = bool((offset >= 0).all()) and bool((position_ids == offset + expected).all())
    message = (
        f"position_ids on rank {rank} of {size} are not this rank's {layout.name} share of one "
        f"contiguous sequence (first values: {position_ids[0, :4].tolist()}). Pass the "
        "`local_position_ids` returned by prepare_seq_parallel_inputs; packed sequences "
        "(positions restarting inside a row) are not supported yet."
    )
    _raise_on_every_rank(ok, message)


def _check_supported(module, query, key, attention_mask, kwargs, rank, size, layout) -> None:
    if query.shape[2] != key.shape[2]:
        raise ValueError(
            f"query length {query.shape[2]} != key length {key.shape[2]}: a KV cache (generation) "
            "is not supported under sequence parallelism; call the model with use_cache=False"
        )
    if attention_mask is not None:
        raise ValueError(
            "an explicit attention mask (4D or custom) is not supported under sequence "
            "parallelism yet; pass attention_mask=None for plain causal LM inputs"
        )
    if not getattr(module, "is_causal", True):
        raise ValueError("non-causal attention is not supported under sequence parallelism yet")
    dropout = kwargs.get("dropout") or 0.0
    if dropout > 0:
        raise ValueError(
            f"attention dropout {dropout} is not supported under sequence parallelism; "
            "set config.attention_dropout=0.0 (or call model.eval())"
        )
    window = kwargs.get("sliding_window")
    global_len = query.shape[2] * size
    if window is not None and window < global_len:
        raise ValueError(
            f"sliding_window={window} is shorter than the sequence ({global_len} tokens): "
            "windowed attention is not supported under sequence parallelism yet; use sequences "
            f"of at most {window} tokens or set config.sliding_window=None (full attention)"
        )
    position_ids = kwargs.get("position_ids")
    if position_ids is not None and getattr(module, "layer_idx", 0) in (0, None):
        _check_positions(position_ids, layout, rank, size)


# ------------------------------------------------------------------ dispatchers
def _sequence_parallel_attention(module, query, key, value, attention_mask, **kwargs):
    groups = _active.groups()
    topology = groups.topology
    layout = _active.mode.layout(topology)
    _check_supported(module, query, key, attention_mask, kwargs, groups.sp_rank, topology.sp_size, layout)
    scale = kwargs.get("scaling") or 1.0 / math.sqrt(query.shape[-1])
    out = _active.mode.attention(query, key, value, scale, groups, layer=module)
    return out.transpose(1, 2), None  # HF expects (B, S, H, D) and no attention weights


def _original_attention(name, module):
    original = _saved.get((id(AttentionInterface._global_mapping), name), _MISSING)
    if original is not _MISSING:
        return original
    # "eager" is not in the registry by default: each model module has its own function.
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise RuntimeError(
            f"{type(module).__name__} uses eager attention but its module has no eager_attention_forward; "
            "call remove_seq_parallel_monkey_patch() before using this model, or give it attn_implementation='sdpa'"
        )
    return eager


def _refuse_implementation(name):
    raise ValueError(
        f"attn_implementation={name!r} is not supported under sequence parallelism (it would attend "
        f"within each rank's shard only); load the model with one of {list(SUPPORTED_IMPLEMENTATIONS)}"
    )


def _make_attention_dispatcher(name):
    def attention(module, query, key, value, attention_mask, **kwargs):
        if _is_patched(getattr(module, "config", None)):
            if name not in SUPPORTED_IMPLEMENTATIONS:
                _refuse_implementation(name)
            return _sequence_parallel_attention(module, query, key, value, attention_mask, **kwargs)
        return _original_attention(name, module)(module, query, key, value, attention_mask, **kwargs)

    attention.__name__ = f"easy_context_{name}_attention"
    return attention


def _make_mask_dispatcher(name, original):
    def mask(*args, **kwargs):
        if not _is_patched(kwargs.get("config")):
            return original(*args, **kwargs)
        if name not in SUPPORTED_IMPLEMENTATIONS:
            _refuse_implementation(name)
        padding = kwargs.get("attention_mask")
        if padding is not None:
            # Every rank of the group takes part, so a mask with zeros on one shard only
            # stops all of them instead of leaving the others waiting in a collective.
            _raise_on_every_rank(
                bool(padding.all()),
                "a padding attention_mask (zeros present) is not supported under sequence "
                "parallelism yet; pack or trim rows to full length, or drop the mask",
            )
        return None  # causal attention over the whole sharded sequence needs no mask

    mask.__name__ = f"easy_context_{name}_mask"
    return mask


# --------------------------------------------------------------- install/undo
def install(patch: ActivePatch) -> None:
    global _active
    _active = patch
    if _saved:  # dispatchers already in place; they read `_active` at call time
        return
    attention_map = AttentionInterface._global_mapping
    mask_map = AttentionMaskInterface._global_mapping
    for name in sorted(set(attention_map) | set(SUPPORTED_IMPLEMENTATIONS)):
        _saved[(id(attention_map), name)] = attention_map.get(name, _MISSING)
        attention_map[name] = _make_attention_dispatcher(name)
    for name in list(mask_map):
        _saved[(id(mask_map), name)] = mask_map[name]
        mask_map[name] = _make_mask_dispatcher(name, mask_map[name])


def uninstall() -> None:
    global _active
    _active = None
    for registry in (AttentionInterface._global_mapping, AttentionMaskInterface._global_mapping):
        for name in list(registry):
            original = _saved.pop((id(registry), name), None)
            if original is _MISSING:
                registry.pop(name, None)
            elif original is not None:
                registry[name] = original
