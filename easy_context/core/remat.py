"""Rematerialisation-aware attention (DistFlashAttn's idea), for every executor schedule.

With gradient checkpointing, a decoder layer's forward runs again during backward, and
with it the whole distributed attention forward (kernels and communication). Its result
is already known: we keep each layer's attention output and log-sum-exp from the first
forward and hand them back when the forward is re-run inside the backward pass.

Hit or miss is decided from the order of calls alone (a re-run takes the layer's latest
entry), never from the values of q/k/v. Every rank makes the same calls in the same order,
so every rank decides the same way by construction: a recomputation that is not
bit-identical on one rank (non-deterministic GPU kernels) cannot send one rank into the
distributed forward while its peers skip it. The original node's backward then checks
that the entry its re-run received was its own (tags); if not (a second forward ran in
between), it recomputes the attention, again on every rank alike.

Reentrant checkpointing runs the first forward without grad and leaves no original node
to check. There, while two such forwards of a layer await their backward (a training-mode
forward that is never back-propagated), which of them a re-run belongs to is unknown: the
layer stops reusing until then and recomputes (always correct). Use model.eval() for
forwards without a backward. Without checkpointing the entry holds tensors autograd saves
anyway and the backward drops it, so it costs no memory.
"""

from __future__ import annotations

import collections
import itertools
import weakref

import torch

__all__ = ["AttentionOutputCache", "in_backward"]


def in_backward() -> bool:
    """True while autograd runs a backward pass (where checkpointed forwards are re-run)."""
    return torch._C._current_graph_task_id() != -1


class AttentionOutputCache:
    def __init__(self, per_layer: int = 1):
        # At most `per_layer` outputs per layer: bounds what forwards that are never followed
        # by a backward can leave behind. One is enough for forward/backward alternation,
        # gradient accumulation included; a miss only costs a recomputation.
        self._entries = weakref.WeakKeyDictionary()  # layer -> deque of (tag, out, lse)
        self._served = weakref.WeakKeyDictionary()  # layer -> tag of the entry its last re-run took
        self._waiting = weakref.WeakKeyDictionary()  # layer -> no-grad forwards awaiting a re-run
        self._per_layer = per_layer
        self._tags = itertools.count()

    def put(self, layer, out, lse, graph: bool):
        """Store a training forward's output; `graph`: the forward records a graph (grad on at
        the call). Returns the entry's tag, or None when nothing was stored. out and lse are kept
        as given (no alias made): hand in tensors outside any autograd graph, never the object
        an autograd Function returns (it would carry the graph in the cache)."""
        if not graph:  # reentrant checkpointing's first forward, or a forward never back-propagated
            waiting = self._waiting.get(layer, 0) + 1
            self._waiting[layer] = waiting
            if waiting > 1:
                self._entries.pop(layer, None)
                return None
        tag = next(self._tags)
        self._entries.setdefault(layer, collections.deque(maxlen=self._per_layer)).append((tag, out, lse))
        return tag

    def take(self, layer):
        """The latest (out, lse) stored for `layer`, removed from the cache; None if absent."""
        waiting = self._waiting.get(layer, 0)
        if waiting:
            self._waiting[layer] = waiting - 1
        entries = self._entries.get(layer)
        if not entries or waiting > 1:
            self._served.pop(layer, None)
            return None
        tag, out, lse = entries.pop()
        self._served[layer] = tag
        return out, lse

    def served(self, layer):
        """Tag of the entry the layer's last re-run received (None: it computed afresh); cleared."""
        return self._served.pop(layer, None)

    def discard(self, layer, tag) -> None:
        entries = self._entries.get(layer, ())
        for i, entry in enumerate(entries):
            if entry[0] == tag:
                del entries[i]
                return

    def __len__(self) -> int:
        return sum(len(e) for e in self._entries.values())
