"""The one integration point with Hugging Face transformers (5.x attention registry).

We replace the `sdpa`, `eager` and `flash_attention_2` entries of transformers' attention
registry and of its mask registry with dispatchers. For a model type that was patched they
run the active mode's sequence-parallel attention; for every other model they call the
original function, so the patch is scoped to the model types named by the user. Models are
found at call time through the registry, so models created before or after the patch are
both covered, and nothing of the model code is forked.

The mask dispatcher exists because transformers builds masks over the *local* shard: it
would read the zigzag position jump as a packed-sequence boundary, and a padding mask
over one shard says nothing about the others. It returns a `ShardedMask` instead: the
local padding mask of this forward. At the first attention call of the forward, every
rank of the SP group all-gathers its local position_ids and padding (S small integers,
once per forward) and the result becomes one `masking.SequenceMask` over the whole
sequence: documents (position_ids restarting), padding and, per layer, the sliding
window. Every rank derives it from the same gathered data, so every check on it fails
on all ranks alike and no rank is left waiting in a collective. The same first call
checks now and then that the SP group's weights are still identical (replicas.py).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import math
import sys
import textwrap
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .architectures import SUPPORTED_MODEL_TYPES
from .layout import Layout
from .masking import SequenceMask
from .modes import SeqParallelMode
from .process_groups import SeqParallelGroups, get_groups
from .replicas import check_replicas

__all__ = ["SUPPORTED_MODEL_TYPES", "ActivePatch", "ShardedMask", "install", "uninstall", "active_patch", "world_size"]

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
    document_split: Optional[bool] = None  # a layout per packed row; the model gets seq_parallel_index

    def groups(self) -> SeqParallelGroups:
        """This rank's process groups; created at the first call, then cached."""
        return get_groups(self.mode.topology(world_size(), self.sp_size, self.ring_degree))


_active: Optional[ActivePatch] = None
_saved: dict = {}  # (registry mapping id, name) -> original function or _MISSING


def active_patch() -> Optional[ActivePatch]:
    return _active


def _is_patched(config) -> bool:
    return _active is not None and getattr(config, "model_type", None) in _active.model_types


# ------------------------------------------------------------------------ masks
class ShardedMask:
    """What the mask dispatcher hands the attention for one forward: the local 2D padding
    mask (or None), resolved into a SequenceMask over the whole sequence at first use."""

    def __init__(self, padding: Optional[torch.Tensor]):
        self.padding = padding
        self._resolved: Optional[SequenceMask] = None

    def resolve(self, module, position_ids, groups: SeqParallelGroups, layout: Layout, token_index=None) -> SequenceMask:
        """Called by every attention layer; the first call of a forward does the work."""
        if self._resolved is None:
            self._resolved = _global_mask(position_ids, self.padding, groups, layout, token_index)
            check_replicas(module, groups.sp, groups.sp_rank, position_ids.device)
        return self._resolved


def _global_mask(position_ids, padding, groups: SeqParallelGroups, layout: Layout, token_index) -> SequenceMask:
    if position_ids is None:
        raise ValueError("the model passed no position_ids to its attention; sequence parallelism needs them "
                         "(pass local_position_ids from prepare_seq_parallel_inputs)")
    batch = position_ids.shape[0] if padding is None else padding.shape[0]
    rows = [
        position_ids.expand(batch, -1).long(),
        torch.ones_like(position_ids.expand(batch, -1), dtype=torch.long) if padding is None else padding.long(),
    ]
    if token_index is not None:
        rows.append(token_index.to(position_ids.device).expand(batch, -1).long())
    local = torch.stack(rows).contiguous()
    size, rank = groups.topology.sp_size, groups.sp_rank
    pieces = [local]
    if groups.sp is not None:  # on the data's device: NCCL takes only CUDA tensors
        pieces = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(pieces, local, group=groups.sp)
    if token_index is None:
        whole = layout.unshard(pieces, dim=2).cpu()  # the one host copy per forward: plans are built on the host
        _check_positions(pieces, size, rank, layout)
        ring_index = None
    else:
        whole, ring_index = _unshard_by_index([piece.cpu() for piece in pieces], layout)
    positions, valid = whole[0], whole[1]
    _check_padding(valid)
    return SequenceMask.from_positions(positions, None if bool(valid.all()) else valid.bool(), ring_index)


