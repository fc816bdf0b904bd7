"""Check every usable kernel backend against attention computed in fp64, on any device.

    python -m tools.check_kernels                  # CUDA when there is one, else CPU
    python -m tools.check_kernels --device cpu --json out.json

For each dtype and each backend that easy_context.core.kernels offers for it on this device, one
forward (out, lse) and one backward (dq, dk, dv, from the backward's contract: the block's
own out and lse) per case: a causal square block, a rectangular unmasked block, a masked
block of packed documents, and a sliding window a quarter of the block long, each with GQA
(8 query heads, 2 KV heads). The window block is long enough for the band path
(core/backends/band.py: cpu_flash, and cuda_efficient in fp32) to cut it into several tiles of
query rows, whose dK / dV sum over the tiles that share a key (S, doubled until it is: 2048 at
S = 256 or 2048, 8 tiles): bounded here like the rest.

Truth is the same inputs (already rounded to the dtype) in fp64. The bound of a backend is
the error of torch's own SDPA in that dtype on that device against the same truth: at most
2x it plus a floor (1e-5 fp32, 1e-3 half types, so that a reference that happens to be
nearly exact does not demand the impossible). lse has no SDPA counterpart: its bound is
relative, 1e-5 in fp32 and one rounding step of the dtype in half types (2^-8 bf16, 2^-11
fp16; torch's CPU flash op rounds its logits to the input dtype, which costs ~5e-5 in bf16):
an lse error below that step cannot show in a merged output of that dtype. Exits 1 when a
bound is exceeded; prints one line per backend x dtype x case, as each finishes (a run stopped
at a time limit keeps the rows it finished).

Compiled graphs (--graph-lengths, default on CUDA: S/2 and 3S/4; each over 256, so that every
case spans more than one of flex's 128-token blocks, a structure of its own): flex compiles once
per call structure, whatever the lengths (core/backends/flex.py). Before the table, flex runs every
case (forward and backward, each dtype) at each of the two lengths, and Dynamo's graph count is
printed after each: the second length must compile nothing new (the first compiles every
structure). They come first because they do the compiling (a cold compile is seconds per
graph), so a run stopped at its time limit has printed them; the table's flex rows then reuse
the graphs. On CPU, flex runs compiled only under EASY_CONTEXT_FLEX_COMPILE (e.g. "eager":
Dynamo's graphs without Triton).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch
import torch.nn.functional as F

from easy_context.core import kernels
from easy_context.core.backends import flex as flex_backend
from easy_context.core.backends.band import band_tiles
from easy_context.core.backends.masks import band_mask

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FLOORS = {torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 1e-3}
LSE_RELATIVE = {torch.float32: 1e-5, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
HQ, HKV = 8, 2
FLEX_BLOCK = 128  # flex's block: Dynamo specialises a length of one block apart from longer ones


def documents_mask(sq: int, sk: int, device) -> torch.Tensor:
    """Packed documents of uneven lengths, causal inside each; the queries are the last sq of
    the sk positions, so every row keeps its diagonal key (no empty rows)."""
    doc = torch.zeros(sk, dtype=torch.long, device=device)
    for start in (sk // 5, sk // 2, (4 * sk) // 5):
        doc[start:] += 1
    q_pos = torch.arange(sk - sq, sk, device=device)
    k_pos = torch.arange(sk, device=device)
    allowed = (doc[q_pos, None] == doc[None, :]) & (k_pos[None, :] <= q_pos[:, None])
    return allowed[None, None]


def window_length(seq: int) -> int:
    """The window case's block length: seq, doubled until the band path cuts its window (a
    quarter of the block) into several tiles."""
    n = seq
    while len(band_tiles(n, n, window_of(n))) < 2:
        n *= 2
    return n


def window_of(seq: int) -> tuple[int, int]:
    """The window case's (left, right), masking.Block's convention: each query sees itself and
    the seq // 4 - 1 keys before it."""
    return (max(1, seq // 4) - 1, 0)


def cases(seq: int, window_seq: int | None = None):
    """(name, Sq, Sk, causal, masked, window); the window block is window_seq long (default:
    window_length(seq), several band tiles)."""
    n = window_seq or window_length(seq)
    return [
        ("causal", seq, seq, True, False, None),
        ("rectangular", seq // 2, seq, False, False, None),
        ("documents", seq, seq, False, True, None),
        ("window", n, n, False, False, window_of(n)),
    ]


def sdpa(q, k, v, causal, scale, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)


def truth(q, k, v, dout, causal, scale, mask):
    """out, lse and gradients in fp64 (plain autograd through softmax)."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    kk, vv = (x.repeat_interleave(HQ // HKV, dim=1) for x in (k, v))
    logits = (q @ kk.transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        logits = logits.masked_fill(~mask, -math.inf)
    lse = logits.logsumexp(-1)
    out = torch.softmax(logits, -1) @ vv
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def max_error(got, want) -> float:
    return (got.double() - want).abs().max().item()


def case_inputs(gen, device, dtype, head_dim, sq, sk, masked, window):
    """q, k, v, dout and the case's bool mask (documents, or the window as a band; None: none)."""
    q = torch.randn(1, HQ, sq, head_dim, generator=gen).to(device, dtype)
    k, v = (torch.randn(1, HKV, sk, head_dim, generator=gen).to(device, dtype) for _ in range(2))
    dout = torch.randn(1, HQ, sq, head_dim, generator=gen).to(device, dtype)
    mask = documents_mask(sq, sk, device) if masked else band_mask(sq, sk, window, device) if window else None
    return q, k, v, dout, mask


def check(device, dtype, seq, head_dim, report=None):
    """The rows of every usable backend x case in `dtype`; report(row) is called as each
    finishes."""
    rows = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    scale = head_dim**-0.5
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    for name, sq, sk, causal, masked, window in cases(seq):
        q, k, v, dout, mask = case_inputs(gen, device, dtype, head_dim, sq, sk, masked, window)
        want = truth(q, k, v, dout, causal, scale, mask)
        # torch's SDPA in this dtype: the error every bound is relative to
        rq, rk, rv = (x.clone().requires_grad_() for x in (q, k, v))
        ref_out = sdpa(rq, rk, rv, causal, scale, mask)
        ref_out.backward(dout)
        ref = [max_error(x, w) for x, w in zip((ref_out.detach(), rq.grad, rk.grad, rv.grad), (want[0], *want[2:]))]
        bounds = [2 * e + FLOORS[dtype] for e in ref]
        # the window goes to each backend as kernels passes it: natively, or folded into a mask
        call = {"window": window} if window else {"mask": mask}
        usable = kernels.available_backends(
            device.type, dtype, head_dim, capability, masked=masked, window=bool(window)
        )
        for backend in usable:
            chosen = kernels.BACKENDS[backend]
            row = {"backend": backend, "dtype": str(dtype).removeprefix("torch."), "case": name}
            if window:
                row["tiles"] = len(band_tiles(sq, sk, window))
            started = time.perf_counter()
            try:
                out, lse = kernels.attention_forward(q, k, v, causal, scale, backend=chosen, **call)
                dq, dk, dv = kernels.attention_backward(dout, q, k, v, out, lse, causal, scale, backend=chosen, **call)
            except Exception as exc:  # noqa: BLE001 - a backend that crashes is a failed row, not a stop
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}".splitlines()[0])
            else:
                errors = [max_error(x, w) for x, w in zip((out, dq, dk, dv), (want[0], *want[2:]))]
                lse_error = ((lse.double() - want[1]).abs() / want[1].abs().clamp(min=1)).max().item()
                ok = all(e <= b for e, b in zip(errors, bounds)) and lse_error <= LSE_RELATIVE[dtype]
                row.update(
                    ok=ok,
                    errors=dict(zip(("out", "dq", "dk", "dv"), errors)),
                    lse_relative=lse_error,
                    sdpa_errors=dict(zip(("out", "dq", "dk", "dv"), ref)),
                    bounds=dict(zip(("out", "dq", "dk", "dv"), bounds)),
                )
            # seconds of forward + backward (a first call compiles: flex's are its compile time)
            row["seconds"] = time.perf_counter() - started
            rows.append(row)
            if report is not None:
                report(row)
    return rows


def graph_count() -> int:
    """Dynamo's compiled graphs in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def graph_counts(device, dtypes, lengths, head_dim, report=None) -> list[dict]:
    """flex (forward and backward) on every case and dtype at each length in turn, Dynamo's
    graph count after each: one row per length, the first one the count before them. The last
    length passes when it compiled nothing new: flex compiles per call structure, not per
    length. report(row) is called as each length finishes."""
    flex = kernels.BACKENDS["flex"]
    gen = torch.Generator(device="cpu").manual_seed(1)
    scale = head_dim**-0.5
    rows = [{"length": None, "graphs": graph_count(), "new": 0, "ok": True}]
    if report is not None:
        report(rows[0])
    for i, length in enumerate(lengths):
        started = time.perf_counter()
        error = None
        for dtype in dtypes:
            for _name, sq, sk, causal, masked, window in cases(length, window_seq=length):
                q, k, v, dout, mask = case_inputs(gen, device, dtype, head_dim, sq, sk, masked, window)
                call = {"window": window} if window else {"mask": mask}
                try:
                    out, lse = kernels.attention_forward(q, k, v, causal, scale, backend=flex, **call)
                    kernels.attention_backward(dout, q, k, v, out, lse, causal, scale, backend=flex, **call)
                except Exception as exc:  # noqa: BLE001 - reported in the row
                    error = error or f"{type(exc).__name__}: {exc}".splitlines()[0]
        graphs = graph_count()
        new = graphs - rows[-1]["graphs"]
        # the first new length may make a length symbolic (once); after it, nothing compiles
        ok = error is None and (i == 0 or new == 0)
        row = {"length": length, "graphs": graphs, "new": new, "ok": ok, "seconds": time.perf_counter() - started}
        if error:
            row["error"] = error
        rows.append(row)
        if report is not None:
            report(row)
    return rows


def print_row(r: dict) -> None:
    lead = f"{r['backend']:15}{r['dtype']:10}{r['case']:13}"
    if "error" in r:
        print(f"{lead} FAILED: {r['error']}", flush=True)
        return
    e, s = r["errors"], r["sdpa_errors"]
    print(
        lead
        + "".join(f"{e[m]:9.1e}" for m in e)
        + f"{r['lse_relative']:9.1e}  ({' '.join(f'{s[m]:.0e}' for m in s)})  {'yes' if r['ok'] else 'NO':3}"
        + f"{r['seconds']:7.1f}",
        flush=True,
    )


def print_graph_row(r: dict) -> None:
    if r["length"] is None:
        print(f"flex graphs (Dynamo) before the lengths: {r['graphs']}", flush=True)
        return
    verdict = "yes" if r["ok"] else "NO"
    print(
        f"flex graphs (Dynamo) after S={r['length']}: {r['graphs']} ({r['new']} new, {r['seconds']:.1f} s)  {verdict}"
        + (f"  FAILED: {r['error']}" if "error" in r else ""),
        flush=True,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument(
        "--dtypes", default=None, help="comma separated from fp32,bf16,fp16 (default: all on CUDA, fp32,bf16 on CPU)"
    )
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per block (default 1024 on CUDA, 256 on CPU)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument(
        "--graph-lengths",
        default=None,
        help="two lengths, comma-separated, at which flex's compiled graphs are counted before the table "
        "(default on CUDA: S/2,3S/4, at least 272,288; on CPU none; 0: none; each over 256)",
    )
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    names = (args.dtypes or ("fp32,bf16,fp16" if device.type == "cuda" else "fp32,bf16")).split(",")
    unknown = [n for n in names if n not in DTYPES]
    if unknown:
        parser.error(f"--dtypes: unknown {unknown}; choose from {sorted(DTYPES)}")
    seq = args.seq_len or (1024 if device.type == "cuda" else 256)
    if seq % 2:
        parser.error(f"--seq-len must be even (the rectangular case uses seq/2 queries), got {seq}")
    if args.graph_lengths is None:
        lengths = [seq // 2, 3 * seq // 4] if device.type == "cuda" else []
        if lengths and seq // 4 <= FLEX_BLOCK:  # a short S: the shortest lengths that span two blocks
            lengths = [2 * FLEX_BLOCK + 16, 2 * FLEX_BLOCK + 32]
    else:
        lengths = [int(n) for n in args.graph_lengths.split(",") if int(n)]
    if lengths and (len(lengths) != 2 or any(n % 2 for n in lengths)):
        parser.error(f"--graph-lengths takes two even lengths (or 0), got {args.graph_lengths!r}")
    if lengths and min(lengths) // 2 <= FLEX_BLOCK:
        # a block of one flex tile (128) is a structure of its own (Dynamo guards on it): every
        # case, the rectangular one's S/2 queries included, spans more than one at both lengths
        parser.error(f"--graph-lengths: each must be over {2 * FLEX_BLOCK} (the rectangular case has S/2 queries)")

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    band = window_length(seq)
    print(
        f"kernel backends vs fp64 on {where}, torch {torch.__version__}, S={seq}, "
        f"{HQ}x{args.head_dim} heads, {HKV} KV heads; window: S={band}, {window_of(band)[0] + 1} keys per query, "
        f"{len(band_tiles(band, band, window_of(band)))} band tiles (dK/dV summed where they overlap)",
        flush=True,
    )
    graphs = []
    if lengths and not flex_backend.flex_usable():
        print("SKIP flex graph counts: flex is not usable with this torch", flush=True)
    elif lengths and flex_backend.flex_compile_backend(device) is None:
        print(f"SKIP flex graph counts: flex runs eagerly on {device.type} (set EASY_CONTEXT_FLEX_COMPILE)", flush=True)
    elif lengths:
        graphs = graph_counts(device, [DTYPES[n] for n in names], lengths, args.head_dim, report=print_graph_row)
        print("flex graphs: the second length must compile nothing new (flex compiles per structure)", flush=True)
    print(
        f"{'backend':15}{'dtype':10}{'case':13}{'out':>9}{'dq':>9}{'dk':>9}{'dv':>9}{'lse rel':>9}"
        "  (sdpa: out dq dk dv)  ok      s",
        flush=True,
    )
    rows = [row for n in names for row in check(device, DTYPES[n], seq, args.head_dim, report=print_row)]
    print(
        "bound per column: 2x torch SDPA's own error in that dtype + 1e-5 (fp32) / 1e-3 (half); "
        "lse relative 1e-5 (fp32), 2^-8 (bf16), 2^-11 (fp16); s: forward + backward (a first call compiles)",
        flush=True,
    )
    ok = bool(rows) and all(r["ok"] for r in rows) and all(r["ok"] for r in graphs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": where, "torch": torch.__version__, "ok": ok, "rows": rows, "graphs": graphs}, f, indent=1
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
