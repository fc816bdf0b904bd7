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
the milliseconds per new token of both, a row as each model finishes (a run stopped at a time
limit keeps the rows it finished); exit 1 when a row fails. On CUDA the decoding steps run the
masked kernels (padding, windows) on the GPU: what tests/distributed/test_generation.py proves
on CPU.

bf16 (--dtypes fp32,bf16, the default): the same models in bf16, where a decoding step splits
the cache: the left-padded prompt's slots go to the masked kernel (cuda_efficient on CUDA) and
the rest to the unmasked one (flash in bf16), merged by their lse. Both generates are forced
along the fp32 model's greedy tokens (a logits processor; bf16 rounding would otherwise pick
other tokens where two logits are close), and every step's raw logits are compared with the
fp32 model's: ours within 2x (plus 1/256) the unpatched bf16 model.generate's own error, the
bound of the other bf16 checks.
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
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True, output_logits=True)


class Forced:
    """A logits processor that makes greedy decoding follow `sequences` (B, prompt + new): every
    token but the next one of each row gets -inf. The raw logits (output_logits) stay the model's."""

    def __init__(self, sequences: torch.Tensor):
        self.sequences = sequences

    def __call__(self, input_ids, scores):
        following = self.sequences[:, input_ids.shape[1]].to(scores.device)
        forced = torch.full_like(scores, -float("inf"))
        return forced.scatter_(1, following[:, None], 0.0)


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


def step_error(got, want) -> float:
    """The worst |logits error| over the decoding steps (fp32 arithmetic)."""
    return max(float((a.float() - b.float()).abs().max()) for a, b in zip(got.logits, want.logits))


def check(model_type: str, mode: str, length: int, new_tokens: int, device, dtypes=("fp32",), report=None) -> list:
    """One row per dtype for this model; report(row) is called as each finishes."""
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    torch.manual_seed(0)
    config = tiny_config(model_type, max_position_embeddings=2 * (length + new_tokens))
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation(config)).to(device).eval()
    ids, mask = prompts(length, config.vocab_size, device)
    kwargs = {**GREEDY, "max_new_tokens": new_tokens}
    rows = []

    def both(model, **options):
        """(theirs, ours, ms/token of each): model.generate, then easy_context.generate, each
        after a 2-token warm-up so that the timings are steady."""
        options = {**kwargs, **options}
        warm_up = {**options, "max_new_tokens": 2}
        model.generate(ids, attention_mask=mask, **warm_up)
        theirs, reference_s = timed(device, lambda: model.generate(ids, attention_mask=mask, **options))
        ec.apply_seq_parallel_monkey_patch(mode, model)
        try:
            ec.generate(mode, model, ids, attention_mask=mask, **warm_up)
            ours, sharded_s = timed(device, lambda: ec.generate(mode, model, ids, attention_mask=mask, **options))
        finally:
            ec.remove_seq_parallel_monkey_patch()
        return theirs, ours, 1e3 * reference_s / new_tokens, 1e3 * sharded_s / new_tokens

    def add(row):
        rows.append(row)
        if report is not None:
            report(row)

    with torch.no_grad():
        if "fp32" in dtypes:
            want, got, reference_ms, sharded_ms = both(model)
            error = step_error(got, want)
            same = torch.equal(got.sequences, want.sequences)
            ok = same and error <= LOGITS_TOL
            add(
                dict(model=model_type, dtype="fp32", tokens_equal=same, logits_error=error, bound=LOGITS_TOL, ok=ok,
                     reference_ms=reference_ms, sharded_ms=sharded_ms)
            )  # fmt: skip
        if "bf16" in dtypes:
            if "fp32" not in dtypes:  # the fp32 model's tokens and logits: what bf16 is compared with
                want = model.generate(ids, attention_mask=mask, **kwargs)
            model.to(torch.bfloat16)
            forced = LogitsProcessorList([Forced(want.sequences)])
            theirs, ours, reference_ms, sharded_ms = both(model, logits_processor=forced)
            baseline, error = step_error(theirs, want), step_error(ours, want)
            bound = 2 * baseline + 1 / 256
            followed = torch.equal(ours.sequences, want.sequences) and torch.equal(theirs.sequences, want.sequences)
            add(
                dict(model=model_type, dtype="bf16", tokens_equal="forced" if followed else False, logits_error=error,
                     bound=bound, baseline=baseline, ok=followed and error <= bound, reference_ms=reference_ms,
                     sharded_ms=sharded_ms)
            )  # fmt: skip
    return rows


def print_row(r: dict) -> None:
    bound = f"<= {r['bound']:.1e}" + (f"; bf16 model.generate {r['baseline']:.1e}" if "baseline" in r else "")
    cells = (r["model"], r["dtype"], r["tokens_equal"], f"{r['logits_error']:.1e} ({bound})",
             f"{r['reference_ms']:.1f}", f"{r['sharded_ms']:.1f}", "yes" if r["ok"] else "NO")  # fmt: skip
    print(f"| {' | '.join(map(str, cells))} |", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    modes = [m for m in ec.BUILT_MODES if m != "data_parallel"]
    parser.add_argument("--mode", default="zigzag_ring_attn", choices=modes)
    parser.add_argument("--prompt-length", type=int, default=None, help="tokens (default: 4096 CUDA, 256 CPU)")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32 and/or bf16 (default both)")
    parser.add_argument("--backend", default=None, choices=["nccl", "gloo"], help="default: nccl on CUDA, gloo on CPU")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()) if cuda else None
    device = device or torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = args.backend or ("nccl" if cuda else "gloo")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes or set(dtypes) - set(DTYPES):
        parser.error(f"--dtypes takes fp32 and/or bf16, got {args.dtypes!r}")
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:  # one process without torchrun: a group of one
        init = "file://" + os.path.join(tempfile.mkdtemp(), "init")
        dist.init_process_group(backend, init_method=init, rank=0, world_size=1)
    length = args.prompt_length or (4096 if cuda else 256)
    rank0 = dist.get_rank() == 0
    if rank0:
        print(
            f"generate, {args.mode}, {dist.get_world_size()} rank(s) over {backend}, {device.type}, "
            f"{','.join(dtypes)}, prompt 2 x {length} (one left-padded), {args.new_tokens} new tokens; "
            "bf16: forced along the fp32 model's tokens, logits against the fp32 model's",
            flush=True,
        )
        header = ("model", "dtype", "tokens equal", "max step logits error", "ms/token model.generate",
                  "ms/token easy_context", "ok")  # fmt: skip
        print(f"| {' | '.join(header)} |\n|{'---|' * len(header)}", flush=True)
    rows, failed = [], []
    for model_type in MODEL_TYPES:
        try:
            rows += check(model_type, args.mode, length, args.new_tokens, device, dtypes, print_row if rank0 else None)
        except Exception as exc:  # noqa: BLE001 - a model that fails is a failed row; the others still run
            failed.append(model_type)
            if rank0:
                print(f"| {model_type} | | FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:200]} | | | | NO |")
    dist.destroy_process_group()
    return 0 if rows and not failed and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