def _unshard_by_index(pieces, layout: Layout):
    """document_split: each rank's rows sit at the global positions its third row names.
    Returns the whole (positions, padding) and, per ring rank, the positions of its rows
    (the Ulysses pieces of a ring share, concatenated in order, as the all-to-all does)."""
    index = torch.cat([piece[2] for piece in pieces], dim=1)
    batch, seq = index.shape
    if not bool((torch.sort(index, dim=1).values == torch.arange(seq)).all()):
        raise ValueError("seq_parallel_index of the sequence-parallel group is not a permutation of the row's positions: "
                         "pass local_token_index from prepare_seq_parallel_inputs (same batch, same options)")
    whole = torch.empty(2, batch, seq, dtype=torch.long)
    whole.scatter_(2, index.expand(2, -1, -1), torch.cat([piece[:2] for piece in pieces], dim=2))
    u = layout.ulysses_degree
    ring_index = [torch.cat([pieces[r * u + i][2] for i in range(u)], dim=1) for r in range(layout.ring_degree)]
    return whole, ring_index


def _check_positions(pieces, size: int, rank: int, layout: Layout) -> None:
    """Positions left to the model's default (arange over each local shard) give wrong RoPE
    on every rank but the first, and would read as documents cut at shard boundaries."""
    local_len = pieces[0].shape[-1]
    if size == 1 or local_len == 1:  # one token per rank: real positions can look like the default
        return
    arange = torch.arange(local_len, device=pieces[0].device)
    if all(bool((piece[0] == arange).all()) for piece in pieces):
        raise ValueError(
            f"position_ids on rank {rank} of {size} are the model's default (0..{local_len - 1} on every rank), "
            f"not this rank's {layout.name} share of the sequence. Pass the `local_position_ids` returned "
            "by prepare_seq_parallel_inputs (to generate, use easy_context.generate, not model.generate)."
        )


def _check_padding(valid: torch.Tensor) -> None:
    """Padding = zeros at the start and/or end of a row; zeros inside a row are refused."""
    if not bool(((valid == 0) | (valid == 1)).all()):
        raise ValueError("attention_mask must hold 0 (padding) and 1 (token) only")
    ones = valid.bool()
    inside = ones.long().cummax(dim=1).values.bool() & ones.flip(1).long().cummax(dim=1).values.flip(1).bool()
    holes = inside & ~ones
    if bool(holes.any()):
        row, col = (int(i) for i in torch.nonzero(holes)[0])
        raise ValueError(
            f"attention_mask row {row} has a 0 at position {col} between tokens: only padding (zeros at the "
            "start and/or end of a row) is supported under sequence parallelism; pack documents with "
            "position_ids restarting at 0 instead of masking inside a row"
        )


# Keywords a model's attention module passes its attention function by name are features of
# the architecture (a softcap, sinks, a window...). Each must be one we implement, or known to
# change nothing here; anything else is refused. This guards the supported types (all 18 pass
# only known keywords) against new releases; it reads the calls to `attention_interface(...)`
# in the class's source, so a feature passed another way (a module attribute, a **dict) is
# not seen, which is why the list of types stays explicit (architectures.py). The rest of
# **kwargs is what the caller passed the model (Trainer's shift_labels, our
# seq_parallel_index...), passed through untouched.
_LOGIT_KWARGS = {"softcap": "softcap", "s_aux": "sinks", "sinks": "sinks"}
_KNOWN_KWARGS = frozenset({"scaling", "dropout", "sliding_window", "position_ids", "is_causal", *_LOGIT_KWARGS})


