"""Which decoder architectures run sequence parallel, and why the others are refused.

The record is model_types.py (SUPPORTED: proven exact by tools/sweep_models.py; REFUSED: the
reason of every other causal-LM type). This module applies it: the model types of a model or
config, the features of a config that no test has proven (layer kinds, rope types), the
logits head, and the model-type tables of docs/model_types.md.
"""

from __future__ import annotations

import functools

import torch

from easy_context.hf import mixers
from easy_context.hf.model_types import (  # noqa: F401  (the record; its categories are re-exported)
    ENCODER,
    ENCODER_DECODER,
    HYBRID,
    MULTIMODAL,
    NEEDS_LIBRARY,
    NOT_IMPLEMENTED,
    OUTSIDE_REGISTRY,
    REFUSAL_CATEGORIES,
    REFUSED,
    SUPPORTED,
    UNTESTED,
)
from easy_context.hf.modeling import modeling_module  # noqa: F401  (re-exported)

__all__ = [
    "SUPPORTED",
    "SUPPORTED_MODEL_TYPES",
    "REFUSED",
    "model_types_of",
    "check_model_type",
    "attn_implementation",
    "logits_head",
    "check_training_config",
    "modeling_module",
    "check_config_features",
    "PROVEN_ROPE_TYPES",
    "rope_types",
]

SUPPORTED_MODEL_TYPES = tuple(SUPPORTED)

# config.layer_types entries. Plain attention (a window, if any, comes as the attention's
# sliding_window argument) and layers that do not mix tokens run sequence parallel; attention
# we do not implement and other sequence mixers are refused.
_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})
_TOKEN_WISE_LAYER_TYPES = frozenset({"mlp", "moe"})
_UNIMPLEMENTED_LAYER_TYPES = {
    "chunked_attention": "chunked attention (fixed-size causal chunks)",
    "indexed_attention": "sparse attention whose indexer picks each query's keys (DeepSeek's DSA)",
    "compressed_sparse_attention": "compressed sparse attention",
    "heavily_compressed_attention": "compressed sparse attention",
}


# How transformers' modeling files name sequence mixers other than attention (class name
# endings), and layer kinds (config.layer_types) that are such mixers.
_MIXER_CLASS_ENDINGS = (
    "Mixer",
    "GatedDeltaNet",
    "DeltaAttention",
    "ShortConv",
    "ShortConvolution",
    "LinearAttention",
    "LightningAttention",
    "RecurrentBlock",
    "MambaLayer",
    "xLSTMLayer",
)


def unimplemented_attention(config) -> str | None:
    """The attention variant a config's layer kinds ask for that is not implemented, if any."""
    kinds = sorted(set(getattr(config, "layer_types", None) or ()) & set(_UNIMPLEMENTED_LAYER_TYPES))
    return _UNIMPLEMENTED_LAYER_TYPES[kinds[0]] if kinds else None


def sequence_mixers(module, config) -> list[str]:
    """What in a model type, besides attention, mixes tokens along the sequence: its layer
    kinds that are not attention and the mixer classes its modeling `module` defines."""
    kinds = set(getattr(config, "layer_types", None) or ())
    kinds -= _ATTENTION_LAYER_TYPES | _TOKEN_WISE_LAYER_TYPES | set(_UNIMPLEMENTED_LAYER_TYPES)
    classes = set()
    if module is not None:
        classes = {
            name
            for name, value in vars(module).items()
            if isinstance(value, type) and value.__module__ == module.__name__ and name.endswith(_MIXER_CLASS_ENDINGS)
        }
    return sorted(kinds) + sorted(classes)


# transformers' ROPE_INIT_FUNCTIONS (5.25) plus the plain rotary ("default"): each is proven
# exact in every mode by tests/distributed/test_rope.py (the length-dependent ones through
# hf/rope.py); a config with any other rope type is refused.
PROVEN_ROPE_TYPES = frozenset({"default", "linear", "dynamic", "yarn", "longrope", "llama3", "proportional"})


