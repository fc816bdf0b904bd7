"""One process, one attention layer, forward + backward: our kernel layer vs torch SDPA.

    python -m benchmarks.bench_kernels                         # CUDA: bf16, S = 8K..64K
    python -m benchmarks.bench_kernels --device cpu --seq-len 1024,2048 --dtype fp32

Rows per sequence length (causal, B=1, --heads x --head-dim with --kv-heads KV heads):
  sdpa            torch.nn.functional.scaled_dot_product_attention (on CUDA restricted to the
                  flash kernel, falling back to torch's choice where flash cannot run)
  kernel:<name>   easy_context.core.kernels.attention_forward + attention_backward with that
                  backend: the two calls every mode is built from
  <mode> P=1      zigzag_ring_attn's and dist_flash_attn's attention function on one rank
                  (what a model layer calls), autograd backward: the kernel plus the ring's
                  bookkeeping (ulysses_attn and usp_attn run zigzag's path on one rank)
  flash_attn      flash_attn.flash_attn_func, if installed
  ring_flash_attn zhuzilin's zigzag_ring_flash_attn_func on a one-rank group, if installed
Columns: median ms of --iters fwd+bwd steps after 2 warm-ups, TFLOP/s (causal fwd+bwd counted
as 3.5 x 4*B*Hq*S^2*D/2: the backward does 2.5x the forward's work, the usual convention),
time / sdpa, peak memory above the inputs (CUDA only), and the max |out - sdpa out|.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from benchmarks.common import write_json
from easy_context.core import kernels
from easy_context.core.groups import get_groups
from easy_context.modes import get_mode

MATH_MAX_CUDA = 16384  # the math backend is the fallback, not a contender: timed up to here
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _flash_sdpa(q):
    """SDPA restricted to the flash kernel on CUDA where flash can run it (half types, head dim
    <= 256 and a multiple of 8, a build with flash); torch's own choice elsewhere."""
    flash_ok = (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] <= 256
        and q.shape[-1] % 8 == 0
        and torch.backends.cuda.is_flash_attention_available()
    )
    if not flash_ok:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def candidates(q, k, v, scale, device):
    """name -> step(): one forward + backward, returning the output in (B, Hq, S, D)."""
    hq, hkv = q.shape[1], k.shape[1]
    dout = torch.randn_like(q)

    def leaf(*xs):
        return [x.detach().requires_grad_() for x in xs]

    def sdpa():
        a, b, c = leaf(q, k, v)
        with _flash_sdpa(q):
            out = F.scaled_dot_product_attention(a, b, c, is_causal=True, scale=scale, enable_gqa=hq != hkv)
            out.backward(dout)
        return out

    steps = {"sdpa": sdpa}
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    for name in kernels.available_backends(device.type, q.dtype, q.shape[-1], capability):
        backend = kernels.BACKENDS[name]
        if name == "math" and device.type == "cuda" and q.shape[2] > MATH_MAX_CUDA:
            steps[f"kernel:{name}"] = f"skipped: the pure-torch fallback above S={MATH_MAX_CUDA} (minutes per step)"
            continue

        def kernel(backend=backend):
            out, lse = kernels.attention_forward(q, k, v, True, scale, backend=backend)
            kernels.attention_backward(dout, q, k, v, out, lse, True, scale, backend=backend)
            return out

        steps[f"kernel:{name}"] = kernel
    # On one rank ulysses_attn and usp_attn hand over to zigzag's path (no all-to-all without
    # peers), so only the two modes whose one-rank paths differ get rows.
    for mode_name in ("zigzag_ring_attn", "dist_flash_attn"):
        mode = get_mode(mode_name)
        groups = get_groups(mode.topology(1))

        def mode_step(mode=mode, groups=groups):
            a, b, c = leaf(q, k, v)
            out = mode.attention(a, b, c, scale, groups)
            out.backward(dout)
            return out

        steps[f"{mode_name} P=1"] = mode_step
    try:
        from flash_attn import flash_attn_func
    except Exception as exc:  # noqa: BLE001 - optional: its row says why
        steps["flash_attn"] = f"not installed ({type(exc).__name__})"
    else:

        def flash():
            a, b, c = leaf(*(x.transpose(1, 2) for x in (q, k, v)))  # (B, S, H, D)
            out = flash_attn_func(a, b, c, softmax_scale=scale, causal=True)
            out.backward(dout.transpose(1, 2))
            return out.transpose(1, 2)

        steps["flash_attn"] = flash
    try:
        from ring_flash_attn import zigzag_ring_flash_attn_func
    except Exception as exc:  # noqa: BLE001
        steps["ring_flash_attn"] = f"not installed ({type(exc).__name__})"
    else:

        def ring_flash():  # one rank: its zigzag layout is the identity
            a, b, c = leaf(*(x.transpose(1, 2) for x in (q, k, v)))
            out = zigzag_ring_flash_attn_func(a, b, c, softmax_scale=scale, causal=True, group=_one_rank_group(device))
            out.backward(dout.transpose(1, 2))
            return out.transpose(1, 2)

        steps["ring_flash_attn"] = ring_flash
    return steps


