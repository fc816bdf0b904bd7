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
  <peer>              other projects' attention (--peers; benchmarks/bench_peers.py: axolotl-ringmaster's
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
  long-tail           log-normal document lengths, benchmarks/mask_balance.py's
                      long_tailed_lengths(S, random.Random(--seed))
  window-<n>          one document, sliding window of n keys (window-1k: n = 1024)

Every row has mask and allowed_ratio: allowed (query, key) pairs / the causal S(S+1)/2 per
batch row (1 for causal). A masked mode's row has no speed-up, efficiency or analytic traffic
(those describe the causal algorithm against the causal baseline); instead, after the main
table, a summary compares each masked row with the same mode's causal row at the same S and P:
time ratio against the ideal ratio allowed_ratio, and the saving achieved (1 - time ratio)
against the ideal saving (1 - allowed_ratio). The mask's kernel calls are worked out during
the warm-up step (in a model they serve every layer), so it is not in the measured time.

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
  python -m benchmarks.bench_attention --seq-len 4096,8192,16384 --csv out.csv --plot out.png
  python -m benchmarks.bench_attention --seq-len 16384 --masks causal,packed-1k,long-tail,window-1k
  python -m benchmarks.bench_attention --smoke        # S=256, 1 step, checks vs SDPA; 15-30 s
  python -m benchmarks.bench_attention --smoke-masks  # S=256, P=2, every kind of mask, checks; ~30 s
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import queue as queue_module
import shutil
import sys
import tempfile
import time

# Keep the driver process free of torch: spawned children inherit (through fork+exec) the
# parent's high-water RSS into their own ru_maxrss, so a light parent keeps that number honest.
from benchmarks import bench_peers  # other projects' attention: adapters, checks, summary table
from benchmarks.attention_config import BASELINE, CPU_CORES, DEEPSPEED, DTYPE_BYTES, import_easy_context_modes
from benchmarks.attention_group import is_busy, run_group
from benchmarks.attention_masks import CAUSAL, MASK_HELP, allowed_ratio, parse_mask
from benchmarks.attention_report import make_row, rows_from_csv, write_outputs
from benchmarks.common import int_list, load_average, use_exact_memory, wait_for_idle

SMOKE_MASKS = "causal,packed-64,long-tail,window-64"
SMOKE_MASK_MODES = "zigzag_ring_attn,dist_flash_attn"


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


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seq-len", default="8192", help="sequence length(s), comma separated (default 8192)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="fp32")
    p.add_argument("--world-sizes", default="2", help="numbers of ranks P, comma separated (default 2)")
    p.add_argument(
        "--modes",
        default="all",
        help=f"comma list of {BASELINE}, easy_context mode names, {DEEPSPEED}; 'all' (default) = every one",
    )
    p.add_argument(
        "--peers",
        default=None,
        help="other projects' attention, comma list of names or packages (ringmaster, lucidrains), 'all' "
        "or 'none'; default: all, unless --modes or --smoke/--smoke-masks is given (then none). "
        "Peers run at P > 1, causal only, each in fresh processes, and are always checked against "
        "SDPA (a wrong or failing peer is marked in its row, never fails the run); see "
        "benchmarks/bench_peers.py",
    )
    p.add_argument(
        "--peer-max-gib",
        type=float,
        default=3.5,
        metavar="GiB",
        help="skip a peer whose estimated memory (S_local^2 fp32 score blocks) is over this per rank",
    )
    p.add_argument(
        "--peer-max-gib-total", type=float, default=7.5, metavar="GiB", help="... or over this for all P ranks together"
    )
    p.add_argument(
        "--masks",
        default=None,
        help=f"attention masks, comma separated (default {CAUSAL}): {MASK_HELP}. The baseline and "
        f"{DEEPSPEED} run for {CAUSAL} only",
    )
    p.add_argument("--iters", type=int, default=3, help="measured steps after one warm-up (default 3)")
    p.add_argument(
        "--check",
        action="store_true",
        help="after timing, compare outputs and gradients with SDPA on the whole sequence (fails the run on a "
        "mismatch); a masked row's SDPA gets a dense S x S boolean mask: small S only",
    )
    p.add_argument("--timeout", type=int, default=600, help="seconds per configuration before it is stopped")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--wait-idle",
        type=float,
        default=0,
        metavar="SECONDS",
        help="before each configuration wait up to this long for the machine to be idle",
    )
    p.add_argument(
        "--retry-busy",
        type=int,
        default=0,
        metavar="N",
        help="measure a configuration again (up to N times) when other processes used the cores meanwhile",
    )
    p.add_argument("--csv", help="write the results as CSV here")
    p.add_argument("--plot", help="write a PNG of time vs sequence length here (needs several --seq-len)")
    p.add_argument(
        "--shared-processes",
        action="store_true",
        help="run all configurations of one P in the same processes (faster start-up; memory numbers then less clean)",
    )
    p.add_argument(
        "--exact-memory",
        action="store_true",
        help="run the ranks with MALLOC_MMAP_THRESHOLD_=65536: freed tensors go back to the OS at once, "
        "so RSS follows the live tensors (peak MiB without allocator caching); times may change a little",
    )
    p.add_argument(
        "--from-csv",
        metavar="PATH[,PATH...]",
        help="run nothing: print the table (and write --csv/--plot) from earlier CSVs; rows of later "
        "files replace the same config/S/P of earlier ones (e.g. a re-run on a quiet machine)",
    )
    p.add_argument(
        "--smoke", action="store_true", help="tiny run for CI: S=256, 1 iteration, --check, --shared-processes"
    )
    p.add_argument(
        "--smoke-masks",
        action="store_true",
        help=f"tiny masked run for CI: as --smoke, with --masks {SMOKE_MASKS} and (unless given) "
        f"--modes {SMOKE_MASK_MODES}",
    )
    args = p.parse_args(argv)
    args.seq_lens = int_list(args.seq_len)
    args.world_sizes = int_list(args.world_sizes)
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


