"""Which decoder architectures run sequence parallel, and why the others are refused.

The one list of supported model types. Each is proven equal to the unpatched single-process
model (logits, loss, every parameter gradient) in every mode family by
tests/unit/test_architectures.py, on a tiny config; the softcap, sinks, MLA head dims and most
windows are active there, the windows of Mistral, Qwen2 and Qwen3 in
tests/distributed/test_masked_models.py. The README's table is checked against this list.

Refused types fall in two groups: hybrids whose other layers mix tokens along the sequence
(linear attention, state-space or convolution layers would need their recurrent state passed
across ranks), and attention variants not implemented yet. A model type in neither list is
refused as untested.
"""

from __future__ import annotations

import functools

import torch

__all__ = [
    "SUPPORTED",
    "SUPPORTED_MODEL_TYPES",
    "REFUSED",
    "model_types_of",
    "check_model_type",
    "attn_implementation",
    "logits_head",
    "check_training_config",
]

# model_type -> what it adds to Llama's architecture
SUPPORTED = {
    "llama": (),
    "mistral": ("sliding window",),
    "mixtral": ("sliding window", "mixture of experts"),
    "qwen2": ("sliding window layers",),
    "qwen3": ("QK norm", "sliding window layers"),
    "qwen3_moe": ("QK norm", "mixture of experts"),
    "gemma": ("scaled embeddings", "head dim 256 by default"),
    "gemma2": ("logit softcapping", "alternating sliding / global layers"),
    "gemma3_text": ("QK norm", "alternating sliding / global layers, local RoPE base"),
    "phi3": ("fused QKV", "sliding window"),
    "olmo2": ("QK norm over all heads",),
    "granite": ("attention multiplier as the scale",),
    "smollm3": ("NoPE layers",),
    "glm4": ("partial rotary",),
    "cohere2": ("alternating sliding / global layers, NoPE global layers",),
    "starcoder2": ("sliding window", "biases"),
    "gpt_oss": ("attention sinks", "alternating sliding / global layers", "mixture of experts"),
    "deepseek_v3": ("MLA: value head dim != query/key head dim", "mixture of experts"),
}
SUPPORTED_MODEL_TYPES = tuple(SUPPORTED)

_RECURRENT = "layers that carry a recurrent state along the sequence"
REFUSED = {
    "qwen3_next": f"hybrid: Gated DeltaNet linear-attention {_RECURRENT}",
    "qwen3_5": f"hybrid: Gated DeltaNet linear-attention {_RECURRENT}",
    "qwen3_5_moe": f"hybrid: Gated DeltaNet linear-attention {_RECURRENT}",
    "falcon_h1": f"hybrid: Mamba-2 {_RECURRENT}, in parallel with attention",
    "falcon_mamba": f"state-space model: Mamba {_RECURRENT}",
    "mamba": f"state-space model: Mamba {_RECURRENT}",
    "mamba2": f"state-space model: Mamba-2 {_RECURRENT}",
    "jamba": f"hybrid: Mamba {_RECURRENT}",
    "bamba": f"hybrid: Mamba-2 {_RECURRENT}",
    "zamba": f"hybrid: Mamba {_RECURRENT}",
    "zamba2": f"hybrid: Mamba-2 {_RECURRENT}",
    "granitemoehybrid": f"hybrid: Mamba-2 {_RECURRENT}",
    "nemotron_h": f"hybrid: Mamba-2 {_RECURRENT}",
    "lfm2": "hybrid: short causal convolution layers that mix neighbouring tokens across shard boundaries",
    "lfm2_moe": "hybrid: short causal convolution layers that mix neighbouring tokens across shard boundaries",
    "kimi_linear": f"hybrid: Kimi Delta Attention {_RECURRENT}",
    "minimax": f"hybrid: lightning (linear) attention {_RECURRENT}",
    "olmo_hybrid": f"hybrid: linear-attention {_RECURRENT}",
    "recurrent_gemma": f"hybrid: RG-LRU {_RECURRENT}",
    "rwkv": f"recurrent model: RWKV {_RECURRENT}",
    "xlstm": f"recurrent model: xLSTM {_RECURRENT}",
    "llama4": "chunked-attention layers (attention_chunk_size) are not implemented yet",
    "llama4_text": "chunked-attention layers (attention_chunk_size) are not implemented yet",
}
# layer_types entries that are plain attention (a window, if any, comes as the attention's
# sliding_window argument); any other entry is a layer sequence parallelism cannot split.
_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def model_types_of(model_or_type) -> list[str]:
    """The model types a model instance (or config) runs attention under: its decoder's, read
    from the nested text config where there is one. A string is returned as it is."""
    if isinstance(model_or_type, str):
        return [model_or_type]
    config = getattr(model_or_type, "config", model_or_type)
    if not hasattr(config, "model_type"):
        raise TypeError(
            f"expected a model type (str) or a transformers model or config, got {type(model_or_type).__name__}"
        )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config  # multimodal: the decoder's
    if text.model_type in REFUSED:  # the known reason first
        check_model_type(text.model_type)
    _check_layer_types(text)
    return [text.model_type]


