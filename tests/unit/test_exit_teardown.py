"""The exit teardown's wait for gloo workers (easy_context/core/groups.py, step 1b): it sees a
thread named like gloo's worker while that thread runs, and returns once it stops."""

import ctypes
import sys
import threading
import time

import pytest

from easy_context.core import groups

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="thread states are read from /proc (Linux)")


def _spin_as_gloo_worker(started: threading.Event, stop: threading.Event) -> None:
    libc = ctypes.CDLL(None)
    libc.pthread_self.restype = ctypes.c_ulong
    libc.pthread_setname_np.argtypes = [ctypes.c_ulong, ctypes.c_char_p]
    libc.pthread_setname_np(libc.pthread_self(), groups.GLOO_WORKER_THREAD.encode())
    started.set()
    while not stop.is_set():
        sum(range(1000))  # runs (state R), taking the GIL in turns with the test


@pytest.mark.timeout(60)
def test_teardown_waits_while_a_gloo_worker_runs_and_not_after():
    assert not groups._gloo_worker_running()
    start = time.monotonic()
    groups._let_gloo_workers_finish(timeout=5.0)
    assert time.monotonic() - start < 1.0  # nothing to wait for: a few polls

    started, stop = threading.Event(), threading.Event()
    worker = threading.Thread(target=_spin_as_gloo_worker, args=(started, stop), daemon=True)
    worker.start()
    try:
        started.wait(10)
        assert any(groups._gloo_worker_running() for _ in range(50))
        start = time.monotonic()
        groups._let_gloo_workers_finish(timeout=0.5)
        assert time.monotonic() - start >= 0.5  # it waited for the running worker, up to the bound
    finally:
        stop.set()
        worker.join(10)
    start = time.monotonic()
    groups._let_gloo_workers_finish(timeout=5.0)
    assert time.monotonic() - start < 1.0
