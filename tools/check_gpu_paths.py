"""What scripts/gpu_check.sh checks beyond the kernels and the NCCL modes, on any device.

    python -m tools.check_gpu_paths masks [--device cuda] [--seq-len 4096]
    python -m tools.check_gpu_paths gloo-ops [--device cuda]
    python -m tools.check_gpu_paths simulate [--device cuda] [--seq-len 2048]

masks      every kernel backend usable on the device, forward + backward of one block, on a
           causal block, a sliding window and packed documents: as bool masks, and in the forms
           the mask's kernel calls hand them over (a native window, documents as segments: flash's variable-length
           call); the median time and the max error against the math backend in fp64. A backend
           that cannot run a case prints `SKIP <backend> <case>: <reason>`.
gloo-ops   two processes (one device: both ranks on it) over gloo, with tensors on --device,
           try each collective the package uses (collectives.all_gather, all_reduce,
           broadcast, ulysses' all_to_all_single, p2p.exchange's batch_isend_irecv), each in
           its own pair of processes (a crash is a result), and print which work and are exact.
           Exit 0 whatever they say; `--require OP,OP` exits 3 unless those work.
multirank  gloo-ops, then every mode the working ops can run: 2 ranks over gloo with tensors on
           --device (tools.check_exactness); the ring modes gloo cannot run: simulate; then
           what stays unexercised (NCCL).
simulate   the ring modes' multi-rank path (kernel calls, layouts, executor, K/V exchange, merges,
           backward with send-back) with 2 ranks as 2 threads of one process on one device:
           p2p.exchange is replaced by an in-memory mailbox, nothing else. out, dq, dk, dv of
           the ranks, put back in sequence order, against the mode on one rank (the
           single-process model) and both against that model in fp64: the 2-rank error is at
           most 2x the 1-rank error + 1e-5 (fp32) / 1e-3 (bf16). Causal, window, documents.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace
from unittest import mock

import torch
import torch.distributed as dist

from easy_context.core import executor, kernels
from easy_context.core.groups import Topology
from easy_context.core.masking import SequenceMask
from easy_context.modes import BUILT_MODES, get_mode

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FLOORS = {torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 1e-3}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------ masks
def document_cuts(seq: int) -> tuple[int, ...]:
    return (0, seq // 5, seq // 2, (4 * seq) // 5, seq)


def documents(seq: int) -> torch.Tensor:
    """(1, S) position_ids of 4 packed documents of uneven lengths."""
    cuts = document_cuts(seq)
    return torch.cat([torch.arange(b - a) for a, b in zip(cuts, cuts[1:])])[None]


def call_forms(case: str, backend, mask, window: int, seq: int) -> list[tuple[str, bool, dict]]:
    """(label, causal, keyword arguments) of each way `backend` takes a case: the mask, and the
    kernel calls' own form where the backend has it (a window; documents as segments)."""
    if mask is None:
        return [("", True, {})]
    forms = [("mask", False, {"mask": mask})] if backend.supports_mask else []
    if case == "window" and backend.supports_window:
        forms.append(("native", False, {"window": (window - 1, 0)}))
    if case == "documents" and backend.supports_segments:
        forms.append(("segments", True, {"segments": document_cuts(seq)}))
    return forms


def bool_mask(seq: int, case: str, window: int, device) -> torch.Tensor | None:
    """The whole-block mask of a case (None: causal, passed as causal=True)."""
    if case == "causal":
        return None
    i = torch.arange(seq, device=device)
    allowed = i[None, :] <= i[:, None]
    if case == "window":
        allowed &= i[:, None] - i[None, :] < window
    else:
        doc = (documents(seq)[0] == 0).cumsum(0).to(device)
        allowed &= doc[:, None] == doc[None, :]
    return allowed[None, None]