def _check_layer_types(config) -> None:
    layer_types = getattr(config, "layer_types", None) or ()
    other = sorted(set(layer_types) - _ATTENTION_LAYER_TYPES)
    if other:
        raise ValueError(
            f"model type {config.model_type!r} has layers of type {other}: sequence parallelism splits only "
            f"attention layers ({sorted(_ATTENTION_LAYER_TYPES)}); "
            "such layers would need their state passed across ranks"
        )


def check_model_type(model_type: str) -> None:
    """Refuse a type that is not in SUPPORTED, saying why."""
    if model_type in SUPPORTED:
        return
    if model_type in REFUSED:
        raise ValueError(f"model type {model_type!r} cannot run sequence parallel: {REFUSED[model_type]}")
    if f"{model_type}_text" in SUPPORTED:  # a multimodal wrapper's type given as a string
        raise ValueError(
            f"model type {model_type!r} is a multimodal wrapper: pass the model itself, or its decoder's "
            f"type {model_type}_text"
        )
    raise ValueError(
        f"model type {model_type!r} is not supported; supported: {list(SUPPORTED)} (each tested against the "
        "single-process model)"
    )


def check_training_config(config) -> None:
    """What training under sequence parallelism cannot reproduce: a mixture-of-experts router
    loss (output_router_logits=True) is a nonlinear function of each forward's tokens, so
    computed per shard it is not the loss of the whole sequence."""
    text = config.get_text_config()
    if getattr(text, "output_router_logits", False):
        raise ValueError(
            f"the {text.model_type} config has output_router_logits=True: its router load-balancing loss would be "
            "computed over each rank's shard, not the whole sequence; set output_router_logits=False "
            "(train with the language-model loss only, the hub default for these models)"
        )


def attn_implementation(config) -> str:
    """'sdpa' where the model's class supports it, else 'eager' (Gemma 2 and gpt-oss: SDPA has
    no softcapping or sinks). Under the patch both run our attention; this is what an
    unpatched model (data_parallel, the single-process reference) needs to be exact.

    Softcapped attention is always 'eager': transformers before 5.2x lets Gemma 2 run SDPA,
    which drops the softcap without a word."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "attn_logit_softcapping", None):
        return "eager"
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    return "sdpa" if cls is None or getattr(cls, "_supports_sdpa", True) else "eager"


# What a CausalLM forward does to the output layer's result, for the types that do something
# (train.py and the evaluations call the decoder and the output layer themselves, chunked).
_LOGIT_TRANSFORMS = {
    "gemma2": lambda logits, c: _softcap(logits, c.final_logit_softcapping),
    "gemma3_text": lambda logits, c: _softcap(logits, c.final_logit_softcapping),
    "granite": lambda logits, c: logits / c.logits_scaling,
    "cohere2": lambda logits, c: logits * c.logit_scale,
}


def _softcap(logits, cap):
    return logits if cap is None else torch.tanh(logits / cap) * cap


def logits_head(model):
    """hidden states -> logits exactly as the model's own forward computes them: its output
    layer (called as a module, so ZeRO-3 gathers its weight), then the architecture's final
    transform (Gemma 2/3 softcapping, Granite's logits_scaling, Cohere's logit_scale)."""
    linear = model.get_output_embeddings()
    config = model.config.get_text_config()
    transform = _LOGIT_TRANSFORMS.get(config.model_type)
    return linear if transform is None else functools.partial(_transformed, linear, transform, config)


def _transformed(linear, transform, config, hidden):
    return transform(linear(hidden), config)


def markdown_tables() -> str:
    """The README's model-type tables (tests/unit/test_architectures.py checks the README has them;
    tools/model_types_table.py prints them)."""
    lines = ["| model type | what it adds to Llama's architecture |", "|---|---|"]
    lines += [f"| `{name}` | {', '.join(features) or 'nothing'} |" for name, features in SUPPORTED.items()]
    lines += ["", "| refused model type | why |", "|---|---|"]
    lines += [f"| `{name}` | {reason} |" for name, reason in REFUSED.items()]
    return "\n".join(lines)
