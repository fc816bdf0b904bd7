"""Where transformers keeps a model type's code: its modeling module."""

from __future__ import annotations

import functools
import importlib

__all__ = ["modeling_module"]


@functools.cache
def modeling_module(model_type: str):
    """transformers' modeling module of a model type (None where it has none)."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    name = model_type_to_module_name(model_type)
    try:
        return importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    except ImportError:
        return None
