"""Plan a long-context training run: per-rank peak memory and a throughput estimate for every
feasible mode x memory-option combination, and a recommendation.

    python -m easy_context.plan --model llama-3-8b --seq-length 524288 --gpus 8 --gpu h100-80g
    python -m easy_context.plan --model configs/tiny-llama --seq-length 65536 --gpus 2 --gpu cpu --json

The model is analytic (no tensors are allocated); docs/planner.md states every term, the
roofline, the assumptions and how the model compares with measured and published runs.
Plain Python arithmetic; transformers is imported only to read a config that is not a preset.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from easy_context.modes import BUILT_MODES, get_mode
from recipes.plan.catalogue import (
    DEVICES,
    PRESETS,
    ZERO_CHOICES,
    PlanError,
    default_host_memory,
    get_device,
    load_model,
)
from recipes.plan.packed import packed_layout
from recipes.plan.planner import flags_of, plan
from recipes.plan.sharding import SHARDINGS

__all__ = ["COLUMNS", "main", "parse_args", "render", "table_cells"]

COLUMNS = [
    "#",
    "mode",
    "sp",
    "ring",
    "ckpt",
    "offload ckpt",
    "tiled MLP",
    "loss chunk",
    "ZeRO / FSDP",
    "peak GiB/rank",
    "host GiB/node",
    "fits",
    "tokens/s",
    "bound by",
]


def parameter_count(n: int) -> str:
    """A parameter count in the unit that shows it: 8.03B, 3.21M, 12.5K, 900."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size * 0.9995:  # 999,999 reads 1.00M, not 1000K
            return f"{n / size:.3g}{unit}" if n < 100 * size else f"{n / size:.0f}{unit}"
    return str(n)


def table_cells(rank: int, r: dict) -> list:
    return [
        str(rank),
        r["mode"],
        str(r["sp_size"]),
        str(r["ring_degree"]),
        "yes" if r["activation_checkpointing"] else "no",
        "yes" if r["offload_checkpoints"] else "no",
        str(r["tiled_mlp"] or "off"),
        str(r["loss_chunk_size"] or "whole"),
        r["zero"],
        f"{r['peak_gib']:.2f}",
        f"{r['host_gib']:.1f}",
        "yes" if r["fits"] else "NO (host)" if r["fits_device"] else "NO",
        f"{r['tokens_per_s']:.0f}",
        r["limiter"],
    ]


