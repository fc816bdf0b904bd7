"""Runs a group of bench_attention configurations in fresh rank processes and gathers one
result per configuration, with the CPU time other processes used meanwhile (busy check)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import statistics
import tempfile
import time

from benchmarks.attention_config import CPU_CORES
from benchmarks.attention_rank import worker
from benchmarks.common import busy_cpu_seconds, start_ranks


def is_busy(res) -> bool:
    """Did other processes use more than 10% of the cores while this configuration ran?"""
    return "others_cpu_s" in res and res["others_cpu_s"] > 0.1 * CPU_CORES * res["window_s"]


def run_group(specs, world, timeout):
    """Runs `specs` in order in `world` fresh processes; returns one result dict per spec
    ({"error": why} for a configuration that failed or never ran)."""
    results = mp.get_context("spawn").Queue()
    busy_before, wall_before = busy_cpu_seconds(), time.time()
    with tempfile.TemporaryDirectory(prefix="bench_attn_") as tmp:
        procs = start_ranks(worker, world, (specs, os.path.join(tmp, "init"), results), daemon=True)
        got, errors = collect(results, procs, world, len(specs), timeout)
        # CPU used by processes other than ours meanwhile (up to the last result: what the
        # ranks do afterwards, shutting down, is ours but no longer counted as ours)
        busy_after, wall_after = busy_cpu_seconds(), time.time()
        stop(procs, fatal=any(i not in errors or len(got[i]) < world for i in errors))
    ours = sum(max((got[i][r].get("cpu_s", 0) for i in got if r in got[i]), default=0) for r in range(world))
    others = max(0.0, busy_after - busy_before - ours)
    window = wall_after - wall_before
    return [summarize(got[index], errors, index, specs, world, timeout, others, window) for index in range(len(specs))]


def collect(results, procs, world, n_specs, timeout):
    """({spec index: {rank: result}}, {spec index or -1: why it failed}) from the ranks' queue,
    until every rank reported every spec, the ranks stopped, or the time is up."""
    got = {i: {} for i in range(n_specs)}
    errors = {}
    expected, received = world * n_specs, 0
    deadline = time.time() + timeout * n_specs
    while received < expected and time.time() < deadline:
        try:
            status, rank, index, payload = results.get(timeout=1.0)
        except queue_module.Empty:
            if results.empty() and any(p.exitcode not in (None, 0) for p in procs):
                errors.setdefault(-1, f"a rank died (exit codes {[p.exitcode for p in procs]})")
                break
            if results.empty() and all(p.exitcode is not None for p in procs):
                break  # everyone stopped (after an error)
            continue
        received += 1
        if status == "skipped":  # could not be set up; the ranks went on to the next one
            errors.setdefault(index, payload)
        elif status == "error":
            errors.setdefault(index, payload)
            # the peers may now hang in a collective: give them a moment, then stop them
            deadline = min(deadline, time.time() + 10)
        else:
            got[index][rank] = payload
    return got, errors


def stop(procs, fatal):
    for p in procs:
        p.join(5 if not fatal else 1)
    for p in procs:  # only the processes started here
        if p.is_alive():
            p.kill()
            p.join(5)


def summarize(ranks, errors, index, specs, world, timeout, others, window):
    """One configuration's result from its ranks' results: the slowest rank's times, every
    rank's peaks, the busiest rank's counted traffic."""
    if index in errors:
        return {"error": errors[index]}
    if len(ranks) < world:
        why = errors.get(-1) or (
            f"not run: {specs[min(errors)]['config']} failed before it" if errors else f"timed out after {timeout} s"
        )
        return {"error": why}
    times = ranks[0]["times"]  # already the max over ranks, on every rank
    return {
        "time": statistics.median(times),
        "times": times,
        "peak_mib": [ranks[r]["peak_mib"] for r in range(world)],
        "peak_mib_measured": [ranks[r]["peak_mib_measured"] for r in range(world)],
        "peak_reset": all(ranks[r]["peak_reset"] for r in range(world)),
        "comm_counted": max(ranks[r]["comm_counted"] for r in range(world)),
        "comm_analytic": ranks[0].get("comm_analytic"),
        "check": ranks[0].get("check", ""),
        "errors": ranks[0].get("errors"),
        "others_cpu_s": others,
        "window_s": window,
    }
