"""The registry of parallel modes: name -> what the mode does differently.

A mode says how its SP group is split between a ring and Ulysses (`ring_degree`), whether
the ring part uses the zigzag layout, and which attention function runs over the groups.
Kernels, ring core, process groups, HF integration and the API are shared. A mode also
declares what it supports and what it costs (modes/costs.py), so that the recipes ask the mode
instead of comparing its name.

One file per mode: zigzag_ring_attn.py, dist_flash_attn.py (the LightSeq schedule),
ulysses_attn.py, usp_attn.py (Ulysses x ring), data_parallel.py (the model's own attention);
costs.py the pieces of their cost declarations (bytes sent, activation terms).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from easy_context.core.groups import Placement, Topology, divisors
from easy_context.core.layout import WHOLE_SEQUENCE, Layout
from easy_context.modes.costs import Activations, AttentionShape, Traffic

__all__ = ["SeqParallelMode", "get_mode", "modes_with", "MODE_NAMES", "BUILT_MODES"]


def no_traffic(shape: AttentionShape) -> Traffic:
    return Traffic()


def no_activations(shape: AttentionShape) -> Activations:
    return Activations()


def even_load(shape: AttentionShape) -> float:
    return 1.0


@dataclass(frozen=True)
class SeqParallelMode:
    name: str
    # (sp_size, requested ring_degree or None, placement: the nodes and heads the default may
    # follow, or None) -> ring_degree; raises for impossible requests.
    ring_degree: Callable[[int, int | None, Placement | None], int]
    zigzag: bool
    # (q, k, v, scale, groups: SeqParallelGroups, layer=None, mask=None, softcap=None,
    # sinks=None) -> out; q (B, Hq, S_local, D), k/v (B, Hkv, S_local, D), out (B, Hq, S_local, D);
    # layer is the HF attention module (a cache key for checkpoint-aware modes); mask a
    # masking.SequenceMask over the SP group's whole sequence (None: plain causal); softcap
    # and sinks (Hq,) change the logits (ring.ring_attention). None: the model's own attention.
    attention: Callable | None
    # The mode can follow a layout per packed row (document_split): its ring cuts each document
    # the way it cuts one causal row. Ulysses alone is balanced already (every rank attends the
    # whole sequence for its heads), data_parallel has nothing to split.
    document_split: bool = False
    # The caller chooses how the SP group splits between the ring and Ulysses (ring_degree);
    # the other modes fix the split and refuse any other value.
    takes_ring_degree: bool = False
    # sp_size -> the ring degrees a planner considers (None: the mode's one split).
    ring_degree_choices: Callable[[int], tuple] | None = None
    # Costs of one layer on one rank (modes/costs.py): bytes sent, and activation bytes per token.
    traffic: Callable[[AttentionShape], Traffic] = no_traffic
    activations: Callable[[AttentionShape], Activations] = no_activations
    # The busiest rank's attention work over the mean rank's (Ulysses with query heads that do
    # not split evenly: ceil(H / U) / (H / U)); the planner's compute time scales by it.
    attention_load: Callable[[AttentionShape], float] = even_load
    # Under activation checkpointing the mode keeps each layer's attention output (and lse), so
    # the recompute neither runs nor communicates the attention forward again.
    keeps_attention_output: bool = False

    @property
    def sequence_parallel(self) -> bool:
        """Splits sequences over ranks (data_parallel keeps the model's own attention)."""
        return self.attention is not None

    def ring_degrees_to_plan(self, sp_size: int) -> tuple:
        """The ring degrees worth planning for an SP group of sp_size ranks: none for a
        sequence-parallel mode on one rank (the planner prices that as data_parallel)."""
        if not self.sequence_parallel:
            return (1,) if sp_size == 1 else ()
        if sp_size == 1:
            return ()
        if self.ring_degree_choices is not None:
            return tuple(self.ring_degree_choices(sp_size))
        return (self.ring_degree(sp_size, None),)

    def topology(
        self,
        world_size: int,
        sp_size: int | None = None,
        ring_degree: int | None = None,
        placement: Placement | None = None,
    ) -> Topology:
        """The split of `world_size` ranks; `placement` (ranks per node, the model's heads) lets a
        mode's default follow the nodes: usp_attn's ring across them."""
        if self.attention is None:  # data_parallel: every rank holds whole sequences
            if sp_size not in (None, 1) or ring_degree not in (None, 1):
                raise ValueError(
                    f"data_parallel has no sequence parallelism; got sp_size={sp_size}, ring_degree={ring_degree}"
                )
            return Topology(world_size, 1, 1)
        sp = world_size if sp_size is None else sp_size
        if sp < 1 or world_size % sp:
            raise ValueError(
                f"sp_size={sp_size} does not divide the world size {world_size}; choose one of {divisors(world_size)}"
            )
        if placement is not None and placement.nodes_of(world_size) is None:
            placement = Placement(None, placement.heads, placement.kv_heads)  # not whole nodes: one node
        return Topology(world_size, sp, self.ring_degree(sp, ring_degree, placement))

    def layout(self, topology: Topology) -> Layout:
        if self.attention is None or topology.sp_size == 1:
            return WHOLE_SEQUENCE
        return Layout(self.zigzag, topology.ring_degree, topology.ulysses_degree)


def fixed_ring_degree(mode: str, value_of_sp: Callable[[int], int], hint: str):
    """A ring_degree rule for modes whose split is fixed; refuses any other request."""

    def rule(sp_size: int, requested: int | None, placement: Placement | None = None) -> int:
        value = value_of_sp(sp_size)
        if requested not in (None, value):
            raise ValueError(
                f"{mode} uses ring_degree={value} for sp_size={sp_size}, got ring_degree={requested}; {hint}"
            )
        return value

    return rule


# Every mode the public API knows, and the subpackage that implements it (None: not built yet).
_MODULES = {
    "zigzag_ring_attn": "easy_context.modes.zigzag_ring_attn",
    "dist_flash_attn": "easy_context.modes.dist_flash_attn",
    "ulysses_attn": "easy_context.modes.ulysses_attn",
    "usp_attn": "easy_context.modes.usp_attn",
    "data_parallel": "easy_context.modes.data_parallel",
}
MODE_NAMES = tuple(_MODULES)
BUILT_MODES = tuple(name for name, module in _MODULES.items() if module)


def modes_with(feature: str) -> tuple:
    """Names of the built modes that support `feature` (a boolean field of SeqParallelMode)."""
    return tuple(name for name in BUILT_MODES if getattr(get_mode(name), feature))


def get_mode(name: str) -> SeqParallelMode:
    if name not in _MODULES:
        raise ValueError(f"unknown parallel mode {name!r}; choose one of {list(MODE_NAMES)}")
    if _MODULES[name] is None:
        raise NotImplementedError(f"parallel mode {name!r} is not built yet; modes that work now: {list(BUILT_MODES)}")
    return importlib.import_module(_MODULES[name]).MODE
