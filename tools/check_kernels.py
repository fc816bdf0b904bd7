"""Check every usable kernel backend against attention computed in fp64, on any device.

    python -m tools.check_kernels                  # CUDA when there is one, else CPU
    python -m tools.check_kernels --device cpu --json out.json

For each dtype and each backend that easy_context.core.kernels offers for it on this device, one
forward (out, lse) and one backward (dq, dk, dv, from the backward's contract: the block's
own out and lse) per case: a causal square block, a rectangular unmasked block, a masked
block of packed documents, each with GQA (8 query heads, 2 KV heads).

Truth is the same inputs (already rounded to the dtype) in fp64. The bound of a backend is
the error of torch's own SDPA in that dtype on that device against the same truth: at most
2x it plus a floor (1e-5 fp32, 1e-3 half types, so that a reference that happens to be
nearly exact does not demand the impossible). lse has no SDPA counterpart: its bound is
relative, 1e-5 in fp32 and one rounding step of the dtype in half types (2^-8 bf16, 2^-11
fp16; torch's CPU flash op rounds its logits to the input dtype, which costs ~5e-5 in bf16):
an lse error below that step cannot show in a merged output of that dtype. Exits 1 when a
bound is exceeded; prints one line per backend x dtype x case.
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

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FLOORS = {torch.float32: 1e-5, torch.bfloat16: 1e-3, torch.float16: 1e-3}
LSE_RELATIVE = {torch.float32: 1e-5, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
HQ, HKV = 8, 2


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


def cases(seq: int):
    """(name, Sq, Sk, causal, masked)."""
    return [
        ("causal", seq, seq, True, False),
        ("rectangular", seq // 2, seq, False, False),
        ("documents", seq, seq, False, True),
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


def check(device, dtype, seq, head_dim):
    rows = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    scale = head_dim**-0.5
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    for name, sq, sk, causal, masked in cases(seq):
        q = torch.randn(1, HQ, sq, head_dim, generator=gen).to(device, dtype)
        k, v = (torch.randn(1, HKV, sk, head_dim, generator=gen).to(device, dtype) for _ in range(2))
        dout = torch.randn(1, HQ, sq, head_dim, generator=gen).to(device, dtype)
        mask = documents_mask(sq, sk, device) if masked else None
        want = truth(q, k, v, dout, causal, scale, mask)
        # torch's SDPA in this dtype: the error every bound is relative to
        rq, rk, rv = (x.clone().requires_grad_() for x in (q, k, v))
        ref_out = sdpa(rq, rk, rv, causal, scale, mask)
        ref_out.backward(dout)
        ref = [max_error(x, w) for x, w in zip((ref_out.detach(), rq.grad, rk.grad, rv.grad), (want[0], *want[2:]))]
        bounds = [2 * e + FLOORS[dtype] for e in ref]
        for backend in kernels.available_backends(device.type, dtype, head_dim, capability, masked=masked):
            chosen = kernels.BACKENDS[backend]
            started = time.perf_counter()
            try:
                out, lse = kernels.attention_forward(q, k, v, causal, scale, backend=chosen, mask=mask)
                dq, dk, dv = kernels.attention_backward(
                    dout, q, k, v, out, lse, causal, scale, backend=chosen, mask=mask
                )
            except Exception as exc:  # noqa: BLE001 - a backend that crashes is a failed row, not a stop
                rows.append(
                    {
                        "backend": backend,
                        "dtype": str(dtype).removeprefix("torch."),
                        "case": name,
                        "ok": False,
                        "error": f"{type(exc).__name__}: {exc}".splitlines()[0],
                    }
                )
                continue
            # progress as it goes (a first call compiles: flex's seconds here are its compile time)
            print(f"  {backend} {dtype} {name}: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
            errors = [max_error(x, w) for x, w in zip((out, dq, dk, dv), (want[0], *want[2:]))]
            lse_error = ((lse.double() - want[1]).abs() / want[1].abs().clamp(min=1)).max().item()
            ok = all(e <= b for e, b in zip(errors, bounds)) and lse_error <= LSE_RELATIVE[dtype]
            rows.append(
                {
                    "backend": backend,
                    "dtype": str(dtype).removeprefix("torch."),
                    "case": name,
                    "ok": ok,
                    "errors": dict(zip(("out", "dq", "dk", "dv"), errors)),
                    "lse_relative": lse_error,
                    "sdpa_errors": dict(zip(("out", "dq", "dk", "dv"), ref)),
                    "bounds": dict(zip(("out", "dq", "dk", "dv"), bounds)),
                }
            )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument(
        "--dtypes", default=None, help="comma separated from fp32,bf16,fp16 (default: all on CUDA, fp32,bf16 on CPU)"
    )
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per block (default 1024 on CUDA, 256 on CPU)")
    parser.add_argument("--head-dim", type=int, default=64)
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

    rows = [row for n in names for row in check(device, DTYPES[n], seq, args.head_dim)]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"kernel backends vs fp64 on {where}, torch {torch.__version__}, S={seq}, "
        f"{HQ}x{args.head_dim} heads, {HKV} KV heads"
    )
    print(
        f"{'backend':15}{'dtype':10}{'case':13}{'out':>9}{'dq':>9}{'dk':>9}{'dv':>9}{'lse rel':>9}"
        "  (sdpa: out dq dk dv)  ok"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['backend']:15}{r['dtype']:10}{r['case']:13} FAILED: {r['error']}")
            continue
        e, s = r["errors"], r["sdpa_errors"]
        print(
            f"{r['backend']:15}{r['dtype']:10}{r['case']:13}"
            + "".join(f"{e[m]:9.1e}" for m in e)
            + f"{r['lse_relative']:9.1e}  ({' '.join(f'{s[m]:.0e}' for m in s)})  {'yes' if r['ok'] else 'NO'}"
        )
    print(
        "bound per column: 2x torch SDPA's own error in that dtype + 1e-5 (fp32) / 1e-3 (half); "
        "lse relative 1e-5 (fp32), 2^-8 (bf16), 2^-11 (fp16)"
    )
    ok = bool(rows) and all(r["ok"] for r in rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": where, "torch": torch.__version__, "ok": ok, "rows": rows}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
