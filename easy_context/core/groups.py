"""The process-group manager: world = dp_size x sp_size, and inside one SP group
sp_size = ring_degree x ulysses_degree.

Ranks [g*sp, (g+1)*sp) form SP group g and share one sequence; different SP groups read
different data. Inside an SP group, Ulysses groups are neighbouring ranks (fast links within
a node) and ring groups are strided ranks. Launchers number ranks node by node (node n holds
ranks [n*L, (n+1)*L) for L ranks per node), so a Ulysses degree that divides L keeps every
Ulysses group on one node and puts the ring across nodes; `ranks_per_node` reads L from the
launcher and `Placement` carries it (and the model's heads) to a mode's default split.

Every group comes from one cache keyed by its sorted rank list (group_for): where two kinds of
group hold the same ranks (SP and ring when ulysses_degree is 1, SP and Ulysses when
ring_degree is 1, any of them across topologies) they are one group object, so one
communicator and one set of buffers. A rank list of the whole world is the default group.

Clean exit, written once here: `destroy_groups` tears our groups and the process groups down in
order, `exit_process` ends a process with its exit code without the interpreter's teardown, and
the exit teardown (registered by get_groups) does both for a script that never asks.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import inspect
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "Topology",
    "Placement",
    "NODE_SIZE_VARIABLES",
    "ranks_per_node",
    "SeqParallelGroups",
    "get_groups",
    "group_for",
    "group_device",
    "release_groups",
    "destroy_groups",
    "exit_process",
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


# The launchers' count of processes on this rank's node: torchrun's (so also accelerate launch's,
# which runs torchrun), DeepSpeed's launcher (pdsh/ssh runners; its MPI runners export it too)
# and Open MPI's (mpirun, deepspeed --launcher openmpi). Each is set only in the processes the
# launcher starts. Slurm's SLURM_NTASKS_PER_NODE is not read: every process of an allocation
# inherits it, including one that spawns its ranks itself, where it would describe other tasks.
NODE_SIZE_VARIABLES = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")


def ranks_per_node(environ=None) -> int | None:
    """Processes per node as the launcher reports it (the first of NODE_SIZE_VARIABLES that is
    set), or None when none is."""
    environ = os.environ if environ is None else environ
    for name in NODE_SIZE_VARIABLES:
        value = environ.get(name, "").strip()
        if value:
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"{name}={value!r} is not a process count; set it to the number of ranks per node")
            return int(value)
    return None


@dataclass(frozen=True)
class Placement:
    """What a mode's default split may follow: ranks per node (None: all on one node) and the
    model's query and key/value head counts (None: unknown)."""

    ranks_per_node: int | None = None
    heads: int | None = None
    kv_heads: int | None = None

    def __post_init__(self):
        for name in ("ranks_per_node", "heads", "kv_heads"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"Placement {name}={value!r}: give a positive integer or None")

    def nodes_of(self, world_size: int) -> int | None:
        """Ranks per node when `world_size` ranks fill whole nodes of that size, else None."""
        node = self.ranks_per_node
        return node if node is not None and node < world_size and world_size % node == 0 else None


@dataclass(frozen=True)
class SeqParallelGroups:
    """This rank's groups; a group of one rank is None (nothing to communicate)."""

    topology: Topology
    sp_rank: int
    sp: object | None
    ring: object | None
    ulysses: object | None


class _PerWorld:
    """What we created for one default group; dropped when the default group changes."""

    def __init__(self, world):
        self.world = world
        self.device = group_device()
        self.by_ranks: dict = {}  # (sorted ranks, backend) -> group
        self.by_topology: dict = {}  # Topology -> SeqParallelGroups


_state: _PerWorld | None = None


def _per_world() -> _PerWorld:
    global _state
    if _state is None or _state.world is not dist.group.WORLD:
        _state = _PerWorld(dist.group.WORLD)
    return _state


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


def group_device() -> torch.device | None:
    """The CUDA device this rank's NCCL groups are bound to, or None off NCCL (gloo: nothing
    changes).

    A script that never calls torch.cuda.set_device stays on device 0, so a group's first
    collective (get_groups' barrier) would set its communicator up on device 0 while the model
    and the ring's transfers use cuda:LOCAL_RANK; NCCL would then set up a second communicator
    for that device lazily, at the first point-to-point on it, and in a masked round not every
    rank of the group takes part there, so a rank can wait for peers that never come. So
    before the first group exists, a rank still on device 0 moves to the default group's bound
    device, else to LOCAL_RANK (when that device exists: with one visible GPU per process,
    device 0 is right), and new groups are created bound to that device (device_id, where
    new_group takes it), which also sets their communicators up at creation, on every rank."""
    if not torch.cuda.is_available() or "nccl" not in str(dist.get_backend()):
        return None
    bound = getattr(dist.group.WORLD, "bound_device_id", None)  # init_process_group(device_id=)
    if bound is not None:
        target = bound.index
    else:
        local = os.environ.get("LOCAL_RANK", "")
        target = int(local) if local.isdigit() else None
    # torch has no public "was set_device called": device 0 with another device wanted is
    # taken as never set (two NCCL ranks cannot share device 0 anyway)
    never_set = torch.cuda.current_device() == 0
    if never_set and target is not None and 0 < target < torch.cuda.device_count():
        torch.cuda.set_device(target)
    return bound if bound is not None else torch.device("cuda", torch.cuda.current_device())