def time_masks(device, dtype, seq: int, heads: int, kv_heads: int, head_dim: int, iters: int) -> bool:
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, heads, seq, head_dim, generator=gen).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(1, kv_heads, seq, head_dim, generator=gen).to(device, dtype) for _ in range(2))
    scale, ok = head_dim**-0.5, True
    print(
        f"backends x masks on {device.type}, {str(dtype)[6:]}, S={seq}, {heads}x{head_dim} heads, {kv_heads} KV heads"
    )
    print(f"{'backend':16}{'case':20}{'ms fwd+bwd':>12}{'max err out':>13}{'max err dq':>12}")
    for case in ("causal", "window", "documents"):
        window = max(1, seq // 8)
        mask = bool_mask(seq, case, window, device)
        causal = mask is None
        math = kernels.BACKENDS["math"]
        want = [x.double() for x in (q, k, v, dout)]
        ref_out, ref_lse = kernels.attention_forward(*want[:3], causal, scale, math, mask=mask)
        ref_dq = kernels.attention_backward(want[3], *want[:3], ref_out, ref_lse, causal, scale, math, mask=mask)[0]
        usable = kernels.available_backends(device.type, dtype, head_dim, capability)
        for name in usable:
            backend = kernels.BACKENDS[name]
            forms = call_forms(case, backend, mask, window, seq)
            if not forms:
                print(f"SKIP {name} {case}: takes no mask, window or segments (such blocks go to another backend)")
            for form, form_causal, options in forms:
                label = f"{case} {form}".strip()
                try:
                    times = []
                    for _ in range(iters + 1):  # the first is a warm-up
                        _sync(device)
                        start = time.perf_counter()
                        out, lse = kernels.attention_forward(q, k, v, form_causal, scale, backend, **options)
                        dq = kernels.attention_backward(
                            dout, q, k, v, out, lse, form_causal, scale, backend, **options
                        )[0]
                        _sync(device)
                        times.append(time.perf_counter() - start)
                except Exception as exc:  # noqa: BLE001 - a backend that fails is a failed row
                    ok = False
                    print(f"{name:16}{label:20} FAILED: {type(exc).__name__}: {str(exc).splitlines()[0]}")
                    continue
                errors = [(got.double() - ref).abs().max().item() for got, ref in ((out, ref_out), (dq, ref_dq))]
                print(
                    f"{name:16}{label:20}{1e3 * statistics.median(times[1:]):12.2f}{errors[0]:13.1e}{errors[1]:12.1e}"
                )
        for name in kernels.BACKENDS:
            if name not in usable:
                print(f"SKIP {name} {case}: not usable for {str(dtype)[6:]} head dim {head_dim} on {device.type}")
    print("errors against the math backend in fp64 (timing rows, not a bound: tools.check_kernels bounds them)")
    return ok


# --------------------------------------------------------------------- gloo-ops
OPS = ("all_gather", "all_reduce", "broadcast", "all_to_all_single", "batch_isend_irecv")


def gloo_ops(device, timeout: float) -> dict:
    """op -> 'works' or why not. Two processes (tools/gloo_ops_rank.py) try the ops in order;
    when they crash or hang on one, that op is the result and a new pair goes on after it."""
    results: dict[str, str] = {}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    while len(results) < len(OPS):
        left = [op for op in OPS if op not in results]
        with tempfile.TemporaryDirectory() as tmp:
            command = [sys.executable, "-m", "tools.gloo_ops_rank", str(device), f"file://{tmp}/init"]
            ranks = [
                subprocess.Popen(
                    [*command, str(r), ",".join(left)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    env=env,
                )
                for r in range(2)
            ]
            hung = False
            try:
                outputs = [p.communicate(timeout=timeout * len(left))[0] for p in ranks]
            except subprocess.TimeoutExpired:
                hung = True
                for p in ranks:
                    p.kill()
                outputs = [p.communicate()[0] for p in ranks]
        verdicts = [
            dict(line.split(" ", 2)[1:] for line in out.splitlines() if line.startswith("RESULT ")) for out in outputs
        ]
        for op in left:
            if op not in verdicts[0] or op not in verdicts[1]:  # the op they were in when they stopped
                last = [
                    line
                    for out in outputs
                    for line in out.splitlines()
                    if line.strip() and not line.startswith("RESULT")
                ]
                why = "hangs" if hung else f"crashes (exit codes {[p.returncode for p in ranks]})"
                results[op] = f"{why}: {last[-1][:160]}" if last else why
                break
            both = {verdicts[0][op], verdicts[1][op]}
            results[op] = "works" if both == {"works"} else " / ".join(sorted(both))
    return {op: results[op] for op in OPS}


# --------------------------------------------------------------------- simulate
class ThreadGroup:
    """A process group whose ranks are threads of this process: dist.get_rank/get_world_size
    answer for it, and executor.exchange goes through a mailbox that keeps each (sender,
    receiver) pair's messages in posting order, as a real backend matches them."""

    def __init__(self, size: int):
        self.size = size
        self.local = threading.local()
        self.cond = threading.Condition()
        self.sent, self.posted, self.box = {}, {}, {}

    def exchange(self, group, sends, recvs, received=None):
        me = self.local.rank
        with self.cond:
            for peer, tensor, _like in sends:
                n = self.sent.get((me, peer), 0)
                self.sent[(me, peer)] = n + 1
                self.box[(me, peer, n)] = tensor.clone()  # the sender may reuse its buffer
            self.cond.notify_all()
            claims = []
            for peer, buffer in recvs:
                n = self.posted.get((peer, me), 0)
                self.posted[(peer, me)] = n + 1
                claims.append(((peer, me, n), buffer))
        return _Mailbox(self, claims, received if received is not None else [b for _, b in recvs])


class _Mailbox:
    def __init__(self, group: ThreadGroup, claims, received):
        self.group, self.claims, self.received = group, claims, received

    def wait(self):
        with self.group.cond:
            for key, buffer in self.claims:
                if not self.group.cond.wait_for(lambda key=key: key in self.group.box, timeout=60):
                    raise TimeoutError(f"simulated rank {key[1]}: no message {key[2]} from rank {key[0]}")
                buffer.copy_(self.group.box.pop(key))
        self.claims = []
        return self.received


@contextlib.contextmanager
def threaded(group: ThreadGroup):
    real_rank, real_size = dist.get_rank, dist.get_world_size

    def get_rank(g=None):
        return group.local.rank if g is group else real_rank(g)

    def get_world_size(g=None):
        return group.size if g is group else real_size(g)

    with (
        mock.patch.object(dist, "get_rank", get_rank),
        mock.patch.object(dist, "get_world_size", get_world_size),
        mock.patch.object(executor, "exchange", group.exchange),
    ):
        yield


def attend(mode, q, k, v, scale, group, mask, dout):
    """The mode's attention and its backward on one rank's shards. The backward node is applied
    directly: autograd's engine runs CUDA nodes on one device thread, where two simulated
    ranks waiting on each other would deadlock."""
    groups = SimpleNamespace(sp=group, ring=group, ulysses=None)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    out = mode.attention(*leaves, scale, groups, mask=mask)
    with torch.no_grad():
        grads = out.grad_fn.apply(dout)
    return out.detach(), grads[:3]


def simulated_modes(size: int) -> list:
    """Built modes whose attention is a ring alone at this size (the executor over p2p)."""
    chosen = []
    for name in BUILT_MODES:
        mode = get_mode(name)
        if mode.attention is None:
            continue
        try:
            topology = Topology(size, size, mode.ring_degree(size, None))
        except ValueError:
            continue
        if topology.ulysses_degree == 1 and topology.ring_degree == size:
            chosen.append(mode)
    return chosen


def simulate(
    device, dtype, seq: int, size: int = 2, heads: int = 8, kv_heads: int = 2, head_dim: int = 64, modes=None
) -> bool:
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, heads, seq, head_dim, generator=gen).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(1, kv_heads, seq, head_dim, generator=gen).to(device, dtype) for _ in range(2))
    scale, ok = head_dim**-0.5, True
    # A SequenceMask caches its kernel calls per forward (for one world size): a fresh one per run.
    masks = {
        "causal": lambda: None,
        "window": lambda: SequenceMask.from_positions(torch.arange(seq)[None]).with_window(max(1, seq // 8)),
        "documents": lambda: SequenceMask.from_positions(documents(seq)),
    }
    print(
        f"{size} ranks as threads on {device.type} ({str(dtype)[6:]}), S={seq}, {heads}x{head_dim} heads, {kv_heads} KV"
    )
    print(
        f"{'mode':18}{'case':11}{'2 ranks':>9}{'1 rank':>9}{'bound':>9}  ok   "
        "(max |error| vs 1 rank in fp64: out dq dk dv)"
    )
    for mode in simulated_modes(size) if modes is None else modes:
        layout = mode.layout(Topology(size, size, size))
        for case, mask in masks.items():
            truth = attend(mode, *(x.double() for x in (q, k, v)), scale, None, mask(), dout.double())
            one = attend(mode, q, k, v, scale, None, mask(), dout)
            mask = mask()  # noqa: PLW2901 - shared by the simulated ranks, as one forward's mask is
            group, results, failures = ThreadGroup(size), [None] * size, []

            def rank_main(rank, mode=mode, mask=mask, group=group, layout=layout, results=results, failures=failures):
                group.local.rank = rank
                try:
                    shards = [layout.shard(x, rank, dim=2) for x in (q, k, v, dout)]
                    results[rank] = attend(mode, *shards[:3], scale, group, mask, shards[3])
                except BaseException as exc:  # noqa: BLE001 - reported below
                    failures.append(f"rank {rank}: {type(exc).__name__}: {exc}")

            with threaded(group):
                threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            if failures:
                ok = False
                print(f"{mode.name:18}{case:11} FAILED: {failures[0].splitlines()[0]}")
                continue
            many = [layout.unshard([r[0] for r in results], dim=2)]
            many += [layout.unshard([r[1][i] for r in results], dim=2) for i in range(3)]
            ones = [one[0], *one[1]]
            truths = [truth[0], *truth[1]]
            err_many = [(a.double() - t).abs().max().item() for a, t in zip(many, truths)]
            err_one = [(a.double() - t).abs().max().item() for a, t in zip(ones, truths)]
            bounds = [2 * e + FLOORS[dtype] for e in err_one]
            passed = all(e <= b for e, b in zip(err_many, bounds))
            ok &= passed
            print(
                f"{mode.name:18}{case:11}{max(err_many):9.1e}{max(err_one):9.1e}{max(bounds):9.1e}  "
                f"{'yes' if passed else 'NO '}  ({' '.join(f'{e:.0e}' for e in err_many)})"
            )
    return ok


# -------------------------------------------------------------------- multirank
# What every mode's multi-rank run needs from the backend besides its attention's own traffic:
# the mask's all-gather of positions (global_mask) and check_exactness's all-reduce of grads.
COMMON_OPS = ("all_gather", "all_reduce")


def relayed(command: list, timeout: float) -> int:
    """Run `command`, its output printed line by line as it comes (a run stopped at a time limit
    keeps what it printed); its stderr after it when it fails. The exit code (-9: killed at
    `timeout` seconds)."""
    with tempfile.TemporaryFile("w+") as errors:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors, text=True)
        timer = threading.Timer(timeout, process.kill)
        timer.start()
        try:
            for line in process.stdout:
                print(line, end="", flush=True)
            returncode = process.wait()
        finally:
            timer.cancel()
        if returncode != 0:
            errors.seek(0)
            print(errors.read()[-1500:], flush=True)
    return returncode


def multirank(device, seq: int, names: list, timeout: float, gloo_runs: int | None = None) -> bool:
    """As much of the multi-rank path as one device allows: the gloo ops with tensors on it;
    every mode those ops can run, 2 ranks over gloo via tools.check_exactness; the ring modes
    (they need point-to-point, which gloo may not do with CUDA tensors) simulated with threads
    when it cannot; and what stays unexercised."""
    ops = gloo_ops(device, timeout)
    print(f"gloo with {device.type} tensors, 2 processes on one device:")
    for op, result in ops.items():
        print(f"  {op:20} {result}")
    works = {op for op, result in ops.items() if result == "works"}
    ok, simulate_these, over_gloo = True, [], []
    for name in BUILT_MODES:
        mode = get_mode(name)
        if mode.attention is None:
            continue
        topology = Topology(2, 2, mode.ring_degree(2, None))
        needs = set(COMMON_OPS)
        needs |= {"batch_isend_irecv"} if topology.ring_degree > 1 else set()
        needs |= {"all_to_all_single"} if topology.ulysses_degree > 1 else set()
        if needs <= works:
            over_gloo.append(name)
        else:
            simulate_these.append((name, sorted(needs - works)))
    if gloo_runs is not None and len(over_gloo) > gloo_runs:
        print(f"-- not run over gloo here (--gloo-runs {gloo_runs}): {', '.join(over_gloo[gloo_runs:])}")
        over_gloo = over_gloo[:gloo_runs]
    if over_gloo:  # one process group for every mode
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   "-m", "tools.check_exactness", "--mode", ",".join(over_gloo), "--backend", "gloo",
                   "--seq-length", str(seq), "--dtypes", ",".join(names)]  # fmt: skip
        returncode = relayed(command, timeout=max(60, 4 * timeout * len(over_gloo)))
        print(f"-- {', '.join(over_gloo)}: 2 ranks over gloo, {device.type} tensors (exit {returncode})", flush=True)
        ok &= returncode == 0
    if simulate_these:
        print(
            "-- modes gloo cannot run with these tensors: "
            + "; ".join(f"{n} (needs {', '.join(m)})" for n, m in simulate_these)
        )
        cannot = [n for n, _ in simulate_these if n not in {m.name for m in simulated_modes(2)}]
        if cannot:
            ok = False
            print(f"NOT RUN on more than one rank here: {', '.join(cannot)} (no simulation for them)")
    # The ring modes' executor, simulated with threads on this device: what runs here whatever
    # gloo can do (the only multi-rank ring run when it cannot do point-to-point).
    for name in names:
        ok &= simulate(device, DTYPES[name], seq)
    print("unexercised here: NCCL (every NCCL collective and its P2P; torch's NCCL stream")
    print("  semantics for our transfers), more than one GPU (peer-to-peer copies, NVLink),")
    print(
        "  ranks on separate devices"
        + (" -- and, this being a CPU dry run, CUDA itself" if device.type == "cpu" else "")
    )
    return ok


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["masks", "gloo-ops", "simulate", "multirank"])
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--dtypes", default=None, help="comma separated from fp32,bf16,fp16 (default fp32,bf16)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens (default: 4096 CUDA, 256 CPU)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=30.0, help="gloo-ops: seconds per op")
    parser.add_argument("--gloo-runs", type=int, default=None, help="multirank: at most this many modes over gloo")
    parser.add_argument("--require", default="", help="gloo-ops: exit 3 unless these ops work")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    names = (args.dtypes or "fp32,bf16").split(",")
    if any(n not in DTYPES for n in names):
        parser.error(f"--dtypes: choose from {sorted(DTYPES)}, got {args.dtypes!r}")
    seq = args.seq_len or (4096 if device.type == "cuda" else 256)
    if seq % 4:
        parser.error(f"--seq-len must be a multiple of 4 (2 ranks, zigzag), got {seq}")

    if args.what == "gloo-ops":
        results = gloo_ops(device, args.timeout)
        print(f"gloo with {device.type} tensors, 2 processes on one device:")
        for op, result in results.items():
            print(f"  {op:20} {result}")
        required = [op for op in args.require.split(",") if op]
        unknown = [op for op in required if op not in OPS]
        if unknown:
            parser.error(f"--require: unknown {unknown}; choose from {list(OPS)}")
        missing = [op for op in required if results[op] != "works"]
        if missing:
            print(f"not usable: {', '.join(missing)} does not work over gloo with {device.type} tensors")
            return 3
        return 0
    if args.what == "multirank":
        return 0 if multirank(device, seq, names, args.timeout, args.gloo_runs) else 1
    ok = True
    for name in names:
        if args.what == "masks":
            ok &= time_masks(device, DTYPES[name], seq, 8, 2, args.head_dim, args.iters)
        else:
            ok &= simulate(device, DTYPES[name], seq, head_dim=args.head_dim)
    print_compiles()
    return 0 if ok else 1


def print_compiles():
    """Dynamo's graphs in this process: flex on CUDA runs compiled, and past Dynamo's recompile
    limit (its log says 'hit config.recompile_limit') it runs eager, materialising the whole
    score matrix, which the timings above would then measure."""
    from torch._dynamo.utils import counters

    graphs, frames = counters["stats"]["unique_graphs"], counters["frames"]
    print(f"dynamo: {graphs} graphs compiled, frames {frames['ok']} ok of {frames['total']}")


if __name__ == "__main__":
    sys.exit(main())
