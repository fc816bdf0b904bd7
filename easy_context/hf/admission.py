"""What a model may bring to sequence-parallel attention, checked once per call.

Keywords its attention passes (a softcap, sinks, a window...), the mask functions it composes,
head dims (MLA), dropout and causality: each is implemented, known to change nothing, or
refused with a message naming it.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import weakref

import torch

from easy_context.hf.architectures import check_config_features

__all__ = [
    "logit_options",
    "equal_head_dims",
    "check_call",
    "check_config",
    "check_mask_function",
    "mask_parts",
    "mask_window",
]


# Keywords a model's attention module passes its attention function by name are features of
# the architecture (a softcap, sinks, a window...). Each must be one we implement, or known to
# change nothing here; anything else is refused. This guards the supported types (all pass
# only known keywords) against new releases; it reads the calls to `attention_interface(...)`
# in the class's source, so a feature passed another way (a module attribute, a **dict) is
# not seen, which is why the list of types stays explicit (architectures.py). The rest of
# **kwargs is what the caller passed the model (Trainer's shift_labels, our
# seq_parallel_index...), passed through untouched.
_LOGIT_KWARGS = {"softcap": "softcap", "s_aux": "sinks", "sinks": "sinks"}
# (attention_mask: the mask argument itself, passed by name)
_KNOWN_KWARGS = frozenset(
    {"attention_mask", "scaling", "dropout", "sliding_window", "position_ids", "is_causal", *_LOGIT_KWARGS}
)


@functools.cache
def named_attention_keywords(cls) -> frozenset:
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


# A constant of the class: torch.compile calls it while tracing instead of tracing through
# inspect and ast (which it cannot), and keeps the answer.
@torch.compiler.assume_constant_result
def unknown_attention_keywords(cls) -> tuple:
    """The keywords `cls` passes its attention function that we do not know, sorted."""
    return tuple(sorted(named_attention_keywords(cls) - _KNOWN_KWARGS))


def logit_options(module, kwargs) -> dict:
    """softcap and sinks from the model's keywords; unimplemented features refused (see above)."""
    unknown = list(unknown_attention_keywords(type(module)))
    if unknown:
        raise ValueError(
            f"{type(module).__name__} passes {unknown} to its attention function; sequence parallelism does not "
            "implement what they do, so this model cannot run sequence parallel (report it with the model type)"
        )
    if kwargs.get("is_causal") is False:
        raise ValueError(
            f"{type(module).__name__} asks for non-causal attention, which sequence parallelism does not support"
        )
    return {option: kwargs[name] for name, option in _LOGIT_KWARGS.items() if kwargs.get(name) is not None}


def equal_head_dims(query, key, value):
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


_checked_configs: dict = {}  # id(config) -> weakref to it: configs whose features were checked


def check_config(config) -> None:
    """architectures.check_config_features, once per config object (the mask dispatcher's
    call: a model patched by its type's name shows its config first there)."""
    if config is None:
        return
    ref = _checked_configs.get(id(config))
    if ref is not None and ref() is config:
        return
    check_config_features(config)
    _checked_configs[id(config)] = weakref.ref(config)


def check_call(module, attention_mask, kwargs, sharded_mask_type) -> None:
    if attention_mask is not None and not isinstance(attention_mask, sharded_mask_type):
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


# The pieces of transformers' mask functions that describe what SequenceMask describes:
# causality, padding, packed documents (position_ids) and sliding windows (read from the mask
# function itself: mask_window). A mask built from anything else (bidirectional image tokens,
# block overlays, chunks, a user's function) is refused, never replaced by ours.
_MASK_PARTS_WE_DESCRIBE = frozenset(
    f"transformers.masking_utils.{name}"
    for name in (
        "and_masks",
        "causal_mask_function",
        "padding_mask_function",
        "packed_sequence_mask_function",
        "remap_positions_for_packed_sequence",
        "add_offsets_to_mask_function",
        "sliding_window_overlay",
        "sliding_window_causal_mask_function",
    )
)


def _composed(mask_function):
    """Every function composed into `mask_function`, itself first (and_masks and its kind keep
    their parts in closure cells)."""
    found, pending, seen = [], [mask_function], set()
    while pending:
        item = pending.pop()
        if id(item) in seen:  # a closure may hold itself (a recursive inner function)
            continue
        seen.add(id(item))
        if isinstance(item, (list, tuple)):
            pending.extend(item)
        elif callable(item) and hasattr(item, "__code__"):
            found.append(item)
            for cell in item.__closure__ or ():
                try:
                    pending.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    continue
    return found


def mask_parts(mask_function) -> set:
    """module.function of every mask function composed into `mask_function`."""
    return {f"{item.__module__}.{item.__qualname__.split('.')[0]}" for item in _composed(mask_function)}


_WINDOW_OVERLAY = "sliding_window_overlay"  # masking_utils: key allowed where kv_idx > q_idx - sliding_window


def mask_window(mask_function) -> int | None:
    """The sliding window the model's own mask applies (None: none), read from the window
    overlay transformers composed into the mask function of the layer. This, not the attention
    call's sliding_window argument, is what the unpatched model attends with: PhiMoE windows in
    its mask and passes no argument; OLMoE passes the config's window and masks without it."""
    windows = set()
    for item in _composed(mask_function) if mask_function is not None else ():
        if item.__module__ == "transformers.masking_utils" and item.__qualname__.split(".")[0] == _WINDOW_OVERLAY:
            cells = dict(zip(item.__code__.co_freevars, item.__closure__ or ()))
            windows.add(int(cells["sliding_window"].cell_contents))
    if len(windows) > 1:
        raise ValueError(f"the model's mask applies several sliding windows at once ({sorted(windows)})")
    return windows.pop() if windows else None


def check_mask_function(mask_function) -> None:
    if mask_function is None:
        return
    other = sorted(mask_parts(mask_function) - _MASK_PARTS_WE_DESCRIBE)
    if other:
        raise ValueError(
            f"the model builds its attention mask with {other} (for example bidirectional attention over image "
            "tokens); sequence parallelism supports causal masks with padding, packed documents and sliding windows"
        )