def group_for(ranks, backend: str | None = None):
    """The process group over `ranks` (in any order), created once per default group: equal rank
    lists get the same group object. A list of every rank is the default group (with the
    default backend).

    Collective like dist.new_group: every rank calls it with the same lists, in the same order.
    Whether a call creates a group depends only on that sequence of lists, so every rank
    creates the same groups in the same order. A rank outside `ranks` gets torch's
    non-member handle."""
    state, world, ranks = _per_world(), dist.get_world_size(), list(ranks)
    members = tuple(sorted(ranks))
    if not members or len(set(members)) != len(members) or not 0 <= members[0] <= members[-1] < world:
        raise ValueError(f"ranks={ranks} is not a group of this world; give distinct ranks in [0, {world - 1}]")
    if len(members) == world and backend is None:
        return dist.group.WORLD
    key = (members, backend)
    if key not in state.by_ranks:
        options = {"timeout": world_timeout(), "backend": backend}
        if state.device is not None and "device_id" in inspect.signature(dist.new_group).parameters:
            options["device_id"] = state.device
        state.by_ranks[key] = dist.new_group(list(members), **options)
    return state.by_ranks[key]


def _mine(rank_lists: list[list[int]], rank: int):
    """This rank's group among `rank_lists` (a partition of the world); every list goes through
    group_for on every rank. A group of one rank is None."""
    groups = [None if len(ranks) == 1 else group_for(ranks) for ranks in rank_lists]
    return next(group for ranks, group in zip(rank_lists, groups) if rank in ranks)


def get_groups(topology: Topology) -> SeqParallelGroups:
    if not (dist.is_available() and dist.is_initialized()):
        if topology.world_size != 1:
            raise RuntimeError(
                f"torch.distributed is not initialised but the topology needs {topology.world_size} ranks"
            )
        return SeqParallelGroups(topology, 0, None, None, None)
    if dist.get_world_size() != topology.world_size:
        raise ValueError(f"world size is {dist.get_world_size()}, not {topology.world_size}")
    state = _per_world()
    if topology not in state.by_topology:
        register_exit_teardown()
        _check_ranks_agree(topology, state.device)
        rank, world = dist.get_rank(), topology.world_size
        sp, u, r = topology.sp_size, topology.ulysses_degree, topology.ring_degree
        sp_lists = [list(range(g * sp, (g + 1) * sp)) for g in range(world // sp)]
        ulysses_lists = [first[i * u : (i + 1) * u] for first in sp_lists for i in range(r)]
        ring_lists = [first[j::u] for first in sp_lists for j in range(u)]
        groups = SeqParallelGroups(
            topology,
            topology.sp_rank(rank),
            _mine(sp_lists, rank),
            _mine(ring_lists, rank),
            _mine(ulysses_lists, rank),
        )
        # A collective on each new group before its first point-to-point: NCCL requires that
        # a group's first operation involve all of its ranks (dist_flash_attn's does not).
        # Each group once: a group serving two roles serves them on all of its ranks.
        distinct = {id(g): g for g in (groups.sp, groups.ring, groups.ulysses) if g is not None}
        for group in distinct.values():
            dist.barrier(group=group)
        if os.environ.get("EASY_CONTEXT_LOG_GROUPS", "0") == "1":
            mine = [next(ranks for ranks in lists if rank in ranks) for lists in (sp_lists, ulysses_lists, ring_lists)]
            # One write with its newline: the ranks of a node share the launcher's pipe, and
            # print's separate write of the newline let two ranks' lines run together.
            sys.stderr.write(
                f"easy_context groups: rank {rank} node {os.environ.get('GROUP_RANK', '?')} "
                f"sp={mine[0]} ulysses={mine[1]} ring={mine[2]}\n"
            )
            sys.stderr.flush()
        state.by_topology[topology] = groups
    return state.by_topology[topology]


def _check_ranks_agree(topology: Topology, device) -> None:
    """Every rank must build the same groups; a rank that derived another split (nodes with
    different process counts give different defaults) would otherwise wait forever."""
    mine = torch.tensor([topology.sp_size, topology.ring_degree], device=device or "cpu")
    pieces = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, mine)
    splits = [tuple(p.tolist()) for p in pieces]
    if len(set(splits)) > 1:
        seen = {split: splits.index(split) for split in splits}
        raise RuntimeError(
            "ranks disagree on the split of the SP group (sp_size, ring_degree): "
            + ", ".join(f"rank {rank} has {split}" for split, rank in seen.items())
            + "; give every node the same number of processes, or pass sp_size and ring_degree explicitly"
        )


def release_groups() -> None:
    """Forget the cached group handles, so that destroy_process_group() really frees them
    before the interpreter exits (a gloo group still referenced then can abort the process)."""
    global _state
    _state = None


def destroy_groups() -> None:
    """Forget our group handles, collect what still holds a group (autograd graphs, modules),
    then destroy the process groups while the interpreter is whole. Gloo groups still referenced
    at interpreter exit can abort a finished run ("terminate called without an active
    exception"). Call it after the last collective (and after releasing engines that hold groups,
    such as DeepSpeed's); recipes.launch.shutdown and the exit teardown below do."""
    release_groups()
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int = 0):
    """End the process with `code` after Python's own exit handlers (trackers such as wandb,
    logging, and the exit teardown below when registered) have run, but without the
    interpreter's teardown: the streams are flushed, then _exit.

    Why: that teardown runs C++ static destructors while threads of gloo and c10d may still
    exist, and rarely that aborts a finished run ("terminate called without an active
    exception", SIGABRT; seen once in six DeepSpeed runs, and in our test harness even after
    destroy_process_group). Whoever checks the exit code would call a finished run failed."""
    try:
        atexit._run_exitfuncs()  # what a normal exit would run first; the C++ teardown is what we skip
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


