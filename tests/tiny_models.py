"""Tiny random-weight models of every supported family, built offline from configs."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

VOCAB = 128
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
    attention_dropout=0.0, tie_word_embeddings=False,
)
_CONFIGS = {
    "llama": lambda: LlamaConfig(**_COMMON),
    # A window longer than the test sequences: exercises the sliding_window kwarg path.
    "mistral": lambda: MistralConfig(**_COMMON, sliding_window=4096),
    "qwen2": lambda: Qwen2Config(**_COMMON, use_sliding_window=False),
    "qwen3": lambda: Qwen3Config(**_COMMON, head_dim=16),
}
MODEL_TYPES = tuple(_CONFIGS)


def tiny_config(model_type: str, **overrides):
    config = _CONFIGS[model_type]()
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def tiny_model(model_type: str, dtype=torch.float32, attn_implementation="sdpa", seed=0, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), attn_implementation=attn_implementation)
    return model.to(dtype)


def tiny_batch(batch: int, seq_len: int, seed: int = 1):
    """input_ids and next-token targets (pre-shifted), with some ignored (-100) targets."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, seq_len + 1), generator=g)
    input_ids, target_ids = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    target_ids[:, : seq_len // 8] = -100  # an uneven share of ignored targets across shards
    return input_ids, target_ids
