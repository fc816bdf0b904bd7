"""The attention work of packed training rows, from their document lengths alone (the
data-parallel order by work, core/work_order.py, balances DP groups by it)."""

from __future__ import annotations

import numpy as np

__all__ = ["packed_row_products"]


def packed_row_products(document_ends: np.ndarray, row_length: int, rows: int) -> np.ndarray:
    """Query x key products of each of `rows` rows of `row_length` tokens cut from documents
    that end (exclusive, cumulative) at `document_ends`, with every row start restarting the
    document it cuts (as --document-masking's positions do). From the lengths alone: no token
    is read."""
    total = rows * row_length
    cuts = np.union1d(document_ends[document_ends < total], np.arange(0, total + 1, row_length))
    lengths = np.diff(cuts).astype(np.float64)
    return np.bincount(cuts[:-1] // row_length, weights=lengths * (lengths + 1) / 2, minlength=rows)[:rows]
