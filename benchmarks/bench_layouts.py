"""Packed long-tailed rows under the three layouts a mode can hold them in, side by side in one
run (issue 44), and the data-parallel order by work.

    python -m benchmarks.bench_layouts                     # S=16K, P=2, 4 and 8, 4 rows
    python -m benchmarks.bench_layouts --seq 32768 --rows 6
    python -m benchmarks.bench_layouts --smoke             # S=2K, P=2, seconds

The rows: documents of log-normal lengths (median 300 tokens, sigma 1.4, between 64 tokens and
the row), packed into rows of --seq tokens; row i is the same in every cell. Layouts:

  static     the mode's own layout (zigzag, or contiguous for dist_flash_attn)
  cut        document_split=True: every document cut over the ring
  workload   document_split="workload": documents whole on one rank, only the longest cut

Each cell runs the mode's attention (forward + backward, gloo, CPU, one thread per rank; q, k,
v of --heads / --kv-heads x --head-dim, fp32) on P ranks. The mask's kernel calls are worked
out in a warm-up step and reused, as every layer of a training step reuses them.

  tokens/s   tokens of all rows / the sum over rows of the slowest rank's time (median of --steps)
  MiB/row    bytes the busiest rank sends per row through torch.distributed (forward + backward)
  balance    max/min query x key products per rank, from the kernel calls (worst row)
  x cut      tokens/s and bytes over document_split's (cut) in the same run
  predicted  one layer's attention on a GPU ring (recipes/plan/packed.py: the row's schedule, its
             kernel calls' products and the rows it moves, priced at the device's attention
             TFLOP/s, link and latency, printed above the table), per row, and over cut's

The data-parallel table composes measured row times into steps of dp 2 x sp 2: each row's time
is measured at P=2 (zigzag_ring_attn, workload layout) and a step lasts as long as its slower
group. It gives the sum over steps of the slower group's time over the sum of the mean group's,
in the epoch's random order and in the order by work (core.work_order.balanced_epoch_order).
Timing two groups at once would put four ranks on two cores, which measures the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time

from benchmarks.common import init_gloo, run_to_end, table_header, table_row

MODES = ("zigzag_ring_attn", "dist_flash_attn")


def row_lengths(seq: int, seed: int) -> list[int]:
    """Document lengths of packed row `seed`: log-normal, at least 64 tokens."""
    from recipes.plan.packed import long_tailed_lengths

    return long_tailed_lengths(seq, random.Random(seed), shortest=64)


def _cell(spec: dict, mode: str, layout: str, seed: int, group, counter) -> dict:
    """One row in one layout on this rank: the slowest rank's median step time and the busiest
    rank's bytes."""
    import torch
    import torch.distributed as dist

    from easy_context.core.layout import Layout, RowLayout
    from easy_context.core.masking import SequenceMask
    from easy_context.modes.dist_flash_attn import dist_flash_attention
    from easy_context.modes.zigzag_ring_attn import zigzag_ring_attention
    from recipes.plan.packed import packed_mask, shares_of

    seq, size, rank = spec["seq"], dist.get_world_size(), dist.get_rank()
    zigzag = mode == "zigzag_ring_attn"
    whole_mask = packed_mask(row_lengths(seq, seed))
    shares = shares_of(layout, whole_mask, size, spec["tolerance"])
    row_layout = None if shares is None else RowLayout([share[None] for share in shares])
    index = Layout(zigzag, size).local_indices(seq, rank) if shares is None else shares[rank]
    generator = torch.Generator().manual_seed(seed)
    make = lambda heads: torch.randn(1, heads, seq, spec["head_dim"], generator=generator)  # noqa: E731
    q, k, v, dout = make(spec["heads"]), make(spec["kv_heads"]), make(spec["kv_heads"]), make(spec["heads"])
    q, k, v = (x[:, :, index].clone().requires_grad_() for x in (q, k, v))
    dout = dout[:, :, index].contiguous()
    mask = SequenceMask(whole_mask.first_key, row_layout=row_layout)
    scale = spec["head_dim"] ** -0.5

    def step():
        if zigzag:
            out = zigzag_ring_attention(q, k, v, scale, group, mask)
        else:
            out = dist_flash_attention(q, k, v, scale, group, None, mask)
        out.backward(dout)

    step()  # warm-up: works out the kernel calls
    times, sent = [], []
    for _ in range(spec["steps"]):
        dist.barrier()
        counter.bytes, counter.enabled = 0, True
        start = time.perf_counter()
        step()
        elapsed = torch.tensor([time.perf_counter() - start, float(counter.bytes)], dtype=torch.float64)
        counter.enabled = False
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed[0].item())
        sent.append(elapsed[1].item())
    return {"seconds": statistics.median(times), "bytes": max(sent)}