# ------------------------------------------------------------------------ exit teardown
# A script that ends without tearing distributed state down (a plain Trainer script, a custom
# loop) leaves gloo and c10d threads alive into the interpreter's teardown, and the C++
# destructors that run after it can abort a finished run ("terminate called without an active
# exception", about 1 run in 24 on gloo): torchrun then reports a failure. So, once the patch
# is applied (or prepare_trainer called) in a distributed process, we tear down at exit
# ourselves, in three steps:
#   1. a Python exit handler: destroy_groups, while the interpreter is whole (what a script that
#      calls destroy_groups itself, through recipes.launch.shutdown, has done already);
#   1b. wait (GIL released, at most 5 s) until no gloo worker thread is running: a process
#      group still referenced (by DDP, say) keeps its workers alive through destroy_process_group,
#      and a worker that drops a finished op's tensors after Python starts finalizing needs the
#      GIL, gets pthread_exit instead, and aborts inside a noexcept destructor (the "terminate"
#      above; backtrace: ProcessGroupGloo::runLoop -> TensorImpl::decref_pyobject ->
#      PyEval_AcquireThread -> pthread_exit). No API tells when a worker is idle: the thread
#      states in /proc do (Linux; elsewhere this step is skipped);
#   2. after Python has finished (its own exit handlers, module teardown, flushed streams),
#      glibc's on_exit calls _exit(status) with the process's own exit status, so the C++
#      static destructors that race those threads never run. The status is the one exit()
#      was given: 0, sys.exit's code, 1 after an unhandled exception. It is registered from
#      step 1, at exit: C exit handlers run last-registered first, and the function-local
#      statics that gloo and c10d create during training register their destructors when
#      first used, so a registration made any earlier would run after them.
# A script that knows its exit code ends through exit_process instead (recipes.launch.run_main):
# it runs these handlers, then _exit(code) skips the same destructors at once.
# EASY_CONTEXT_EXIT_TEARDOWN=0 turns all three off.
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
    try:
        destroy_groups()
    except Exception as error:  # a peer already gone: nothing left to release in order
        print(f"easy_context: destroy_process_group at exit failed ({error})", file=sys.stderr)
    _let_gloo_workers_finish()
    _skip_cxx_static_destructors_at_exit()


GLOO_WORKER_THREAD = "pt_gloo_runloop"  # the name torch gives ProcessGroupGloo's worker threads


def _gloo_worker_running() -> bool:
    """Whether a gloo worker thread of this process is running or runnable (state R)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread has ended
            continue
        name, state = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2]
        if name == GLOO_WORKER_THREAD and state == "R":
            return True
    return False


def _let_gloo_workers_finish(timeout: float = 5.0, quiet_polls: int = 3) -> None:
    """Sleep (the GIL released) until no gloo worker has run for `quiet_polls` polls in a row."""
    deadline, quiet = time.monotonic() + timeout, 0
    while quiet < quiet_polls and time.monotonic() < deadline:
        time.sleep(0.005)
        quiet = 0 if _gloo_worker_running() else quiet + 1


def _skip_cxx_static_destructors_at_exit() -> None:
    try:
        libc = ctypes.CDLL(None)
        on_exit, exit_now = libc.on_exit, libc._exit  # glibc; elsewhere only step 1 runs
    except (AttributeError, OSError):
        return
    # on_exit calls function(status, arg); _exit reads only the status
    on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    on_exit(ctypes.cast(exit_now, ctypes.c_void_p), None)
