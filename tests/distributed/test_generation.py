"""easy_context.generate on P gloo ranks against one process's model.generate: the same tokens
and, at every decoding step, the same logits (within the forward bound of test_models.py),
fp32. Prompts of lengths no layout splits, a one-token prompt, left-padded batches, sampling,
beam search, and the attention features decoding must keep (windows, sinks, softcap, MLA)."""

import pytest
import torch
from generation_runs import GREEDY, LOGITS_TOL, NEW_TOKENS, compare, prompts
from ranks import run_ranks
from tiny_models import tiny_model

from easy_context import apply_seq_parallel_monkey_patch, generate, remove_seq_parallel_monkey_patch
from easy_context.hf.sharded_cache import GROWTH, ShardedKVCache

# Lengths that no layout of 2 or 4 ranks splits (1, 2, 37, 130), and one that all do (64).
PROMPT_LENGTHS = (1, 2, 37, 64, 130)


def _greedy_worker(rank, world_size, mode):
    results = {}
    for model_type in ("llama", "qwen3"):  # qwen3: GQA with a head dim of its own
        model = tiny_model(model_type).eval()
        for length in PROMPT_LENGTHS:
            results[(model_type, length)] = compare(model, mode, *prompts(1, length, seed=length))
        # Two different prompts, left-padded to one length; then a prefix shorter than the layout's split.
        results[(model_type, "batch2")] = compare(model, mode, *prompts(2, 75, seed=7, left_pad=(0, 29)))
        results[(model_type, "batch2-short")] = compare(model, mode, *prompts(2, 3, seed=9, left_pad=(1, 0)))
        results[(model_type, "no patch call")] = compare(model, mode, *prompts(1, 40, seed=5), patch_first=False)
    return results


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("mode", ["zigzag_ring_attn", "dist_flash_attn", "ulysses_attn", "usp_attn"])
def test_greedy_generation_matches_one_process(mode, world_size):
    per_rank = run_ranks(_greedy_worker, world_size, mode, timeout=400)
    for case, (same, error, sequences) in per_rank[0].items():
        print(f"{mode} P={world_size} {case}: tokens equal {same}, step logits {error:.1e}")
        assert same and error <= LOGITS_TOL, case
        for other in per_rank[1:]:
            assert torch.equal(other[case][2], sequences), ("ranks differ", case)


def _sampling_worker(rank, world_size, mode):
    model = tiny_model("qwen3").eval()
    ids, mask = prompts(2, 50, seed=3, left_pad=(11, 0))
    sampled = dict(do_sample=True, top_k=0, temperature=1.3, output_logits=False)
    # EOS: the token the first row greedily generates 6th ends that row early, later or never the other.
    eos = int(model.generate(ids, attention_mask=mask, **{**GREEDY, "max_new_tokens": 6}).sequences[0, -1])
    return {
        "eos": compare(model, mode, ids, mask, eos_token_id=eos, output_logits=False),
        "sample": compare(model, mode, ids, mask, seed=1234, **sampled),
        "sample-x2": compare(model, mode, ids, mask, seed=99, num_return_sequences=2, **sampled),
        "beams": compare(model, mode, ids, mask, num_beams=3, output_logits=False),
    }


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,world_size", [("zigzag_ring_attn", 2), ("usp_attn", 4)])
def test_sampling_and_beams_match_one_process(mode, world_size):
    per_rank = run_ranks(_sampling_worker, world_size, mode, timeout=280)
    for case, (same, _, sequences) in per_rank[0].items():
        assert same, case
        assert all(torch.equal(other[case][2], sequences) for other in per_rank[1:]), ("ranks differ", case)
    assert per_rank[0]["sample-x2"][2].shape[0] == 4
    ended = per_rank[0]["eos"][2]
    assert ended.shape[1] < 50 + NEW_TOKENS and (ended[0, 50 + 6 :] == 0).all()  # row 0 padded after its EOS


