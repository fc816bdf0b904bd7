"""RoPE whose frequencies depend on the sequence length, exact under sequence parallelism.

transformers' `dynamic_rope_update` (modeling_rope_utils) makes the `dynamic` (dynamic NTK) and
`longrope` (Phi-3's 128K recipe) types pick their frequencies from `max(position_ids) + 1` of
the input the rotary module sees, and `dynamic` keeps state from call to call (it grows with
the longest length seen, and resets below the original context). Under sequence parallelism a
rank sees its shard only, so a rank whose shard ends early would rotate with other frequencies
than the one-process model: no error, silently wrong logits.

So, for the model types the patch runs, the rotary classes' forward is replaced while the patch
is installed. For a length-dependent type it first runs transformers' own update (the decorated
forward, called on a one-element position tensor) with the length the one-process model would
see, then the rotary's own computation (the function the decorator wraps) on the local
positions. The length is the SP group's: one all-reduce (MAX) of the local maximum position
per forward, on the device, with no host sync of ours (transformers' update syncs as it does in
one process). Generation's prefill, which runs S - 1 of the prompt's S tokens, names the
prompt's length instead (`SequenceParallel.prefilling`); decoding steps hold the same positions
on every rank and pass through.

Rope types we have proven exact in every mode are architectures.PROVEN_ROPE_TYPES; a config with
any other type is refused rather than run.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.distributed as dist

from easy_context.hf.architectures import PROVEN_ROPE_TYPES
from easy_context.hf.modeling import modeling_module

__all__ = ["LENGTH_DEPENDENT", "length_dependent", "rotary_classes", "install", "uninstall"]


def length_dependent(rope_type: str) -> bool:
    """Whether transformers recomputes this type's frequencies from the input's length (the
    test `dynamic_rope_update` applies)."""
    return "dynamic" in rope_type or rope_type == "longrope"


LENGTH_DEPENDENT = frozenset(t for t in PROVEN_ROPE_TYPES if length_dependent(t))


# ----------------------------------------------------------------- the rotary classes
_originals: dict[type, object] = {}  # rotary class -> its own (decorated) forward
_active = None  # callable returning the installed SequenceParallel (set by install)


@functools.cache
def _update_wrapper_code():
    """The code object of the function dynamic_rope_update returns (the same for every forward
    it wraps; functools.wraps gives each the wrapped forward's names)."""
    from transformers.modeling_rope_utils import dynamic_rope_update

    return dynamic_rope_update(lambda self, x, position_ids: None).__code__


def _is_length_updated(function) -> bool:
    """A forward wrapped by transformers' dynamic_rope_update."""
    return getattr(function, "__code__", None) is _update_wrapper_code() and hasattr(function, "__wrapped__")


def rotary_classes(model_type: str) -> list[type]:
    """The classes of the model type's modeling module whose forward dynamic_rope_update wraps."""
    module = modeling_module(model_type)
    found = []
    for value in vars(module).values() if module is not None else ():
        if isinstance(value, type) and issubclass(value, torch.nn.Module):
            for klass in value.__mro__:
                if _is_length_updated(klass.__dict__.get("forward")) or klass in _originals:
                    found.append(klass)
    return found


def install(model_types, active) -> None:
    """Replace the forward of the rotary classes of `model_types` (idempotent)."""
    global _active
    _active = active
    for model_type in model_types:
        for klass in rotary_classes(model_type):
            if klass not in _originals:
                _originals[klass] = klass.__dict__["forward"]
                klass.forward = _group_length_forward(_originals[klass])


def uninstall() -> None:
    for klass, forward in _originals.items():
        klass.forward = forward
    _originals.clear()


def _group_length_forward(decorated):
    def forward(self, x, position_ids, *args, **kwargs):
        context = _active() if _active is not None else None
        if context is None or context.decoding is not None or not _length_dependent_call(self, *args, **kwargs):
            return decorated(self, x, position_ids, *args, **kwargs)
        group = context.groups().sp
        last = context.prefill_last_position
        if last is None and group is None:
            return decorated(self, x, position_ids, *args, **kwargs)
        if last is None:
            last = _group_max_once(position_ids, group)
        decorated(self, x, last.reshape(1, 1).to(position_ids.device), *args, **kwargs)  # the update only
        return decorated.__wrapped__(self, x, position_ids, *args, **kwargs)

    forward.__wrapped__ = decorated
    forward.__doc__ = decorated.__doc__
    return forward


def _length_dependent_call(module, *args, **kwargs) -> bool:
    layer_type = kwargs.get("layer_type", args[0] if args else None)
    rope_type = module.rope_type if layer_type is None else module.rope_type[layer_type]
    return length_dependent(rope_type)


_last_max: tuple = (None, -1, None)  # (weakref to position_ids, its version, the group's max)


def _group_max_once(position_ids: torch.Tensor, group) -> torch.Tensor:
    """_group_max, once per forward: a model with one rotary call per layer type (Gemma 3)
    passes each the same position_ids."""
    global _last_max
    ref, version, value = _last_max
    if ref is not None and ref() is position_ids and version == position_ids._version:
        return value
    value = _group_max(position_ids, group)
    _last_max = (weakref.ref(position_ids), position_ids._version, value)
    return value


# Dynamo cannot trace a collective that feeds a Python decision; the update it feeds is
# transformers' own, which breaks the graph there in one process too.
@torch.compiler.disable
def _group_max(position_ids: torch.Tensor, group) -> torch.Tensor:
    """The largest position over the SP group: what max(position_ids) is in one process."""
    local = position_ids.max().reshape(1).to(torch.int64)
    dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    return local
