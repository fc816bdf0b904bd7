"""A GRPO training step at long completions: TRL's GRPOTrainer in one process against the same
trainer made sequence-parallel by prepare_trainer over 2 ranks.

    python -m benchmarks.bench_rl --completion-lengths 8192,16384 [--csv out.csv]

The tiny Llama of bench_train.py (vocab 32000, 4 layers, hidden 256, 4 query / 2 KV heads of
64), fp32, GRPOConfig's gradient checkpointing on (its default), loss type dapo, beta 0 and one
iteration per generation (so each step is one log-prob forward and its backward per row), a
prompt of --prompt-tokens and 2 completions of exactly L tokens per step (num_generations 2).
The completions are given, not generated: the trainer's rollout (`_generate_single_turn`,
replaced on the instance) returns fixed random tokens, so a row measures the training step
(what scales with L in RL training); benchmarks/bench_generate.py measures the sharded rollout.
Rows, each in fresh processes on the same cores (CPU, gloo, 2 threads in all):
  trl P=1        1 process, 2 threads: the unpatched GRPOTrainer (TRL's fused LM head: per-token
                 log-probs without the (S x vocab) logits)
  MODE P=2       2 processes of one thread: prepare_trainer(MODE, trainer), one SP group
Columns: the time of the second step (the first warms up), and the peak RSS growth of a rank
over both steps (VmHWM reset when training starts), the ranks returning freed memory to the OS
at once (common.use_exact_memory).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks.bench_train import tiny_llama
from benchmarks.common import (
    init_gloo,
    int_list,
    reset_peak_rss,
    spawn_ranks,
    status_bytes,
    table_header,
    table_row,
    use_exact_memory,
    write_csv,
    write_result,
)

VOCAB = 32000


def _worker(rank, world, spec, workdir):
    torch.set_num_threads(max(1, 2 // world))
    if world > 1:
        init_gloo(rank, world, workdir)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    import warnings

    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from transformers.utils import logging
    from trl import GRPOConfig, GRPOTrainer

    import easy_context as ec

    warnings.filterwarnings("ignore")  # keep the table readable
    logging.set_verbosity_error()
    length, prompt = spec["completion"], spec["prompt"]
    tokens = torch.Generator().manual_seed(1)
    completions = torch.randint(1, VOCAB, (64, length), generator=tokens).tolist()  # no EOS (id 0)

    def given_completions(prompt_ids, *args, **kwargs):
        """The rollout: fixed completions of exactly `length` tokens (every rank alike)."""
        return completions[: len(prompt_ids)], None

    step_times, peak = [], []

    class Measure(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            peak.append(status_bytes("VmRSS:"))
            reset_peak_rss(required=True)

        def on_step_begin(self, args, state, control, **kwargs):
            step_times.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            step_times[-1] = time.perf_counter() - step_times[-1]

    # A word-level tokenizer: each prompt word one id, so the prompt is exactly `prompt` tokens.
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<eos>": 0, **{f"w{i}": i + 1 for i in range(VOCAB - 1)}}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=word_level, eos_token="<eos>", pad_token="<eos>")
    tokenizer.padding_side = "left"
    texts = [" ".join(f"w{(7 * i + j) % (VOCAB - 1)}" for j in range(prompt)) for i in range(8)]
    model = tiny_llama(VOCAB, checkpointing=False, tile=0)
    for config in (model.config, model.generation_config):  # the tokenizer's special ids
        config.eos_token_id, config.pad_token_id, config.bos_token_id = 0, 0, None
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kwargs: [float(i) for i in range(len(completions))],
        args=GRPOConfig(
            output_dir=f"{workdir}/out",
            per_device_train_batch_size=2,
            num_generations=2,
            max_completion_length=length,
            max_steps=2,
            loss_type="dapo",
            beta=0.0,
            learning_rate=1e-5,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            bf16=False,
            disable_tqdm=True,
        ),
        train_dataset=Dataset.from_dict({"prompt": texts}),
        processing_class=tokenizer,
        callbacks=[Measure()],
    )
    if spec["mode"] is not None:
        ec.prepare_trainer(spec["mode"], trainer)
    trainer.remove_callback(PrinterCallback)
    # On the instance, after prepare_trainer: it refuses trainer classes that override the rollout.
    trainer._generate_single_turn = given_completions
    if spec.get("profile"):  # where the memory goes (live tensors at the peak), then stop
        from benchmarks.memory_trace import LiveTensorTrace

        with LiveTensorTrace(model) as trace:
            trainer.train()
        if rank == 0:
            print(trace.report(tokens=length), flush=True)
    else:
        trainer.train()
    write_result(workdir, rank, [step_times[-1], status_bytes("VmHWM:") - peak[0]])
    if world > 1:
        ec.remove_seq_parallel_monkey_patch()
        torch.distributed.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--completion-lengths", default="8192,16384")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--modes", default="zigzag_ring_attn")
    parser.add_argument("--csv", default=None)
    parser.add_argument("--smoke", action="store_true", help="one short length, for CI")
    parser.add_argument(
        "--profile", default=None, metavar="CONFIG", help="only this config: print what is live at its peak"
    )
    args = parser.parse_args()
    use_exact_memory()
    lengths = [256] if args.smoke else int_list(args.completion_lengths)
    configs = [("trl P=1", None, 1)] + [(f"{mode} P=2", mode, 2) for mode in args.modes.split(",")]
    if args.profile:
        configs = [c for c in configs if c[0] == args.profile]
    columns = ["config", "completion tokens", "step s", "x trl step", "peak MiB/rank", "x trl peak"]
    print(table_header(columns), flush=True)
    rows = []
    for length in lengths:
        baseline = None
        for name, mode, world in configs:
            spec = {"mode": mode, "completion": length, "prompt": 64 if args.smoke else args.prompt_tokens}
            spec["profile"] = args.profile is not None
            values = spawn_ranks(_worker, spec, world)
            if values is None:
                raise SystemExit(f"{name} at {length} completion tokens: a rank failed")
            step, peak = max(v[0] for v in values), max(v[1] for v in values) / 2**20
            baseline = baseline or (step, peak)
            row = {"config": name, "completion_tokens": length, "step_s": step, "peak_mib": peak}
            rows.append(row)
            cells = [name, str(length), f"{step:.1f}", f"{step / baseline[0]:.2f}", f"{peak:.0f}"]
            print(table_row([*cells, f"{peak / baseline[1]:.2f}"]), flush=True)
    if args.csv:
        write_csv(args.csv, rows)


if __name__ == "__main__":
    main()
