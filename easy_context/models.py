"""Loading Hugging Face causal LMs the way the scripts need them (config overrides, checks)."""

from __future__ import annotations

import torch

from .hf import SUPPORTED_MODEL_TYPES

__all__ = ["load_config", "load_pretrained", "check_config"]


def load_config(source: str, rope_theta: float | None = None):
    """The model's config with the RoPE base overridden; unsupported model types are refused."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model type {config.model_type!r} is not supported; supported: {list(SUPPORTED_MODEL_TYPES)}")
    if rope_theta is not None:
        # transformers 5 keeps the base in config.rope_parameters; older configs in rope_theta
        if isinstance(getattr(config, "rope_parameters", None), dict):
            config.rope_parameters["rope_theta"] = rope_theta
        else:
            config.rope_theta = rope_theta
    config.use_cache = False
    return config


def load_pretrained(source: str, rope_theta: float | None = None, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from a hub name or a local folder, with SDPA attention."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = load_config(source, rope_theta)
    model = AutoModelForCausalLM.from_pretrained(source, config=config, attn_implementation="sdpa", dtype=dtype)
    return model, AutoTokenizer.from_pretrained(source)


def check_config(config, topology, seq_length: int, mode: str) -> None:
    """What sequence parallelism cannot run yet, refused before the first forward (with the
    value and what would work) rather than from inside it."""
    if (getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        raise ValueError(f"the model has attention_dropout={config.attention_dropout}; sequence parallelism needs 0.0")
    heads = config.num_attention_heads
    if heads % topology.ulysses_degree:
        raise ValueError(f"num_attention_heads={heads} does not split over the Ulysses degree {topology.ulysses_degree} "
                         f"(parallel mode {mode}); use a degree dividing {heads} (--ring_degree with usp_attn) or zigzag_ring_attn")
