"""One rank of bench_attention: builds the configuration's attention and this rank's inputs,
times the steps, reads the memory peaks, and (with --check, and always for peers) compares
with SDPA on the whole sequence. torch is imported inside the functions only (the driver
imports this module for `worker`; see benchmarks.common)."""

from __future__ import annotations

import math
import os
import sys
import time
import traceback

from benchmarks import bench_peers
from benchmarks.attention_comm import CommCounter
from benchmarks.attention_config import BASELINE, CPU_CORES, DEEPSPEED, import_easy_context_modes
from benchmarks.attention_masks import CAUSAL, dense_reference_mask, sequence_mask
from benchmarks.common import MiB, cpu_seconds, peak_rss_bytes, reset_peak_rss, rss_bytes

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


class SetupError(Exception):
    """A configuration that cannot run (raised identically on every rank, before any step)."""


class PeerFailure(Exception):
    """A peer's step failed (the message says which phase and why): its row, not the run."""


def first_line(exc) -> str:
    return str(exc).splitlines()[0] if str(exc) else ""


def worker(rank, world, specs, init_file, results):
    """One rank running `specs` in order (one spec: a fresh process per configuration).
    Puts ("ok", rank, index, dict) or ("error", rank, index, text) per spec; stops at the
    first error (its peers may be stuck in a collective by then)."""
    os.environ["OMP_NUM_THREADS"] = str(specs[0]["threads"])
    os.environ["DS_ACCELERATOR"] = "cpu"
    for index, spec in enumerate(specs):
        try:
            import torch

            torch.set_num_threads(spec["threads"])
            result = run_rank(torch, rank, world, spec, init_file)
            result["cpu_s"] = cpu_seconds()  # this process so far (for the busy-machine check)
            results.put(("ok", rank, index, result))
        except SetupError as exc:  # every rank stops here alike: go on with the next one
            results.put(("skipped", rank, index, str(exc)))
        except PeerFailure as exc:  # its row says why; no traceback
            results.put(("error", rank, index, str(exc)))
            return
        except BaseException as exc:  # noqa: BLE001 - every failure becomes a table row
            tb = traceback.format_exc(limit=6)
            sys.stderr.write(f"[{spec['config']} rank {rank}] {tb}\n")
            results.put(("error", rank, index, f"{type(exc).__name__}: {first_line(exc)}"))
            return


def run_rank(torch, rank, world, spec, init_file):
    import torch.nn.functional as F

    config = spec["config"]
    scale = 1.0 / math.sqrt(spec["D"])
    peer = bench_peers.always_checked(config)  # a peer's (or DeepSpeed's) errors are reported, never fatal
    check = spec["check"] or peer
    dist = None if config == BASELINE else join_group(rank, world, init_file)
    # Set-up fails the same way on every rank (shapes, layout, imports), before any step:
    # reported as this configuration's error, and the next configuration can still run.
    try:
        attend, shard, to_out, analytic = build_attention(torch, F, spec, dist, rank, world, scale, peer)
        tensors, inputs = rank_inputs(torch, spec, shard, to_out, keep_globals=check)
    except Exception as exc:
        raise SetupError(f"{type(exc).__name__}: {first_line(exc)}") from exc
    step = make_step(attend, tensors, peer)
    if dist is not None:
        dist.barrier()
    result = measure(step, tensors, dist, CommCounter.instance, spec["iters"])
    result["comm_analytic"] = analytic
    if dist is not None:  # slowest rank per step
        result["times"] = max_over_ranks(torch, dist, result["times"])
    if check:  # after measuring: the max over ranks of each error
        result.update(check_against_sdpa(torch, F, spec, scale, step, tensors, inputs, shard, to_out, dist, rank, peer))
    if dist is not None:
        dist.barrier()
    return result


def join_group(rank, world, init_file):
    """torch.distributed, joined (once per process) with its collectives counted."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
        CommCounter.install(dist)
    return dist


def build_attention(torch, F, spec, dist, rank, world, scale, peer):
    """(attend(q, k, v), shard(global tensor), to_out or None, analytic bytes or None) of the
    configuration; to_out turns a tensor in the shard layout into the layout attend returns."""
    config, S, B = spec["config"], spec["S"], spec["B"]
    if config == BASELINE:

        def attend(q, k, v):
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=spec["Hkv"] != spec["Hq"]
            )

        return attend, (lambda x: x), None, None
    if config == DEEPSPEED or peer:
        return (*bench_peers.make(config, torch, F, dist, rank, world, spec, scale), None)
    modes, process_groups = import_easy_context_modes()
    mode = modes.get_mode(config)
    topology = mode.topology(world)
    groups = process_groups.get_groups(topology)
    layout = mode.layout(topology)
    layout.check_length(S)
    # over the whole sequence, identical on every rank; its kernel calls are worked out in the warm-up
    seq_mask = sequence_mask(spec["mask"], S, B, spec["seed"])

    def attend(q, k, v):
        return mode.attention(q, k, v, scale, groups, mask=seq_mask)

    def shard(x):
        return layout.shard(x, groups.sp_rank, dim=2)

    return attend, shard, None, None


def rank_inputs(torch, spec, shard, to_out, keep_globals):
    """((q, k, v, dout) of this rank, (the global q, k, v, dout) or None). The global tensors
    come from one seed (identical on every rank) and are sharded as the mode shards them; they
    are dropped unless kept for the check. The high-water mark is reset before the steps, so
    this transient does not count."""
    dtype = getattr(torch, DTYPES[spec["dtype"]])
    B, Hq, Hkv, S, D = spec["B"], spec["Hq"], spec["Hkv"], spec["S"], spec["D"]
    g = torch.Generator().manual_seed(spec["seed"])
    inputs = [
        torch.randn(shape, generator=g).to(dtype)
        for shape in ((B, Hq, S, D), (B, Hkv, S, D), (B, Hkv, S, D), (B, Hq, S, D))
    ]
    q, k, v, dout = (shard(x).contiguous() for x in inputs)
    if to_out is not None:  # the layout the attention returns
        dout = to_out(dout)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    return (q, k, v, dout), (inputs if keep_globals else None)


def make_step(attend, tensors, peer):
    """One fwd+bwd; a peer's failure becomes a PeerFailure naming the phase."""
    q, k, v, dout = tensors

    def step():
        phase = "forward"
        try:
            out = attend(q, k, v)
            phase = "backward"
            out.backward(dout)
        except Exception as exc:
            if not peer:
                raise
            why = first_line(exc)
            why = why[: why.index(". ") + 1] if ". " in why[:200] else why[:200]  # torch's dispatcher lists
            raise PeerFailure(f"{phase} fails: {type(exc).__name__}: {why}") from exc
        return out

    return step