def main(argv=None):
    args = parse_args(argv)
    if args.from_csv:
        rows = rows_from_csv(args.from_csv.split(","))
        write_outputs(rows, args, [r["S"] for r in rows])
        return 0
    started = time.time()
    if args.exact_memory:
        use_exact_memory()
    wanted_names = None if args.modes == "all" else [m.strip() for m in args.modes.split(",") if m.strip()]
    mine, ds_problem, ratios = probe(
        wanted_names is None or DEEPSPEED in wanted_names, args.masks, args.seq_lens, args.seed
    )
    known = [BASELINE, *mine, DEEPSPEED]
    peers = bench_peers.select(args.peers)

    def no_run(config, S, P):  # why a configuration gets its row without running, or None
        if config == DEEPSPEED:
            return ds_problem
        if bench_peers.is_peer(config):
            return bench_peers.not_installed(config) or bench_peers.memory_skip(
                config,
                S,
                P,
                args.batch,
                args.heads,
                args.kv_heads,
                args.head_dim,
                args.peer_max_gib,
                args.peer_max_gib_total,
            )
        return None

    wanted = known if wanted_names is None else wanted_names
    wanted = [m for m in wanted if m != DEEPSPEED] + [m for m in wanted if m == DEEPSPEED]  # DeepSpeed last
    unknown = [m for m in wanted if m not in known]
    if unknown:
        raise SystemExit(f"unknown --modes {unknown}; choose from {known}")

    shape = dict(B=args.batch, Hq=args.heads, Hkv=args.kv_heads, D=args.head_dim, dtype=args.dtype)
    print(
        f"# one attention layer fwd+bwd: B={args.batch} Hq={args.heads} Hkv={args.kv_heads} D={args.head_dim} "
        f"{args.dtype}; masks: {args.masks}; {args.iters} measured iters after 1 warm-up; modes: {wanted}"
        + (f"; peers: {peers}" if peers else "")
        + ("; configurations share processes" if args.shared_processes else "")
        + ("; --exact-memory" if args.exact_memory else ""),
        flush=True,
    )
    if any(m != CAUSAL for m in args.masks) and {BASELINE, DEEPSPEED} & set(wanted):
        print(f"# {BASELINE} and {DEEPSPEED} run for the {CAUSAL} mask only", flush=True)
    rows = []
    base_times = {}  # S -> the causal baseline's time
    ref_dir = tempfile.mkdtemp(prefix="bench_attn_ref_")  # SDPA references for the checks, one per shape
    for S, P, work in _groups(args, wanted, peers, no_run):
        configs = [c for c, _ in work]
        specs = [
            dict(
                config=c,
                S=S,
                mask=mask,
                iters=args.iters,
                check=args.check,
                seed=args.seed,
                ref_dir=ref_dir,
                threads=CPU_CORES if c == BASELINE else max(1, CPU_CORES // P),
                **shape,
            )
            for c, mask in work
        ]
        for attempt in range(1 + args.retry_busy):
            if args.wait_idle:
                wait_for_idle(args.wait_idle, CPU_CORES)
            t0, load = time.time(), load_average()
            if len(configs) == 1 and no_run(configs[0], S, P):
                results = [{"error": no_run(configs[0], S, P)}]
                break
            results = run_group(specs, P, args.timeout)
            busy = [r for r in results if is_busy(r)]
            if not busy or attempt == args.retry_busy:
                break
            print(
                f"  other processes used {busy[0]['others_cpu_s']:.0f} CPU-s during {configs}: measuring again",
                flush=True,
            )
        for spec, res in zip(specs, results):
            mask, causal = spec["mask"], spec["mask"] == CAUSAL
            print(
                f"  {spec['config']:>18} S={S} P={P}"
                + ("" if causal else f" {mask}")
                + ": "
                + (
                    f"{res['time']:.3f} s"
                    if "error" not in res
                    else res["error"]
                    if no_run(spec["config"], S, P)
                    else f"FAILED ({res['error']})"
                )
                + (f"  [{time.time() - t0:.0f} s wall]" if len(specs) == 1 else ""),
                flush=True,
            )
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
    failed = [
        r for r in rows if r["time_s"] is None and r["config"] != DEEPSPEED and not bench_peers.is_peer(r["config"])
    ]
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


if __name__ == "__main__":
    sys.exit(main())
