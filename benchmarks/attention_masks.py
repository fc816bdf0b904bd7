"""The attention masks bench_attention measures (--masks), by name: causal, packed-<n>,
long-tail, window-<n>. Parsing the names needs no torch (the driver checks them first)."""

from __future__ import annotations

import importlib
import random

from benchmarks.attention_config import import_easy_context_modes

CAUSAL = "causal"
MASK_HELP = (
    "causal, packed-<n> (S/n documents of n tokens), long-tail (log-normal document lengths), "
    "window-<n> (one document, sliding window n); n may end in k (x1024), e.g. packed-1k"
)


def parse_mask(name: str):
    """(kind, n) for a --masks name; kind in causal, packed, long-tail, window."""
    if name in (CAUSAL, "long-tail"):
        return name, None
    kind, _, size = name.partition("-")
    if kind in ("packed", "window") and size:
        n = size[:-1] if size.endswith("k") else size
        if n.isdigit() and int(n) > 0:
            return kind, int(n) * (1024 if size.endswith("k") else 1)
    raise ValueError(f"unknown mask {name!r}; choose from {MASK_HELP}")


def mask_balance():
    """benchmarks.mask_balance (its long_tailed_lengths and packed_mask), imported after the
    light import of easy_context, so that its `from easy_context...` imports skip transformers."""
    import_easy_context_modes()
    return importlib.import_module("benchmarks.mask_balance")


def mask_documents(name: str, S: int, seed: int):
    """(document lengths summing to S, sliding window or None) of a --masks name."""
    kind, n = parse_mask(name)
    if kind == "packed":
        return [n] * (S // n) + ([S % n] if S % n else []), None
    if kind == "long-tail":
        return mask_balance().long_tailed_lengths(S, random.Random(seed)), None
    return [S], (n if kind == "window" else None)


def sequence_mask(name: str, S: int, B: int, seed: int):
    """The SequenceMask the modes get for this mask (None for causal: today's call)."""
    if name == CAUSAL:
        return None
    lengths, window = mask_documents(name, S, seed)
    mask = mask_balance().packed_mask(lengths)  # first_key (1, S)
    if B > 1:  # the same documents in every batch row
        mask = type(mask)(mask.first_key.expand(B, S).contiguous())
    return mask.with_window(window)


def allowed_ratio(name: str, S: int, seed: int) -> float:
    """Allowed (query, key) pairs / causal pairs S(S+1)/2 of one batch row."""
    if name == CAUSAL:
        return 1.0
    import torch

    mask = sequence_mask(name, S, 1, seed)
    index = torch.arange(S)
    return mask.allowed_pairs(index, index) / (S * (S + 1) / 2)


def dense_reference_mask(torch, name: str, S: int, seed: int):
    """(S, S) bool, True = query i may attend key j: first_key[i] <= j <= i and i - j < window,
    first_key from the document lengths (independent of SequenceMask); for --check."""
    lengths, window = mask_documents(name, S, seed)
    lengths = torch.tensor(lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    first_key = torch.repeat_interleave(starts, lengths)
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    allowed = (first_key[:, None] <= j) & (j <= i)
    if window is not None:
        allowed &= (i - j) < window
    return allowed
