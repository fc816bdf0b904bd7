"""check_masks(model): the mask the unpatched model builds for each kind of attention layer,
compared with the one sequence parallelism will attend with, before any training.

The patch attends with a rule of its own (masking.SequenceMask: causal, documents, padding and
a per-layer window) derived from what the model hands its attention. Released configs set
fields the tests' tiny configs leave unset, and models disagree on where a window lives (in the
mask, in an argument, in both), so the derivation is checked on the user's own config:

  1. a skeleton of the model is built from its config on the meta device (no memory, no
     weights; the user's model, wherever it lives, is not touched);
  2. its forward runs on a few tokens with two probes registered in transformers' registries
     under a name of their own: the mask probe records the mask function transformers composed
     for each layer, the attention probe records the call (its sliding_window argument) and
     stops the layer there, so no layer computes anything;
  3. for each distinct (mask function, argument) pair, the model's mask function is evaluated
     on query rows at a length that crosses every window, and compared with the rule the patch
     derives from the same mask and call (patch.layer_window).

Mask level only, well under a second for an 8B config; what it does not cover is the mask
a model builds outside transformers' mask functions (refused by admission at the first call).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from unittest import mock

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from easy_context.core.masking import SequenceMask
from easy_context.hf import admission, architectures
from easy_context.hf.model_types import MASKS_NOT_PROBED

__all__ = ["MaskDisagreement", "LayerMask", "check_masks", "compare", "layer_masks", "rows"]

_PROBE = "easy_context_mask_probe"
_TOKENS = 2  # the skeleton's forward: enough for the model to build its masks


class MaskDisagreement(ValueError):
    """The patch would attend with another mask than the model's own."""


@dataclass(frozen=True)
class LayerMask:
    """What one attention layer of the skeleton was handed: the mask function transformers
    composed for it (None: the model built no mask) and its call's sliding_window argument."""

    layer: str
    mask_function: object
    sliding_window: int | None
    module: torch.nn.Module  # the skeleton's attention module (on the meta device)


class _Recorder:
    def __init__(self):
        self.masks: list = []  # mask functions, in the order the model built them
        self.calls: list[LayerMask] = []

    def mask(self, *args, **kwargs):
        self.masks.append(kwargs.get("mask_function"))
        return _MaskToken(len(self.masks) - 1)

    def attention(self, module, query, key, value, attention_mask, **kwargs):
        mask_function = self.masks[attention_mask.index] if isinstance(attention_mask, _MaskToken) else None
        self.calls.append(LayerMask(_layer_name(module), mask_function, kwargs.get("sliding_window"), module))
        batch, heads, length, _ = query.shape
        return query.new_zeros(batch, length, heads, value.shape[-1]), None


@dataclass(frozen=True)
class _MaskToken:
    index: int


def _layer_name(module) -> str:
    index = getattr(module, "layer_idx", None)
    return type(module).__name__ + ("" if index is None else f"[{index}]")


@contextlib.contextmanager
def _probes(recorder: _Recorder):
    AttentionInterface.register(_PROBE, recorder.attention)
    AttentionMaskInterface.register(_PROBE, recorder.mask)
    try:
        yield
    finally:  # the registries have no public removal
        AttentionInterface._global_mapping.pop(_PROBE, None)
        AttentionMaskInterface._global_mapping.pop(_PROBE, None)


@contextlib.contextmanager
def _one_document_on_meta():
    """transformers looks for packed documents in the position_ids by reading their values, which
    a meta tensor has none of; the skeleton's positions are 0..n-1, one document, for which the
    answer is None. Replaced for the probe only, since meta tensors are what keep it free."""
    from transformers import masking_utils

    with mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda position_ids: None):
        yield


def _skeleton(config):
    """The base model of `config` on the meta device (bf16: the meta kernels of grouped matmuls
    take no other), attending and masking with the probes."""
    from transformers import AutoModel

    config = config.__class__.from_dict(config.to_dict())
    with torch.device("meta"):
        model = AutoModel.from_config(
            config, attn_implementation=_PROBE, experts_implementation="batched_mm", dtype=torch.bfloat16
        )
    model.warn_if_padding_and_no_attention_mask = lambda *args: None  # it reads the input_ids' values
    return model


def layer_masks(model_or_config) -> list[LayerMask]:
    """What every attention layer of the model is handed, from a skeleton's forward (see the
    module docstring)."""
    config = architectures.text_config_of(model_or_config)
    recorder = _Recorder()
    with _probes(recorder), _one_document_on_meta(), torch.no_grad():
        skeleton = _skeleton(config)
        for layer in _decoder_layers(skeleton):
            layer.forward = _masks_only(layer.forward, recorder)
        skeleton(input_ids=torch.zeros(1, _TOKENS, dtype=torch.long, device="meta"), use_cache=False)
    return recorder.calls


