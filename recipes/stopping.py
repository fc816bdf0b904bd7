"""Why a run stopped, said once: a rank that fails or is interrupted records it where its
peers read it, and Ctrl-C or SIGTERM becomes an interrupt instead of a traceback per rank.

- record_stop / peer_stop: the first rank to stop writes (its rank, exit code, kind) under one
  key of the launcher's store (the TCPStore at MASTER_ADDR:MASTER_PORT, torchrun's agent's, which
  outlives the ranks). A rank whose collective then breaks finds that a peer stopped on purpose
  and does not report the broken connection as the cause (recipes.launch.script_failures).
- install_signal_handlers: SIGINT and SIGTERM raise Interrupted in the main thread, once per
  run. SIGTERM is also how torchrun stops the other ranks after one failed: a rank that finds a
  peer's failure recorded raises StoppedByPeer instead, and prints its stack first when that
  peer saw a collective fail (this rank may be the one that was stuck). A main thread that does
  not get to the handler within STUCK_AFTER seconds (stuck inside a C++ call) prints every
  thread's stack from a watcher thread.
- same_command: the command line of this run with some flags replaced (the resume command).

Stdlib and torch only; recipes.launch uses it.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import json
import os
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "STUCK_AFTER",
    "Interrupted",
    "StoppedByPeer",
    "PeerStop",
    "install_signal_handlers",
    "record_stop",
    "peer_stop",
    "mark_stopping",
    "same_command",
    "this_rank",
]

STUCK_AFTER = 5.0  # seconds after a SIGTERM the main thread may take to reach a Python instruction
STORE_TIMEOUT = datetime.timedelta(seconds=3)  # connecting to the store, reading or writing the record


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM, as an exception in the main thread (a KeyboardInterrupt, so that code
    which lets Ctrl-C through lets this through)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def code(self) -> int:
        return 128 + self.signum  # the shell's code for a process ended by this signal


@dataclass(frozen=True)
class PeerStop:
    rank: int
    code: int
    kind: str  # "failed" (a refusal, exit 2/3), "collective" (a collective failed, exit 4), "interrupted"

    def __str__(self) -> str:
        return f"rank {self.rank} {'was interrupted' if self.kind == 'interrupted' else 'failed'}"


class StoppedByPeer(BaseException):
    """SIGTERM from the launcher after another rank failed: this rank stops without a message of
    its own (the failed rank printed the cause)."""

    def __init__(self, peer: PeerStop):
        super().__init__(str(peer))
        self.peer = peer


def this_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


# ------------------------------------------------------------------ the record in the store
_client = None  # this process's connection to the launcher's store (None: not made yet, False: none)


def _store():
    """A client of the launcher's store, or None outside a distributed run (or when it is gone)."""
    global _client
    import torch.distributed as dist

    if _client is None:
        _client = False
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and "MASTER_ADDR" in os.environ:
            try:
                _client = dist.TCPStore(
                    os.environ["MASTER_ADDR"],
                    int(os.environ["MASTER_PORT"]),
                    is_master=False,
                    timeout=STORE_TIMEOUT,
                    wait_for_workers=False,
                )
            except (RuntimeError, ValueError, OSError):  # the store's host is gone
                _client = False
    return _client or None


def _key() -> str:  # this attempt's (torchrun --max-restarts starts the ranks again)
    return f"easy_context/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/stopped"


def record_stop(kind: str, code: int) -> None:
    """Record that this rank stops (`kind` as PeerStop's), unless a rank recorded first."""
    store = _store()
    if store is None:
        return
    value = json.dumps({"rank": this_rank(), "code": code, "kind": kind})
    with contextlib.suppress(RuntimeError, ValueError, OSError):  # the store's host is gone: nobody to tell
        store.compare_set(_key(), "", value)  # the first rank's record stays


def peer_stop() -> PeerStop | None:
    """Another rank's record of its stop (the first one recorded), or None."""
    store = _store()
    if store is None:
        return None
    try:
        if not store.check([_key()]):
            return None
        record = json.loads(store.get(_key()))
    except (RuntimeError, ValueError, OSError):
        return None
    peer = PeerStop(int(record["rank"]), int(record["code"]), str(record["kind"]))
    return None if peer.rank == this_rank() else peer


# ------------------------------------------------------------------------------- signals
_handled = threading.Event()  # the main thread ran the handler for it
_stopping = threading.Event()  # this process is already on its way out: later signals change nothing


def mark_stopping() -> None:
    _stopping.set()


def _on_signal(signum, frame) -> None:
    _handled.set()
    if _stopping.is_set():
        return
    _stopping.set()  # one interrupt per run: the second Ctrl-C (or torchrun's copy of it) is ignored
    if signum == signal.SIGTERM:
        peer = peer_stop()
        if peer is not None and peer.kind != "interrupted":
            if peer.kind == "collective":  # the peer waited on this rank: show where it was
                faulthandler.dump_traceback(all_threads=True)
            raise StoppedByPeer(peer)
    record_stop("interrupted", 128 + signum)
    raise Interrupted(signum)


def _watch(read_fd: int) -> None:
    """Signals as bytes from the wakeup fd: a main thread that has not run the handler
    STUCK_AFTER seconds after a SIGTERM is stuck in a C++ call; print every thread's stack."""
    while True:
        try:
            received = os.read(read_fd, 64)
        except OSError:
            return
        if signal.SIGTERM in received and not _handled.is_set():
            time.sleep(STUCK_AFTER)
            if not _handled.is_set():
                print(f"rank {this_rank()}: stopped while stuck; its threads:", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(all_threads=True)


def install_signal_handlers() -> None:
    """SIGINT and SIGTERM as Interrupted (or StoppedByPeer) in the main thread, and the watcher."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _on_signal)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_watch, args=(read_fd,), daemon=True, name="easy_context-signals").start()


# ----------------------------------------------------------------------- the same command
def same_command(flags: dict[str, str], argv: list[str] | None = None, environ=None) -> str:
    """This run's command line with `flags` set (each replacing the flag's value, or added):
    launched as it was where that can be told (python, or torchrun on one node), else
    `<launcher> script ...`."""
    environ = os.environ if environ is None else environ
    argv = list(sys.argv if argv is None else argv)
    script, args = argv[0], argv[1:]
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in flags:
            skip = "=" not in arg
            continue
        kept.append(arg)
    for flag, value in flags.items():
        kept += [flag, value]
    world, local = int(environ.get("WORLD_SIZE", "1")), environ.get("LOCAL_WORLD_SIZE")
    if "TORCHELASTIC_RUN_ID" not in environ:
        launcher = [Path(sys.executable).name] if world == 1 else ["<launcher>"]
    elif local is not None and int(local) == world and not any(k.startswith("ACCELERATE_") for k in environ):
        launcher = ["torchrun", "--standalone", f"--nproc_per_node={local}"]
    else:  # several nodes, or accelerate launch: its own flags, which the ranks do not see
        launcher = ["<launcher>"]
    return " ".join([*launcher, *map(shlex.quote, [script, *kept])])
