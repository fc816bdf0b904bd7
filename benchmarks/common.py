"""What every benchmark here shares: ranks in fresh processes, memory and CPU-time readers, and
the report writers (markdown tables, CSV, JSON).

No torch at import time: bench_attention's driver imports this, and a spawned child inherits
(through fork+exec) its parent's high-water RSS into its own ru_maxrss, so a light driver keeps
the children's peak numbers honest. Everything that needs torch imports it inside the function.
"""

from __future__ import annotations

import csv
import datetime
import json
import multiprocessing as mp
import os
import tempfile
import time

MiB = 1024 * 1024
EXACT_MEMORY_MMAP_THRESHOLD = "65536"


# ------------------------------------------------------------------------------- memory
def rss_bytes() -> int:
    """This process's resident set now (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def status_bytes(field: str) -> int:
    """A size field of /proc/self/status ("VmRSS:", "VmHWM:", ...) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def reset_peak_rss(required: bool = False) -> bool:
    """Resets the kernel's high-water RSS mark (VmHWM, ru_maxrss) to the current RSS; False when
    the kernel does not allow it (an OSError instead when `required`)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        if required:
            raise
        return False


def peak_rss_bytes() -> int:
    """ru_maxrss of this process (since the last reset_peak_rss), in bytes."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def use_exact_memory() -> None:
    """Ranks spawned from now on return freed tensors to the OS at once (glibc reads
    MALLOC_MMAP_THRESHOLD_ when each process starts), so their RSS follows the live tensors."""
    os.environ["MALLOC_MMAP_THRESHOLD_"] = EXACT_MEMORY_MMAP_THRESHOLD


def memory_total_gib() -> float:
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) / 2**20


# ----------------------------------------------------------------------------- CPU time
def cpu_seconds() -> float:
    """CPU time this process and its waited-for children have used."""
    import resource

    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def busy_cpu_seconds() -> float:
    """CPU seconds all processes on the machine have used since boot (/proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return float("nan")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def load_average() -> float:
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except OSError:
        return 0.0


def wait_for_idle(max_wait: float, cores: int) -> None:
    """Wait (at most max_wait s) until the machine is idle: < 5% of the cores busy over 3 s."""
    deadline = time.time() + max_wait
    while time.time() < deadline:
        before = busy_cpu_seconds()
        time.sleep(3)
        if busy_cpu_seconds() - before < 0.05 * cores * 3:
            return
    print(f"  machine still busy after waiting {max_wait:.0f} s; measuring anyway", flush=True)


# -------------------------------------------------------------------------------- ranks
def start_ranks(target, world: int, args: tuple, daemon: bool = False) -> list:
    """target(rank, world, *args) in `world` fresh (spawned) processes, started."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(rank, world, *args), daemon=daemon) for rank in range(world)]
    for p in procs:
        p.start()
    return procs


def run_to_end(target, world: int, args: tuple, timeout: float, what: str) -> None:
    """target(rank, world, *args) in `world` fresh processes, waited for; a RuntimeError naming
    `what` when a rank fails."""
    procs = start_ranks(target, world, args)
    for p in procs:
        p.join(timeout)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"{what}: a rank failed (exit codes {[p.exitcode for p in procs]})")


def init_gloo(rank: int, world: int, workdir: str, timeout_s: float | None = 600) -> None:
    """Joins the gloo process group of the ranks started on `workdir` (file:// rendezvous)."""
    import torch.distributed as dist

    timeout = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    dist.init_process_group("gloo", init_method=f"file://{workdir}/init", rank=rank, world_size=world, **timeout)


def write_result(workdir: str, rank: int, values) -> None:
    """A rank's numbers for spawn_ranks, space separated."""
    with open(f"{workdir}/result{rank}", "w") as f:
        f.write(" ".join(map(str, values)))


def spawn_ranks(worker, spec, world: int, timeout: float = 3600):
    """worker(rank, world, spec, workdir) in `world` fresh processes; the numbers each rank
    wrote with write_result (rank order), or None if a rank failed."""
    with tempfile.TemporaryDirectory() as workdir:
        procs = start_ranks(worker, world, (spec, workdir))
        for p in procs:
            p.join(timeout)
        if any(p.exitcode != 0 for p in procs):
            return None
        return [list(map(float, open(f"{workdir}/result{r}").read().split())) for r in range(world)]


# ------------------------------------------------------------------------------ reports
def int_list(text) -> list[int]:
    """ "4096,8192" -> [4096, 8192]."""
    return [int(x) for x in str(text).split(",") if x.strip()]


def table_header(columns) -> str:
    """The two first lines of a markdown table."""
    return "| " + " | ".join(columns) + " |\n" + "|" + "---|" * len(columns)


def table_row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def write_csv(path: str, rows, fields=None) -> None:
    """rows (dicts) as CSV; the columns are `fields`, or every key in the order first seen."""
    fields = fields if fields is not None else list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def write_json(path: str, report) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
