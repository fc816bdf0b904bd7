"""Check the planner (recipes/plan/) against measurements and published results.

    python -m tools.validate_plan                 # tables 1-3 (seconds)
    python -m tools.validate_plan --calibrate     # + table 0: saved-tensor bytes per layer (about 10 s of CPU)
    python -m tools.validate_plan --csv more.csv  # + rows of other `python -m benchmarks.bench_train --csv` runs

Table 0 (calibration): bytes per token one Llama decoder layer saves for backward, counted
with torch's saved-tensor hooks (unique storages, parameters and RoPE tables excluded, slope
between two lengths), next to the planner's per-layer formula.
Table 1 (measured): benchmarks/bench_train.py per-rank absolute peaks (CPU, fp32, one fwd+bwd, no
optimizer, --exact-memory): docs/bench_train.csv, the 64K check of docs/bench_train_fit.csv,
and the rows in MEASURED below, next to the planner's prediction.
Table 2 (published): fit / no-fit of published runs and the planner's per-GPU peak.
Table 3 (throughput): the roofline against EasyContext's published tokens/s.
"""

from __future__ import annotations

import argparse
import csv
import os

from recipes.plan import GIB, MIB, PRESETS, Options, activation_terms, estimate, get_device, throughput

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Rows measured for the planner (not in docs/bench_train.csv), each with the command that
# produced it (2 CPU cores, torch 2.13 CPU, 2026-12-01):
MEASURED = [
    # python -m benchmarks.bench_train --modes ulysses_attn,dist_flash_attn --seq-lengths 8192 --exact-memory
    #   --configs "ulysses_attn P=2,ulysses_attn P=2 +mem,dist_flash_attn P=2,dist_flash_attn P=2 +mem"
    {"config": "ulysses_attn P=2", "seq": 8192, "vocab": 32000, "absolute_mib": 2283, "step_mib": 1864},
    {"config": "ulysses_attn P=2 +mem", "seq": 8192, "vocab": 32000, "absolute_mib": 878, "step_mib": 458},
    {"config": "dist_flash_attn P=2", "seq": 8192, "vocab": 32000, "absolute_mib": 2268, "step_mib": 1847},
    {"config": "dist_flash_attn P=2 +mem", "seq": 8192, "vocab": 32000, "absolute_mib": 894, "step_mib": 474},
    # python -m benchmarks.bench_train --modes zigzag_ring_attn --seq-lengths 8192 --vocab 8000 --exact-memory
    {"config": "hf-plain", "seq": 8192, "vocab": 8000, "absolute_mib": 1798, "step_mib": 1428},
    {"config": "zigzag_ring_attn P=2", "seq": 8192, "vocab": 8000, "absolute_mib": 1095, "step_mib": 722},
    {"config": "zigzag_ring_attn P=2 +mem", "seq": 8192, "vocab": 8000, "absolute_mib": 526, "step_mib": 153},
    # python -m benchmarks.bench_train --modes ulysses_attn,dist_flash_attn --seq-lengths 32768 --exact-memory
    #   --configs "ulysses_attn P=2 +mem,dist_flash_attn P=2 +mem"
    {"config": "ulysses_attn P=2 +mem", "seq": 32768, "vocab": 32000, "absolute_mib": 982, "step_mib": 562},
    {"config": "dist_flash_attn P=2 +mem", "seq": 32768, "vocab": 32000, "absolute_mib": 1047, "step_mib": 626},
    # python -m benchmarks.bench_train --modes zigzag_ring_attn,ulysses_attn,dist_flash_attn --seq-lengths 16384
    #   --vocab 1000 --exact-memory        (a small vocabulary: the layer activations dominate)
    {"config": "hf-plain", "seq": 16384, "vocab": 1000, "absolute_mib": 1877, "step_mib": 1521},
    {"config": "zigzag_ring_attn P=2", "seq": 16384, "vocab": 1000, "absolute_mib": 1129, "step_mib": 769},
    {"config": "zigzag_ring_attn P=2 +mem", "seq": 16384, "vocab": 1000, "absolute_mib": 525, "step_mib": 165},
    {"config": "ulysses_attn P=2", "seq": 16384, "vocab": 1000, "absolute_mib": 1161, "step_mib": 802},
    {"config": "ulysses_attn P=2 +mem", "seq": 16384, "vocab": 1000, "absolute_mib": 528, "step_mib": 168},
    {"config": "dist_flash_attn P=2", "seq": 16384, "vocab": 1000, "absolute_mib": 1130, "step_mib": 770},
    {"config": "dist_flash_attn P=2 +mem", "seq": 16384, "vocab": 1000, "absolute_mib": 554, "step_mib": 193},
]


