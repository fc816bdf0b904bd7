"""What predicts a CUDA step's overhead, counted on CPU: host syncs and dispatched ops.

    python -m benchmarks.dispatch_counts [--seq-len 4096] [--window 256] [--modes zigzag_ring_attn,...]

On a GPU two costs dominate small-kernel code: a host sync stalls the stream, and every kernel
launch costs 5-10 us whatever its size. A TorchDispatchMode sees every aten op on every rank:
  host syncs  ops that hand a value to Python (`.item()`, `int()`, `bool()` of a tensor,
              torch.equal/allclose): each is a device-to-host sync on CUDA
  ops         every dispatched aten op; roughly one kernel launch each on CUDA (views included,
              so this overcounts launches a little, the same way for us and for HF)
Each case runs a tiny model with 2 and 4 layers on P=2 gloo ranks (the worse rank's counts) and in one
process unpatched (the same model on the whole sequence); the difference between the layer
counts is the per-layer cost, the 4-layer count the per-step cost.
  training   one forward + backward of a causal LM loss, after a warm-up step
             masks: causal; packed (three documents per row); window (Mistral, sliding_window)
  decoding   easy_context's generate vs HF generate, per new token (the difference between
             two numbers of new tokens, so the prefill drops out): one prompt without padding,
             and a left-padded batch of two (its padding masked), over two spans of new tokens
  new bytes  bytes of the tensors ops create (neither views nor in-place writes): per layer
             per token, what a decoding step materialises; it must not grow with the cache
The replica guard (hf/replicas.py) is off on the ranks: its check every 16 attention forwards
would land in some spans and not others (benchmarks/bench_replica_check.py measures it).
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["DispatchCounts", "HOST_SYNC_OPS", "count_case", "rank_counts", "reference_counts", "MASKS", "MODES"]

# aten ops whose result is read on the host; on CUDA each waits for the stream.
HOST_SYNC_OPS = frozenset({"_local_scalar_dense", "is_nonzero", "equal", "allclose", "item"})
# Ops that only make a view (new sizes and strides over the same memory): no kernel on CUDA.
VIEW_OPS = frozenset(
    {"view", "_unsafe_view", "slice", "select", "permute", "transpose", "t", "expand", "unsqueeze", "squeeze",
     "alias", "detach", "as_strided", "unflatten", "split", "split_with_sizes", "narrow", "unbind", "movedim",
     "_reshape_alias", "view_as"}
)  # fmt: skip
MASKS = ("causal", "packed", "window")
MODES = ("zigzag_ring_attn", "dist_flash_attn", "ulysses_attn", "usp_attn")
OPTIONS = {"usp_attn": {"ring_degree": 2}}  # at P=2: the ring inside usp (pure Ulysses is ulysses_attn)
VOCAB = 128


_TRACE = set(filter(None, os.environ.get("EASY_CONTEXT_TRACE_OPS", "").split(",")))


def _caller() -> str:
    import traceback

    frames = [f for f in traceback.extract_stack()[:-3] if "easy_context" in f.filename]
    return "; ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in frames[-3:])


class DispatchCounts(TorchDispatchMode):
    """Counts every aten op dispatched while active, and those that sync with the host."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.syncs = 0
        self.launches = 0  # ops that are not views: about one kernel launch each on CUDA
        self.new_bytes = 0  # bytes of the tensors non-view, not in-place ops return
        self.by_op = collections.Counter()
        self.new_bytes_by_op = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        name = func.overloadpacket.__name__
        self.by_op[name] += 1
        if name not in VIEW_OPS:
            self.launches += 1
        if name in _TRACE:
            self.by_op[(name, _caller())] += 1
        if name in HOST_SYNC_OPS:
            self.syncs += 1
        result = func(*args, **(kwargs or {}))
        if name not in VIEW_OPS and not name.endswith("_") and "out" not in (kwargs or {}):
            outputs = result if isinstance(result, (tuple, list)) else (result,)
            made = sum(x.nbytes for x in outputs if isinstance(x, torch.Tensor))
            self.new_bytes += made
            self.new_bytes_by_op[name] += made
        return result


def tiny_model(mask: str, layers: int):
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=65536,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    if mask == "window":
        config = MistralConfig(**common, sliding_window=WINDOW[0])
    else:
        config = LlamaConfig(**common)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


WINDOW = [256]  # set from the spec before any model is built


