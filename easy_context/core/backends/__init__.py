"""The attention backends behind core/kernels.py: one block -> (out, lse), and its backward.

Each backend takes q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D), a scale and causal, and where it
can, a bool mask (True: may attend), a softcap and a window (left, right); kernels.py checks
the arguments, picks the backend and counts the work. Conventions (layouts, empty rows,
softcap, windows): kernels.py's docstring.

One file per backend family:
  masks.py       helpers several backends share (additive biases, band masks, empty rows,
                 the accumulation dtype)
  band.py        the band path: a window in tiles of query rows (backends with a bias, no window)
  math_tiles.py  math: pure torch, in tiles of query rows; the reference and the fallback
  cpu_flash.py   cpu_flash: torch's fused CPU op
  cuda.py        cuda_flash and cuda_efficient: torch's fused CUDA ops
  flash_attn.py  flash_attn: the optional flash_attn package (imported on first use)
  flex.py        flex: torch's FlexAttention
  segments.py    packed documents for backends without document boundaries: one call per document
"""

from __future__ import annotations

from easy_context.core.backends.band import BAND_TILE_ROWS, BAND_WHOLE_PRODUCTS, band_tiles
from easy_context.core.backends.cpu_flash import cpu_flash_backward, cpu_flash_forward
from easy_context.core.backends.cuda import (
    cuda_efficient_backward,
    cuda_efficient_forward,
    cuda_flash_backward,
    cuda_flash_forward,
)
from easy_context.core.backends.flash_attn import (
    flash_attn_backward,
    flash_attn_backward_options,
    flash_attn_forward,
    flash_attn_has_softcap,
    flash_attn_has_window,
    flash_attn_usable,
    parameter_names,
)
from easy_context.core.backends.flex import (
    flex_backward,
    flex_compilable,
    flex_forward,
    flex_usable,
    flex_window_rule,
)
from easy_context.core.backends.masks import HALF, accumulation_dtype, band_mask
from easy_context.core.backends.math_tiles import (
    MATH_CUDA_FREE_FRACTION,
    MATH_CUDA_MAX_TILE_LOGITS,
    MATH_TILE_LOGITS,
    MATH_TILE_TEMPORARIES,
    math_backward,
    math_forward,
    row_tiles,
    tile_logits,
)

__all__ = [
    "HALF",
    "accumulation_dtype",
    "MATH_TILE_LOGITS",
    "MATH_TILE_TEMPORARIES",
    "MATH_CUDA_FREE_FRACTION",
    "MATH_CUDA_MAX_TILE_LOGITS",
    "tile_logits",
    "row_tiles",
    "math_forward",
    "math_backward",
    "cpu_flash_forward",
    "cpu_flash_backward",
    "cuda_flash_forward",
    "cuda_flash_backward",
    "cuda_efficient_forward",
    "cuda_efficient_backward",
    "flash_attn_forward",
    "flash_attn_backward",
    "flash_attn_usable",
    "flash_attn_has_softcap",
    "flash_attn_has_window",
    "band_mask",
    "band_tiles",
    "BAND_TILE_ROWS",
    "BAND_WHOLE_PRODUCTS",
    "flash_attn_backward_options",
    "parameter_names",
    "flex_forward",
    "flex_backward",
    "flex_usable",
    "flex_compilable",
    "flex_window_rule",
]