def bench_options(config: str):
    """(Options, world) of a benchmarks/bench_train.py config name."""
    memory = config.endswith("+mem")
    if config == "hf-plain":
        return Options("data_parallel", 1, 1, zero="noopt"), 1
    mode = config.split()[0]
    ring = 1 if mode == "ulysses_attn" else 2
    return Options(mode, 2, ring, memory, False, 1024 if memory else 0, 1024 if memory else 0, "noopt"), 2


def measured_rows(extra_csvs):
    rows = []
    with open(os.path.join(ROOT, "docs", "bench_train.csv")) as f:
        for r in csv.DictReader(f):
            rows.append(
                {
                    "config": r["config"],
                    "seq": int(r["seq"]),
                    "vocab": 32000,
                    "absolute_mib": float(r["absolute_mib"]),
                    "step_mib": float(r["peak_mib"]),
                    "source": "docs/bench_train.csv",
                }
            )
    with open(os.path.join(ROOT, "docs", "bench_train_fit.csv")) as f:
        for r in csv.DictReader(f):
            if r.get("verify_tokens"):
                rows.append(
                    {
                        "config": r["config"],
                        "seq": int(r["verify_tokens"]),
                        "vocab": 32000,
                        "absolute_mib": float(r["verify_mib"]),
                        "step_mib": None,
                        "source": "docs/bench_train_fit.csv (verify)",
                    }
                )
    rows += [{**r, "source": "MEASURED (validate_plan.py)"} for r in MEASURED]
    for path in extra_csvs or []:
        vocab = 32000
        with open(path) as f:
            for r in csv.DictReader(f):
                if r.get("absolute_mib"):
                    rows.append(
                        {
                            "config": r["config"],
                            "seq": int(r["seq"]),
                            "vocab": int(r.get("vocab") or vocab),
                            "absolute_mib": float(r["absolute_mib"]),
                            "step_mib": float(r["peak_mib"]),
                            "source": os.path.basename(path),
                        }
                    )
    return rows


