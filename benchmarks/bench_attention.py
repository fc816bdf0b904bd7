#!/usr/bin/env python
"""Benchmark ONE attention layer (causal or masked), forward + backward, under sequence parallelism on CPU.

Side by side, in one run, for every mask, sequence length and world size asked for:

  baseline            one process, 2 threads, the whole sequence through
                      torch.nn.functional.scaled_dot_product_attention (is_causal, enable_gqa)
                      (causal mask only)
  <easy_context mode> P spawned processes over gloo (file:// rendezvous), one per rank,
                      max(1, 2 // P) threads each, each holding its shard of q/k/v in the
                      mode's own layout and calling the mode's attention exactly as
                      easy_context.hf does: get_mode(name).attention(q, k, v, scale, groups,
                      mask=...). Every mode in easy_context.BUILT_MODES except data_parallel;
                      modes added later are picked up automatically.
  deepspeed_ulysses   DeepSpeed's own HF Ulysses (UlyssesSPAttentionHF) at the same P on a
                      gloo group, torch SDPA as its inner attention (when deepspeed is missing
                      or fails, its row says why instead) (causal mask only: it cannot take
                      easy_context's masks)
  <peer>              other projects' attention (--peers; scripts/bench_peers.py: axolotl-ringmaster's
                      ring / zigzag / distflash / Ulysses / USP, lucidrains' ring and striped ring),
                      P > 1, causal only, always checked against SDPA: a wrong peer is flagged WRONG
                      in its row, one that cannot run gets the reason; neither fails the run

Masks (--masks, comma separated; default causal). Each is an easy_context.core.masking.SequenceMask
over the whole sequence (SequenceMask.from_positions(position_ids).with_window(w), documents
packed back to back, position_ids restarting at 0 at each document start), built on every rank
before the steps; the modes skip the work it rules out (blocks, ring steps, transfers):

  causal              one document, plain causal attention: today's rows (the modes get mask=None)
  packed-<n>          S/n documents of n tokens each (packed-1k: n = 1024; a shorter last one
                      when n does not divide S)
  long-tail           log-normal document lengths, scripts/mask_balance.py's
                      long_tailed_lengths(S, random.Random(--seed))
  window-<n>          one document, sliding window of n keys (window-1k: n = 1024)

Every row has mask and allowed_ratio: allowed (query, key) pairs / the causal S(S+1)/2 per
batch row (1 for causal). A masked mode's row has no speed-up, efficiency or analytic traffic
(those describe the causal algorithm against the causal baseline); instead, after the main
table, a summary compares each masked row with the same mode's causal row at the same S and P:
time ratio against the ideal ratio allowed_ratio, and the saving achieved (1 - time ratio)
against the ideal saving (1 - allowed_ratio). The mask's kernel-call plan is built during the
warm-up step (in a model one plan serves every layer), so it is not in the measured time.

Every configuration runs in fresh processes (unless --shared-processes), so memory numbers
do not leak between configurations. Measured per configuration:

  time        median over --iters steps, after one warm-up step, of the fwd+bwd wall time;
              per step the slowest rank counts (ranks start each step on a barrier)
  peak MiB    per rank: ru_maxrss (getrusage RUSAGE_SELF) after the last step minus the RSS
              read from /proc/self/statm just before the first (warm-up) step: how much the
              resident set grew at its peak while the steps ran, inputs already allocated.
              The kernel's high-water mark is reset (/proc/self/clear_refs <- 5) right before,
              so earlier transient allocations do not count. The CSV also has the same number
              for the measured steps alone (peak_mib_measured_steps_per_rank). glibc keeps
              some freed memory, so RSS overstates live tensors; --exact-memory removes that.
  comm MiB    per rank per fwd+bwd: analytic (see analytic_comm_bytes), and as counted by
              wrapping torch.distributed's batch_isend_irecv / all_to_all_single / all_gather
  busy check  CPU time used by processes other than the ranks while a configuration ran
              (/proc/stat minus the ranks' own rusage); over 10% of the cores flags the row
              (and --retry-busy measures it again)

--check compares every row with SDPA on the whole sequence; a masked row with SDPA given the
dense boolean mask of the same rule (query i attends key j iff first_key[i] <= j <= i and
i - j < window), built from the document lengths, not from SequenceMask (small S only).

Usage:
  python scripts/bench_attention.py --seq-len 4096,8192,16384 --csv out.csv --plot out.png
  python scripts/bench_attention.py --seq-len 16384 --masks causal,packed-1k,long-tail,window-1k
  python scripts/bench_attention.py --smoke        # S=256, 1 step, checks vs SDPA; 15-30 s
  python scripts/bench_attention.py --smoke-masks  # S=256, P=2, every kind of mask, checks; ~30 s
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import math
import multiprocessing as mp
import os
import queue as queue_module
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import types

# Keep the driver process free of torch: spawned children inherit (through fork+exec) the
# parent's high-water RSS into their own ru_maxrss, so a light parent keeps that number honest.

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_peers  # noqa: E402  (other projects' attention: adapters, checks, summary table)
CPU_CORES = 2  # the machine this benchmark is written for (see docs/benchmarks.md)
BASELINE = "baseline"
DEEPSPEED = "deepspeed_ulysses"
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
MiB = 1024 * 1024


# ----------------------------------------------------------------------------------- modes
def probe(want_deepspeed: bool, masks=(), seq_lens=(), seed=0):
    """(easy_context's sequence-parallel modes, why deepspeed cannot run or None,
    {(mask, S): allowed_ratio}), found in a throwaway child so that the driver never
    imports torch."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_probe, args=(q, want_deepspeed, list(masks), list(seq_lens), seed))
    p.start()
    try:
        modes, ds_problem, ratios = q.get(timeout=300)
    except queue_module.Empty:
        modes, ds_problem, ratios = "probe timed out", "probe timed out", {}
    p.join(30)
    if p.is_alive():
        p.kill()
    if isinstance(modes, str):
        raise SystemExit(f"cannot import easy_context: {modes}")
    if isinstance(ratios, str):
        raise SystemExit(f"cannot build the masks: {ratios}")
    return [m for m in modes if m != "data_parallel"], ds_problem, ratios