def clear_grads(tensors):
    """Outside the timed region: no step starts with the previous step's grads."""
    for x in tensors[:3]:
        x.grad = None


def measure(step, tensors, dist, counter, iters):
    """One warm-up and `iters` timed steps: this rank's times, its peak RSS growth over all
    the steps and over the measured ones alone, and the bytes it sent per step."""
    peak_reset = reset_peak_rss()
    rss_before = rss_bytes()  # just before the first (warm-up) step
    times = []
    if counter:
        counter.bytes, counter.enabled = 0, True
    n_steps = 1 + iters
    for i in range(n_steps):
        if i == 1:  # also the measured steps alone, without one-off warm-up allocations
            peak_warmup = peak_rss_bytes()
            reset_peak_rss()
            rss_measured = rss_bytes()
        if dist is not None:
            dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        clear_grads(tensors)
    if counter:
        counter.enabled = False
    peak_steps = peak_rss_bytes()
    return {
        "times": times[1:],
        "peak_mib": (max(peak_warmup, peak_steps) - rss_before) / MiB,
        "peak_mib_measured": (peak_steps - rss_measured) / MiB,
        "peak_reset": peak_reset,
        "comm_counted": counter.bytes / n_steps if counter else 0,
    }


def max_over_ranks(torch, dist, values):
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def check_against_sdpa(torch, F, spec, scale, step, tensors, inputs, shard, to_out, dist, rank, peer):
    """{"errors": max |ours - SDPA| of out, dq, dk, dv over the ranks, "check": the row's note};
    one of our modes outside the tolerance fails the run, a peer is flagged in its note."""
    q, k, v, _ = tensors
    clear_grads(tensors)
    out = step()
    ref, ref_dq, ref_dk, ref_dv = reference(torch, F, spec, scale, inputs, dist, rank)
    ref = to_out(shard(ref)) if to_out is not None else shard(ref)
    errors = {
        "out": (out.detach() - ref).abs().max().item(),
        "dq": (q.grad - shard(ref_dq)).abs().max().item(),
        "dk": (k.grad - shard(ref_dk)).abs().max().item(),
        "dv": (v.grad - shard(ref_dv)).abs().max().item(),
    }
    if dist is not None:
        errors = dict(zip(errors, max_over_ranks(torch, dist, list(errors.values()))))
    config, dtype = spec["config"], spec["dtype"]
    if peer:
        return {"errors": errors, "check": bench_peers.error_note(config, errors, dtype, spec["Hq"], spec["Hkv"])}
    worst = max(errors.values())
    if not worst < bench_peers.TOLERANCE[dtype]:
        raise AssertionError(f"{config} ({spec['mask']}) differs from SDPA: {errors}")
    return {"errors": errors, "check": f"max err {worst:.1e}"}


def reference(torch, F, spec, scale, inputs, dist, rank):
    """SDPA on the whole sequence: (out, dq, dk, dv), global. With spec["ref_dir"] computed once
    per shape, mask and seed for the whole run (by rank 0, saved there) and loaded by the rest."""
    path = None
    if spec.get("ref_dir"):
        key = "_".join(str(spec[k]) for k in ("S", "B", "Hq", "Hkv", "D", "dtype", "mask", "seed"))
        path = os.path.join(spec["ref_dir"], key + ".pt")
    if path is None:  # no cache: every rank computes it
        return sdpa_reference(torch, F, spec, scale, inputs)
    # Decided by rank 0 alone and always followed by a barrier on every rank: a rank that looked
    # at the file on its own could skip the barrier its peers wait in.
    if (dist is None or rank == 0) and not os.path.exists(path):
        torch.save(sdpa_reference(torch, F, spec, scale, inputs), path + ".tmp")
        os.replace(path + ".tmp", path)
    if dist is not None:
        dist.barrier()
    return torch.load(path)


def sdpa_reference(torch, F, spec, scale, inputs):
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