@functools.lru_cache(maxsize=None)
def _named_attention_keywords(cls) -> frozenset:
    """The keywords `cls.forward` passes by name to `attention_interface(...)` (transformers'
    name for the registry function in every model); empty when the source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "attention_interface":
            names |= {keyword.arg for keyword in node.keywords if keyword.arg}
    return frozenset(names)


def _logit_options(module, kwargs) -> dict:
    """softcap and sinks from the model's keywords; unimplemented features refused (see above)."""
    unknown = sorted(_named_attention_keywords(type(module)) - _KNOWN_KWARGS)
    if unknown:
        raise ValueError(
            f"{type(module).__name__} passes {unknown} to its attention function; sequence parallelism does not "
            "implement what they do, so this model cannot run sequence parallel (report it with the model type)"
        )
    if kwargs.get("is_causal") is False:
        raise ValueError(f"{type(module).__name__} asks for non-causal attention, which sequence parallelism does not support")
    return {option: kwargs[name] for name, option in _LOGIT_KWARGS.items() if kwargs.get(name) is not None}


def _equal_head_dims(query, key, value):
    """(q, k, v, value head dim or None) with one head dim for all three: torch's fused kernels
    refuse others. MLA (DeepSeek-V3) has values narrower than queries/keys: v gets zero
    columns, whose outputs are zero and sliced off afterwards. Wider values: q and k get zero
    columns, which change no logit (the scale is the model's, not recomputed). Exact either
    way; the cost is the padded columns' compute and K/V traffic."""
    d_qk, d_v = query.shape[-1], value.shape[-1]
    if d_qk == d_v:
        return query, key, value, None
    if d_v < d_qk:
        return query, key, torch.nn.functional.pad(value, (0, d_qk - d_v)), d_v
    pad = (0, d_v - d_qk)
    return torch.nn.functional.pad(query, pad), torch.nn.functional.pad(key, pad), value, d_v


def _check_supported(module, attention_mask, kwargs) -> None:
    if attention_mask is not None and not isinstance(attention_mask, ShardedMask):
        raise ValueError(
            "an explicit attention mask (4D or custom) is not supported under sequence parallelism; pass a 2D "
            "padding attention_mask (local_attention_mask from prepare_seq_parallel_inputs), packed position_ids, "
            "or neither"
        )
    if not getattr(module, "is_causal", True):
        raise ValueError("non-causal attention is not supported under sequence parallelism yet")
    dropout = kwargs.get("dropout") or 0.0
    if dropout > 0:
        raise ValueError(
            f"attention dropout {dropout} is not supported under sequence parallelism; "
            "set config.attention_dropout=0.0 (or call model.eval())"
        )


# ------------------------------------------------------------------ dispatchers
def _sequence_parallel_attention(module, query, key, value, attention_mask, **kwargs):
    _check_supported(module, attention_mask, kwargs)
    if _decoding_cache is not None:
        window = kwargs.get("sliding_window")

        def attend(q, k, v, scale, **options):
            return _decoding_cache.attend(q, k, v, scale, module.layer_idx, window=window, **options)
    else:
        attend = _mode_attention(module, query, key, attention_mask, kwargs)
    scale = kwargs.get("scaling") or 1.0 / math.sqrt(query.shape[-1])
    options = _logit_options(module, kwargs)
    query, key, value, value_dim = _equal_head_dims(query, key, value)
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        # RoPE returns fp32 q/k under autocast while v comes out of a bf16 matmul: run the
        # attention in the autocast dtype, as SDPA would, with autocast off inside our kernels
        # (their fp32 accumulation must stay fp32).
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = (x.to(dtype) for x in (query, key, value))
        with torch.autocast(device_type, enabled=False):
            out = attend(query, key, value, scale, **options)
    else:
        if not query.dtype == key.dtype == value.dtype:
            raise ValueError(f"query/key/value dtypes differ ({query.dtype}, {key.dtype}, {value.dtype}) outside autocast")
        out = attend(query, key, value, scale, **options)
    if value_dim is not None:
        out = out[..., :value_dim]
    return out.transpose(1, 2), None  # HF expects (B, S, H, D) and no attention weights


