"""Sequence mixers besides attention, sequence parallel: causal convolutions and recurrent scans.

A mixer reads the sequence in order. Under sequence parallelism each rank holds runs of it
(core/pieces.py), and a run's result depends on everything before it: the last (kernel - 1)
inputs of a convolution, the state of a scan. Two strategies make it exact:

- state passing (state_passing.py): each rank runs its runs with what earlier runs carry in. A
  convolution takes its halo from the run before; a scan, whose final state is an affine
  function of its initial state, sends that function's summary (its transition and its final
  state from a zero start), every rank composes the summaries of the runs before its own, and
  runs again from the state that gives. O(state) bytes, any head count.
- head exchange (families.py over core/exchange.py): an all-to-all turns sequence shards into head shards, the
  scan runs over the whole sequence for the local heads, and a second all-to-all turns it back
  (Ulysses applied to the mixer). O(sequence) bytes; the heads must split over the SP group.

`families.py` holds each family's scan under both strategies (Mamba-2's SSD, the gated delta
rule, short convolutions), over the kernels transformers provides (its torch paths, or the
packages it dispatches to), which the integration passes in; `costs.py` what each strategy sends.
Never imports transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["STRATEGIES", "Sharding", "choose_strategy"]

STRATEGIES = ("state_passing", "head_exchange")


@dataclass(frozen=True)
class Sharding:
    """Where this rank's tokens sit in the sequence: its SP group, its rank there, the layout
    (core.layout.Layout), the whole sequence's length and, for packed rows, where documents
    start ((B, S) bool on the host, in sequence order; None: one document per row). A mixer's
    state restarts at every document, as if each ran alone."""

    group: object
    rank: int
    layout: object
    seq_len: int
    starts: object = None

    @property
    def size(self) -> int:
        return self.layout.size


def choose_strategy(option: str | None, heads: int, groups: int, size: int) -> str:
    """The strategy a mixer with `heads` heads (and `groups` B/C groups, Mamba-2; the query/key
    heads of the gated delta rule) runs on `size` ranks: the one asked for, or by default head
    exchange where the heads and groups split over the ranks (or there is one group) and state
    passing elsewhere. Head exchange where they do not split is refused,
    naming the numbers and the other strategy."""
    splits = heads % size == 0 and (groups % size == 0 or groups == 1)  # one group: B and C go whole
    if option in (None, "auto"):
        return "head_exchange" if splits else "state_passing"
    if option not in STRATEGIES:
        raise ValueError(f"mixer_strategy={option!r} is not one of {['auto', *STRATEGIES]}")
    if option == "head_exchange" and not splits:
        raise ValueError(
            f"mixer_strategy='head_exchange' needs the mixer's heads ({heads}) and groups ({groups}) to split over "
            f"the {size} ranks of the sequence-parallel group; use mixer_strategy='state_passing', which has no "
            "such limit"
        )
    return option