def rope_types(config) -> set[str]:
    """The rope types a (text) config uses: one, or one per layer type (Gemma 3's local base)."""
    parameters = getattr(config, "rope_parameters", None)
    if not isinstance(parameters, dict):
        return set()
    if "rope_type" in parameters or "rope_theta" in parameters:
        return {parameters.get("rope_type", "default")}
    return {p.get("rope_type", "default") for p in parameters.values() if isinstance(p, dict)}


def text_config_of(model_or_config):
    """The config a model's (or config's) decoder is built from: the nested text config of a
    multimodal wrapper, else the config itself."""
    config = getattr(model_or_config, "config", model_or_config)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def model_types_of(model_or_type) -> list[str]:
    """The model types a model instance (or config) runs attention under: its decoder's, read
    from the nested text config where there is one. A string is returned as it is."""
    if isinstance(model_or_type, str):
        return [model_or_type]
    if not hasattr(getattr(model_or_type, "config", model_or_type), "model_type"):
        raise TypeError(
            f"expected a model type (str) or a transformers model or config, got {type(model_or_type).__name__}"
        )
    text = text_config_of(model_or_type)
    if text.model_type in REFUSED:  # the known reason first
        check_model_type(text.model_type)
    check_config_features(text)
    return [text.model_type]


def check_config_features(config) -> None:
    """Refuse what a (text) config asks for that no test has proven exact: layers other than
    attention, rope types outside rope.PROVEN_ROPE_TYPES."""
    kinds = set(getattr(config, "layer_types", None) or ())
    unimplemented = sorted(kinds & set(_UNIMPLEMENTED_LAYER_TYPES))
    if unimplemented:
        raise ValueError(
            f"model type {config.model_type!r} has layers of type {unimplemented}: "
            f"{_UNIMPLEMENTED_LAYER_TYPES[unimplemented[0]]} is {NOT_IMPLEMENTED} under sequence parallelism"
        )
    module = modeling_module(config.model_type)
    other = sorted(kinds - _ATTENTION_LAYER_TYPES - _TOKEN_WISE_LAYER_TYPES)
    if other and not mixers.covers(module):
        raise ValueError(
            f"model type {config.model_type!r} has layers of type {other}: sequence parallelism splits only "
            f"attention layers ({sorted(_ATTENTION_LAYER_TYPES)}), layers that do not mix tokens "
            f"({sorted(_TOKEN_WISE_LAYER_TYPES)}) and the mixers of easy_context/hf/mixers.py; such layers would need "
            "their state passed across ranks"
        )
    found = sequence_mixers(module, config)
    if found and not mixers.covers(module):  # e.g. an older transformers without the mixer seams
        raise ValueError(
            f"model type {config.model_type!r} has sequence mixers besides attention ({', '.join(found)}) that this "
            "transformers does not call through the seams easy_context/hf/mixers.py replaces "
            f"({', '.join(mixers.SEAMS)}); use transformers >= 5.25, where they are"
        )
    unproven = sorted(rope_types(config) - PROVEN_ROPE_TYPES)
    if unproven:
        raise ValueError(
            f"model type {config.model_type!r} uses rope type {unproven}, which sequence parallelism has not been "
            f"proven exact with; proven: {sorted(PROVEN_ROPE_TYPES)}"
        )


def check_model_type(model_type: str) -> None:
    """Refuse a type that is not in SUPPORTED, saying why."""
    if model_type in SUPPORTED:
        return
    if model_type in REFUSED:
        raise ValueError(f"model type {model_type!r} cannot run sequence parallel: {REFUSED[model_type]}")
    raise ValueError(
        f"model type {model_type!r} is untested: easy_context/hf/model_types.py records {len(SUPPORTED)} supported "
        "types (each proven against the single-process model by python -m tools.sweep_models; "
        "docs/model_types.md lists them and says how to add one)"
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
    """The model-type tables of docs/model_types.md (tests/unit/test_architectures.py checks the page has them;
    tools/model_types_table.py prints them)."""
    lines = ["| model type | what it adds to Llama's architecture |", "|---|---|"]
    lines += [f"| `{name}` | {', '.join(features) or 'nothing'} |" for name, features in SUPPORTED.items()]
    lines += ["", "| refused model type | why |", "|---|---|"]
    lines += [f"| `{name}` | {reason} |" for name, reason in REFUSED.items()]
    return "\n".join(lines)
