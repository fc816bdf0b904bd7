"""The position_ids a model's forward was given, for the model types whose attention layers
never see them (model_types.POSITIONS_AT_FORWARD: Granite 4.0-H builds its masks and calls its
layers without them).

Sequence parallelism needs each shard's positions: they say where its tokens sit in the whole
sequence and where packed documents start. For such a type, while the patch is installed, the
forward of its decoder stack (transformers' base model class of the type) records the
position_ids it was called with; the attention and mixer seams read them when the call they
get has none. The latest forward's stay recorded (as mixers.py's do), because activation
checkpointing recomputes layers after the forward has returned.
"""

from __future__ import annotations

import functools
import inspect

__all__ = ["install", "uninstall", "or_latest"]

_saved: dict[type, object] = {}  # base model class -> its own forward
_latest: tuple = (None, None)  # (modeling module name, local position_ids) of the latest forward


def _base_model_class(model_type: str):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    return getattr(transformers, MODEL_MAPPING_NAMES[model_type])


def install(model_types) -> None:
    from easy_context.hf.model_types import POSITIONS_AT_FORWARD

    for model_type in set(model_types) & POSITIONS_AT_FORWARD:
        cls = _base_model_class(model_type)
        if cls not in _saved:
            _saved[cls] = cls.forward
            cls.forward = _recording(cls.forward, cls.__module__)


def uninstall() -> None:
    global _latest
    for cls, forward in _saved.items():
        cls.forward = forward
    _saved.clear()
    _latest = (None, None)


def or_latest(positions, module_name: str):
    """`positions` (a call's own position_ids), or where it is None, those of the latest forward
    of a model whose code is in `module_name` (None: none recorded, or the latest was another
    model's)."""
    if positions is not None:
        return positions
    recorded_by, recorded = _latest
    return recorded if recorded_by == module_name else None


def _recording(forward, module_name: str):
    signature = inspect.signature(forward)

    @functools.wraps(forward)
    def recording_forward(self, *args, **kwargs):
        global _latest
        _latest = (module_name, signature.bind_partial(self, *args, **kwargs).arguments.get("position_ids"))
        return forward(self, *args, **kwargs)

    return recording_forward