def table_measured(extra_csvs=None, vocab_of_csv=None):
    device = get_device("cpu")
    print("### 1. Per-rank absolute peak, measured (benchmarks/bench_train.py, CPU, fp32) vs predicted\n")
    print(
        "| config | S | vocab | measured MiB | predicted MiB | error | step: measured / predicted MiB | "
        "peak phase (predicted) | source |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    errors = []
    for r in measured_rows(extra_csvs):
        vocab = vocab_of_csv.get(r["source"], r["vocab"]) if vocab_of_csv else r["vocab"]
        model = PRESETS["tiny-bench"].__class__(
            **{**PRESETS["tiny-bench"].__dict__, "vocab": vocab, "name": "tiny-bench"}
        )
        options, world = bench_options(r["config"])
        e = estimate(model, r["seq"], world, options, device, "fp32", persistent_grads=False)
        pred = e["peak_bytes"] / MIB
        err = pred / r["absolute_mib"] - 1
        errors.append(err)
        flag = "" if abs(err) <= 0.15 else " MISS"
        # the step alone: the peak above the RSS of the built model (runtime and weights excluded)
        step_pred = pred - device.runtime_gib * 1024 - 4 * model.params / MIB
        step = f"{r['step_mib']:.0f} / {step_pred:.0f}" if r.get("step_mib") else "- / -"
        print(
            f"| {r['config']} | {r['seq']} | {vocab} | {r['absolute_mib']:.0f} | {pred:.0f} | {err:+.1%}{flag} | "
            f"{step} | "
            f"{e['peak_phase']} | {r['source']} |"
        )
    print(
        f"\n{len(errors)} rows; largest |error| {max(abs(e) for e in errors):.1%}; "
        f"{sum(abs(e) > 0.15 for e in errors)} outside 15%\n"
    )
    return errors


# Published runs: (what, model, seq, gpus, gpu, options, published verdict, note)
PUBLISHED = [
    (
        "EasyContext: Llama-2-7B, 700K, 8 x A100-80GB",
        "llama-2-7b",
        700_000,
        8,
        "a100-80g",
        Options("zigzag_ring_attn", 8, 8, True, False, 0, 4096, "zero3-offload"),
        True,
        "zigzag ring, checkpointing, ZeRO-3 offload; their fused CE stood in by 4096-token loss chunks",
    ),
    (
        "ALST: Llama-3-8B, 500K, 1 x H100-80GB",
        "llama-3-8b",
        500_000,
        1,
        "h100-80g",
        Options("data_parallel", 1, 1, True, True, 4096, 1024, "zero3-offload"),
        True,
        "tiled MLP, tiled loss, checkpoints offloaded, ZeRO-3 offload (one GPU: no SP)",
    ),
    (
        "ALST: Llama-3-8B, 3.7M, 8 x H100-80GB",
        "llama-3-8b",
        3_700_000,
        8,
        "h100-80g",
        Options("ulysses_attn", 8, 1, True, True, 4096, 1024, "zero3-offload"),
        True,
        "Ulysses sp 8, tiled MLP, tiled loss, checkpoints offloaded, ZeRO-3 offload",
    ),
    (
        "HF baseline: Llama-3-8B, 32K, 1 x H100-80GB",
        "llama-3-8b",
        32_768,
        1,
        "h100-80g",
        Options("data_parallel", 1, 1, True, False, 0, 0, "zero3-offload"),
        True,
        "ALST's baseline reached 32K (500K = 16x, 3.7M = 116x it); "
        "assumed: checkpointing on, HF loss on full logits, ZeRO-3 offload",
    ),
    (
        "HF baseline: Llama-3-8B, 64K, 1 x H100-80GB",
        "llama-3-8b",
        65_536,
        1,
        "h100-80g",
        Options("data_parallel", 1, 1, True, False, 0, 0, "zero3-offload"),
        False,
        "ALST: 'over 32K runs out of memory' on the basic HF model; same assumptions",
    ),
    (
        "HF baseline without checkpointing: Llama-3-8B, 32K, 1 x H100-80GB",
        "llama-3-8b",
        32_768,
        1,
        "h100-80g",
        Options("data_parallel", 1, 1, False, False, 0, 0, "zero3-offload"),
        None,
        "not published: shows why the baseline must have had checkpointing",
    ),
]


def table_published(margin: float = 0.10):
    print("### 2. Published fit / no-fit vs predicted (bf16)\n")
    print(
        "| run | published | predicted peak GiB/GPU | GPU GiB | predicted (peak <= memory) | with 10% margin | "
        "agrees | peak phase | assumptions |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    verdicts = []
    for what, name, seq, gpus, gpu, options, published, note in PUBLISHED:
        device = get_device(gpu)
        e = estimate(PRESETS[name], seq, gpus, options, device, "bf16")
        peak = e["peak_bytes"] / GIB
        fit = peak <= device.memory_gib
        margin_fit = peak <= device.memory_gib * (1 - margin)
        agree = "" if published is None else ("yes" if fit == published else "NO")
        pub = "n/a" if published is None else ("fits" if published else "OOM")
        verdicts.append((what, published, fit, margin_fit, peak))
        print(
            f"| {what} | {pub} | {peak:.1f} | {device.memory_gib:.0f} | {'fit' if fit else 'no fit'} | "
            f"{'fit' if margin_fit else 'no fit'} | {agree} | {e['peak_phase']} | {note} |"
        )
    print()
    return verdicts


# EasyContext README: Llama-2-7B on 8 x A100-80GB, zigzag ring (64K DP: data parallel), tokens/s
EASYCONTEXT_SPEED = [
    (65536, "data_parallel", 10240),
    (65536, "zigzag_ring_attn", 7816),
    (131072, "zigzag_ring_attn", 4266),
    (524288, "zigzag_ring_attn", 2133),
    (700_000, "zigzag_ring_attn", 1603),
]


def table_throughput():
    print(
        "### 3. Roofline tokens/s vs EasyContext's published "
        "(Llama-2-7B, 8 x A100-80GB, checkpointing, ZeRO-3 offload)\n"
    )
    print("| S | mode | published tokens/s | predicted tokens/s | ratio | bound by |")
    print("|---|---|---|---|---|---|")
    device, model = get_device("a100-80g"), PRESETS["llama-2-7b"]
    for seq, mode, published in EASYCONTEXT_SPEED:
        sp = 1 if mode == "data_parallel" else 8
        o = Options(mode, sp, sp, True, False, 0, 4096, "zero3-offload")
        t = throughput(model, seq, 8, o, device)
        print(
            f"| {seq} | {mode} | {published} | {t['tokens_per_s']:.0f} | {t['tokens_per_s'] / published:.2f} | "
            f"{t['limiter']} |"
        )
    print()


def saved_bytes_per_token(hidden, inter, heads, kv_heads, dtype):
    """Bytes per token a Llama decoder layer saves for backward (saved-tensor hooks; unique
    storages; parameters and the RoPE tables excluded; slope between 256 and 512 tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(dtype)
    layer, params = model.model.layers[0], {p.untyped_storage().data_ptr() for p in model.parameters()}

    def total(s):
        x = torch.randn(1, s, hidden, dtype=dtype, requires_grad=True)
        pos = torch.arange(s)[None]
        cos, sin = model.model.rotary_emb(x, pos)
        skip = params | {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
        seen = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in skip:
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(x, position_embeddings=(cos, sin), position_ids=pos)
        return sum(seen.values())

    return (total(512) - total(256)) / 256


def table_calibration():
    import torch

    print("### 0. Saved tensors of one Llama decoder layer, bytes per token: hooks vs formula\n")
    print("| hidden | intermediate | heads / KV heads | dtype | measured | formula | error |")
    print("|---|---|---|---|---|---|---|")
    for shape in [(256, 688, 4, 2), (512, 688, 8, 8), (256, 1376, 4, 4)]:
        for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            measured = saved_bytes_per_token(*shape, dtype)
            h, i, H, kv = shape
            model = PRESETS["tiny-bench"].__class__("x", h, i, 1, H, kv, h // H, 1000)
            act = activation_terms(model, Options("data_parallel", 1, 1), 4 if name == "fp32" else 2)
            formula = act["attn"] + act["mlp_in"] + act["mlp"]
            print(f"| {h} | {i} | {H} / {kv} | {name} | {measured:.0f} | {formula} | {formula / measured - 1:+.1%} |")
    print()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibrate", action="store_true", help="also count saved tensors with torch (table 0)")
    parser.add_argument("--csv", action="append", default=None, help="more benchmarks/bench_train.py CSVs (table 1)")
    parser.add_argument("--csv-vocab", type=int, default=None, help="the --vocab those CSVs were measured with")
    args = parser.parse_args()
    if args.calibrate:
        table_calibration()
    vocab_of = {os.path.basename(p): args.csv_vocab for p in args.csv or []} if args.csv_vocab else None
    table_measured(args.csv, vocab_of)
    table_published()
    table_throughput()


if __name__ == "__main__":
    main()
