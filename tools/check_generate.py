"""easy_context.generate against one process's model.generate, on this machine's device.

    torchrun --standalone --nproc_per_node 2 -m tools.check_generate      # 2 ranks: gloo on CPU, NCCL on 2 GPUs
    python -m tools.check_generate --prompt-length 4096                     # 1 rank (one GPU: gloo takes no
                                                                            # CUDA tensors point-to-point)

For each tiny model (no download: tools.tiny_configs) a batch of two prompts, the second
left-padded by a third of its length, is continued greedily by the unpatched model and by
`easy_context.generate` with the prompt's K/V sharded over the ranks. The models carry what
decoding must keep: a plain causal model, a sliding window shorter than the prompt (the
window still masks keys at every step) and a softcap with alternating windows. The tokens
must be equal and every step's logits within LOGITS_TOL (fp32). Rank 0 prints a table with
the milliseconds per new token of both; exit 1 when a row fails. On CUDA the decoding steps
run the masked kernels (padding, windows) on the GPU: what tests/distributed/test_generation.py
proves on CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import easy_context as ec
from easy_context.hf.architectures import attn_implementation
from tools.tiny_configs import tiny_config

LOGITS_TOL = 1e-4  # test_generation.py's fp32 bound
MODEL_TYPES = ("llama", "mistral", "gemma2")  # plain; a window; softcap + alternating windows
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True, output_logits=True)


def prompts(length: int, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(length)
    ids = torch.randint(3, vocab, (2, length), generator=generator)
    mask = torch.ones_like(ids)
    ids[1, : length // 3], mask[1, : length // 3] = 0, 0
    return ids.to(device), mask.to(device)


def timed(device, call):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - start


def check(model_type: str, mode: str, length: int, new_tokens: int, device) -> dict:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config(model_type, max_position_embeddings=2 * (length + new_tokens))
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation(config)).to(device).eval()
    ids, mask = prompts(length, config.vocab_size, device)
    kwargs = {**GREEDY, "max_new_tokens": new_tokens}
    with torch.no_grad():
        # a warm-up of each, so that the timings below are steady
        model.generate(ids, attention_mask=mask, **{**kwargs, "max_new_tokens": 2})
        want, reference_s = timed(device, lambda: model.generate(ids, attention_mask=mask, **kwargs))
        ec.apply_seq_parallel_monkey_patch(mode, model)
        try:
            ec.generate(mode, model, ids, attention_mask=mask, **{**kwargs, "max_new_tokens": 2})
            got, sharded_s = timed(device, lambda: ec.generate(mode, model, ids, attention_mask=mask, **kwargs))
        finally:
            ec.remove_seq_parallel_monkey_patch()
    error = max(float((a - b).abs().max()) for a, b in zip(got.logits, want.logits))
    same = torch.equal(got.sequences, want.sequences)
    return dict(
        model=model_type,
        tokens_equal=same,
        logits_error=error,
        ok=same and error <= LOGITS_TOL,
        reference_ms=1e3 * reference_s / new_tokens,
        sharded_ms=1e3 * sharded_s / new_tokens,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = [m for m in ec.BUILT_MODES if m != "data_parallel"]
    parser.add_argument("--mode", default="zigzag_ring_attn", choices=modes)
    parser.add_argument("--prompt-length", type=int, default=None, help="tokens (default: 4096 CUDA, 256 CPU)")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--backend", default=None, choices=["nccl", "gloo"], help="default: nccl on CUDA, gloo on CPU")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()) if cuda else None
    device = device or torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = args.backend or ("nccl" if cuda else "gloo")
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:  # one process without torchrun: a group of one
        init = "file://" + os.path.join(tempfile.mkdtemp(), "init")
        dist.init_process_group(backend, init_method=init, rank=0, world_size=1)
    length = args.prompt_length or (4096 if cuda else 256)
    rows = [check(t, args.mode, length, args.new_tokens, device) for t in MODEL_TYPES]
    if dist.get_rank() == 0:
        print(f"generate, {args.mode}, {dist.get_world_size()} rank(s) over {backend}, {device.type}, fp32, "
              f"prompt 2 x {length} (one left-padded), {args.new_tokens} new tokens")  # fmt: skip
        print("| model | tokens equal | max logits error | ms/token model.generate | ms/token easy_context |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['model']} | {r['tokens_equal']} | {r['logits_error']:.1e} (<= {LOGITS_TOL:g}) | "
                  f"{r['reference_ms']:.1f} | {r['sharded_ms']:.1f} |")  # fmt: skip
    dist.destroy_process_group()
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
