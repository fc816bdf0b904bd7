"""Continue a long prompt with the prompt's KV cache sharded over the ranks (easy_context.generate).

    # CPU, 2 processes, the model the README's train.py command saved (outputs/tiny-llama)
    torchrun --standalone --nproc_per_node 2 -m tools.generate --prompt_file PROMPT.txt

    # 8 GPUs, a long-context model, sampling
    torchrun --nproc_per_node 8 -m tools.generate --model PATH --prompt_file BOOK.txt \
        --max_new_tokens 256 --do_sample --temperature 0.7 --top_p 0.9 --seed 1

The prompt is prefilled in the mode's layout, each rank keeps its share of every layer's
K/V, and decoding is transformers' generate (greedy unless --do_sample). The continuation
streams to stdout from the first rank; prompt length, prefill time, decoding speed and the
K/V cache each rank holds go to stderr. Every SP group generates the same text.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

import easy_context as ec
from easy_context.hf.sharded_cache import kv_bytes
from easy_context.versions import output_cache
from recipes.configuration import ParallelismConfig, add_flags
from recipes.evaluation import load_scorer_for_flags, resolve_model
from recipes.launch import Stage, run_job, run_main
from recipes.launch import fail as launch_fail


def fail(message: str):
    launch_fail("tools/generate.py", message)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    def flag(name, **kwargs):  # underscore spelling, as in the other scripts, and the dashed one
        p.add_argument(f"--{name}", f"--{name.replace('_', '-')}", dest=name, **kwargs)

    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt_file", "--prompt-file", dest="prompt_file", help="a UTF-8 text file ('-': stdin)")
    source.add_argument("--prompt", help="the prompt text itself")
    flag("model", default=None, help="hub name or local folder (default: outputs/tiny-llama, what train.py saves)")
    flag("parallel_mode", default="zigzag_ring_attn", choices=ec.MODE_NAMES)
    flag("sp_size", type=int, default=None, help="ranks sharing one prompt (default: all)")
    flag("ring_degree", type=int, default=None, help="usp_attn: ring part of the SP group")
    flag("max_new_tokens", type=int, default=64)
    flag("do_sample", action="store_true", help="sample (default: greedy)")
    flag("temperature", type=float, default=None)
    flag("top_p", type=float, default=None)
    flag("top_k", type=int, default=None)
    flag("seed", type=int, default=0, help="the same on every rank, so sampling agrees")
    flag(
        "dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bf16 on CUDA, fp32 on CPU",
    )
    flag("rope_theta", type=float, default=None, help="override the model's RoPE base")
    add_flags(p, [ParallelismConfig], only=["dist_timeout"])
    args = p.parse_args(argv)
    errors = []
    if args.max_new_tokens < 1:
        errors.append(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}")
    if args.prompt_file not in (None, "-") and not Path(args.prompt_file).is_file():
        errors.append(f"--prompt_file {args.prompt_file}: no such file")
    if not args.do_sample and any(x is not None for x in (args.temperature, args.top_p, args.top_k)):
        errors.append("--temperature/--top_p/--top_k need --do_sample")
    if errors:
        p.error("; ".join(errors))
    return args


def prompt_text(args) -> str:
    if args.prompt is not None:
        text = args.prompt
    elif args.prompt_file == "-":
        text = sys.stdin.read()
    else:
        text = Path(args.prompt_file).read_text(encoding="utf-8", errors="replace")
    if not text:
        fail("the prompt is empty")
    return text


class Timer:
    """A streamer that only notes when the prompt (after our prefill) and each token arrive."""

    def __init__(self, echo=None):
        self.times, self.echo = [], echo

    def put(self, value):
        self.times.append(time.perf_counter())
        if self.echo is not None:
            self.echo.put(value)

    def end(self):
        if self.echo is not None:
            self.echo.end()


def run(args, accelerator, stage: Stage):
    from transformers import TextStreamer

    stage.at("loading the model")
    text = prompt_text(args)
    try:
        source = resolve_model(args.model)
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(source)(text, return_tensors="pt")["input_ids"]
        scorer, tokenizer = load_scorer_for_flags(accelerator, source, args, ids.shape[1] + args.max_new_tokens)
    except (ValueError, OSError) as error:
        fail(str(error))
    echo = TextStreamer(tokenizer, skip_prompt=True) if accelerator.is_main_process else None
    timer = Timer(echo)
    sampling = {
        name: getattr(args, name) for name in ("temperature", "top_p", "top_k") if getattr(args, name) is not None
    }
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    torch.manual_seed(args.seed)
    stage.at(f"generating from a {ids.shape[1]}-token prompt")
    start = time.perf_counter()
    output = ec.generate(
        args.parallel_mode,
        scorer.model,
        ids.to(scorer.device),
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        pad_token_id=pad,
        streamer=timer,
        synced_gpus=scorer.lockstep,
        return_dict_in_generate=True,
        sp_size=args.sp_size,
        ring_degree=args.ring_degree,
        **sampling,
    )
    new = output.sequences.shape[1] - ids.shape[1]
    if accelerator.is_main_process:
        first, rest = timer.times[1] - start, timer.times[-1] - timer.times[1]  # times[0]: the prompt
        print(
            f"\n[{ids.shape[1]} prompt tokens, {args.parallel_mode} over {accelerator.num_processes} process(es): "
            f"first token after {first:.2f} s (prefill), then {new - 1} tokens in {rest:.2f} s "
            f"({(new - 1) / max(rest, 1e-9):.1f} tokens/s); "
            f"K/V cache on this rank {kv_bytes(output_cache(output)) / 2**20:.1f} MiB]",
            file=sys.stderr,
        )
    ec.remove_seq_parallel_monkey_patch()
    return output.sequences


def main(argv=None):
    args = parse_args(argv)
    return run_job("tools/generate.py", lambda accelerator, stage: run(args, accelerator, stage), args.dist_timeout)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_main(main)
