"""The process-group manager: world = dp_size x sp_size, and inside one SP group
sp_size = ring_degree x ulysses_degree.

Ranks [g*sp, (g+1)*sp) form SP group g and share one sequence; different SP groups read
different data. Inside an SP group, Ulysses groups are neighbouring ranks (fast links within
a node) and ring groups are strided ranks. Groups are created once per topology and cached.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import sys
from dataclasses import dataclass

import torch.distributed as dist

__all__ = [
    "Topology",
    "SeqParallelGroups",
    "get_groups",
    "release_groups",
    "world_timeout",
    "divisors",
    "register_exit_teardown",
]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Topology:
    world_size: int
    sp_size: int
    ring_degree: int

    def __post_init__(self):
        if self.sp_size < 1 or self.world_size % self.sp_size:
            raise ValueError(
                f"sp_size={self.sp_size} does not divide the world size {self.world_size}; "
                f"choose one of {divisors(self.world_size)}"
            )
        if self.ring_degree < 1 or self.sp_size % self.ring_degree:
            raise ValueError(
                f"ring_degree={self.ring_degree} does not divide sp_size={self.sp_size}; "
                f"choose one of {divisors(self.sp_size)}"
            )

    @property
    def ulysses_degree(self) -> int:
        return self.sp_size // self.ring_degree

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    def sp_rank(self, rank: int) -> int:
        return rank % self.sp_size

    def dp_rank(self, rank: int) -> int:
        return rank // self.sp_size


@dataclass(frozen=True)
class SeqParallelGroups:
    """This rank's groups; a group of one rank is None (nothing to communicate)."""

    topology: Topology
    sp_rank: int
    sp: object | None
    ring: object | None
    ulysses: object | None


_cache: dict = {}


def world_timeout():
    """The timeout the default process group was created with (`init_process_group(timeout=)`,
    accelerate's InitProcessGroupKwargs, the scripts' --dist-timeout), or None if unknown.

    new_group() does not inherit it: left alone, our groups would wait gloo's default 30
    minutes (NCCL's 10) while the script promised its user a shorter limit."""
    try:  # private API (torch 2.x): on any surprise, fall back to torch's default
        world = dist.group.WORLD
        for device in world._device_types:
            timeout = getattr(getattr(world._get_backend(device), "options", None), "_timeout", None)
            if timeout is not None:
                return timeout
    except (AttributeError, RuntimeError, ValueError):
        pass
    return None


def _new_groups(rank_lists: list[list[int]], rank: int, world_size: int):
    """Create one group per list (every rank must create every group, in the same order)."""
    mine, timeout = None, world_timeout()
    for ranks in rank_lists:
        if len(ranks) == world_size:
            group = dist.group.WORLD
        elif len(ranks) == 1:
            group = None
        else:
            group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine = group
    return mine


def get_groups(topology: Topology) -> SeqParallelGroups:
    if not (dist.is_available() and dist.is_initialized()):
        if topology.world_size != 1:
            raise RuntimeError(
                f"torch.distributed is not initialised but the topology needs {topology.world_size} ranks"
            )
        return SeqParallelGroups(topology, 0, None, None, None)
    if dist.get_world_size() != topology.world_size:
        raise ValueError(f"world size is {dist.get_world_size()}, not {topology.world_size}")
    key = (topology, id(dist.group.WORLD))
    if key not in _cache:
        register_exit_teardown()
        rank, world = dist.get_rank(), topology.world_size
        sp, u, r = topology.sp_size, topology.ulysses_degree, topology.ring_degree
        sp_lists = [list(range(g * sp, (g + 1) * sp)) for g in range(world // sp)]
        ulysses_lists = [first[i * u : (i + 1) * u] for first in sp_lists for i in range(r)]
        ring_lists = [first[j::u] for first in sp_lists for j in range(u)]
        groups = SeqParallelGroups(
            topology,
            topology.sp_rank(rank),
            _new_groups(sp_lists, rank, world),
            _new_groups(ring_lists, rank, world),
            _new_groups(ulysses_lists, rank, world),
        )
        # A collective on each new group before its first point-to-point: NCCL requires that
        # a group's first operation involve all of its ranks (dist_flash_attn's does not).
        for group in (groups.sp, groups.ring, groups.ulysses):
            if group is not None:
                dist.barrier(group=group)
        _cache[key] = groups
    return _cache[key]


def release_groups() -> None:
    """Forget the cached group handles, so that destroy_process_group() really frees them
    before the interpreter exits (a gloo group still referenced then can abort the process)."""
    _cache.clear()


# ------------------------------------------------------------------------ exit teardown
# A script that ends without tearing distributed state down (a plain Trainer script, a custom
# loop) leaves gloo and c10d threads alive into the interpreter's teardown, and the C++
# destructors that run after it can abort a finished run ("terminate called without an active
# exception", about 1 run in 24 on gloo): torchrun then reports a failure. So, once the patch
# is applied (or prepare_trainer called) in a distributed process, we tear down at exit
# ourselves, in two steps:
#   1. a Python exit handler: forget our group handles and destroy the process groups while the
#      interpreter is whole (what launch.shutdown does for our own scripts);
#   2. after Python has finished (its own exit handlers, module teardown, flushed streams),
#      glibc's on_exit calls _exit(status) with the process's own exit status, so the C++
#      static destructors that race those threads never run. The status is the one exit()
#      was given: 0, sys.exit's code, 1 after an unhandled exception. It is registered from
#      step 1, at exit: C exit handlers run last-registered first, and the function-local
#      statics that gloo and c10d create during training register their destructors when
#      first used, so a registration made any earlier would run after them.
# EASY_CONTEXT_EXIT_TEARDOWN=0 turns both off.
_teardown_registered = False


def register_exit_teardown() -> None:
    """Register the exit teardown above, once per process, if torch.distributed is initialised."""
    global _teardown_registered
    if _teardown_registered or os.environ.get("EASY_CONTEXT_EXIT_TEARDOWN", "1") == "0":
        return
    if not (dist.is_available() and dist.is_initialized()):
        return
    _teardown_registered = True
    atexit.register(_teardown)


def _teardown() -> None:
    release_groups()
    gc.collect()  # autograd graphs and modules that still hold a group
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as error:  # a peer already gone: nothing left to release in order
            print(f"easy_context: destroy_process_group at exit failed ({error})", file=sys.stderr)
    _skip_cxx_static_destructors_at_exit()


def _skip_cxx_static_destructors_at_exit() -> None:
    try:
        libc = ctypes.CDLL(None)
        on_exit, exit_now = libc.on_exit, libc._exit  # glibc; elsewhere only step 1 runs
    except (AttributeError, OSError):
        return
    # on_exit calls function(status, arg); _exit reads only the status
    on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    on_exit(ctypes.cast(exit_now, ctypes.c_void_p), None)
