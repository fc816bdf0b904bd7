"""One training step of a tiny Llama (vocab 32000): our modes and memory options vs plain HF.

    python -m benchmarks.bench_train --seq-lengths 4096,8192 [--csv out.csv]

Rows, each in fresh processes (CPU, gloo, 2 threads in all):
  hf-plain        1 process: the unpatched model, sdpa, no checkpointing, full logits,
                  HF's own loss (model(input_ids, labels=...)).
  MODE P=2        2 processes: our attention, loss in one chunk (full local logits), no
                  checkpointing.
  MODE P=2 +mem   2 processes: + activation checkpointing, tiled MLP (1024 tokens),
                  chunked loss (1024 tokens).
  MODE P=2 compiled  (--compile) MODE P=2 with the decoder torch.compile'd (inductor) after
                  patching; the first step compiles, so its memory includes the compiler's.
  MODE P=2 +mem full / lora rR  (--lora R) fine-tuning every weight against rank-R LoRA
                  adapters on the attention projections (peft; train.py --lora-r): the +mem
                  step plus an AdamW step over the trainable weights, so that their gradients
                  and optimizer state count.
Columns: tokens/s of the whole step (all ranks together; the mean of --timed-steps steps
after the first), per-rank peak
memory of the first step (peak RSS above the RSS of the built model, from /proc/self/status
VmHWM after resetting it through /proc/self/clear_refs), and that peak per token the rank
holds.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from benchmarks.common import (
    init_gloo,
    memory_total_gib,
    reset_peak_rss,
    spawn_ranks,
    status_bytes,
    table_header,
    use_exact_memory,
    write_csv,
    write_result,
)


def tiny_llama(vocab: int, checkpointing: bool, tile: int):
    """The benchmarks' tiny Llama (4 layers, hidden 256, 4 query / 2 KV heads), seed 0."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from easy_context.versions import enable_activation_checkpointing
    from recipes.tiled_mlp import tile_mlps

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1 << 20,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if checkpointing:
        enable_activation_checkpointing(model)
    if tile:
        tile_mlps(model, tile)
    return model


