"""A tiny config of any causal-LM model type, from the type's own config class.

    tiny_config("olmo3")                 # 2 layers, hidden 64, 4 heads / 2 KV heads, vocab 128
    tiny_config("gemma3_text", seed=...)

The sizes are shrunk field by field where the config has the field (`SIZES`), mixture-of-experts
and low-rank fields by name (`shrink_by_name`), dropouts set to 0, and whatever a family
needs beyond that is in `OVERRIDES`. What a family adds to attention stays active at the sweep's
length: sliding windows of `WINDOW` tokens, its layer kinds (one layer of each, in the
default pattern's order), sinks, softcaps, MLA dims.
"""

from __future__ import annotations

import warnings

VOCAB = 128
WINDOW = 40  # shorter than the sweep's sequence, so a window changes the result
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# Multi-head latent attention (DeepSeek-V2/V3 and their kin): a value head dim of its own
MLA = dict(
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    qk_head_dim=24,
    v_head_dim=12,
    head_dim=8,
)
# Mamba-2 layers, under each family's names: 8 heads of 16 (expand 2 x hidden 64), groups of 2
# heads' B/C... except where the family's default is one group (Bamba, Falcon-H1, Granite 4,
# Zamba2: kept, the case that head exchange serves by replicating B and C), chunks of 32 (so
# a run of 64 tokens spans two), states of 16.
MAMBA = dict(
    mamba_n_heads=8,
    mamba_num_heads=8,
    n_mamba_heads=8,
    mamba_d_head=16,
    mamba_head_dim=16,
    mamba_headdim=16,
    mamba_d_ssm=128,
    mamba_d_state=16,
    ssm_state_size=16,
    mamba_chunk_size=32,
)
# Per family: what the generic shrinking cannot know (consistent MLA dims, fields whose names
# say nothing, features switched off by default that the sweep should see).
_PER_LAYER_INPUT = dict(vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16)
OVERRIDES: dict[str, dict] = {
    "codegen": dict(rotary_dim=8),
    "gptj": dict(rotary_dim=8),
    "ctrl": dict(dff=96),
    "deepseek_v2": dict(num_experts_per_tok=2, n_group=1, topk_group=1),
    "dots1": dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2),
    "nemotron_h": dict(chunk_size=32, n_groups=2),
    "gemma3n_text": dict(**_PER_LAYER_INPUT, num_kv_shared_layers=0, laurel_rank=8),
    "gemma4_text": dict(**_PER_LAYER_INPUT, per_layer_config={"01": {"head_dim": 32}}),
    # a looped middle: input, recurrent (run twice) and output blocks of one layer each
    "dory": dict(
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        num_hidden_layers=3,
        n_input_layers=1,
        n_recurrent_layers=1,
        n_output_layers=1,
    ),
    "gemma4_assistant": dict(hidden_size_per_layer_input=0),
    # hybrids whose layer kinds the generic shrinking does not see (an aliased field, or none by default)
    "zamba2": dict(layers_block_type=["linear_attention", "hybrid"], num_hidden_layers=2),
    "mamba2": dict(hidden_size=64, num_heads=8, head_dim=16, expand=2, n_groups=2, state_size=16),
    "lfm2_moe": dict(layer_types=["conv", "full_attention", "conv"], num_hidden_layers=3, num_dense_layers=1),
    "lfm2": dict(layer_types=["conv", "full_attention"], num_hidden_layers=2),
    # an attention layer besides the mixers (by default all mixers at two layers, and transformers'
    # own generate cannot build an attention mask over a cache of mixer states alone)
    "bamba": dict(attn_layer_indices=[1]),
}