def render(result: dict, rows: list, packed: bool = False, layout_choice: tuple | None = None) -> str:
    """The table and the recommendation; `layout_choice`: (layout, why) for packed rows
    (packed.packed_layout), None where the recommended mode takes no layout per row."""
    m, dev = result["model"], result["device"]
    out = [
        f"model {m['name']}: {parameter_count(result['params'])} params, hidden {m['hidden']}, "
        f"intermediate {m['intermediate']}, "
        f"{m['layers']} layers, {m['heads']} heads / {m['kv_heads']} KV heads, vocab {m['vocab']}",
        f"{result['seq_length']} tokens on {result['gpus']} x {dev['name']} ({dev['memory_gib']:.1f} GiB each), "
        f"{result['dtype']}, "
        f"safety margin {result['margin']:.0%}",
    ]
    if result.get("host_memory_gib") is not None:
        out.append(
            f"host memory {result['host_memory_gib']:.1f} GiB per node ({result.get('host_memory_source', 'given')}); "
            "host GiB/node: what a node pins for offloaded checkpoints and ZeRO / FSDP CPU-offloaded states"
        )
    if result["gpus"] > dev["per_node"]:
        out.append(
            f"{-(-result['gpus'] // dev['per_node'])} nodes of {dev['per_node']}: {dev['link_gbs']:g} GB/s per device "
            f"inside a node, {dev['network_gbs']:g} GB/s across nodes"
        )
    out.append("")
    out.append("| " + " | ".join(COLUMNS) + " |")
    out.append("|" + "---|" * len(COLUMNS))
    for i, r in enumerate(rows, 1):
        out.append("| " + " | ".join(table_cells(i, r)) + " |")
    shown = len(rows)
    if shown < len(result["rows"]):
        out.append(f"\n({shown} of {len(result['rows'])} combinations shown; --all for every one)")
    best = result["recommendation"]
    if best:
        out.append(
            f"\nrecommended: {best['mode']}, sp_size {best['sp_size']}"
            + (f", ring_degree {best['ring_degree']}" if get_mode(best["mode"]).takes_ring_degree else "")
            + f": {best['peak_gib']:.2f} GiB/rank predicted, {best['tokens_per_s']:.0f} tokens/s predicted"
        )
        layout = layout_choice[0] if layout_choice else "workload"
        out.append("  " + flags_of(best, result["seq_length"], packed, layout))
        if layout_choice:
            out.append(f"  packed rows: the {layout} layout, the least {layout_choice[1]}")
        out.append(f"  memory at the peak ({best['peak_phase']}):")
        for k, v in best["terms_gib"].items():
            out.append(f"    {k}: {v:.2f} GiB")
        if best["host_terms_gib"]:
            n = best["host_ranks_per_node"]
            out.append(f"  host memory: {best['host_gib']:.2f} GiB per node = {n} rank{'s' * (n > 1)} x:")
            for k, v in best["host_terms_gib"].items():
                out.append(f"    {k}: {v:.2f} GiB")
    return "\n".join(out)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m easy_context.plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", required=True, help=f"a preset ({', '.join(PRESETS)}), a local config folder, or a cached hub name"
    )
    p.add_argument("--seq-length", type=int, required=True, help="tokens per training sequence")
    p.add_argument("--gpus", type=int, default=8, help="devices in the job (world size)")
    p.add_argument("--gpu", default="h100-80g", help=f"one of {sorted(set(DEVICES))}")
    p.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=None,
        help="memory per device (overrides the named GPU's; cpu: this machine's memory / --gpus)",
    )
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        help="devices per node (default: the GPU's usual node, 8; cpu: one node); groups that span nodes are "
        "priced at --network-gbs",
    )
    p.add_argument(
        "--link-gbs", type=float, default=None, help="GB/s per device inside a node, one way (default: the GPU's)"
    )
    p.add_argument(
        "--network-gbs", type=float, default=None, help="GB/s per device across nodes, one way (default: the GPU's)"
    )
    p.add_argument(
        "--host-memory",
        "--host-memory-gib",
        dest="host_memory",
        type=float,
        default=None,
        metavar="GiB",
        help="host RAM per node; a combination whose offloaded checkpoints and CPU-offloaded ZeRO / FSDP states "
        "need more (less the margin) does not fit (default: this machine's RAM when the plan is for it, --gpu cpu "
        "or a node's worth of the named GPU here; else the named GPU's node, "
        + ", ".join(
            f"{k} {d.default_host_memory_gib:g}" for k, d in DEVICES.items() if k == d.name and not d.memory_is_host
        )
        + " GiB)",
    )
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 (cpu: fp32)")
    p.add_argument(
        "--margin", type=float, default=0.10, help="safety margin: a row fits when peak <= memory x (1 - margin)"
    )
    p.add_argument("--sp-size", type=int, action="append", default=None, help="only these SP sizes (repeatable)")
    p.add_argument("--mode", action="append", default=None, help="only these modes (repeatable)")
    p.add_argument(
        "--zero",
        action="append",
        default=None,
        choices=list(SHARDINGS),
        help=f"only these model-state settings (repeatable; default: {', '.join(ZERO_CHOICES)}): none = DDP, "
        "zero3* = DeepSpeed ZeRO-3, fsdp2* = train.py --fsdp (docs/planner.md)",
    )
    p.add_argument(
        "--tiled-mlp", type=int, default=None, help="MLP tile to consider (default: ~hidden_size tokens, >= 1024)"
    )
    p.add_argument(
        "--loss-chunk-size", type=int, default=None, help="loss chunk to consider (default: logits within 2 GiB)"
    )
    p.add_argument(
        "--packed-documents",
        action="store_true",
        help="the rows are packed documents: the command gets --document-masking and, in modes that take a "
        "layout per row, the layout with the least predicted attention time (static, cut or workload; "
        "recipes/plan/packed.py)",
    )
    p.add_argument("--top", type=int, default=15, help="rows to print (best first)")
    p.add_argument("--all", action="store_true", help="print every combination")
    p.add_argument("--json", action="store_true", help="the same rows as JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.mode:
            unknown = [m for m in args.mode if m not in BUILT_MODES]
            if unknown:
                raise PlanError(f"unknown mode(s) {unknown}; choose from {list(BUILT_MODES)}")
        model = load_model(args.model)
        device = get_device(
            args.gpu,
            args.gpu_memory_gib,
            per_node=args.gpus_per_node,
            link_gbs=args.link_gbs,
            network_gbs=args.network_gbs,
        )
        if device.name == "cpu" and args.gpu_memory_gib is None:  # the ranks share the machine's memory
            device = replace(device, memory_gib=device.memory_gib / max(1, args.gpus))
        for name in ("tiled_mlp", "loss_chunk_size", "top"):
            value = getattr(args, name)
            if value is not None and value < 1:
                raise PlanError(f"--{name.replace('_', '-')} must be positive, got {value}")
        if args.host_memory is not None:
            host_gib, host_source = args.host_memory, "--host-memory"
        else:
            host_gib, host_source = default_host_memory(device, args.gpus)
        result = plan(
            model,
            args.seq_length,
            args.gpus,
            device,
            args.dtype,
            args.margin,
            args.sp_size,
            args.mode,
            args.zero,
            args.tiled_mlp,
            args.loss_chunk_size,
            host_gib,
        )
        result["host_memory_source"] = host_source
    except PlanError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    rows = result["rows"] if args.all else result["rows"][: args.top]
    if args.json:
        print(json.dumps({**result, "rows": rows, "rows_total": len(result["rows"])}, indent=1))
    else:
        choice = None
        if args.packed_documents and result["recommendation"]:
            choice = packed_layout(result["recommendation"], model, device, args.gpus, args.seq_length)
        print(render(result, rows, args.packed_documents, choice))
    if result["recommendation"] is None:
        small = result["smallest"]
        more = f"{small['gpus']} x {args.gpu}" if small["gpus"] else "no GPU count up to 65536"
        if small["host_why"]:  # some combinations fit the GPUs, none the host
            print(
                f"error: nothing fits {args.seq_length} tokens on {args.gpus} x {device.name} within the host memory: "
                f"the combination that fits the GPUs with the least host memory {small['host_why']}; give "
                f"--host-memory (at least {small['host_gib']} GiB), or use {more}",
                file=sys.stderr,
            )
            return 3
        print(
            f"error: nothing fits {args.seq_length} tokens on {args.gpus} x {device.name} "
            f"({device.memory_gib:.1f} GiB, "
            f"margin {args.margin:.0%}); the best combination needs {small['memory_gib']} GiB per GPU, "
            f"or use {more}",
            file=sys.stderr,
        )
        return 3
    return 0