def _worker(rank, world, spec, workdir):
    torch.set_num_threads(max(1, 2 // world))
    if world > 1:
        init_gloo(rank, world, workdir)
    import easy_context as ec
    from easy_context.hf.loss import chunked_cross_entropy_sum, global_token_mean

    seq, mode, memory, vocab = spec["seq"], spec["mode"], spec["memory"], spec["vocab"]
    model = tiny_llama(vocab, checkpointing=memory, tile=1024 if memory else 0)
    optimizer = None
    if spec.get("optimizer"):
        if spec.get("lora"):
            from recipes.lora import add_lora

            model = add_lora(model, spec["lora"])
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    tokens = torch.randint(0, vocab, (1, seq + 1), generator=torch.Generator().manual_seed(1))
    if mode is None:  # plain HF: full logits, HF's loss

        def step():
            model(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss.backward()

        local_tokens = seq
    else:
        ec.apply_seq_parallel_monkey_patch(mode, "llama")
        if spec.get("compile"):
            model.get_decoder().compile()
        local = ec.prepare_seq_parallel_inputs(mode, tokens[:, :-1], None, tokens[:, 1:], rank, world, "cpu")
        chunk = 1024 if memory else seq

        def step():
            hidden = model.get_decoder()(
                input_ids=local["local_input_ids"], position_ids=local["local_position_ids"]
            ).last_hidden_state
            loss_sum = chunked_cross_entropy_sum(
                hidden, model.get_output_embeddings(), local["local_target_ids"], chunk
            )
            global_token_mean(loss_sum, local["local_target_ids"])[0].backward()
            if optimizer is not None:  # what DDP does: average the trainable weights' gradients, then step
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        dist.all_reduce(p.grad)
                        p.grad /= world
                optimizer.step()

        local_tokens = local["local_input_ids"].shape[1]
    if spec.get("profile"):  # where the memory goes (live tensors at the peak), then stop
        from benchmarks.memory_trace import LiveTensorTrace

        with LiveTensorTrace(model) as trace:
            step()
        if rank == 0:
            print(trace.report(tokens=seq), flush=True)
        write_result(workdir, rank, ["nan", trace.peak, local_tokens])
        return
    # Memory: the first step, measured from the RSS of the built model (a warm-up would
    # leave freed memory resident in the allocator and hide part of the peak). VmHWM is
    # the absolute peak (model, runtime and the step), what a memory budget has to hold.
    before = status_bytes("VmRSS:")
    reset_peak_rss(required=True)  # VmHWM back to the current RSS
    start = time.perf_counter()
    step()
    elapsed = time.perf_counter() - start
    absolute = status_bytes("VmHWM:")
    model.zero_grad(set_to_none=True)
    if not spec.get("one_step"):  # time: the steps after the first
        steps = spec.get("timed_steps", 1)
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
            model.zero_grad(set_to_none=True)
        if world > 1:
            dist.barrier()
        elapsed = (time.perf_counter() - start) / steps
    write_result(workdir, rank, [elapsed, absolute - before, local_tokens, absolute])
    if world > 1:
        dist.destroy_process_group()


def run(spec, world):
    values = spawn_ranks(_worker, spec, world)
    if values is None:
        return None
    elapsed = max(v[0] for v in values)
    peak = max(v[1] for v in values)
    return {
        "tokens_per_s": spec["seq"] / elapsed,
        "step_s": elapsed,
        "peak_mib": peak / 2**20,
        "bytes_per_token": peak / values[0][2],
        "absolute_mib": max(v[3] for v in values) / 2**20,
    }


def fit_line(xs, ys):
    """Least-squares slope and intercept."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(1e-12, sum((x - mx) ** 2 for x in xs))
    return slope, my - slope * mx


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lengths", default="4096,8192,16384")
    parser.add_argument("--modes", default="zigzag_ring_attn")
    parser.add_argument("--configs", default=None, help="only these configs (comma separated names, e.g. 'hf-plain')")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument(
        "--exact-memory",
        action="store_true",
        help="MALLOC_MMAP_THRESHOLD_=65536 in the ranks: freed tensors return to the OS at once, so the "
        "RSS peak follows live memory instead of what glibc keeps cached",
    )
    parser.add_argument(
        "--memory-budget-gib",
        type=float,
        default=None,
        help="memory of the machine that the ranks of one config share (default: this machine's)",
    )
    parser.add_argument(
        "--verify-length",
        type=int,
        default=None,
        help="then run one real step of each '+mem' config at this length, next to its prediction",
    )
    parser.add_argument(
        "--compile", action="store_true", help="add 'MODE P=2 compiled': the decoder torch.compile'd after patching"
    )
    parser.add_argument(
        "--lora",
        type=int,
        default=None,
        metavar="R",
        help="add 'MODE P=2 +mem full' and 'MODE P=2 +mem lora rR': every weight vs rank-R adapters, with AdamW",
    )
    parser.add_argument("--timed-steps", type=int, default=1, help="steps timed after the first (their mean)")
    parser.add_argument("--csv", default=None)
    parser.add_argument("--smoke", action="store_true", help="one tiny size, for CI")
    parser.add_argument(
        "--profile", default=None, metavar="CONFIG", help="only this config: print what is live at its peak"
    )
    args = parser.parse_args()
    if args.exact_memory:
        use_exact_memory()
    seqs = [512, 1024] if args.smoke else [int(s) for s in args.seq_lengths.split(",")]
    vocab = 1000 if args.smoke else args.vocab
    budget = args.memory_budget_gib or memory_total_gib()
    if args.timed_steps < 1:
        parser.error(f"--timed-steps must be >= 1, got {args.timed_steps}")
    if args.lora is not None and args.lora < 1:
        parser.error(f"--lora must be >= 1 (the adapters' rank), got {args.lora}")
    configs = [("hf-plain", None, False, 1, False)]
    extras = {}  # config name -> what its spec adds
    for mode in args.modes.split(","):
        configs += [(f"{mode} P=2", mode, False, 2, False), (f"{mode} P=2 +mem", mode, True, 2, False)]
        if args.compile:
            configs.append((f"{mode} P=2 compiled", mode, False, 2, True))
        if args.lora:
            for name, rank in ((f"{mode} P=2 +mem full", 0), (f"{mode} P=2 +mem lora r{args.lora}", args.lora)):
                configs.append((name, mode, True, 2, False))
                extras[name] = {"optimizer": True, "lora": rank}
    if args.configs or args.profile:
        wanted = set((args.configs or args.profile).split(","))
        configs = [c for c in configs if c[0] in wanted]

    print(
        table_header(
            ["config", "S", "tokens/s", "step s", "peak MiB/rank (step)", "KiB/local token", "peak MiB/rank (absolute)"]
        ),
        flush=True,
    )
    rows = []
    for seq in seqs:
        for name, mode, memory, world, compiled in configs:
            spec = {"seq": seq, "mode": mode, "memory": memory, "vocab": vocab, "profile": bool(args.profile)}
            spec.update(extras.get(name, {}))
            result = run({**spec, "compile": compiled, "timed_steps": args.timed_steps}, world)
            rows.append({"config": name, "seq": seq, "world": world, **(result or {})})
            if result:
                print(
                    f"| {name} | {seq} | {result['tokens_per_s']:.0f} | {result['step_s']:.2f} | "
                    f"{result['peak_mib']:.0f} | "
                    f"{result['bytes_per_token'] / 1024:.1f} | {result['absolute_mib']:.0f} |",
                    flush=True,
                )
            else:
                print(f"| {name} | {seq} | failed | | | | |", flush=True)
    if args.profile:
        return

    # Memory against length: per-token slope and fixed part per rank, and the longest context
    # whose predicted per-rank peak fits the budget (the ranks of a config share the machine).
    print(
        f"\nlongest context within {budget:.1f} GiB shared by the ranks of each config "
        "(linear fit of the absolute per-rank peak over the lengths above):\n"
        "| config | slope KiB/token/rank | fixed MiB/rank | longest S (predicted) | verified S | measured MiB/rank | "
        "predicted MiB/rank |\n"
        "|---|---|---|---|---|---|---|",
        flush=True,
    )
    fits = []
    for name, mode, memory, world, _ in configs:
        points = [(r["seq"], r["absolute_mib"]) for r in rows if r["config"] == name and "absolute_mib" in r]
        if len(points) < 2:
            continue
        slope, fixed = fit_line([p[0] for p in points], [p[1] for p in points])  # MiB per token, MiB
        longest = int((budget * 1024 / world - fixed) / slope) if slope > 0 else float("inf")
        fit = {"config": name, "slope_kib_per_token": slope * 1024, "fixed_mib": fixed, "longest_tokens": longest}
        if memory and args.verify_length:
            result = run(
                {"seq": args.verify_length, "mode": mode, "memory": True, "vocab": vocab, "one_step": True}
                | extras.get(name, {}),
                world,
            )
            fit.update(
                verify_tokens=args.verify_length,
                verify_mib=result["absolute_mib"] if result else float("nan"),
                verify_predicted_mib=fixed + slope * args.verify_length,
                verify_step_s=result["step_s"] if result else float("nan"),
            )
        fits.append(fit)
        verified = (
            f"{fit['verify_tokens']} | {fit['verify_mib']:.0f} | {fit['verify_predicted_mib']:.0f}"
            if "verify_tokens" in fit
            else " | | "
        )
        print(f"| {name} | {fit['slope_kib_per_token']:.1f} | {fixed:.0f} | {longest} | {verified} |", flush=True)
    if args.csv:
        write_csv(args.csv, rows)
        if fits:
            write_csv(args.csv.replace(".csv", "") + "_fit.csv", fits)


if __name__ == "__main__":
    main()