def shrink_by_name(name: str, value):
    """Mixture-of-experts, low-rank and per-part sizes, recognised by their field names."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and ("dropout" in name or name.endswith("_pdrop") or "jitter" in name):
            return 0.0
        return value
    if name in SIZES:
        return value
    if "per_tok" in name or name in ("moe_topk", "top_k", "num_experts_per_token", "router_top_k"):
        return min(value, 2)
    if "expert" in name and value > 4:
        return 4
    if name.endswith("intermediate_size") or "ffn_dim" in name or "ffn_hidden_size" in name:
        return min(value, 32)
    if name in ("moe_k", "moe_top_k", "n_activated_experts") or name.endswith("topk"):
        return min(value, 2)
    if name.endswith("lora_rank"):
        return min(value, 32)
    if name in ("n_group", "topk_group", "first_k_dense_replace"):
        return min(value, 1)
    return value


def tiny_config(model_type: str, **extra):
    """The config of `model_type` at tiny sizes (see the module docstring)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        defaults = CONFIG_MAPPING[model_type](**OVERRIDES.get(model_type, {}))
        fields = {k: v for k, v in defaults.to_dict().items() if not k.startswith("_")}
        kwargs = {k: v for k, v in SIZES.items() if k in fields or k in getattr(defaults, "attribute_map", {})}
        kwargs.update({k: shrink_by_name(k, v) for k, v in fields.items() if k not in SIZES})
        kwargs = {k: v for k, v in kwargs.items() if fields.get(k) != v or k in SIZES}
        kwargs.update({k: v for k, v in MAMBA.items() if k in fields})
        if "qk_rope_head_dim" in fields:  # MLA: consistent low-rank and head dims, no GQA
            kwargs.update({k: v for k, v in MLA.items() if k in fields or k == "head_dim"})
        if fields.get("sliding_window") is not None:
            kwargs["sliding_window"] = WINDOW
        layer_types = fields.get("layer_types")
        if layer_types:
            kinds = list(dict.fromkeys(layer_types))
            kwargs["layer_types"] = kinds if len(kinds) > 1 else kinds * 2
            kwargs["num_hidden_layers"] = len(kwargs["layer_types"])
        kwargs.update(OVERRIDES.get(model_type, {}))
        kwargs.update(extra)
        return AutoConfig.for_model(model_type, **kwargs)


def window_variants(model_type: str) -> dict:
    """{name: config overrides}: the type's tiny config with a sliding window set, as a user may
    write one into any config (a model reads it, or not, in its mask or its attention: issue
    56), and without one where the type has a window its layers do not require. A window
    switches `use_sliding_window` on and `max_window_layers` to 1, so both layer kinds are built."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fields = CONFIG_MAPPING[model_type]().to_dict()
    window = {"sliding_window": WINDOW}
    window.update({k: v for k, v in (("use_sliding_window", True), ("max_window_layers", 1)) if k in fields})
    variants = {"window": window}
    if fields.get("sliding_window") is not None and "sliding_attention" not in (fields.get("layer_types") or ()):
        none = {"sliding_window": None, **({"use_sliding_window": False} if "use_sliding_window" in fields else {})}
        try:  # some config classes require a window (an int) and refuse None
            CONFIG_MAPPING[model_type](**none)
            variants["no window"] = none
        except Exception:  # noqa: BLE001 - huggingface_hub raises its own strict-dataclass errors
            pass
    return variants


def rope_parameters(rope_type: str, original: int, half_head: int) -> dict:
    """Each rope type's own parameters (transformers' ROPE_INIT_FUNCTIONS, and `default`), for an
    original context of `original` tokens and rotary of `half_head` frequencies: the lengths the
    tests run cross it, so the length-dependent types switch their frequencies on the way."""
    return {
        "default": {},
        "linear": {"factor": 2.0},
        "dynamic": {"factor": 4.0},
        "yarn": {"factor": 4.0, "original_max_position_embeddings": original},
        "longrope": {
            "original_max_position_embeddings": original,
            "short_factor": [1.0 + 0.1 * i for i in range(half_head)],
            "long_factor": [2.0 + 0.5 * i for i in range(half_head)],
        },
        "llama3": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": original // 2,
        },
        "proportional": {"partial_rotary_factor": 0.5},
    }[rope_type]


def rope_variants(model_type: str, original: int) -> dict:
    """{"rope=<type>": config overrides} for each rope type transformers implements, for a type
    whose tiny config has rope parameters: the type's own parameters (per layer type too, as
    Gemma 3 keeps them) with rope_type and its fields replaced, the original context and
    max_position_embeddings at `original`."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = tiny_config(model_type)
    own = getattr(config, "rope_parameters", None)
    if not isinstance(own, dict) or not own:
        return {}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    halves = {buffer.shape[-1] for name, buffer in model.named_buffers() if name.endswith("inv_freq")}
    if len(halves) != 1:  # no rotary of transformers' kind, or several sizes (per-layer heads)
        return {}
    half = halves.pop()
    nested = all(isinstance(v, dict) for v in own.values())
    names = sorted(set(ROPE_INIT_FUNCTIONS) | {"default"})
    named = {"rope_type"} | {k for t in names for k in rope_parameters(t, original, half)}
    variants = {}
    for rope_type in names:
        fields = {"rope_type": rope_type, **rope_parameters(rope_type, original, half)}

        def typed(parameters, fields=fields):  # the type's own fields that no rope type here names stay
            return {**{k: v for k, v in parameters.items() if k not in named}, **fields}

        parameters = {k: typed(v) for k, v in own.items()} if nested else typed(own)
        variants[f"rope={rope_type}"] = {"rope_parameters": parameters, "max_position_embeddings": original}
    return variants
