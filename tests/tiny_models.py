"""The tests' one factory of tiny random-weight models, built offline from configs.

    tiny_config("llama")                   # the tuned config of a type tuned here (`ARCHITECTURES`)
    tiny_config("qwen3_next")              # any other type: the model sweep's (tools/tiny_configs.py)
    tiny_config("mistral", sweep=True)     # the sweep's even for a type tuned here
    tiny_model("llama", torch.bfloat16, vocab_size=260)   # sizes and fields: config overrides

Every test builds its tiny models and configs here; no test defines its own (tests/user_scripts/
are users' standalone programs, and write theirs as a user would).
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from easy_context.hf.architectures import SUPPORTED
from easy_context.hf.architectures import attn_implementation as default_impl
from tools import tiny_configs
from tools.tiny_configs import WINDOW, rope_parameters, window_variants

__all__ = [
    "ARCHITECTURES",
    "MODEL_TYPES",
    "VOCAB",
    "WINDOW",
    "rope_parameters",
    "tiny_batch",
    "tiny_config",
    "tiny_model",
    "window_variants",
]

VOCAB = 128
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    attention_dropout=0.0,
    tie_word_embeddings=False,
)
_CONFIGS = {
    "llama": lambda: LlamaConfig(**_COMMON),
    # A window longer than the test sequences: exercises the sliding_window kwarg path.
    "mistral": lambda: MistralConfig(**_COMMON, sliding_window=4096),
    "qwen2": lambda: Qwen2Config(**_COMMON, use_sliding_window=False),
    "qwen3": lambda: Qwen3Config(**_COMMON, head_dim=16),
}
MODEL_TYPES = tuple(_CONFIGS)  # the four of test_models.py's full mode matrix

# Every supported architecture, each configured so that what its attention adds matters at
# the test length (128 tokens): windows of 40 tokens, a softcap of 2 on logits of order
# 1-10, sinks of order 1, a value head dim half the query/key one. GQA (4 query heads over 2
# KV heads) wherever the architecture has it. WINDOW: the sweep's (tools/tiny_configs.py).
_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
_MOE = dict(num_local_experts=4, num_experts_per_tok=2)
_ALTERNATING = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
_ARCHITECTURES = {
    "mixtral": dict(sliding_window=WINDOW, **_MOE),
    "qwen3_moe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "gemma": dict(head_dim=16),
    # Larger weights: logits of order 1-10, where a softcap of 2 bends them (at the default
    # 0.02 init the logits stay far below the cap and softcapping changes nothing measurable).
    "gemma2": dict(
        head_dim=16, query_pre_attn_scalar=16, attn_logit_softcapping=2.0, initializer_range=0.2, **_ALTERNATING
    ),
    "gemma3_text": dict(head_dim=16, query_pre_attn_scalar=16, **_ALTERNATING),
    "phi3": dict(sliding_window=WINDOW),
    "olmo2": {},
    "granite": dict(attention_multiplier=0.3, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0),
    "smollm3": dict(no_rope_layer_interval=2),
    "glm4": dict(head_dim=16),
    "cohere2": dict(logit_scale=1.0, **_ALTERNATING),  # default 0.0625 leaves logits of order 0.03
    "starcoder2": dict(sliding_window=WINDOW),
    "gpt_oss": dict(head_dim=16, **_MOE, **_ALTERNATING),
    "deepseek_v3": dict(
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        moe_intermediate_size=32,
        n_shared_experts=1,
    ),
}
for _type, _extra in _ARCHITECTURES.items():
    _CONFIGS[_type] = lambda t=_type, e=_extra: AutoConfig.for_model(t, **{**_COMMON, **_IDS, **e})
# The families whose features the architecture tests switch on and off one by one (bf16, usp at
# 4 ranks, generation); every supported type is proven in fp32 by tools/sweep_models.py.
ARCHITECTURES = tuple(_CONFIGS)
assert set(_CONFIGS) <= set(SUPPORTED), "tiny configs of supported model types only"


def tiny_config(model_type: str, *, sweep: bool = False, **overrides):
    """The tiny config of `model_type` with config fields `overrides`: the tuned one above for a
    type in ARCHITECTURES (overrides set on it), else (or with sweep=True) the model sweep's,
    tools/tiny_configs.tiny_config (overrides passed to the config class)."""
    if sweep or model_type not in _CONFIGS:
        return tiny_configs.tiny_config(model_type, **overrides)
    config = _CONFIGS[model_type]()
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def tiny_model(model_type: str, dtype=torch.float32, attn_implementation=None, seed=0, *, sweep=False, **overrides):
    """tiny_config(model_type, sweep=sweep, **overrides) with random weights from `seed`, in
    `dtype`; attn_implementation None: the library's choice for the type (sdpa where the class
    has it)."""
    torch.manual_seed(seed)
    config = tiny_config(model_type, sweep=sweep, **overrides)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation or default_impl(config))
    _randomise_zero_inits(model)
    return model.to(dtype)


def _randomise_zero_inits(model) -> None:
    """Parameters initialised to constants (gpt-oss sinks: zeros) get random values, so the
    tests see their effect and their gradients."""
    for name, param in model.named_parameters():
        if name.endswith(".sinks"):
            with torch.no_grad():
                param.normal_(0.0, 1.0)


def tiny_batch(batch: int, seq_len: int, seed: int = 1):
    """input_ids and next-token targets (pre-shifted), with some ignored (-100) targets."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, seq_len + 1), generator=g)
    input_ids, target_ids = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    target_ids[:, : seq_len // 8] = -100  # an uneven share of ignored targets across shards
    return input_ids, target_ids
