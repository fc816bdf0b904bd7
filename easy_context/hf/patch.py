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

A layer's window is the one the model's own mask applies (read from the mask function
transformers composed for it), never the attention call's sliding_window argument: the two
disagree in released models (PhiMoE windows in its mask only, OLMoE passes a window its mask
does not apply), and the mask is what the unpatched model attends with.

Under torch.compile the dispatcher calls the mode through one custom operator (compiled.py).
"""

from __future__ import annotations

import math
import sys
import warnings

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from easy_context.core.global_mask import gather_sequence_mask
from easy_context.core.groups import SeqParallelGroups
from easy_context.core.layout import Layout
from easy_context.core.masking import SequenceMask
from easy_context.hf import admission, compiled, forward_positions, mixers, rope
from easy_context.hf.replicas import check_replicas

__all__ = ["SUPPORTED_IMPLEMENTATIONS", "ShardedMask", "install", "uninstall", "active", "layer_window"]

# Implementations a patched model may use (each becomes sequence parallel). Every other name
# in the registries is dispatched too, so a patched model on, say, flex_attention is refused
# instead of silently attending within its shard only.
SUPPORTED_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")
_MISSING = object()


# The installed sequence-parallel context (hf/context.py's SequenceParallel): the registries are
# process-wide, so one context is live at a time; the dispatchers read it at call time.
_installed = None
_saved: dict = {}  # (registry mapping id, name) -> original function or _MISSING


def active():
    return _installed


def _is_patched(config) -> bool:
    return _installed is not None and getattr(config, "model_type", None) in _installed.model_types


# ------------------------------------------------------------------------ masks
class ShardedMask:
    """What the mask dispatcher hands the attention for one forward: the local 2D padding
    mask (or None), resolved into a SequenceMask over the whole sequence at first use, and the
    sliding window the model's mask applies to the layers it is built for (None: none)."""

    def __init__(self, padding: torch.Tensor | None, window: int | None = None):
        self.padding = padding
        self.window = window
        self._resolved: SequenceMask | None = None
        self._started = False

    def starts_forward(self) -> bool:
        """True at the first call of this forward's attention (the compiled path: decided while
        tracing, the same on every rank; the call that gathers the mask)."""
        first, self._started = not self._started, True
        return first

    def resolve(
        self, module, position_ids, groups: SeqParallelGroups, layout: Layout, token_index=None
    ) -> SequenceMask:
        """Called by every attention layer; the first call of a forward does the work."""
        if self._resolved is None:
            self._resolved = gather_sequence_mask(position_ids, self.padding, groups, layout, token_index)
            check_replicas(module, groups.sp, groups.sp_rank, position_ids.device)
        return self._resolved


# ------------------------------------------------------------------ dispatchers
def _sequence_parallel_attention(module, query, key, value, attention_mask, **kwargs):
    admission.check_call(module, attention_mask, kwargs, ShardedMask)
    cache = _installed.decoding
    if cache is None and torch.compiler.is_compiling():
        attend = _compiled_attention(module, query, key, attention_mask, kwargs)
    elif cache is not None:
        window = layer_window(module, attention_mask, kwargs)
        layer_idx = module.layer_idx
        if layer_idx is None or layer_idx < 0:  # a block shared by several layers (Zamba2): the index its update used
            layer_idx = cache.updated_layer

        def attend(q, k, v, scale, **options):
            return cache.attend(q, k, v, scale, layer_idx, window=window, **options)
    else:
        attend = _mode_attention(module, query, key, attention_mask, kwargs)
    scale = kwargs.get("scaling") or 1.0 / math.sqrt(query.shape[-1])
    options = admission.logit_options(module, kwargs)
    query, key, value, value_dim = admission.equal_head_dims(query, key, value)
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
            raise ValueError(
                f"query/key/value dtypes differ ({query.dtype}, {key.dtype}, {value.dtype}) outside autocast"
            )
        out = attend(query, key, value, scale, **options)
    if value_dim is not None:
        out = out[..., :value_dim]
    return out.transpose(1, 2), None  # HF expects (B, S, H, D) and no attention weights


def layer_window(module, attention_mask, kwargs) -> int | None:
    """The sliding window a layer attends with: the one its mask from the model applies (see the
    module docstring). Only where the model built no mask for the call is it the argument."""
    argument = kwargs.get("sliding_window")
    if not isinstance(attention_mask, ShardedMask):
        return argument
    if argument is not None and argument != attention_mask.window:
        _tell_disagreement(type(module).__name__, attention_mask.window, argument)
    return attention_mask.window


_told: set = set()