def _probe(q, want_deepspeed, masks, seq_lens, seed):
    sys.path.insert(0, REPO_ROOT)
    os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        modes = list(import_easy_context_modes()[0].BUILT_MODES)
    except Exception as exc:
        modes = f"{type(exc).__name__}: {exc}"
    ratios = {}
    if not isinstance(modes, str):
        try:
            for name in masks:
                for S in seq_lens:
                    ratios[(name, S)] = allowed_ratio(name, S, seed)
        except Exception as exc:
            ratios = f"{type(exc).__name__}: {exc}"
    ds_problem = None
    # Only whether it is installed: importing it here would cost seconds; an import that
    # fails later is reported in deepspeed's own row (it always runs last).
    if want_deepspeed and importlib.util.find_spec("deepspeed") is None:
        ds_problem = "deepspeed is not installed (see docs/benchmarks.md for the CPU install)"
    q.put((modes, ds_problem, ratios))


def import_easy_context_modes():
    """(easy_context.modes, easy_context.core.groups), loaded without running the package's
    __init__, which imports transformers (~8 s per process here; none of it is used by the
    attention paths measured). Falls back to the normal import if that does not work."""
    if "easy_context" not in sys.modules:
        spec = importlib.util.find_spec("easy_context")  # locates the package, runs nothing
        if spec is not None and spec.submodule_search_locations:
            stub = types.ModuleType("easy_context")
            stub.__path__ = list(spec.submodule_search_locations)
            stub.__spec__ = spec
            sys.modules["easy_context"] = stub
            try:
                modes = importlib.import_module("easy_context.modes")
                return modes, importlib.import_module("easy_context.core.groups")
            except Exception:
                for name in [n for n in sys.modules if n == "easy_context" or n.startswith("easy_context.")]:
                    del sys.modules[name]
    return importlib.import_module("easy_context.modes"), importlib.import_module("easy_context.core.groups")


# ----------------------------------------------------------------------------------- masks
CAUSAL = "causal"
MASK_HELP = ("causal, packed-<n> (S/n documents of n tokens), long-tail (log-normal document lengths), "
             "window-<n> (one document, sliding window n); n may end in k (x1024), e.g. packed-1k")


def parse_mask(name: str):
    """(kind, n) for a --masks name; kind in causal, packed, long-tail, window. No torch here:
    the driver checks the names before anything runs."""
    if name in (CAUSAL, "long-tail"):
        return name, None
    kind, _, size = name.partition("-")
    if kind in ("packed", "window") and size:
        n = size[:-1] if size.endswith("k") else size
        if n.isdigit() and int(n) > 0:
            return kind, int(n) * (1024 if size.endswith("k") else 1)
    raise ValueError(f"unknown mask {name!r}; choose from {MASK_HELP}")


