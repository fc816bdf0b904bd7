"""Continue a long prompt with the prompt's KV cache sharded over the ranks (easy_context.generate).

    # CPU, 2 processes, the model the README's train.py command saved (outputs/tiny-llama)
    torchrun --standalone --nproc_per_node 2 -m tools.generate --prompt-file PROMPT.txt

    # 8 GPUs, a long-context model, sampling
    torchrun --nproc_per_node 8 -m tools.generate --model PATH --prompt-file BOOK.txt \
        --max-new-tokens 256 --do-sample --temperature 0.7 --top-p 0.9 --seed 1

The prompt is prefilled in the mode's layout, each rank keeps its share of every layer's
K/V, and decoding is transformers' generate (greedy unless --do-sample). The continuation
streams to stdout from the first rank; prompt length, prefill time, decoding speed and the
K/V cache each rank holds go to stderr. Every SP group generates the same text.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

import easy_context as ec
from easy_context.hf.sharded_cache import kv_bytes
from easy_context.versions import output_cache
from recipes.configuration import parse
from recipes.evaluation import load_scorer_for_flags, resolve_model
from recipes.evaluation_config import GenerateConfig, PromptConfig, parser
from recipes.launch import Stage, run_job, run_main
from recipes.launch import fail as launch_fail


def fail(message: str):
    launch_fail("tools/generate.py", message)


def parse_args(argv=None) -> GenerateConfig:
    """The command line as a GenerateConfig (recipes/evaluation_config.py); a failed check exits 2
    with every reason in one line."""
    return parse(GenerateConfig, parser(GenerateConfig, __doc__), argv)


def prompt_text(prompt: PromptConfig) -> str:
    if prompt.prompt is not None:
        text = prompt.prompt
    elif prompt.prompt_file == "-":
        text = sys.stdin.read()
    else:
        text = Path(prompt.prompt_file).read_text(encoding="utf-8", errors="replace")
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


def run(config: GenerateConfig, accelerator, stage: Stage):
    from transformers import TextStreamer

    decoding, parallelism = config.decoding, config.parallelism
    stage.at("loading the model")
    text = prompt_text(config.prompt)
    try:
        source = resolve_model(config.model.model)
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(source)(text, return_tensors="pt")["input_ids"]
        longest = ids.shape[1] + decoding.max_new_tokens
        scorer, tokenizer = load_scorer_for_flags(accelerator, source, config.model, parallelism, longest)
    except (ValueError, OSError) as error:
        fail(str(error))
    echo = TextStreamer(tokenizer, skip_prompt=True) if accelerator.is_main_process else None
    timer = Timer(echo)
    sampling = {
        name: getattr(decoding, name)
        for name in ("temperature", "top_p", "top_k")
        if getattr(decoding, name) is not None
    }
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    torch.manual_seed(decoding.seed)
    stage.at(f"generating from a {ids.shape[1]}-token prompt")
    start = time.perf_counter()
    output = ec.generate(
        parallelism.parallel_mode,
        scorer.model,
        ids.to(scorer.device),
        max_new_tokens=decoding.max_new_tokens,
        do_sample=decoding.do_sample,
        pad_token_id=pad,
        streamer=timer,
        synced_gpus=scorer.lockstep,
        return_dict_in_generate=True,
        sp_size=parallelism.sp_size,
        ring_degree=parallelism.ring_degree,
        **sampling,
    )
    new = output.sequences.shape[1] - ids.shape[1]
    if accelerator.is_main_process:
        first, rest = timer.times[1] - start, timer.times[-1] - timer.times[1]  # times[0]: the prompt
        print(
            f"\n[{ids.shape[1]} prompt tokens, {parallelism.parallel_mode} over "
            f"{accelerator.num_processes} process(es): "
            f"first token after {first:.2f} s (prefill), then {new - 1} tokens in {rest:.2f} s "
            f"({(new - 1) / max(rest, 1e-9):.1f} tokens/s); "
            f"K/V cache on this rank {kv_bytes(output_cache(output)) / 2**20:.1f} MiB]",
            file=sys.stderr,
        )
    ec.remove_seq_parallel_monkey_patch()
    return output.sequences


def main(argv=None):
    config = parse_args(argv)
    timeout = config.parallelism.dist_timeout
    return run_job("tools/generate.py", lambda accelerator, stage: run(config, accelerator, stage), timeout)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run_main(main)
