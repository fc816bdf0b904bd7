"""Where transformers keeps a model type's code: its modeling module."""

from __future__ import annotations

import functools
import importlib
import sys

__all__ = ["modeling_module"]


@functools.cache
def modeling_module(model_type: str):
    """transformers' modeling module of a model type: modeling_<type>, or where the type has
    none (EXAONE and InternLM3 run Llama's code), the module of its causal-LM class. None where
    there is neither."""
    import transformers
    from transformers.models.auto.configuration_auto import model_type_to_module_name
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = model_type_to_module_name(model_type)
    try:
        return importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ImportError:
        pass
    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    try:
        cls = getattr(transformers, class_name) if isinstance(class_name, str) else None
    except (AttributeError, ImportError):
        return None
    return sys.modules.get(cls.__module__) if cls is not None else None
