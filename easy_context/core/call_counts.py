"""What the attention kernels were asked to compute: forward calls and (query, key) products,
counted by core.kernels.attention_forward when a test turns the counter on."""

from __future__ import annotations

import torch

from easy_context.core.backends import band_mask

__all__ = ["FORWARD_CALLS", "ForwardCounter"]


class ForwardCounter:
    """Forward kernel calls and query x key products computed (a causal square block of n
    rows counts n(n+1)/2; a masked block counts its allowed (query, key) pairs summed over the
    mask's batch rows and divided by their number, rounded, so batch and heads never count);
    tests use it to prove what was recomputed and how work is spread.

    Off unless a test turns it on with `start()` (counting a masked block is a reduction on
    the mask's device: kernel launches nobody else wants). A masked count is added up lazily:
    reading `products` is the only host sync."""

    def __init__(self) -> None:
        self.enabled = False
        self.reset()

    def start(self) -> None:
        """Count from zero, from now on."""
        self.reset()
        self.enabled = True

    def reset(self) -> None:
        self.calls = 0
        self._products = 0
        self._masked_products = None  # 0-dim tensor on the masks' device, not yet read

    @property
    def products(self) -> int:
        self._fold()
        return self._products

    def _fold(self) -> None:
        if self._masked_products is not None:
            self._products += int(self._masked_products)
            self._masked_products = None

    def add(
        self, q_len: int, k_len: int, causal: bool, mask: torch.Tensor | None = None, window=None, segments=None
    ) -> None:
        if not self.enabled:
            return
        self.calls += 1
        if segments is not None:  # one call, the work of its documents
            self._products += sum(_plain_pairs(b - a, b - a, causal, window) for a, b in zip(segments, segments[1:]))
            return
        if mask is None:
            self._products += _plain_pairs(q_len, k_len, causal, window)
            return
        if window is not None:
            mask = mask & band_mask(q_len, k_len, window, mask.device)
        rows = mask.shape[0]
        allowed = (mask.sum() * 2 + rows) // (2 * rows)  # mean over batch rows, rounded half up
        if self._masked_products is not None and self._masked_products.device != allowed.device:
            self._fold()  # masks on two devices: add the older count up on the host (rare)
        self._masked_products = allowed if self._masked_products is None else self._masked_products + allowed


FORWARD_CALLS = ForwardCounter()


def _plain_pairs(sq: int, sk: int, causal: bool, window) -> int:
    """Allowed (query, key) pairs of an unmasked block."""
    if window is not None:
        return _window_pairs(sq, sk, *window)
    return sq * (sq + 1) // 2 if causal else sq * sk


def _window_pairs(sq: int, sk: int, left: int, right: int) -> int:
    """Allowed (query, key) pairs of a window block (masking.Block's convention)."""
    total = 0
    for r in range(sq):
        first = max(0, r + sk - sq - left) if left >= 0 else 0
        last = min(sk - 1, r + sk - sq + right) if right >= 0 else sk - 1
        total += max(0, last - first + 1)
    return total
