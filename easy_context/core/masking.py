"""Which keys each query may attend, described once per forward, and the kernel calls it implies.

Packed documents, padding and a sliding window all reduce to one rule per row:

    query i may attend key j   iff   first_key[i] <= j <= i   and   i - j < window

`first_key[i]` is the first token of i's document (0 everywhere for one unpacked document).
Padding tokens get first_key = i + 1: they attend nothing and nobody attends them (their
output is 0 and they are left out of every kernel call). Indices are global positions in
the row, so the same description serves every rank and every mode; the window is the only
per-layer part (`with_window`).

`kernel_calls` turns the rule into kernel calls for one (local query rows x local key rows)
pair of any layout: rows are grouped into runs whose first and last allowed keys each stay
or move by one per row, and each run is one kernel call: a full rectangle, a rectangle plus
a causal square, or a window (a sliding band; kernels with a native window run it as such,
the others with a mask that depends only on the block's shape). Nothing wasted, no per-row
work: the runs come from one vectorized pass, so a pair's calls cost the same few host
operations at any length. Pairs with no allowed key are never computed.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

__all__ = ["Block", "SequenceMask", "document_starts", "kernel_calls", "FULL_ROWS"]

FULL_ROWS = slice(None)


class Block(NamedTuple):
    """One kernel call: local query rows `q` (of batch rows `batch`) attend to rows `kv` of the
    K/V block in hand, causally (top-left aligned square), fully, or in a `window`.

    window (left, right), flash-attention's convention (bottom-right aligned): query row r of
    n may attend key column c of m iff r + m - n - left <= c <= r + m - n + right, -1 for no
    limit on that side. A sliding band is (m - n, 0), the start of a band cut off by the
    block's first key (m - n, -1).

    segments (0, s1, ..., n): a square block (n query rows, n keys) made of documents on its
    diagonal: rows [s_i, s_i+1) attend only keys [s_i, s_i+1), each square causal or in the
    window as the block says. One variable-length kernel call (flash's cu_seqlens) instead of
    one call per document."""

    q: slice
    kv: slice
    causal: bool
    batch: slice = FULL_ROWS
    window: tuple[int, int] | None = None
    segments: tuple[int, ...] | None = None

    def split(self) -> list[Block]:
        """The block as one call per document (for kernels that take no segments)."""
        if self.segments is None:
            return [self]
        q0, k0 = self.q.start, self.kv.start
        return [
            self._replace(q=slice(q0 + a, q0 + b), kv=slice(k0 + a, k0 + b), segments=None)
            for a, b in zip(self.segments, self.segments[1:])
        ]


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, S) bool: where a document starts in each row, by HF's packing convention (a token
    whose position is not the one before it plus one; the first token always)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts


@dataclass(eq=False)
class SequenceMask:
    """first_key (B, S) int64 on the host, global indices; window None = unlimited."""

    first_key: torch.Tensor
    window: int | None = None
    # document_split: the layout.RowLayout the ranks hold this forward's rows in (the kernel
    # calls are worked out on it). None: the mode's static layout.
    row_layout: object | None = None
    _memo: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_positions(
        cls, position_ids: torch.Tensor, valid: torch.Tensor | None = None, row_layout=None
    ) -> SequenceMask:
        """HF's packing convention: a document starts where position_ids[i] != position_ids[i-1] + 1.
        `valid` (B, S) bool marks non-padding tokens (None: all valid)."""
        position_ids = position_ids.cpu().long()
        batch, seq = position_ids.shape
        index = torch.arange(seq).expand(batch, seq)
        starts = document_starts(position_ids)
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
        # shares nothing but the description: kernel calls differ
        return self.memo(("window", window), lambda: SequenceMask(self.first_key, window, self.row_layout))

    @property
    def is_causal(self) -> bool:
        """True when the rule is plain causal attention over the whole row (no work to skip)."""
        return self.memo(
            "causal", lambda: self.window is None and self.row_layout is None and not bool(self.first_key.any())
        )

    def memo(self, key, build):
        """The value cached under `key` (hashable) for this mask, built by build() at the first
        call: kernel calls, key rows and the like depend on the mask only, so every layer of a
        forward and its backward reuse them."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    def blocks(self, key, q_index: torch.Tensor, k_index: torch.Tensor, device=None) -> list[Block]:
        """Kernel calls for local queries at global positions q_index x keys at k_index (both
        increasing). `key` (hashable) names the pair for the caller: every layer of a forward
        and its backward reuse them."""
        return self.memo(key, lambda: kernel_calls(self, q_index, k_index))

    def pairs_per_query(self, q_index: torch.Tensor, k_index: torch.Tensor) -> torch.Tensor:
        """(n,) allowed keys of each local query row, summed over the batch rows. Indices: (n,)
        shared by the batch rows, or (B, n) per row."""
        total = torch.zeros(q_index.shape[-1], dtype=torch.long)
        for _, first_key_q, q, k, rows in _by_row(self, q_index, k_index):
            lo, hi = _key_ranges(first_key_q, q, k, self.window)
            total += (hi - lo)[0] * rows
        return total

    def dense(self, queries: torch.Tensor | None = None, row: int = 0) -> torch.Tensor:
        """(n, S) bool: which keys the queries (global indices; None: all S) of batch row `row`
        may attend. For checks and tests: the kernels never materialise it."""
        keys = torch.arange(self.first_key.shape[1])
        queries = keys if queries is None else queries
        query, key = queries[:, None], keys[None, :]
        allowed = (key >= self.first_key[row, queries][:, None]) & (key <= query)
        if self.window is not None:
            allowed &= query - key < self.window
        return allowed

    def allowed_pairs(self, q_index: torch.Tensor, k_index: torch.Tensor) -> int:
        """Allowed (query, key) pairs summed over the batch rows."""
        return int(self.pairs_per_query(q_index, k_index).sum())

    def key_rows(self, key, q_index: torch.Tensor, k_index: torch.Tensor, device=None):
        """The local key rows that hold every allowed key of the local queries, over all batch
        rows: FULL_ROWS (all of them), a slice (one run) or an increasing index tensor on
        `device` (several runs: e.g. the pieces of a few cut documents between whole ones).
        Cached under `key` like `blocks`."""

        def rows():
            n = k_index.shape[-1]
            edges = torch.zeros(n + 1, dtype=torch.long)
            for _, first_key_q, q, k, _ in _by_row(self, q_index, k_index):
                lo, hi = (x[0] for x in _key_ranges(first_key_q, q, k, self.window))
                live = hi > lo
                edges.index_add_(0, lo[live], torch.ones_like(lo[live]))
                edges.index_add_(0, hi[live], -torch.ones_like(hi[live]))
            needed = torch.nonzero(edges.cumsum(0)[:n] > 0).flatten()
            count = needed.numel()
            if count == n:
                return FULL_ROWS
            if count == 0:
                return slice(0, 0)
            first, last = needed[[0, -1]].tolist()  # one conversion: no host sync per value
            return slice(first, last + 1) if last - first + 1 == count else needed

        found = self.memo(("key rows", key), rows)
        if isinstance(found, slice):
            return found
        return self.memo(("key rows", key, str(device)), lambda: found.to(device))

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
    group of batch rows whose kernel calls are worked out together: all rows at once when they share the
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


def kernel_calls(mask: SequenceMask, q_index: torch.Tensor, k_index: torch.Tensor) -> list[Block]:
    """SequenceMask.blocks' kernel calls, worked out (not cached): one Block per call, as the
    module's docstring describes."""
    blocks = []
    for batch, first_key_q, q, k, _ in _by_row(mask, q_index, k_index):
        lo, hi = (x[0] for x in _key_ranges(first_key_q, q, k, mask.window))
        blocks += _documents_joined(_row_blocks(lo, hi, batch))
    return blocks


def _square(block: Block) -> bool:
    return block.q.stop - block.q.start == block.kv.stop - block.kv.start


def _longest_document(block: Block) -> int:
    bounds = block.segments or (0, block.q.stop - block.q.start)
    return max(b - a for a, b in zip(bounds, bounds[1:]))


def _as_band(block: Block, window) -> Block | None:
    """The block under the band `window`'s rule when that is the same rule: causal squares no
    longer than a band (left, 0) see exactly the band."""
    if block.causal and window is not None and window[1] == 0 and _longest_document(block) <= window[0] + 1:
        return block._replace(causal=False, window=window)
    return None


def _same_rule(a: Block, b: Block) -> tuple[Block, Block] | None:
    """a and b under one rule (causal, window), or None."""
    if (a.causal, a.window) == (b.causal, b.window):
        return a, b
    if (band := _as_band(a, b.window)) is not None:
        return band, b
    if (band := _as_band(b, a.window)) is not None:
        return a, band
    return None


def _documents_joined(blocks: list[Block]) -> list[Block]:
    """Runs of square blocks that follow each other on the diagonal (the next one starts where
    the previous one ends, in rows and in keys) with the same rule, joined into one block with
    segments: packed documents of a shard become one kernel call."""
    joined = []
    for block in blocks:
        last = joined[-1] if joined else None
        pair = None
        if (
            last is not None
            and _square(block)
            and _square(last)
            and last.batch == block.batch
            and (last.q.stop, last.kv.stop) == (block.q.start, block.kv.start)
        ):
            pair = _same_rule(last, block)
        if pair is not None:
            last, block = pair
            bounds = last.segments or (0, last.q.stop - last.q.start)
            joined[-1] = last._replace(
                q=slice(last.q.start, block.q.stop),
                kv=slice(last.kv.start, block.kv.stop),
                segments=(*bounds, bounds[-1] + block.q.stop - block.q.start),
            )
            continue
        joined.append(block)
    return joined


def _runs(lo: torch.Tensor, hi: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """(first row, end row, lo step, hi step) of the maximal runs of consecutive rows whose
    first and last allowed keys each move by a constant 0 or 1 per row: a rectangle, a causal
    edge, a sliding band, or a band's clipped start. Vectorized: the steps are classified in
    one pass and handed to the host once; the loop below visits runs, not rows. Rows with
    nothing to attend are left out."""
    n = lo.shape[0]
    live = (hi > lo).tolist()
    if n < 2:
        return [(0, 1, 0, 0)] if n and live[0] else []
    d_lo, d_hi = lo[1:] - lo[:-1], hi[1:] - hi[:-1]
    # step i joins rows i and i + 1; its kind is 2 * lo step + hi step, or -1 (a jump)
    kind = torch.where((d_lo >= 0) & (d_lo <= 1) & (d_hi >= 0) & (d_hi <= 1), d_lo * 2 + d_hi, -1)
    # steps changes[j] .. changes[j + 1] - 1 share a kind (a step into or out of an empty row
    # is always a jump: empty rows hold keys [0, 0), so no run reaches one)
    changes = (torch.nonzero(kind[1:] != kind[:-1]).flatten() + 1).tolist() + [n - 1]
    kinds = kind.tolist()
    runs, row = [], 0
    while row < n:
        if not live[row]:
            row += 1
            continue
        step = kinds[row] if row < n - 1 and live[row + 1] else -1
        if step < 0:
            runs.append((row, row + 1, 0, 0))
            row += 1
            continue
        last = changes[bisect.bisect_right(changes, row)]  # steps row .. last - 1 join rows row .. last
        runs.append((row, last + 1, step >> 1, step & 1))
        row = last + 1
    return runs


def _windows(runs, los: list, his: list) -> list[tuple[int, int]]:
    """Consecutive runs joined into the longest row ranges one window block describes: first
    keys that stay, then move by one per row (a window's left edge, clipped by the block's
    first key), and last keys that move by one, then stay (its right edge, clipped by the
    block's last key). Visits runs, not rows."""
    groups = []  # [first row, end row, left edge moving, right edge stopped]
    for a, b, d_lo, d_hi in runs:
        if groups and groups[-1][1] == a:
            group = groups[-1]
            lo_steps = [los[a] - los[a - 1]] + [d_lo] * (b - a - 1)
            hi_steps = [his[a] - his[a - 1]] + [d_hi] * (b - a - 1)
            moving, stopped = group[2], group[3]
            fits = True
            for lo_step, hi_step in zip(lo_steps[:2], hi_steps[:2]):  # the rest repeat the second
                if lo_step not in (0, 1) or hi_step not in (0, 1) or (moving and not lo_step) or (stopped and hi_step):
                    fits = False
                    break
                moving, stopped = moving or lo_step == 1, stopped or hi_step == 0
            if fits:
                group[1:] = [b, moving, stopped]
                continue
        groups.append([a, b, d_lo == 1 and b - a > 1, d_hi == 0 and b - a > 1])
    return [(a, b) for a, b, _, _ in groups]


def _row_blocks(lo, hi, batch) -> list[Block]:
    blocks = []
    los, his = lo.tolist(), hi.tolist()
    for a, b in _windows(_runs(lo, hi), los, his):
        k0, k1, n = los[a], his[b - 1], b - a
        m = k1 - k0
        left = m - 1 - (los[b - 1] - k0) if los[b - 1] != k0 else -1
        right = his[a] - 1 - k0 - (m - n) if his[a] != k1 else -1
        if (left, right) == (-1, -1):  # every row sees keys [k0, k1)
            blocks.append(Block(slice(a, b), slice(k0, k1), False, batch))
        elif (left, right) == (-1, 0):  # a causal edge: a rectangle, then a causal square (no window)
            if m > n:
                blocks.append(Block(slice(a, b), slice(k0, k1 - n), False, batch))
            blocks.append(Block(slice(a, b), slice(k1 - n, k1), True, batch))
        else:  # a window, bottom-right aligned
            blocks.append(Block(slice(a, b), slice(k0, k1), False, batch, window=(left, right)))
    return blocks
