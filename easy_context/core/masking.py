"""Which keys each query may attend, described once per forward, and the kernel calls it implies.

Packed documents, padding and a sliding window all reduce to one rule per row:

    query i may attend key j   iff   first_key[i] <= j <= i   and   i - j < window

`first_key[i]` is the first token of i's document (0 everywhere for one unpacked document).
Padding tokens get first_key = i + 1: they attend nothing and nobody attends them (their
output is 0 and they are left out of every kernel call). Indices are global positions in
the row, so the same description serves every rank and every mode; the window is the only
per-layer part (`with_window`).

`plan_blocks` turns the rule into kernel calls for one (local query rows x local key rows)
pair of any layout: rows are grouped into runs whose allowed keys form a full rectangle or
a rectangle plus a causal square (unmasked kernel calls, nothing wasted); rows whose key
range moves with every row (sliding windows) go into masked tiles of at most TILE rows.
Pairs with no allowed key are never computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

__all__ = ["Block", "SequenceMask", "plan_blocks", "FULL_ROWS"]

FULL_ROWS = slice(None)
TILE = 256  # rows per masked tile: mask memory and wasted pairs stay small
SHORT_RUN = 32  # runs shorter than this are not worth a kernel call of their own


class Block(NamedTuple):
    """One kernel call: local query rows `q` (of batch rows `batch`) attend to rows `kv` of the
    K/V block in hand, causally (top-left aligned square), fully, or through `mask`
    (bool (1, 1, len q, len kv), True = allowed)."""

    q: slice
    kv: slice
    causal: bool
    batch: slice = FULL_ROWS
    mask: torch.Tensor | None = None


@dataclass(eq=False)
class SequenceMask:
    """first_key (B, S) int64 on the host, global indices; window None = unlimited."""

    first_key: torch.Tensor
    window: int | None = None
    # document_split: the layout.RowLayout the ranks hold this forward's rows in (the plans are
    # built on it). None: the mode's static layout.
    row_layout: object | None = None
    _plans: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_positions(
        cls, position_ids: torch.Tensor, valid: torch.Tensor | None = None, row_layout=None
    ) -> SequenceMask:
        """HF's packing convention: a document starts where position_ids[i] != position_ids[i-1] + 1.
        `valid` (B, S) bool marks non-padding tokens (None: all valid)."""
        position_ids = position_ids.cpu().long()
        batch, seq = position_ids.shape
        index = torch.arange(seq).expand(batch, seq)
        starts = torch.ones_like(position_ids, dtype=torch.bool)
        starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
        if valid is not None:
            valid = valid.cpu().bool()
            starts[:, 1:] |= valid[:, 1:] != valid[:, :-1]
        first_key = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
        if valid is not None:
            first_key = torch.where(valid, first_key, index + 1)
        return cls(first_key.contiguous(), row_layout=row_layout)

    def with_window(self, window: int | None) -> SequenceMask:
        if window is None or window >= self.first_key.shape[1]:
            return self
        if window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {window}")
        # shares nothing but the description: plans differ
        return self.memo(("window", window), lambda: SequenceMask(self.first_key, window, self.row_layout))

    @property
    def is_causal(self) -> bool:
        """True when the rule is plain causal attention over the whole row (no work to skip)."""
        return self.memo(
            "causal", lambda: self.window is None and self.row_layout is None and not bool(self.first_key.any())
        )

    def memo(self, key, build):
        """The value cached under `key` (hashable) for this mask, built by build() at the first
        call: plans depend on the mask only, so every layer of a forward and its backward reuse them."""
        if key not in self._plans:
            self._plans[key] = build()
        return self._plans[key]

    def blocks(self, key, q_index: torch.Tensor, k_index: torch.Tensor, device) -> list[Block]:
        """Kernel calls for local queries at global positions q_index x keys at k_index (both
        increasing). `key` (hashable) names the pair for the caller: every layer of a forward
        and its backward reuse the plan."""
        return self.memo((key, str(device)), lambda: plan_blocks(self, q_index, k_index, device))

    def pairs_per_query(self, q_index: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor:
        """(n,) allowed keys of each local query row, summed over the batch rows. Indices: (n,)
        shared by the batch rows, or (B, n) per row."""
        total = torch.zeros(q_index.shape[-1], dtype=torch.long)
        for _, first_key_q, q, k, rows in _by_row(self, q_index, k_index):
            lo, hi = _key_ranges(first_key_q, q, k, self.window)
            total += (hi - lo)[0] * rows
        return total

    def allowed_pairs(self, q_index: torch.Tensor, k_index: torch.Tensor) -> int:
        """Allowed (query, key) pairs summed over the batch rows."""
        return int(self.pairs_per_query(q_index, k_index).sum())

    def has_pairs(self, key, q_index: torch.Tensor, k_index: torch.Tensor) -> bool:
        """Whether any pair is allowed; cached under `key` like `blocks`."""
        return self.memo(("has pairs", key), lambda: self.allowed_pairs(q_index, k_index) > 0)


def _key_ranges(first_key_q, q_index, k_index, window):
    """Per batch row and local query: the allowed local keys are [lo, hi) (contiguous, because
    the allowed global keys form an interval and k_index is increasing)."""
    lower = first_key_q
    if window is not None:
        lower = torch.maximum(lower, q_index - window + 1)
    lo = torch.searchsorted(k_index, lower.contiguous())
    hi = torch.searchsorted(k_index, q_index.expand_as(lower).contiguous(), right=True)
    empty = lo >= hi
    return lo.masked_fill(empty, 0), hi.masked_fill(empty, 0)


def _by_row(mask: SequenceMask, q_index: torch.Tensor, k_index: torch.Tensor):
    """(batch rows, first_key of the queries (1, n), q_index, k_index, number of rows) for each
    group of batch rows that can be planned together: all rows at once when they share the
    layout and the boundaries, else row by row. Indices: (n,) shared, or (B, n) per row."""
    if q_index.dim() == 2:  # a layout of its own per batch row
        for b in range(q_index.shape[0]):
            yield slice(b, b + 1), mask.first_key[b : b + 1, q_index[b]], q_index[b], k_index[b], 1
        return
    first_key_q = mask.first_key[:, q_index]
    if bool((first_key_q == first_key_q[:1]).all()):  # every batch row has the same boundaries
        yield FULL_ROWS, first_key_q[:1], q_index, k_index, first_key_q.shape[0]
        return
    for b in range(first_key_q.shape[0]):
        yield slice(b, b + 1), first_key_q[b : b + 1], q_index, k_index, 1


def plan_blocks(mask: SequenceMask, q_index: torch.Tensor, k_index: torch.Tensor, device) -> list[Block]:
    blocks = []
    for batch, first_key_q, q, k, _ in _by_row(mask, q_index, k_index):
        lo, hi = (x[0] for x in _key_ranges(first_key_q, q, k, mask.window))
        blocks += _row_blocks(lo, hi, batch, device)
    return blocks


def _runs(lo: torch.Tensor, hi: torch.Tensor) -> list[tuple[int, int]]:
    """Maximal runs of rows with one first key whose last key stays put (a rectangle) or
    moves by one per row (a rectangle plus a causal square)."""
    n = lo.shape[0]
    if n == 0:
        return []
    step = hi[1:] - hi[:-1]
    empty = hi <= lo  # rows with nothing to attend (stored as [0, 0)) never share a run with others
    breaks = (lo[1:] != lo[:-1]) | ((step != 0) & (step != 1)) | (empty[1:] != empty[:-1])
    breaks[1:] |= step[1:] != step[:-1]
    starts = [0] + (torch.nonzero(breaks).flatten() + 1).tolist()
    return list(zip(starts, starts[1:] + [n]))


def _row_blocks(lo, hi, batch, device) -> list[Block]:
    blocks, pending = [], []  # pending: short runs waiting to be merged into a masked tile

    def flush():
        if pending:
            a, b = pending[0][0], pending[-1][1]
            blocks.extend(_masked_tiles(lo, hi, a, b, batch, device))
            pending.clear()

    for a, b in _runs(lo, hi):
        first, last = int(lo[a]), int(hi[a])
        if last <= first:  # rows with nothing to attend here
            continue
        if b - a < SHORT_RUN and (b - a == 1 or int(hi[a + 1]) != last):
            pending.append((a, b))
            if pending[-1][1] - pending[0][0] >= TILE:
                flush()
            continue
        flush()
        if b - a == 1 or int(hi[a + 1]) == last:  # every row sees keys [first, last)
            blocks.append(Block(slice(a, b), slice(first, last), False, batch))
            continue
        diagonal = last - 1  # row a sees keys [first, diagonal], row a + n sees up to diagonal + n
        if first < diagonal:
            blocks.append(Block(slice(a, b), slice(first, diagonal), False, batch))
        blocks.append(Block(slice(a, b), slice(diagonal, diagonal + b - a), True, batch))
    flush()
    return blocks


def _masked_tiles(lo, hi, a, b, batch, device) -> list[Block]:
    tiles = []
    for start in range(a, b, TILE):
        stop = min(start + TILE, b)
        tile_lo, tile_hi = lo[start:stop], hi[start:stop]
        live = tile_hi > tile_lo
        if not bool(live.any()):
            continue
        k0, k1 = int(tile_lo[live].min()), int(tile_hi[live].max())
        keys = torch.arange(k0, k1)
        allowed = (keys >= tile_lo[:, None]) & (keys < tile_hi[:, None])
        tiles.append(Block(slice(start, stop), slice(k0, k1), False, batch, allowed[None, None].to(device)))
    return tiles