# Features decoding has to apply to every cached key: windows shorter than the prompt (per
# layer, alternating with global layers), sinks, attention softcapping, narrower MLA values.
# Gemma 2's final logit softcap saturates this tiny model's logits (ties); it is switched off
# here, its attention softcap is not.
FEATURES = {
    "window-16": ("mistral", {"sliding_window": 16}),
    "sinks-windows": ("gpt_oss", {}),
    "softcap-windows": ("gemma2", {"final_logit_softcapping": None}),
    "mla": ("deepseek_v3", {}),
}


def _features_worker(rank, world_size, mode):
    results = {}
    for case, (model_type, overrides) in FEATURES.items():
        model = tiny_model(model_type, **overrides).eval()
        results[case] = compare(model, mode, *prompts(2, 90, seed=5, left_pad=(0, 13)), max_new_tokens=24)
    return results


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["zigzag_ring_attn", "ulysses_attn"])
def test_attention_features_decode_exactly(mode):
    per_rank = run_ranks(_features_worker, 2, mode, timeout=280)
    for case, (same, error, _) in per_rank[0].items():
        print(f"{mode} {case}: tokens equal {same}, step logits {error:.1e}")
        assert same and error <= LOGITS_TOL, case


def _bf16_worker(rank, world_size):
    """bf16 weights: the logits of every step, teacher-forced on one token sequence (the fp32
    model's greedy output), against fp32; ours and the unpatched bf16 model's."""
    model = tiny_model("qwen3").eval()
    ids, mask = prompts(2, 70, seed=6, left_pad=(0, 9))
    kwargs = {**GREEDY, "max_new_tokens": 16}
    fp32 = model.generate(ids, attention_mask=mask, **kwargs)
    forced = dict(kwargs, max_new_tokens=1)
    steps = range(ids.shape[1], fp32.sequences.shape[1])
    extended = [torch.cat([mask, torch.ones(2, n - ids.shape[1], dtype=mask.dtype)], dim=1) for n in steps]
    want = [
        model.generate(fp32.sequences[:, :n], attention_mask=m, **forced).logits[0] for n, m in zip(steps, extended)
    ]
    model = model.to(torch.bfloat16)
    theirs = [
        model.generate(fp32.sequences[:, :n], attention_mask=m, **forced).logits[0] for n, m in zip(steps, extended)
    ]
    apply_seq_parallel_monkey_patch("zigzag_ring_attn", model)
    try:
        ours = [
            generate("zigzag_ring_attn", model, fp32.sequences[:, :n], attention_mask=m, **forced).logits[0]
            for n, m in zip(steps, extended)
        ]
    finally:
        remove_seq_parallel_monkey_patch()
    return [(float((a - w).abs().max()), float((b - w).abs().max())) for a, b, w in zip(ours, theirs, want)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bf16_generation_is_as_close_to_fp32_as_the_unpatched_bf16_model():
    """bf16: within 2x (plus 1/256) the unpatched bf16 model's own error, as the other bf16 tests."""
    for mine, baseline in run_ranks(_bf16_worker, 2, timeout=280)[0]:
        assert mine <= 2 * baseline + 1 / 256, (mine, baseline)


def generate_keeping_cache(model, ids, mask, **kwargs):
    """(output, the ShardedKVCache it used) of generate under zigzag_ring_attn."""
    caches, original = [], ShardedKVCache.__init__

    def keep(self, *args, **options):
        original(self, *args, **options)
        caches.append(self)

    apply_seq_parallel_monkey_patch("zigzag_ring_attn", model)
    ShardedKVCache.__init__ = keep
    try:
        output = generate("zigzag_ring_attn", model, ids, attention_mask=mask, **kwargs)
    finally:
        ShardedKVCache.__init__ = original
        remove_seq_parallel_monkey_patch()
    return output, caches[0]


def _cache_worker(rank, world_size):
    """The cache holds this rank's share: balanced, and growing by GROWTH slots at a time."""
    model = tiny_model("llama").eval()
    ids, mask = prompts(1, 131, seed=1)  # 130 tokens prefilled: padded to 132 for the zigzag layout
    _, cache = generate_keeping_cache(model, ids, mask, max_new_tokens=10, do_sample=False)
    return cache.length, cache.positions, [(layer.used, layer.keys.shape[-2]) for layer in cache.layers]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cache_is_sharded_and_balanced():
    per_rank = run_ranks(_cache_worker, 2)
    # 130 prompt tokens prefilled (zigzag chunks of 33 over 2 ranks; the 2 padding tokens in rank
    # 0's last chunk are not kept), then the last prompt token and 9 generated ones (the 10th is
    # never fed back): sequence indices 130..139, kept by rank i % 2.
    prefilled = {0: 64, 1: 66}
    for rank, (length, index, layers) in enumerate(per_rank):
        assert length == 140
        assert sorted(i for i in index if i >= 130) == [i for i in range(130, 140) if i % 2 == rank]
        for used, capacity in layers:
            assert used == len(index) == prefilled[rank] + 5
            assert capacity == prefilled[rank] + 1 + GROWTH  # one growth: at the first token kept
    assert sorted(per_rank[0][1] + per_rank[1][1]) == list(range(140))  # every token once, no padding


def _window_worker(rank, world_size):
    """Sliding-window layers drop what falls out of the window (as transformers' sliding cache
    does), global layers keep everything; the tokens stay one process's."""
    model = tiny_model("gemma3_text", sliding_window=16).eval()  # a window layer, then a global one
    ids, mask = prompts(2, 300, seed=8, left_pad=(0, 17))
    kwargs = dict(max_new_tokens=300, min_new_tokens=300, do_sample=False, pad_token_id=0)
    got, cache = generate_keeping_cache(model, ids, mask, **kwargs)
    layers = [
        (
            layer.window,
            layer.used - (layer.first - layer.base),
            layer.keys.shape[-2],
            layer.first,
            min(cache.positions[layer.first :]),
        )
        for layer in cache.layers
    ]
    return torch.equal(got, model.generate(ids, attention_mask=mask, **kwargs)), cache.length, layers


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sliding_window_layers_keep_only_the_window():
    for same, length, layers in run_ranks(_window_worker, 2):
        assert same and length == 599
        (window, live, capacity, _, oldest), (full_window, full_live, _, full_first, _) = layers
        # memory bounded by the window (and the spare slots), not by the length
        assert window == 16 and 8 <= live <= 9 and oldest >= length - 16 and capacity <= window + 1 + GROWTH
        assert full_window is None and full_live >= length // 2 - 2 and full_first == 0


def _refusals_worker(rank, world_size):
    model = tiny_model("llama").eval()
    ids, mask = prompts(1, 20, seed=rank)  # a different prompt on each rank
    found = {}

    def refused(name, call):
        try:
            call()
        except ValueError as error:
            found[name] = str(error)

    apply_seq_parallel_monkey_patch("ulysses_attn", model)
    refused("another mode", lambda: generate("zigzag_ring_attn", model, ids))
    remove_seq_parallel_monkey_patch()
    apply_seq_parallel_monkey_patch("zigzag_ring_attn", model)
    same, same_mask = prompts(1, 20, seed=0)
    right_padded = same_mask.clone()
    right_padded[0, -3:] = 0
    refused("different prompts", lambda: generate("zigzag_ring_attn", model, ids, max_new_tokens=2))
    refused("right padding", lambda: generate("zigzag_ring_attn", model, same, attention_mask=right_padded))
    refused("use_cache", lambda: generate("zigzag_ring_attn", model, same, use_cache=False))
    refused("assistant", lambda: generate("zigzag_ring_attn", model, same, assistant_model=model))
    refused("other options", lambda: generate("zigzag_ring_attn", model, same, sp_size=1))
    torch.manual_seed(rank)  # a different random state on each rank
    refused("seeds", lambda: generate("zigzag_ring_attn", model, same, do_sample=True, max_new_tokens=2))
    torch.manual_seed(0)
    try:  # the same seed, but another temperature on each rank: the sampled tokens part ways
        generate(
            "zigzag_ring_attn", model, same, do_sample=True, top_k=0, temperature=0.5 + 2 * rank, max_new_tokens=30
        )
    except RuntimeError as error:
        found["diverged"] = str(error)
    model.train()
    refused("training", lambda: generate("zigzag_ring_attn", model, same))
    model.eval()
    refused("plain model.generate", lambda: model.generate(same, max_new_tokens=2))
    remove_seq_parallel_monkey_patch()
    return found


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_generate_refusals_are_clear():
    found = run_ranks(_refusals_worker, 2)[0]
    expected = {
        "another mode": "the patch runs 'ulysses_attn'",
        "different prompts": "prompts differ between the ranks",
        "right padding": "left-padded",
        "use_cache": "use_cache=False is not supported",
        "assistant": "assistant_model is not supported",
        "other options": "sp_size=1, ring_degree=1 differ",
        "seeds": "random states",
        "training": "call model.eval() first",
        "diverged": "rank 1 of the sequence-parallel group decodes other tokens than rank 0",
        "plain model.generate": "use easy_context.generate",
    }
    for name, text in expected.items():
        assert name in found and text in found[name], (name, found.get(name))


def test_data_parallel_generate_is_model_generate():
    model = tiny_model("llama").eval()
    ids, mask = prompts(2, 30, seed=2, left_pad=(5, 0))
    want = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    got = generate("data_parallel", model, ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)


def test_generate_refuses_what_it_cannot_do_in_one_process():
    """World of one: the patched path runs (an SP group of one rank) and its refusals are the same."""
    model = tiny_model("llama").eval()
    ids, mask = prompts(2, 30, seed=4, left_pad=(0, 6))
    apply_seq_parallel_monkey_patch("zigzag_ring_attn", model)
    try:
        want_kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        got = generate("zigzag_ring_attn", model, ids, attention_mask=mask, **want_kwargs)
        cases = {
            "a cache": (dict(cache=object()), "cache is not supported (generate makes its own sharded cache)"),
            "embeddings": (dict(inputs_embeds=torch.zeros(1)), "inputs_embeds is not supported (pass input_ids)"),
            "positions": (dict(position_ids=torch.zeros(1)), "position_ids is not supported"),
            "document_split": (dict(document_split=True), "document_split is for packed rows"),
            "guidance": (dict(guidance_scale=1.5), "guidance_scale is not supported"),
        }
        for _name, (kwargs, text) in cases.items():
            with pytest.raises(ValueError, match=text.replace("(", r"\(").replace(")", r"\)")):
                generate("zigzag_ring_attn", model, ids, **kwargs)
        with pytest.raises(
            ValueError, match=r"input_ids must be a \(batch, seq_len\) tensor with seq_len >= 1, got \(30,\)"
        ):
            generate("zigzag_ring_attn", model, ids[0])
        with pytest.raises(ValueError, match=r"attention_mask shape \(2, 29\) != input_ids shape \(2, 30\)"):
            generate("zigzag_ring_attn", model, ids, attention_mask=mask[:, 1:])
    finally:
        remove_seq_parallel_monkey_patch()
    assert torch.equal(got, model.generate(ids, attention_mask=mask, **want_kwargs))


def test_a_forward_with_another_cache_while_decoding_is_refused():
    """Phi-3 drops the cache when the length crosses original_max_position_embeddings and runs
    the whole sequence again with a cache of its own: refused (on every rank alike)."""
    model = tiny_model("phi3", original_max_position_embeddings=40, sliding_window=None).eval()
    ids, mask = prompts(1, 30, seed=3)
    apply_seq_parallel_monkey_patch("zigzag_ring_attn", model)
    try:
        with pytest.raises(ValueError, match="a forward with another cache ran while decoding"):
            generate("zigzag_ring_attn", model, ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    finally:
        remove_seq_parallel_monkey_patch()
