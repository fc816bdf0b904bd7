"""The sharded KV cache's decoding step on one rank, against attention over the whole sequence
with masking.py's rule: left padding of different lengths per row (rows whose padded part has
no valid slot included), sliding windows, and the refusal of steps of several tokens. The
multi-rank path (the all-gather merge) is tests/distributed/test_generation.py's."""

import math

import pytest
import torch

from easy_context.core.kernels import attention_forward
from easy_context.hf import sharded_cache
from easy_context.hf.sharded_cache import ShardedKVCache

HEADS, KV_HEADS, DIM = 4, 2, 8


def full_attention(q, k, v, valid, window):
    """One query (the last position) over every key, masked by validity and the window."""
    k, v = (x.repeat_interleave(HEADS // KV_HEADS, dim=1) for x in (k, v))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(DIM)
    allowed = valid[:, None, None, :].clone()
    if window is not None:
        positions = torch.arange(k.shape[2])
        allowed &= (k.shape[2] - 1 - positions < window)[None, None, None, :]
    return torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1) @ v


def prefilled_cache(prompt_k, prompt_v, valid):
    cache = ShardedKVCache(None, 0, 1)
    length = prompt_k.shape[2]
    cache.start_prefill(torch.arange(length), valid, length)
    cache.update(prompt_k, prompt_v, 0)
    cache.finish_prefill(valid.shape[0], prompt_k.device)
    return cache


@pytest.mark.parametrize("window", [None, 6, 10])  # the cache holds 13 to 17 slots
@pytest.mark.parametrize("pads", [(0, 0), (0, 5), (3, 12), (12, 12)])
def test_a_decoding_step_is_attention_over_the_whole_sequence(pads, window):
    g = torch.Generator().manual_seed(sum(pads) + (window or 0))
    prompt, steps = 12, 5
    k = torch.randn(2, KV_HEADS, prompt + steps, DIM, generator=g, dtype=torch.float64)
    v = torch.randn(2, KV_HEADS, prompt + steps, DIM, generator=g, dtype=torch.float64)
    valid = torch.ones(2, prompt + steps, dtype=torch.bool)
    for row, pad in enumerate(pads):
        valid[row, :pad] = False
    cache = prefilled_cache(k[:, :, :prompt], v[:, :, :prompt], valid[:, :prompt])
    for step in range(prompt, prompt + steps):
        q = torch.randn(2, HEADS, 1, DIM, generator=g, dtype=torch.float64)
        live_k, live_v = cache.update(k[:, :, step : step + 1], v[:, :, step : step + 1], 0)
        got = cache.attend(q, live_k, live_v, 1 / math.sqrt(DIM), 0, window=window)
        want = full_attention(q, k[:, :, : step + 1], v[:, :, : step + 1], valid[:, : step + 1], window)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_the_masked_part_is_only_the_prompts_padded_slots(monkeypatch):
    """What the masked kernel gets does not grow with the cache: the slots up to the last one
    that is padding in some row; the rest goes to the unmasked kernel."""
    calls = []

    def recording(q, k, v, causal, scale, mask=None, softcap=None):
        calls.append((k.shape[-2], None if mask is None else tuple(mask.shape)))
        return attention_forward(q, k, v, causal, scale, mask=mask, softcap=softcap)

    monkeypatch.setattr(sharded_cache, "attention_forward", recording)
    k = torch.randn(2, KV_HEADS, 30, DIM)
    valid = torch.ones(2, 30, dtype=torch.bool)
    valid[1, :7] = False
    cache = prefilled_cache(k[:, :, :20], k[:, :, :20], valid[:, :20])
    for step in range(20, 30):
        calls.clear()
        cache.update(k[:, :, step : step + 1], k[:, :, step : step + 1], 0)
        cache.attend(torch.randn(2, HEADS, 1, DIM), *cache.layers[0].live(), 1.0, 0)
        assert calls == [(7, (2, 1, 1, 7)), (step + 1 - 7, None)], (step, calls)
    assert tuple(cache.valid.shape) == (2, 7) and cache.positions == list(range(30))


def test_a_step_of_several_tokens_is_refused():
    prompt = torch.randn(1, KV_HEADS, 6, DIM)
    cache = prefilled_cache(prompt, prompt, torch.ones(1, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="a decoding step of 2 tokens; the sharded cache decodes one token per step"):
        cache.update(torch.randn(1, KV_HEADS, 2, DIM), torch.randn(1, KV_HEADS, 2, DIM), 0)