def _counted(spec: dict, mode: str, layout: str, seed: int, size: int, link) -> dict:
    """The row's work balance (max/min, from the kernel calls) and its predicted GPU time
    (recipes/plan/packed.py): pure functions of its mask, worked out once, here, not on every rank."""
    from benchmarks.mask_balance import WORK_OF
    from recipes.plan.packed import packed_mask, predict, round_costs, schedule_of, shares_of

    seq = spec["seq"]
    mask = packed_mask(row_lengths(seq, seed))
    shares = shares_of(layout, mask, size, spec["tolerance"])
    work = WORK_OF[mode](mask, seq, size, None if shares is None else [share[None] for share in shares])
    rounds = round_costs(schedule_of(mode, mask, seq, size, shares), size, seq // size)
    return {
        "balance": max(work) / max(1, min(work)),
        "predicted": predict(rounds, *spec["model_shape"], link)["seconds"],
    }


def _worker(rank: int, world: int, spec: dict, workdir: str) -> None:
    import torch
    import torch.distributed as dist

    from benchmarks.attention_comm import CommCounter

    torch.set_num_threads(1)
    init_gloo(rank, world, workdir)
    CommCounter.install(dist)
    results = []
    for mode in spec["modes"]:
        for layout in spec["layouts"]:
            for seed in range(spec["rows"]):
                cell = _cell(spec, mode, layout, seed, dist.group.WORLD, CommCounter.instance)
                results.append({"mode": mode, "layout": layout, "row": seed, **cell})
    if rank == 0:
        with open(os.path.join(workdir, "results.json"), "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def run_world(spec: dict, world: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as workdir:
        run_to_end(_worker, world, (spec, workdir), 3600, f"P={world}")
        with open(os.path.join(workdir, "results.json")) as f:
            return json.load(f)


def layout_table(results: dict, seq: int, rows: int) -> str:
    lines = [
        table_header(
            [
                "mode",
                "P",
                "layout",
                "tokens/s",
                "MiB/row",
                "balance (worst)",
                "tokens/s x cut",
                "bytes x cut",
                "predicted GPU ms/row",
                "predicted x cut",
            ]
        )
    ]
    for (world, mode), cells in results.items():
        totals = {}
        for layout in dict.fromkeys(c["layout"] for c in cells):  # the run's layouts, in its order
            mine = [c for c in cells if c["layout"] == layout]
            seconds = sum(c["seconds"] for c in mine)
            totals[layout] = (
                seq * rows / seconds,
                sum(c["bytes"] for c in mine) / rows,
                max(c["balance"] for c in mine),
                sum(c["predicted"] for c in mine) / rows,
            )
        for layout, (speed, sent, balance, predicted) in totals.items():
            cut_speed, cut_sent, _, cut_predicted = totals["cut"]
            bytes_ratio = f"{sent / cut_sent:.2f}" if cut_sent else "-"
            cells_out = [mode, str(world), layout, f"{speed:,.0f}", f"{sent / 2**20:.1f}", f"{balance:.3f}"]
            ratios = [
                f"{speed / cut_speed:.2f}",
                bytes_ratio,
                f"{predicted * 1e3:.3f}",
                f"{predicted / cut_predicted:.2f}",
            ]
            lines.append(table_row([*cells_out, *ratios]))
    return "\n".join(lines)


def data_parallel_table(seconds: list[float], seq: int, rows: int) -> str:
    """Measured row times (P=2) composed into dp 2 steps: slower group / mean, summed over steps."""
    import numpy as np
    import torch

    from easy_context.core.work_order import balanced_epoch_order

    products = np.array(
        [sum(n * (n + 1) / 2 for n in row_lengths(seq, seed)) for seed in range(rows)], dtype=np.float64
    )
    times = np.array(seconds)
    lines = [table_header(["order", "slowest group / mean (sum over steps)", "epoch seconds (dp 2)"])]
    for name in ("random", "by work"):
        per_order = []
        for seed in range(20):  # 20 epochs' orders of the same rows
            order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
            if name == "by work":
                order = balanced_epoch_order(order, products, 2, 1, seed)
            steps = times[order[: rows // 2 * 2].numpy()].reshape(-1, 2)
            per_order.append((steps.max(axis=1).sum(), steps.mean(axis=1).sum()))
        slowest, mean = (sum(x) / len(per_order) for x in zip(*per_order))
        lines.append(table_row([name, f"{slowest / mean:.3f}", f"{slowest:.2f}"]))
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--sizes", default="2,4,8")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--dp-rows", type=int, default=16, help="rows timed for the data-parallel table (0: none)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument(
        "--tolerance", type=float, default=None, help="the workload layout's max/min work (default: WORK_TOLERANCE)"
    )
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument(
        "--model-shape",
        default="32,8,128",
        help="query heads, K/V heads, head dim of the predicted GPU step (default: Llama-3-8B's attention)",
    )
    parser.add_argument("--gpu", default="h100-80g", help="the planner's device whose figures the prediction uses")
    parser.add_argument("--smoke", action="store_true", help="S=2K, P=2, 2 rows, 4 data-parallel rows")
    args = parser.parse_args()
    if args.smoke:
        args.seq, args.sizes, args.rows, args.dp_rows, args.steps = 2048, "2", 2, 4, 1
    from easy_context.core.balance import WORK_TOLERANCE

    args.tolerance = WORK_TOLERANCE if args.tolerance is None else args.tolerance
    spec = {k: getattr(args, k) for k in ("seq", "rows", "steps", "heads", "kv_heads", "head_dim", "tolerance")}
    from recipes.plan.catalogue import get_device
    from recipes.plan.packed import LAYOUTS, LinkModel
    from recipes.plan.speed import efficiency

    device = get_device(args.gpu)
    link = LinkModel(tflops=device.tflops * efficiency(device)[1], link_gbs=device.link_gbs)
    spec["model_shape"] = [int(x) for x in args.model_shape.split(",")]
    print(
        f"S={args.seq}, {args.rows} long-tailed packed rows (log-normal, median 300, >= 64 tokens); "
        f"q {args.heads} / kv {args.kv_heads} heads x {args.head_dim}, fp32, forward + backward, CPU gloo; "
        f"workload layout within {args.tolerance} max/min work"
    )
    results = {}
    for world in map(int, args.sizes.split(",")):
        for row in run_world({**spec, "modes": args.modes.split(","), "layouts": LAYOUTS}, world):
            row.update(_counted(spec, row["mode"], row["layout"], row["row"], world, link))
            results.setdefault((world, row["mode"]), []).append(row)
    heads, kv_heads, head_dim = spec["model_shape"]
    print(
        f"predicted GPU ms/row: one layer's attention (forward + backward) of {heads} / {kv_heads} heads x {head_dim}, "
        f"bf16, on {device.name} (recipes/plan/packed.py's model): {link.describe()}"
    )
    print(layout_table(results, args.seq, args.rows))
    if not args.dp_rows:
        return
    dp = run_world({**spec, "rows": args.dp_rows, "modes": ("zigzag_ring_attn",), "layouts": ("workload",)}, 2)
    seconds = [c["seconds"] for c in sorted(dp, key=lambda c: c["row"])]
    print(f"\ndata parallel: {args.dp_rows} rows timed at P=2 (zigzag_ring_attn, workload), composed into dp 2 steps")
    print(data_parallel_table(seconds, args.seq, args.dp_rows))


if __name__ == "__main__":
    main()