def _decoder_layers(model) -> list:
    """The model's decoder layers: transformers builds each on GradientCheckpointingLayer."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]


def _masks_only(forward, recorder: _Recorder):
    """A decoder layer's forward that gives up once its attention call is recorded: some layers
    read values after it (MoE routing: nonzero, item), which a meta tensor has none of, and
    nothing after the call concerns masks. Decoder layers return their hidden states."""

    def run(*args, **kwargs):
        seen = len(recorder.calls)
        try:
            return forward(*args, **kwargs)
        except Exception:
            if len(recorder.calls) == seen:
                raise
            return args[0] if args else kwargs["hidden_states"]

    return run


def check_masks(model_or_config) -> list[LayerMask]:
    """Raise MaskDisagreement where sequence parallelism would attend with another mask than the
    model's own, for each distinct layer mask of the model (or config); returns them. The masks
    are compared on the query rows where a window or the causal edge can differ (see `rows`)."""
    model_type = architectures.text_config_of(model_or_config).model_type
    if model_type in MASKS_NOT_PROBED:
        why = MASKS_NOT_PROBED[model_type]
        warnings.warn(f"check_masks: {model_type}'s masks are not probed ({why})", stacklevel=2)
        return []
    return compare(layer_masks(model_or_config))


def compare(layers: list[LayerMask], window_of=None) -> list[LayerMask]:
    """check_masks on layers already probed; `window_of(layer_mask)` is the window the patch
    attends with (default: patch.layer_window's rule). Returns the distinct layer masks."""
    window_of = window_of or _patch_window
    distinct = {}
    for call in layers:
        distinct.setdefault((id(call.mask_function), call.sliding_window), call)
    windows = {admission.mask_window(c.mask_function) for c in distinct.values()}
    windows |= {c.sliding_window for c in distinct.values()}
    windows = sorted(w for w in windows if w)
    length = 2 * max(windows, default=1) + 2
    queries = rows(windows, length)
    for call in distinct.values():
        _compare(call, window_of(call), length, queries)
    return list(distinct.values())


def rows(windows, length: int) -> torch.Tensor:
    """The query rows where masks of these windows can differ: the first ones, each side of
    every window's edge (a query w - 1 is the last to see key 0), twice each window, the last."""
    picked = {0, 1, 2, length - 1}
    for window in windows:
        for edge in (window, 2 * window):
            picked |= {edge - 2, edge - 1, edge, edge + 1}
    return torch.tensor(sorted(q for q in picked if 0 <= q < length))


def _patch_window(call: LayerMask) -> int | None:
    from easy_context.hf import patch

    sharded = patch.ShardedMask(None, admission.mask_window(call.mask_function)) if call.mask_function else None
    return patch.layer_window(call.module, sharded, {"sliding_window": call.sliding_window})


def _compare(call: LayerMask, window, length: int, queries: torch.Tensor) -> None:
    ours = SequenceMask.from_positions(torch.arange(length)[None]).with_window(window).dense(queries)
    theirs = _evaluate(call.mask_function, length, queries)
    if torch.equal(ours, theirs):
        return
    row, key = (int(x) for x in torch.nonzero(ours != theirs)[0])
    raise MaskDisagreement(
        f"{call.layer}: the model's own mask and sequence parallelism's differ at query {int(queries[row])}, "
        f"key {key} (length {length}): the model's mask applies {_describe(call.mask_function)} and its "
        f"attention is passed sliding_window={call.sliding_window}; sequence parallelism would attend causally "
        f"{'without a window' if window is None else f'in a window of {window}'}, which "
        f"{'allows' if ours[row, key] else 'masks'} that pair"
    )


def _describe(mask_function) -> str:
    if mask_function is None:
        return "nothing (it builds no mask)"
    window = admission.mask_window(mask_function)
    return "no window" if window is None else f"a window of {window}"


def _evaluate(mask_function, length: int, queries: torch.Tensor) -> torch.Tensor:
    """(queries, length) bool: the model's mask function on those rows (None: the model built no
    mask, so its attention is causal)."""
    q, k = queries[:, None], torch.arange(length)[None, :]
    if mask_function is None:
        return k <= q
    zero = torch.zeros((), dtype=torch.long)
    return torch.as_tensor(mask_function(zero, zero, q, k)).expand(len(queries), length)