def batch(seq_len: int, mask: str):
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (1, seq_len), generator=g)
    positions = torch.arange(seq_len)
    if mask == "packed":  # three documents: positions restart at each start
        starts = [0, seq_len // 4 + 3, seq_len // 2 + seq_len // 5]
        for a, b in zip(starts, starts[1:] + [seq_len]):
            positions[a:b] = torch.arange(b - a)
    return input_ids, positions[None]


def padded_prompts(length: int, pad: int):
    """Two prompts of `length` tokens, the second left-padded by `pad`: (input_ids, attention_mask)."""
    g = torch.Generator().manual_seed(2)
    input_ids = torch.randint(1, VOCAB, (2, length), generator=g)
    attention_mask = torch.ones_like(input_ids)
    input_ids[1, :pad], attention_mask[1, :pad] = 0, 0
    return input_ids, attention_mask


def _train_step(model, input_ids, position_ids):
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), input_ids.flatten()).backward()


def count_case(run) -> DispatchCounts:
    run()  # warm-up: groups, caches and lazily built state are one-time costs
    with DispatchCounts() as counts:
        run()
    return counts


def _measure(build, train, decode, spec) -> dict:
    """{(case, mask or 'decoding', layers[, tokens]): (ops, syncs)} for one way of running."""
    results = {}
    for mask in spec["masks"]:
        for layers in (2, 4):
            counts = count_case(train(build(mask, layers), mask))
            results[("train", mask, layers)] = (counts.ops, counts.syncs)
            results[("launches", mask, layers)] = counts.launches
            results[("by_op", mask, layers)] = counts.by_op
    if spec["decode"]:
        prompts = {
            "decode": (batch(spec["prompt_len"], "causal")[0], None, spec["decode_tokens"]),
            "padded": (*padded_prompts(spec["prompt_len"], spec["prompt_pad"]), spec["padded_decode_tokens"]),
        }
        for layers in (2, 4):
            model = build("causal", layers).eval()
            for case, (input_ids, attention_mask, new_tokens) in prompts.items():
                for tokens in new_tokens:
                    counts = count_case(decode(model, input_ids, attention_mask, tokens))
                    results[(case, layers, tokens)] = (counts.ops, counts.syncs, counts.new_bytes)
                    results[("by_op", case, layers, tokens)] = counts.by_op
                    results[("new_bytes_by_op", case, layers, tokens)] = counts.new_bytes_by_op
    return results


def _greedy(tokens: int) -> dict:
    return dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)


def reference_counts(spec) -> dict:
    """The unpatched model in this process, on the whole sequence."""
    WINDOW[0] = spec["window"]
    torch.set_num_threads(1)

    def train(model, mask):
        input_ids, positions = batch(spec["seq_len"], mask)
        return lambda: _train_step(model, input_ids, positions)

    def decode(model, input_ids, attention_mask, tokens):
        return lambda: model.generate(input_ids, attention_mask=attention_mask, **_greedy(tokens))

    return _measure(tiny_model, train, decode, spec)


def rank_counts(rank: int, world: int, spec) -> dict:
    """One rank's counts for spec["mode"] (torch.distributed initialised by the caller)."""
    import easy_context

    WINDOW[0] = spec["window"]
    mode, options = spec["mode"], OPTIONS.get(spec["mode"], {})
    contexts = []

    def build(mask, layers):
        model = tiny_model(mask, layers)
        contexts.append(easy_context.setup(mode, model, **options))
        return model

    def train(model, mask):
        input_ids, positions = batch(spec["seq_len"], mask)
        local = contexts[-1].shard(input_ids, positions)
        return lambda: _train_step(model, local["local_input_ids"], local["local_position_ids"])

    def decode(model, input_ids, attention_mask, tokens):
        context = contexts[-1]
        return lambda: context.generate(model, input_ids, attention_mask=attention_mask, **_greedy(tokens))

    try:
        # the guard reads this once, at the first patched forward; the caller's environment
        # (a test session's, whose later ranks fork from it) is left as it was
        with mock.patch.dict(os.environ, {"EASY_CONTEXT_REPLICA_CHECK_EVERY": "0"}):
            return _measure(build, train, decode, spec)
    finally:
        easy_context.teardown()


def per_layer(results: dict, case: tuple) -> tuple[float, int]:
    """(ops per layer, host syncs per step) of one training mask, from the 2- and 4-layer runs."""
    (ops2, syncs2), (ops4, syncs4) = results[(*case, 2)], results[(*case, 4)]
    return (ops4 - ops2) / 2, max(syncs2, syncs4)