def _mask_balance():
    """scripts/mask_balance.py as a module (its long_tailed_lengths and packed_mask)."""
    if "_bench_mask_balance" not in sys.modules:
        import_easy_context_modes()  # its `from easy_context...` imports then skip transformers
        path = os.path.join(REPO_ROOT, "scripts", "mask_balance.py")
        spec = importlib.util.spec_from_file_location("_bench_mask_balance", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["_bench_mask_balance"]


def mask_documents(name: str, S: int, seed: int):
    """(document lengths summing to S, sliding window or None) of a --masks name."""
    kind, n = parse_mask(name)
    if kind == "packed":
        return [n] * (S // n) + ([S % n] if S % n else []), None
    if kind == "long-tail":
        import random

        return _mask_balance().long_tailed_lengths(S, random.Random(seed)), None
    return [S], (n if kind == "window" else None)


def sequence_mask(name: str, S: int, B: int, seed: int):
    """The SequenceMask the modes get for this mask (None for causal: today's call)."""
    if name == CAUSAL:
        return None
    lengths, window = mask_documents(name, S, seed)
    mask_balance = _mask_balance()
    mask = mask_balance.packed_mask(lengths)  # first_key (1, S)
    if B > 1:  # the same documents in every batch row
        mask = type(mask)(mask.first_key.expand(B, S).contiguous())
    return mask.with_window(window)


def allowed_ratio(name: str, S: int, seed: int) -> float:
    """Allowed (query, key) pairs / causal pairs S(S+1)/2 of one batch row."""
    if name == CAUSAL:
        return 1.0
    import torch

    mask = sequence_mask(name, S, 1, seed)
    index = torch.arange(S)
    return mask.allowed_pairs(index, index) / (S * (S + 1) / 2)


def dense_reference_mask(torch, name: str, S: int, seed: int):
    """(S, S) bool, True = query i may attend key j: first_key[i] <= j <= i and i - j < window,
    first_key from the document lengths (independent of SequenceMask); for --check."""
    lengths, window = mask_documents(name, S, seed)
    lengths = torch.tensor(lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    first_key = torch.repeat_interleave(starts, lengths)
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    allowed = (first_key[:, None] <= j) & (j <= i)
    if window is not None:
        allowed &= (i - j) < window
    return allowed


# ------------------------------------------------------------------------ analytic comm
def analytic_comm_bytes(config, S, P, B, Hq, Hkv, D, dtype):
    """Bytes one rank sends per fwd+bwd, from the algorithm (None when not derived).

    ring (zigzag_ring_attn, and the ring part of usp_attn):
        forward   K and V shards rotate P-1 times                 2 (P-1) kv
        backward  K and V rotate P-1 times again                  2 (P-1) kv
                  dK/dV accumulators (fp32) go straight back      2 (P-1) kv_acc
                  to their owner, once per borrowed K/V block
        (causal, unmasked: every step is needed; masks skip steps and transfers)
    Ulysses (ulysses_attn, usp_attn's Ulysses part, deepspeed_ulysses):
        forward   all-to-all of q, k, v and the output            4 x (P-1)/P of each
        backward  all-to-all of dout, dq, dk, dv                  4 x (P-1)/P of each
        K/V heads are replicated first when Hkv does not split over P.
    deepspeed_ulysses also all-gathers position_ids (int64) once per forward.
    """
    if config == BASELINE or P == 1:
        return 0
    e = DTYPE_BYTES[dtype]
    acc = max(e, 4)  # accumulation dtype: promote(dtype, fp32)
    S_l = S // P
    q_elems = B * Hq * S_l * D

    def ulysses(U):
        rep = math.lcm(Hkv, U) // Hkv
        kv_elems = B * Hkv * rep * S_l * D
        frac = (U - 1) / U
        return 2 * frac * (q_elems + 2 * kv_elems + q_elems) * e, rep

    def ring(R, kv_elems):
        if R == 1:
            return 0
        return 2 * (R - 1) * kv_elems * e * 2 + 2 * (R - 1) * kv_elems * acc

    if config == "zigzag_ring_attn":
        return ring(P, B * Hkv * S_l * D)
    if config in ("ulysses_attn", "usp_attn"):  # usp_attn is run with its default ring_degree=1
        return ulysses(P)[0]
    if config == DEEPSPEED:
        rep = max(1, P // Hkv)  # DeepSpeed replicates K/V heads by P // Hkv when P > Hkv
        kv_elems = B * Hkv * rep * S_l * D
        frac = (P - 1) / P
        return 2 * frac * (2 * q_elems + 2 * kv_elems) * e + (P - 1) * B * S_l * 8
    return None


def dist_flash_comm_bytes(rounds, S, P, B, Hq, Hkv, D, dtype):
    """Bytes per rank (the busiest) per fwd+bwd for dist_flash_attn, walking its schedule.

    Every round t >= 1, for each unit whose worker is not the owner of its queries or K/V:
        forward   q-owner -> worker: its query rows;  kv-owner -> worker: K and V
                  worker -> q-owner: partial out rows + their lse (fp32)
        backward  q-owner -> worker: q, dout, out rows + lse;  kv-owner -> worker: K and V
                  worker -> q-owner: dq rows (fp32);  worker -> kv-owner: dK and dV (fp32)
    """
    e, acc = DTYPE_BYTES[dtype], max(DTYPE_BYTES[dtype], 4)
    S_l = S // P
    sent = [0] * P
    for units in rounds[1:]:
        for u in units:
            rows = len(range(S_l)[u.rows(S_l)])
            q_rows, lse_rows, kv = B * Hq * rows * D, B * Hq * rows, B * Hkv * S_l * D
            if u.q_owner != u.worker:
                sent[u.q_owner] += q_rows * e + (3 * q_rows * e + lse_rows * 4)
                sent[u.worker] += q_rows * e + lse_rows * 4 + q_rows * acc
            if u.kv_owner != u.worker:
                sent[u.kv_owner] += 2 * kv * e * 2
                sent[u.worker] += 2 * kv * acc
    return max(sent)


# ----------------------------------------------------------------------------- workers
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _cpu_seconds() -> float:
    import resource

    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def _busy_cpu_seconds() -> float:
    """CPU seconds all processes on the machine have used since boot (/proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return float("nan")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class _CommCounter:
    """Counts the bytes this rank sends through torch.distributed while enabled."""

    instance = None

    @classmethod
    def install(cls, dist):
        cls.instance = cls(dist)

    def __init__(self, dist):
        self.dist, self.bytes, self.enabled = dist, 0, False
        self._isend = dist.isend
        orig_batch, orig_a2a, orig_ag = dist.batch_isend_irecv, dist.all_to_all_single, dist.all_gather
        counter = self

        def batch_isend_irecv(ops):
            if counter.enabled:
                for op in ops:
                    if getattr(op.op, "__name__", "") == "isend":
                        counter.bytes += op.tensor.numel() * op.tensor.element_size()
            return orig_batch(ops)

        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            if counter.enabled:
                size = dist.get_world_size(group)
                me = dist.get_rank(group)
                total = input.numel() * input.element_size()
                if input_split_sizes:
                    row = total // max(1, input.shape[0])
                    kept = input_split_sizes[me] * row
                else:
                    kept = total // size
                counter.bytes += total - kept
            return orig_a2a(output, input, output_split_sizes=output_split_sizes,
                            input_split_sizes=input_split_sizes, group=group, async_op=async_op)

        def all_gather(tensor_list, tensor, group=None, async_op=False):
            if counter.enabled:
                counter.bytes += (dist.get_world_size(group) - 1) * tensor.numel() * tensor.element_size()
            return orig_ag(tensor_list, tensor, group=group, async_op=async_op)

        dist.batch_isend_irecv = batch_isend_irecv
        dist.all_to_all_single = all_to_all_single
        dist.all_gather = all_gather


def _make_inputs(torch, shape_q, shape_kv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(shape_q, generator=g).to(dtype)
    k = torch.randn(shape_kv, generator=g).to(dtype)
    v = torch.randn(shape_kv, generator=g).to(dtype)
    dout = torch.randn(shape_q, generator=g).to(dtype)
    return q, k, v, dout


class _SetupError(Exception):
    """A configuration that cannot run (raised identically on every rank, before any step)."""


def _first_line(exc) -> str:
    return str(exc).splitlines()[0] if str(exc) else ""


def _worker(rank, world, specs, init_file, results):
    """One rank running `specs` in order (one spec: a fresh process per configuration).
    Puts ("ok", rank, index, dict) or ("error", rank, index, text) per spec; stops at the
    first error (its peers may be stuck in a collective by then)."""
    os.environ["OMP_NUM_THREADS"] = str(specs[0]["threads"])
    os.environ["DS_ACCELERATOR"] = "cpu"
    sys.path.insert(0, REPO_ROOT)
    for index, spec in enumerate(specs):
        try:
            import torch

            torch.set_num_threads(spec["threads"])
            result = _run_rank(torch, rank, world, spec, init_file)
            result["cpu_s"] = _cpu_seconds()  # this process so far (for the busy-machine check)
            results.put(("ok", rank, index, result))
        except _SetupError as exc:  # every rank stops here alike: go on with the next one
            results.put(("skipped", rank, index, str(exc)))
        except PeerFailure as exc:  # its row says why; no traceback
            results.put(("error", rank, index, str(exc)))
            return
        except BaseException as exc:  # noqa: BLE001 - every failure becomes a table row
            tb = traceback.format_exc(limit=6)
            sys.stderr.write(f"[{spec['config']} rank {rank}] {tb}\n")
            results.put(("error", rank, index, f"{type(exc).__name__}: {_first_line(exc)}"))
            return


def _run_rank(torch, rank, world, spec, init_file):
    import torch.nn.functional as F

    config, S, B, Hq, Hkv, D = spec["config"], spec["S"], spec["B"], spec["Hq"], spec["Hkv"], spec["D"]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[spec["dtype"]]
    scale = 1.0 / math.sqrt(D)
    dist, analytic, to_out = None, None, None
    peer = bench_peers.always_checked(config)  # a peer's (or DeepSpeed's) errors are reported, never fatal
    check = spec["check"] or peer
    if config != BASELINE:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
            _CommCounter.install(dist)
    counter = _CommCounter.instance

    # ---- the attention callable and this rank's inputs
    # Set-up fails the same way on every rank (shapes, layout, imports), before any step:
    # reported as this configuration's error, and the next configuration can still run.
    try:
        if config == BASELINE:
            def attend(q, k, v):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=Hkv != Hq)

            def shard(x):
                return x
        elif config == DEEPSPEED or peer:
            attend, shard, to_out = bench_peers.make(config, torch, F, dist, rank, world, spec, scale)
        else:
            modes, process_groups = import_easy_context_modes()
            mode = modes.get_mode(config)
            topology = mode.topology(world)
            groups = process_groups.get_groups(topology)
            layout = mode.layout(topology)
            layout.check_length(S)
            # over the whole sequence, identical on every rank; its plans are built in the warm-up
            seq_mask = sequence_mask(spec["mask"], S, B, spec["seed"])

            def attend(q, k, v):
                return mode.attention(q, k, v, scale, groups, mask=seq_mask)

            def shard(x):
                return layout.shard(x, groups.sp_rank, dim=2)

            if config == "dist_flash_attn" and spec["mask"] == CAUSAL:  # its analytic traffic depends on its schedule
                try:
                    schedule = importlib.import_module("easy_context.modes.dist_flash_schedule")
                    analytic = dist_flash_comm_bytes(schedule.balanced_schedule(world), S, world, B, Hq, Hkv, D, spec["dtype"])
                except Exception:  # the schedule API changed: leave the column empty
                    analytic = None

        # Inputs: global tensors from one seed (identical on every rank), sharded as the mode
        # shards them, then the globals are dropped (kept for --check). The high-water mark is
        # reset before the steps, so this transient does not count.
        gq, gk, gv, gdout = _make_inputs(torch, (B, Hq, S, D), (B, Hkv, S, D), dtype, spec["seed"])
        q, k, v, dout = (shard(x).contiguous() for x in (gq, gk, gv, gdout))
        if not check:
            del gq, gk, gv, gdout
        if to_out is not None:  # the layout the attention returns
            dout = to_out(dout)
        q, k, v = (x.requires_grad_() for x in (q, k, v))
    except Exception as exc:
        raise _SetupError(f"{type(exc).__name__}: {_first_line(exc)}") from exc

    def step():
        phase = "forward"
        try:
            out = attend(q, k, v)
            phase = "backward"
            out.backward(dout)
        except Exception as exc:
            if not peer:
                raise
            why = _first_line(exc)
            why = why[:why.index(". ") + 1] if ". " in why[:200] else why[:200]  # torch's dispatcher lists
            raise PeerFailure(f"{phase} fails: {type(exc).__name__}: {why}") from exc
        return out

    def clear():  # outside the timed region: no step starts with the previous step's grads
        for x in (q, k, v):
            x.grad = None

    # ---- measure
    if dist is not None:
        dist.barrier()
    import resource

    def peak_bytes():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    peak_reset = _reset_peak_rss()
    rss_before = _rss_bytes()  # just before the first (warm-up) step
    times = []
    if counter:
        counter.bytes, counter.enabled = 0, True
    n_steps = 1 + spec["iters"]
    for i in range(n_steps):
        if i == 1:  # also the measured steps alone, without one-off warm-up allocations
            peak_warmup = peak_bytes()
            _reset_peak_rss()
            rss_measured = _rss_bytes()
        if dist is not None:
            dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        clear()
    if counter:
        counter.enabled = False
    peak_steps = peak_bytes()
    result = {
        "times": times[1:],
        "peak_mib": (max(peak_warmup, peak_steps) - rss_before) / MiB,
        "peak_mib_measured": (peak_steps - rss_measured) / MiB,
        "peak_reset": peak_reset,
        "comm_counted": counter.bytes / n_steps if counter else 0,
        "comm_analytic": analytic,
    }
    if dist is not None:  # slowest rank per step
        t = torch.tensor(times[1:], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        result["times"] = t.tolist()

    # ---- correctness check against SDPA on the whole sequence (after measuring): with
    # --check, and always for peers; the max over ranks of each error
    if check:
        clear()
        out = step()
        ref, ref_dq, ref_dk, ref_dv = _reference(torch, F, spec, scale, (gq, gk, gv, gdout), dist, rank)
        if to_out is not None:
            ref = to_out(shard(ref))
        else:
            ref = shard(ref)
        errors = {"out": (out.detach() - ref).abs().max().item(),
                  "dq": (q.grad - shard(ref_dq)).abs().max().item(),
                  "dk": (k.grad - shard(ref_dk)).abs().max().item(),
                  "dv": (v.grad - shard(ref_dv)).abs().max().item()}
        if dist is not None:
            t = torch.tensor(list(errors.values()), dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            errors = dict(zip(errors, t.tolist()))
        result["errors"] = errors
        worst = max(errors.values())
        if peer:
            result["check"] = bench_peers.error_note(config, errors, spec["dtype"], Hq, Hkv)
        else:
            result["check"] = f"max err {worst:.1e}"
            if not worst < bench_peers.TOLERANCE[spec["dtype"]]:
                raise AssertionError(f"{config} ({spec['mask']}) differs from SDPA: {errors}")

    if dist is not None:
        dist.barrier()
    return result


def _reference(torch, F, spec, scale, inputs, dist, rank):
    """SDPA on the whole sequence: (out, dq, dk, dv), global. With spec["ref_dir"] computed once
    per shape, mask and seed for the whole run (by rank 0, saved there) and loaded by the rest."""
    path = None
    if spec.get("ref_dir"):
        key = "_".join(str(spec[k]) for k in ("S", "B", "Hq", "Hkv", "D", "dtype", "mask", "seed"))
        path = os.path.join(spec["ref_dir"], key + ".pt")
    if path is None:  # no cache: every rank computes it
        return _sdpa_reference(torch, F, spec, scale, inputs)
    # Decided by rank 0 alone and always followed by a barrier on every rank: a rank that looked
    # at the file on its own could skip the barrier its peers wait in.
    if (dist is None or rank == 0) and not os.path.exists(path):
        torch.save(_sdpa_reference(torch, F, spec, scale, inputs), path + ".tmp")
        os.replace(path + ".tmp", path)
    if dist is not None:
        dist.barrier()
    return torch.load(path)


def _sdpa_reference(torch, F, spec, scale, inputs):
    """SDPA on the whole sequence with every core (the other ranks wait): (out, dq, dk, dv)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(CPU_CORES)
    gq, gk, gv, gdout = inputs
    ref_q, ref_k, ref_v = (x.detach().clone().requires_grad_() for x in (gq, gk, gv))
    gqa = spec["Hkv"] != spec["Hq"]
    if spec["mask"] == CAUSAL:
        ref = F.scaled_dot_product_attention(ref_q, ref_k, ref_v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:  # the dense boolean mask of the same rule, on the whole sequence
        dense = dense_reference_mask(torch, spec["mask"], spec["S"], spec["seed"])
        ref = F.scaled_dot_product_attention(ref_q, ref_k, ref_v, attn_mask=dense, scale=scale, enable_gqa=gqa)
    ref.backward(gdout)
    torch.set_num_threads(threads)
    return ref.detach(), ref_q.grad, ref_k.grad, ref_v.grad


class PeerFailure(Exception):
    """A peer's step failed (the message says which phase and why): its row, not the run."""


# ------------------------------------------------------------------------------ driver
def run_group(specs, world, timeout):
    """Runs `specs` in order in `world` fresh processes; returns one result dict per spec
    ({"error": why} for a configuration that failed or never ran)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    got = {i: {} for i in range(len(specs))}
    errors = {}
    busy_before, wall_before = _busy_cpu_seconds(), time.time()
    with tempfile.TemporaryDirectory(prefix="bench_attn_") as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_worker, args=(r, world, specs, init_file, results), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        expected, received = world * len(specs), 0
        deadline = time.time() + timeout * len(specs)
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
        # CPU used by processes other than ours meanwhile (up to the last result: what the
        # ranks do afterwards, shutting down, is ours but no longer counted as ours)
        busy_after, wall_after = _busy_cpu_seconds(), time.time()
        fatal = any(i not in errors or len(got[i]) < world for i in errors)
        for p in procs:
            p.join(5 if not fatal else 1)
        for p in procs:  # only the processes started here
            if p.is_alive():
                p.kill()
                p.join(5)
    ours = sum(max((got[i][r].get("cpu_s", 0) for i in got if r in got[i]), default=0) for r in range(world))
    others = max(0.0, busy_after - busy_before - ours)
    window = wall_after - wall_before
    out = []
    for index in range(len(specs)):
        ranks = got[index]
        if index in errors:
            out.append({"error": errors[index]})
        elif len(ranks) < world:
            why = errors.get(-1) or (f"not run: {specs[min(errors)]['config']} failed before it" if errors
                                     else f"timed out after {timeout} s")
            out.append({"error": why})
        else:
            times = ranks[0]["times"]  # already the max over ranks, on every rank
            out.append({
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
            })
    return out


def _int_list(text):
    return [int(x) for x in str(text).split(",") if x.strip()]


SMOKE_MASKS = "causal,packed-64,long-tail,window-64"
SMOKE_MASK_MODES = "zigzag_ring_attn,dist_flash_attn"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", default="8192", help="sequence length(s), comma separated (default 8192)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="fp32")
    p.add_argument("--world-sizes", default="2", help="numbers of ranks P, comma separated (default 2)")
    p.add_argument("--modes", default="all",
                   help=f"comma list of {BASELINE}, easy_context mode names, {DEEPSPEED}; 'all' (default) = every one")
    p.add_argument("--peers", default=None,
                   help="other projects' attention, comma list of names or packages (ringmaster, lucidrains), 'all' "
                        "or 'none'; default: all, unless --modes or --smoke/--smoke-masks is given (then none). "
                        "Peers run at P > 1, causal only, each in fresh processes, and are always checked against "
                        "SDPA (a wrong or failing peer is marked in its row, never fails the run); see "
                        "scripts/bench_peers.py")
    p.add_argument("--peer-max-gib", type=float, default=3.5, metavar="GiB",
                   help="skip a peer whose estimated memory (S_local^2 fp32 score blocks) is over this per rank")
    p.add_argument("--peer-max-gib-total", type=float, default=7.5, metavar="GiB",
                   help="... or over this for all P ranks together")
    p.add_argument("--masks", default=None,
                   help=f"attention masks, comma separated (default {CAUSAL}): {MASK_HELP}. The baseline and "
                        f"{DEEPSPEED} run for {CAUSAL} only")
    p.add_argument("--iters", type=int, default=3, help="measured steps after one warm-up (default 3)")
    p.add_argument("--check", action="store_true", help="after timing, compare outputs and gradients with SDPA on the whole sequence (fails the run on a "
                        "mismatch); a masked row's SDPA gets a dense S x S boolean mask: small S only")
    p.add_argument("--timeout", type=int, default=600, help="seconds per configuration before it is stopped")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                   help="before each configuration wait up to this long for the machine to be idle")
    p.add_argument("--retry-busy", type=int, default=0, metavar="N",
                   help="measure a configuration again (up to N times) when other processes used the cores meanwhile")
    p.add_argument("--csv", help="write the results as CSV here")
    p.add_argument("--plot", help="write a PNG of time vs sequence length here (needs several --seq-len)")
    p.add_argument("--shared-processes", action="store_true",
                   help="run all configurations of one P in the same processes (faster start-up; memory numbers then less clean)")
    p.add_argument("--exact-memory", action="store_true",
                   help="run the ranks with MALLOC_MMAP_THRESHOLD_=65536: freed tensors go back to the OS at once, "
                        "so RSS follows the live tensors (peak MiB without allocator caching); times may change a little")
    p.add_argument("--from-csv", metavar="PATH[,PATH...]",
                   help="run nothing: print the table (and write --csv/--plot) from earlier CSVs; rows of later "
                        "files replace the same config/S/P of earlier ones (e.g. a re-run on a quiet machine)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny run for CI: S=256, 1 iteration, --check, --shared-processes")
    p.add_argument("--smoke-masks", action="store_true",
                   help=f"tiny masked run for CI: as --smoke, with --masks {SMOKE_MASKS} and (unless given) "
                        f"--modes {SMOKE_MASK_MODES}")
    args = p.parse_args(argv)
    args.seq_lens = _int_list(args.seq_len)
    args.world_sizes = _int_list(args.world_sizes)
    if args.smoke or args.smoke_masks:
        args.seq_lens, args.iters, args.check, args.shared_processes = [256], 1, True, True
    if args.smoke_masks:
        args.masks = args.masks or SMOKE_MASKS
        args.modes = SMOKE_MASK_MODES if args.modes == "all" else args.modes
    if args.peers is None:
        args.peers = "none" if args.modes != "all" or args.smoke or args.smoke_masks else "all"
    try:
        bench_peers.select(args.peers)
    except ValueError as exc:
        p.error(str(exc))
    args.masks = list(dict.fromkeys(m.strip() for m in (args.masks or CAUSAL).split(",") if m.strip()))
    for name in args.masks:
        try:
            parse_mask(name)
        except ValueError as exc:
            p.error(str(exc))
    return args


def _num(x, fmt):
    return "" if x is None or x == "" else format(x, fmt)


def format_table(rows):
    header = ["config", "S", "P", "time (s)", "speed-up", "efficiency", "peak MiB/rank",
              "comm MiB/rank (analytic)", "comm MiB/rank (counted)", "mask", "allowed ratio", "notes"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append("| " + " | ".join([
            r["config"], str(r["S"]), str(r["P"]), _num(r["time_s"], ".3f"), _num(r["speedup"], ".2f"),
            _num(r["efficiency"], ".2f"), r["peak_mib_per_rank"], _num(r["comm_mib_analytic"], ".1f"),
            _num(r["comm_mib_counted"], ".1f"), r.get("mask") or CAUSAL, _num(r.get("allowed_ratio"), ".3f"),
            r["notes"],
        ]) + " |")
    return "\n".join(lines)


def format_mask_summary(rows):
    """Masked rows against the same mode's causal row (same S and P); "" when none was run."""
    causal = {(r["config"], r["S"], r["P"]): r["time_s"] for r in rows
              if (r.get("mask") or CAUSAL) == CAUSAL and r["time_s"]}
    masked = [r for r in rows if (r.get("mask") or CAUSAL) != CAUSAL and r["time_s"]]
    if not masked:
        return ""
    header = ["mode", "mask", "S", "P", "time s", "causal time s", "time ratio", "ideal ratio (allowed/causal)",
              "saving achieved / ideal saving"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in masked:
        ideal = r.get("allowed_ratio")
        base = causal.get((r["config"], r["S"], r["P"]))
        if base:
            ratio = r["time_s"] / base
            saving = f"{1 - ratio:.2f} / " + ("—" if ideal is None else f"{1 - ideal:.2f}")
            if ideal is not None and 1 - ideal > 1e-9:
                saving += f" ({(1 - ratio) / (1 - ideal):.0%})"
            cells = [f"{base:.3f}", f"{ratio:.2f}", _num(ideal, ".3f") or "—", saving]
        else:
            cells = ["—", "—", _num(ideal, ".3f") or "—", "—"]
        lines.append("| " + " | ".join([r["config"], r["mask"], str(r["S"]), str(r["P"]),
                                         f"{r['time_s']:.3f}", *cells]) + " |")
    return "\n".join(lines)


def plot(rows, path):
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed; no plot written ({path})")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = {}
    for r in rows:
        if r["time_s"] not in (None, ""):
            label = r["config"] if r["config"] == BASELINE else f"{r['config']} (P={r['P']})"
            if (r.get("mask") or CAUSAL) != CAUSAL:
                label += f" {r['mask']}"
            series.setdefault(label, []).append((r["S"], r["time_s"], "BUSY" in (r.get("notes") or "")))
    any_busy = False
    for label, points in series.items():
        points.sort()
        line, = ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                        linestyle="--" if label == BASELINE else "-", label=label)
        busy = [p for p in points if p[2]]
        if busy:  # measured while other processes used the cores: hollow marker
            any_busy = True
            ax.plot([p[0] for p in busy], [p[1] for p in busy], marker="o", linestyle="none",
                    markerfacecolor="white", markeredgecolor=line.get_color(), markersize=9)
    if any_busy:
        ax.text(0.99, 0.01, "hollow: measured on a busy machine", transform=ax.transAxes,
                ha="right", va="bottom", fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length S")
    ax.set_ylabel("fwd+bwd time (s), median")
    masks = sorted({r.get("mask") or CAUSAL for r in rows})
    ax.set_title("One attention layer fwd+bwd on CPU (gloo), 2 cores"
                 + ("" if masks == [CAUSAL] else f"; masks: {', '.join(masks)}"))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def rows_from_csv(paths):
    """Rows of earlier runs; a row of a later file replaces the same (config, S, P, mask) of an
    earlier one. Files from before masks were measured are causal rows. Speed-up and
    efficiency are recomputed against the (causal) baseline row of each S, for causal rows."""
    merged = {}
    for path in paths:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                for key in ("S", "P", "threads_per_rank"):
                    row[key] = int(row[key])
                row["mask"] = row.get("mask") or CAUSAL  # before allowed_ratio: the CSV's column order
                for key in ("time_s", "speedup", "efficiency", "peak_mib_max", "comm_mib_analytic",
                            "comm_mib_counted", "others_cpu_s", "allowed_ratio", "err_out", "err_dq", "err_dk",
                            "err_dv"):
                    row[key] = float(row[key]) if row.get(key) not in (None, "") else None
                if row["allowed_ratio"] is None and row["mask"] == CAUSAL:
                    row["allowed_ratio"] = 1.0
                merged[(row["config"], row["S"], row["P"], row["mask"])] = row
    rows = list(merged.values())
    base = {r["S"]: r["time_s"] for r in rows if r["config"] == BASELINE and r["mask"] == CAUSAL and r["time_s"]}
    for r in rows:
        if r["time_s"] and r["S"] in base and r["mask"] == CAUSAL:
            cores = min(CPU_CORES, r["P"] * r["threads_per_rank"])
            r["speedup"] = base[r["S"]] / r["time_s"]
            r["efficiency"] = base[r["S"]] / (r["time_s"] * cores / CPU_CORES)
    order = {c: i for i, c in enumerate([BASELINE])}
    masks = list(dict.fromkeys([CAUSAL] + [r["mask"] for r in rows]))
    rows.sort(key=lambda r: (masks.index(r["mask"]), r["S"], r["P"] if r["config"] != BASELINE else 0,
                             order.get(r["config"], 1)))
    return rows


def write_outputs(rows, args, seq_lens):
    print()
    print(format_table(rows))
    peer_table = bench_peers.summary(rows, args.dtype)
    if peer_table:
        print()
        print("peers: errors against SDPA on the whole sequence (max over ranks); ratios of our fastest / "
              "lowest-peak mode at the same S and P over each exact peer's")
        print(peer_table)
    summary = format_mask_summary(rows)
    if summary:
        print()
        print("masked rows against the same mode's causal row (same S, P): saving = 1 - time / causal time, "
              "ideal saving = 1 - allowed ratio")
        print(summary)
    if args.csv:
        fields = list(dict.fromkeys(k for r in rows for k in r))
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
        print(f"csv written to {args.csv}")
    if args.plot:
        if len(set(seq_lens)) > 1:
            plot(rows, args.plot)
        else:
            print("one sequence length only: no plot (give several --seq-len values)")


def main(argv=None):
    args = parse_args(argv)
    if args.from_csv:
        rows = rows_from_csv(args.from_csv.split(","))
        write_outputs(rows, args, [r["S"] for r in rows])
        return 0
    started = time.time()
    if args.exact_memory:  # read by glibc when each spawned rank starts
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    wanted_names = None if args.modes == "all" else [m.strip() for m in args.modes.split(",") if m.strip()]
    mine, ds_problem, ratios = probe(wanted_names is None or DEEPSPEED in wanted_names,
                                     args.masks, args.seq_lens, args.seed)
    known = [BASELINE, *mine, DEEPSPEED]
    peers = bench_peers.select(args.peers)

    def no_run(config, S, P):  # why a configuration gets its row without running, or None
        if config == DEEPSPEED:
            return ds_problem
        if bench_peers.is_peer(config):
            return bench_peers.not_installed(config) or bench_peers.memory_skip(
                config, S, P, args.batch, args.heads, args.kv_heads, args.head_dim, args.peer_max_gib,
                args.peer_max_gib_total)
        return None
    wanted = known if wanted_names is None else wanted_names
    wanted = [m for m in wanted if m != DEEPSPEED] + [m for m in wanted if m == DEEPSPEED]  # DeepSpeed last
    unknown = [m for m in wanted if m not in known]
    if unknown:
        raise SystemExit(f"unknown --modes {unknown}; choose from {known}")

    shape = dict(B=args.batch, Hq=args.heads, Hkv=args.kv_heads, D=args.head_dim, dtype=args.dtype)
    print(f"# one attention layer fwd+bwd: B={args.batch} Hq={args.heads} Hkv={args.kv_heads} D={args.head_dim} "
          f"{args.dtype}; masks: {args.masks}; {args.iters} measured iters after 1 warm-up; modes: {wanted}"
          + (f"; peers: {peers}" if peers else "")
          + ("; configurations share processes" if args.shared_processes else "")
          + ("; --exact-memory" if args.exact_memory else ""), flush=True)
    if any(m != CAUSAL for m in args.masks) and {BASELINE, DEEPSPEED} & set(wanted):
        print(f"# {BASELINE} and {DEEPSPEED} run for the {CAUSAL} mask only", flush=True)
    rows = []
    base_times = {}  # S -> the causal baseline's time
    ref_dir = tempfile.mkdtemp(prefix="bench_attn_ref_")  # SDPA references for the checks, one per shape
    for S, P, work in _groups(args, wanted, peers, no_run):
        configs = [c for c, _ in work]
        specs = [dict(config=c, S=S, mask=mask, iters=args.iters, check=args.check, seed=args.seed, ref_dir=ref_dir,
                      threads=CPU_CORES if c == BASELINE else max(1, CPU_CORES // P), **shape)
                 for c, mask in work]
        for attempt in range(1 + args.retry_busy):
            if args.wait_idle:
                _wait_for_idle(args.wait_idle)
            t0, load = time.time(), _load_average()
            if len(configs) == 1 and no_run(configs[0], S, P):
                results = [{"error": no_run(configs[0], S, P)}]
                break
            results = run_group(specs, P, args.timeout)
            busy = [r for r in results if _busy(r)]
            if not busy or attempt == args.retry_busy:
                break
            print(f"  other processes used {busy[0]['others_cpu_s']:.0f} CPU-s during {configs}: "
                  "measuring again", flush=True)
        for spec, res in zip(specs, results):
            mask, causal = spec["mask"], spec["mask"] == CAUSAL
            print(f"  {spec['config']:>18} S={S} P={P}" + ("" if causal else f" {mask}") + ": "
                  + (f"{res['time']:.3f} s" if "error" not in res else res["error"] if no_run(spec["config"], S, P)
                     else f"FAILED ({res['error']})")
                  + (f"  [{time.time() - t0:.0f} s wall]" if len(specs) == 1 else ""), flush=True)
            if spec["config"] == BASELINE and "error" not in res:
                base_times[S] = res["time"]
            # a masked row does less work than the causal baseline: no speed-up against it
            rows.append(make_row(spec, P, res, base_times.get(S) if causal else None, args))
            rows[-1]["load_avg_before"] = round(load, 2)
            rows[-1]["mask"] = mask  # the CSV's last two columns (older CSVs: causal)
            rows[-1]["allowed_ratio"] = ratios.get((mask, S))
        if len(specs) > 1:
            print(f"  [{time.time() - t0:.0f} s wall for these {len(specs)}]", flush=True)

    shutil.rmtree(ref_dir, ignore_errors=True)
    write_outputs(rows, args, args.seq_lens)
    print(f"(total {time.time() - started:.0f} s)")
    # A failing easy_context mode fails the run (CI); a missing/failing DeepSpeed or peer does not.
    failed = [r for r in rows if r["time_s"] is None and r["config"] != DEEPSPEED and not bench_peers.is_peer(r["config"])]
    return 1 if failed else 0


def _groups(args, wanted, peers, no_run):
    """(S, P, [(config, mask), ...]) in the order they run, one process group each: every
    mask x every S x every P, one configuration per group; with --shared-processes one group
    per S and P holding every mode and mask. The baseline (P=1, whole sequence), DeepSpeed and
    the peers (P > 1 only) run for the causal mask only, after our modes; a peer always in
    processes of its own (a failing one stops its ranks), as does anything that gets its row
    without running (no_run: not installed, over the memory limit)."""
    parallel = [m for m in wanted if m not in (BASELINE, DEEPSPEED)]
    causal_only = ([DEEPSPEED] if DEEPSPEED in wanted else []) + peers if CAUSAL in args.masks else []

    def baseline(S):
        return [(S, 1, [(BASELINE, CAUSAL)])] if BASELINE in wanted and CAUSAL in args.masks else []

    def extra(S, P, shared):  # (configurations that join the shared group, groups of their own)
        mine = [c for c in causal_only if P > 1 or not bench_peers.is_peer(c)]
        alone = [c for c in mine if not shared or no_run(c, S, P) or bench_peers.is_peer(c)]
        return [(c, CAUSAL) for c in mine if c not in alone], [(S, P, [(c, CAUSAL)]) for c in alone]

    groups = []
    if args.shared_processes:
        for S in args.seq_lens:
            groups += baseline(S)
            for P in args.world_sizes:
                joining, own = extra(S, P, True)
                work = [(c, mask) for mask in args.masks for c in parallel] + joining
                groups += ([(S, P, work)] if work else []) + own
        return groups
    for mask in args.masks:
        for S in args.seq_lens:
            groups += baseline(S) if mask == CAUSAL else []
            for P in args.world_sizes:
                groups += [(S, P, [(c, mask)]) for c in parallel]
                groups += extra(S, P, False)[1] if mask == CAUSAL else []
    return groups


def _busy(res) -> bool:
    """Did other processes use more than 10% of the cores while this configuration ran?"""
    return "others_cpu_s" in res and res["others_cpu_s"] > 0.1 * CPU_CORES * res["window_s"]


def _wait_for_idle(max_wait: float) -> None:
    """Wait (at most max_wait s) until the machine is idle: < 5% of the cores busy over 3 s."""
    deadline = time.time() + max_wait
    while time.time() < deadline:
        before = _busy_cpu_seconds()
        time.sleep(3)
        if _busy_cpu_seconds() - before < 0.05 * CPU_CORES * 3:
            return
    print(f"  machine still busy after waiting {max_wait:.0f} s; measuring anyway", flush=True)


def _load_average() -> float:
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except OSError:
        return 0.0


def make_row(spec, P, res, base_time, args):
    config, S, threads = spec["config"], spec["S"], spec["threads"]
    analytic = analytic_comm_bytes(config, S, P, args.batch, args.heads, args.kv_heads, args.head_dim, args.dtype)
    if spec.get("mask", CAUSAL) != CAUSAL:  # the formulas are the causal algorithm's; masks skip transfers
        analytic = None
    row = dict(config=config, S=S, P=P, threads_per_rank=threads, time_s=None, speedup=None, efficiency=None,
               peak_mib_per_rank="", peak_mib_max=None, peak_mib_measured_steps_per_rank="",
               comm_mib_analytic=None if analytic is None else analytic / MiB, comm_mib_counted=None,
               others_cpu_s=None, times="", notes="", err_out=None, err_dq=None, err_dk=None, err_dv=None)
    if "error" in res:
        row["notes"] = res["error"].replace("|", "/")
        row["comm_mib_analytic"] = None
        return row
    row["time_s"] = res["time"]
    row["times"] = " ".join(f"{t:.4f}" for t in res["times"])
    row["peak_mib_per_rank"] = " / ".join(f"{max(m, 0):.0f}" for m in res["peak_mib"])
    row["peak_mib_max"] = max(res["peak_mib"])
    row["peak_mib_measured_steps_per_rank"] = " / ".join(f"{max(m, 0):.0f}" for m in res["peak_mib_measured"])
    row["comm_mib_counted"] = res["comm_counted"] / MiB
    if row["comm_mib_analytic"] is None and res.get("comm_analytic") is not None:
        row["comm_mib_analytic"] = res["comm_analytic"] / MiB
    for name, value in (res.get("errors") or {}).items():
        row[f"err_{name}"] = value
    notes = [res["check"]] if res["check"] else []
    if not res["peak_reset"]:
        notes.append("high-water mark not reset")
    row["others_cpu_s"] = round(res["others_cpu_s"], 1)
    if _busy(res):
        notes.append(f"BUSY MACHINE: other processes used {res['others_cpu_s']:.0f} CPU-s of "
                     f"{CPU_CORES * res['window_s']:.0f}; time inflated")
    row["notes"] = "; ".join(notes)
    if base_time:
        row["speedup"] = base_time / res["time"]
        # speed-up per core, relative to the baseline's cores (the same 2 cores here)
        cores = min(CPU_CORES, P * threads)
        row["efficiency"] = base_time / (res["time"] * cores / CPU_CORES)
    return row


if __name__ == "__main__":
    sys.exit(main())