def _one_rank_group(device):
    import torch.distributed as dist

    if not dist.is_initialized():
        init = os.path.join(tempfile.mkdtemp(prefix="bench_kernels_"), "init")
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", init_method=f"file://{init}", rank=0, world_size=1
        )
    return dist.group.WORLD


def measure(step, device, iters):
    for _ in range(2):
        step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        out = step()
        _sync(device)
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if device.type == "cuda" else float("nan")
    return statistics.median(times), peak, out.detach()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument(
        "--seq-len", default=None, help="comma separated (default 8192,16384,32768,65536 on CUDA, 1024,2048 on CPU)"
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    cuda = device.type == "cuda"
    dtype = DTYPES[args.dtype or ("bf16" if cuda else "fp32")]
    seqs = [int(s) for s in (args.seq_len or ("8192,16384,32768,65536" if cuda else "1024,2048")).split(",")]
    where = torch.cuda.get_device_name(device) if cuda else "cpu"
    print(
        f"one layer fwd+bwd on {where}, torch {torch.__version__}, {str(dtype).removeprefix('torch.')}, "
        f"{args.heads} heads x {args.head_dim}, {args.kv_heads} KV heads, causal, median of {args.iters}"
    )
    print("| S | config | ms | TFLOP/s | x sdpa | peak MiB | max err vs sdpa |\n|---|---|---|---|---|---|---|")
    rows = []
    for seq in seqs:
        gen = torch.Generator().manual_seed(seq)
        q = torch.randn(1, args.heads, seq, args.head_dim, generator=gen).to(device, dtype)
        k, v = (torch.randn(1, args.kv_heads, seq, args.head_dim, generator=gen).to(device, dtype) for _ in range(2))
        flops = 3.5 * 4 * args.heads * seq * seq * args.head_dim / 2
        base_time, base_out = None, None
        for name, step in candidates(q, k, v, args.head_dim**-0.5, device).items():
            row = {"seq": seq, "config": name}
            if isinstance(step, str):
                row["error"] = step
            else:
                try:
                    seconds, peak, out = measure(step, device, args.iters)
                except Exception as exc:  # noqa: BLE001 - a row that fails says why
                    row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
                else:
                    if base_time is None:
                        base_time, base_out = seconds, out.float()
                    row.update(
                        ms=seconds * 1e3,
                        tflops=flops / seconds / 1e12,
                        ratio=seconds / base_time,
                        peak_mib=peak,
                        max_err=(out.float() - base_out).abs().max().item(),
                    )
            rows.append(row)
            if "error" in row:
                print(f"| {seq} | {name} | {row['error']} | | | | |", flush=True)
            else:
                print(
                    f"| {seq} | {name} | {row['ms']:.2f} | {row['tflops']:.3g} | {row['ratio']:.2f} | "
                    f"{row['peak_mib']:.0f} | {row['max_err']:.1e} |",
                    flush=True,
                )
        del q, k, v
    if args.json:
        write_json(args.json, {"device": where, "torch": torch.__version__, "dtype": str(dtype), "rows": rows})
    failed = [r for r in rows if "error" in r and not r["error"].startswith(("not installed", "skipped"))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
