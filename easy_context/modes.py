"""The registry of parallel modes: name -> what the mode does differently.

A mode is a layout (how tokens are split over ranks) plus an attention function over the
sequence-parallel group. Everything else (kernels, ring, HF integration, API) is shared.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Optional

from .layout import Layout

__all__ = ["SeqParallelMode", "get_mode", "MODE_NAMES", "BUILT_MODES"]


@dataclass(frozen=True)
class SeqParallelMode:
    name: str
    layout: Layout
    # (q, k, v, scale, group) -> out, with q (B, Hq, S_local, D), k/v (B, Hkv, S_local, D),
    # out (B, Hq, S_local, D). None: the model keeps its own (unpatched) attention.
    attention: Optional[Callable]


# Every mode the public API knows, and the subpackage that implements it (None: not built yet).
_MODULES = {
    "zigzag_ring_attn": "easy_context.zigzag_ring_attn",
    "dist_flash_attn": None,
    "ulysses_attn": None,
    "usp_attn": None,
    "data_parallel": "easy_context.data_parallel",
}
MODE_NAMES = tuple(_MODULES)
BUILT_MODES = tuple(name for name, module in _MODULES.items() if module)


def get_mode(name: str) -> SeqParallelMode:
    if name not in _MODULES:
        raise ValueError(f"unknown parallel mode {name!r}; choose one of {list(MODE_NAMES)}")
    if _MODULES[name] is None:
        raise NotImplementedError(
            f"parallel mode {name!r} is not built yet; modes that work now: {list(BUILT_MODES)}"
        )
    return importlib.import_module(_MODULES[name]).MODE
