"""Helpers several backends share: masks as additive biases, the empty-row contract, the
accumulation dtype."""

from __future__ import annotations

import functools

import torch

__all__ = [
    "HALF",
    "INF",
    "accumulation_dtype",
    "additive_bias",
    "band_mask",
    "band_bias",
    "clear_empty_rows",
    "backward_lse",
]

HALF = (torch.float16, torch.bfloat16)
INF = float("inf")


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half types, else the input's own (fp64 stays fp64 for exactness checks).
    Plain Python: torch.promote_types is a dispatched op, and this runs for every block."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _empty_rows(mask: torch.Tensor) -> torch.Tensor:
    """(B or 1, 1, Sq): query rows with no allowed key."""
    return ~mask.any(-1)


def additive_bias(mask: torch.Tensor, dtype: torch.dtype, key_align: int = 1) -> torch.Tensor:
    """0 where `mask` allows, -inf where it forbids, in `dtype`. The bias is a slice of storage
    whose key dim is padded up to a multiple of `key_align` (row starts stay aligned)."""
    *lead, sk = mask.shape
    storage = torch.zeros(*lead, -(-sk // key_align) * key_align, dtype=dtype, device=mask.device)
    return storage[..., :sk].masked_fill_(~mask, -INF)


@functools.lru_cache(maxsize=32)
def band_mask(sq: int, sk: int, window: tuple[int, int], device: torch.device) -> torch.Tensor:
    """A window (left, right), masking.Block's convention, as a bool (1, 1, Sq, Sk) mask. It
    depends on the block's shape only (the mask's kernel calls cut the same few band shapes for every shard pair
    and layer), so backends without a native window reuse a handful: none is built per call."""
    left, right = window
    offset = torch.arange(sk, device=device)[None, :] - torch.arange(sq, device=device)[:, None] - (sk - sq)
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        allowed &= offset >= -left
    if right >= 0:
        allowed &= offset <= right
    return allowed[None, None]


@functools.lru_cache(maxsize=32)
def band_bias(
    sq: int, sk: int, window: tuple[int, int], dtype: torch.dtype, device: torch.device, key_align: int = 1
) -> torch.Tensor:
    return additive_bias(band_mask(sq, sk, window, device), dtype, key_align)


def clear_empty_rows(out, lse, mask, clear_out: bool = True):
    """The contract for rows with no allowed key: out 0, lse -inf, whatever the kernel gave."""
    empty = _empty_rows(mask)
    if clear_out:  # where, not masked_fill: it keeps out's (B, S, H, D) memory layout
        out = torch.where(empty.unsqueeze(-1), 0, out)
    return out, lse.masked_fill(empty, -INF)


def backward_lse(lse: torch.Tensor) -> torch.Tensor:
    """lse for a masked backward: rows with no allowed key (-inf) get +inf, so every
    probability exp(score - lse) of theirs is 0 and so are their gradients (-inf - -inf
    would be NaN). The CUDA efficient kernel pads its own lse with +inf for the same reason."""
    return lse.masked_fill(lse == -INF, INF)