@torch.compiler.disable(reason="a warning, once per attention class")
def _tell_disagreement(name: str, window, argument) -> None:
    if (name, window, argument) in _told:
        return
    _told.add((name, window, argument))
    warnings.warn(
        f"{name} passes sliding_window={argument} to its attention but the model's own mask applies "
        f"{'no window' if window is None else f'a window of {window}'}; the mask is what transformers' sdpa and "
        "eager attention apply, so sequence parallelism attends with it (flash_attention_2 in one process would "
        "apply the argument instead)",
        stacklevel=3,
    )


def _check_mode_call(query, key, kwargs):
    """What a forward of the active mode needs: no KV cache, and the token index exactly when
    the patch splits documents. Returns the token index (None without document_split)."""
    if query.shape[2] != key.shape[2]:
        raise ValueError(
            f"query length {query.shape[2]} != key length {key.shape[2]}: a KV cache (generation) "
            "outside easy_context.generate is not supported under sequence parallelism; call the model with "
            "use_cache=False, or generate with easy_context.generate(mode, model, input_ids, ...)"
        )
    token_index = kwargs.get("seq_parallel_index")
    if _installed.document_split and token_index is None:
        raise ValueError(
            f"the patch has document_split={_installed.document_split!r}: call the model with "
            "seq_parallel_index=local['local_token_index'] from prepare_seq_parallel_inputs"
        )
    if token_index is not None and not _installed.document_split:
        raise ValueError("seq_parallel_index was passed but the patch has no document_split (True or 'workload')")
    return token_index


def _mode_attention(module, query, key, attention_mask, kwargs):
    """The active mode's attention over the SP group's shards, with this forward's mask."""
    token_index = _check_mode_call(query, key, kwargs)
    context = _installed
    groups = context.groups()
    layout = context.mode.layout(groups.topology)
    sharded = attention_mask if attention_mask is not None else ShardedMask(None)
    positions = forward_positions.or_latest(kwargs.get("position_ids"), type(module).__module__)
    mask = sharded.resolve(module, positions, groups, layout, token_index).with_window(
        layer_window(module, attention_mask, kwargs)
    )

    def attend(q, k, v, scale, **options):
        return context.mode.attention(q, k, v, scale, groups, layer=module, mask=mask, **options)

    return attend


def _compiled_attention(module, query, key, attention_mask, kwargs):
    """_mode_attention under torch.compile: the mode's attention through the custom operator
    (compiled.py), which gathers the mask at the forward's first call."""
    token_index = _check_mode_call(query, key, kwargs)
    sharded = attention_mask if attention_mask is not None else ShardedMask(None)
    first = sharded.starts_forward()

    def attend(q, k, v, scale, **options):
        return compiled.attention(
            q,
            k,
            v,
            scale,
            options,
            position_ids=forward_positions.or_latest(kwargs.get("position_ids"), type(module).__module__),
            padding=sharded.padding,
            token_index=token_index,
            window=layer_window(module, attention_mask, kwargs),
            first=first,
            layer=module,
        )

    return attend


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


def _check_mask_call(mask_function, config) -> int | None:
    """What a forward's mask builder shows us: the mask function transformers composed (checked,
    and its window returned), and the config (a model patched by its type's name is seen whole
    here first)."""
    admission.check_mask_function(mask_function)
    admission.check_config(config)
    return admission.mask_window(mask_function)


# The check reads the closures of the mask function transformers composed for this forward,
# which Dynamo cannot trace: under torch.compile it runs outside the graph (one graph break
# per forward, before the decoder layers).
_check_mask_call_outside_graph = torch.compiler.disable(
    _check_mask_call, reason="reads the closures of the forward's mask function"
)


def _make_mask_dispatcher(name, original):
    def mask(*args, **kwargs):
        if not _is_patched(kwargs.get("config")):
            return original(*args, **kwargs)
        if name not in SUPPORTED_IMPLEMENTATIONS:
            _refuse_implementation(name)
        check = _check_mask_call_outside_graph if torch.compiler.is_compiling() else _check_mask_call
        window = check(kwargs.get("mask_function"), kwargs.get("config"))
        # Resolved at the first attention call, where the position_ids are known.
        return ShardedMask(kwargs.get("attention_mask"), window)

    mask.__name__ = f"easy_context_{name}_mask"
    return mask


# --------------------------------------------------------------- install/undo
def install(context) -> None:
    """Make `context` (a SequenceParallel) the one the dispatchers run."""
    global _installed
    _installed = context
    compiled.register(active)
    rope.install(context.model_types, active)
    mixers.install(context.model_types, active)
    forward_positions.install(context.model_types)
    if _saved:  # dispatchers already in place; they read `_installed` at call time
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
    global _installed
    _installed = None
    rope.uninstall()
    mixers.uninstall()
    forward_positions.uninstall()
    for registry in (AttentionInterface._global_mapping, AttentionMaskInterface._global_mapping):
        for name in list(registry):
            original = _saved.pop((id(registry), name), None)
            if original is _MISSING:
                registry.pop(name, None)
            elif original is not None:
                registry[name] = original