def _mode_attention(module, query, key, attention_mask, kwargs):
    """The active mode's attention over the SP group's shards, with this forward's mask."""
    if query.shape[2] != key.shape[2]:
        raise ValueError(
            f"query length {query.shape[2]} != key length {key.shape[2]}: a KV cache (generation) "
            "outside easy_context.generate is not supported under sequence parallelism; call the model with "
            "use_cache=False, or generate with easy_context.generate(mode, model, input_ids, ...)"
        )
    groups = _active.groups()
    layout = _active.mode.layout(groups.topology)
    sharded = attention_mask if attention_mask is not None else ShardedMask(None)
    token_index = kwargs.get("seq_parallel_index")
    if _active.document_split and token_index is None:
        raise ValueError("the patch has document_split=True: call the model with "
                         "seq_parallel_index=local['local_token_index'] from prepare_seq_parallel_inputs")
    if token_index is not None and not _active.document_split:
        raise ValueError("seq_parallel_index was passed but the patch has no document_split=True")
    mask = sharded.resolve(module, kwargs.get("position_ids"), groups, layout, token_index).with_window(kwargs.get("sliding_window"))

    def attend(q, k, v, scale, **options):
        return _active.mode.attention(q, k, v, scale, groups, layer=module, mask=mask, **options)

    return attend


# While generation.generate decodes, its ShardedKVCache: a layer's call is then one decoding
# step's queries, the same on every rank, against this rank's K/V shard.
_decoding_cache = None


@contextlib.contextmanager
def decoding_with(cache):
    global _decoding_cache
    previous, _decoding_cache = _decoding_cache, cache
    try:
        yield cache
    finally:
        _decoding_cache = previous


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


# The pieces of transformers' mask functions that describe what SequenceMask describes:
# causality, padding, packed documents (position_ids) and sliding windows (which reach the
# attention as its sliding_window argument). A mask built from anything else (bidirectional
# image tokens, block overlays, chunks, a user's function) is refused, never replaced by ours.
_MASK_PARTS_WE_DESCRIBE = frozenset(f"transformers.masking_utils.{name}" for name in (
    "and_masks", "causal_mask_function", "padding_mask_function", "packed_sequence_mask_function",
    "remap_positions_for_packed_sequence", "add_offsets_to_mask_function", "sliding_window_overlay",
    "sliding_window_causal_mask_function",
))


def _mask_parts(mask_function) -> set:
    """module.function of every mask function composed into `mask_function` (and_masks and its
    kind keep their parts in closure cells)."""
    parts, pending, seen = set(), [mask_function], set()
    while pending:
        item = pending.pop()
        if id(item) in seen:  # a closure may hold itself (a recursive inner function)
            continue
        seen.add(id(item))
        if isinstance(item, (list, tuple)):
            pending.extend(item)
        elif callable(item) and hasattr(item, "__code__"):
            parts.add(f"{item.__module__}.{item.__qualname__.split('.')[0]}")
            for cell in item.__closure__ or ():
                try:
                    pending.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    continue
    return parts


def _check_mask_function(mask_function) -> None:
    if mask_function is None:
        return
    other = sorted(_mask_parts(mask_function) - _MASK_PARTS_WE_DESCRIBE)
    if other:
        raise ValueError(
            f"the model builds its attention mask with {other} (for example bidirectional attention over image "
            "tokens); sequence parallelism supports causal masks with padding, packed documents and sliding windows"
        )


def _make_mask_dispatcher(name, original):
    def mask(*args, **kwargs):
        if not _is_patched(kwargs.get("config")):
            return original(*args, **kwargs)
        if name not in SUPPORTED_IMPLEMENTATIONS:
            _refuse_implementation(name)
        _check_mask_function(kwargs.get("mask_function"))
        # Resolved at the first attention call, where the position_ids are known.
        return ShardedMask(kwargs.get("attention_mask"))

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