def launches_per_layer(results: dict, mask: str) -> float:
    """Non-view ops per layer of one training mask."""
    return (results[("launches", mask, 4)] - results[("launches", mask, 2)]) / 2


def per_token(results: dict, tokens: tuple[int, int], case="decode") -> dict:
    """Per new token of a decoding case ("decode" or "padded"), between two numbers of new
    tokens: ops, host syncs and new bytes per layer, and host syncs per token."""
    n1, n2 = tokens

    def delta(layers, index):
        return (results[(case, layers, n2)][index] - results[(case, layers, n1)][index]) / (n2 - n1)

    return {
        "ops_per_layer": (delta(4, 0) - delta(2, 0)) / 2,
        "syncs_per_layer": (delta(4, 1) - delta(2, 1)) / 2,
        "syncs_per_token": delta(4, 1),
        "bytes_per_layer": (delta(4, 2) - delta(2, 2)) / 2,
    }


def spec_for(seq_len=1024, window=128, masks=MASKS, decode=True, mode=None) -> dict:
    return dict(
        mode=mode,
        seq_len=seq_len,
        window=window,
        masks=tuple(masks),
        decode=decode,
        prompt_len=64,
        prompt_pad=24,  # the left padding of the padded batch's second row
        decode_tokens=(4, 8),
        padded_decode_tokens=(4, 8, 16),  # two spans: per token, at two cache lengths
    )


def _rank_entry(rank, world, spec, workdir):
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{workdir}/init", rank=rank, world_size=world, timeout=datetime.timedelta(600)
    )
    try:
        torch.save(rank_counts(rank, world, spec), f"{workdir}/result{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_mode(spec, world: int = 2) -> list[dict]:
    """Every rank's counts (rank order)."""
    from benchmarks.common import run_to_end

    with tempfile.TemporaryDirectory() as workdir:
        run_to_end(_rank_entry, world, (spec, workdir), 1800, spec["mode"])
        return [torch.load(f"{workdir}/result{rank}.pt", weights_only=False) for rank in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    base = spec_for(args.seq_len, args.window)
    reference = reference_counts(base)
    print(
        f"P=2 gloo ranks (the worse rank), tiny Llama/Mistral (hidden 64, 4 q / 2 kv heads), S={args.seq_len}, "
        f"window {args.window}; unpatched: one process, whole sequence\n"
    )
    print(
        "| mode | case | host syncs per step | (unpatched) | ops per layer | (unpatched) | ratio "
        "| non-view ops per layer | (unpatched) | ratio | new bytes per layer | (unpatched) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        ranks = run_mode({**base, "mode": mode})
        for mask in MASKS:
            ops = max(per_layer(r, ("train", mask))[0] for r in ranks)
            syncs = max(per_layer(r, ("train", mask))[1] for r in ranks)
            launches = max(launches_per_layer(r, mask) for r in ranks)
            ref_ops, ref_syncs = per_layer(reference, ("train", mask))
            ref_launches = launches_per_layer(reference, mask)
            print(
                f"| {mode} | train, {mask} | {syncs} | {ref_syncs} | {ops:.0f} | {ref_ops:.0f} | {ops / ref_ops:.2f} "
                f"| {launches:.0f} | {ref_launches:.0f} | {launches / ref_launches:.2f} | | |"
            )
        tokens = base["decode_tokens"]
        spans = base["padded_decode_tokens"]
        cases = [("decode", tokens, "decoding, per token")]
        for span in zip(spans, spans[1:]):
            cases.append(("padded", span, f"decoding, left-padded, tokens {span[0]}-{span[1]}"))
        for case, tokens, label in cases:
            per_rank = [per_token(r, tokens, case) for r in ranks]
            ours = {key: max(counts[key] for counts in per_rank) for key in per_rank[0]}
            theirs = per_token(reference, tokens, case)
            print(
                f"| {mode} | {label} | {ours['syncs_per_token']:.2f} (per layer {ours['syncs_per_layer']:.2f})"
                f" | {theirs['syncs_per_token']:.2f} | {ours['ops_per_layer']:.1f} | {theirs['ops_per_layer']:.1f} | "
                f"{ours['ops_per_layer'] / theirs['ops_per_layer']:.2f} | | | | {ours['bytes_per_layer']:.0f} "
                f"| {theirs['bytes_per_layer']:.0f} |"
            )


if __name__ == "__main__":
    main()
