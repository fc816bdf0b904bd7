"""Loading Hugging Face causal LMs the way the scripts need them (config overrides, checks)."""

from __future__ import annotations

from pathlib import Path

import torch

from easy_context.core.exchange import ulysses_head_splits
from easy_context.hf.architectures import attn_implementation, check_model_type

__all__ = ["load_config", "load_pretrained", "check_config"]


def load_config(source: str, rope_theta: float | None = None):
    """The model's config with the RoPE base overridden; unsupported model types are refused."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source)
    check_model_type(config.get_text_config().model_type)
    if rope_theta is not None:
        _set_rope_theta(config.get_text_config(), rope_theta)
    config.use_cache = False
    return config


def _set_rope_theta(config, rope_theta: float) -> None:
    """transformers 5 keeps the base in config.rope_parameters (per layer type where sliding
    and global layers differ, as in Gemma 3: there the global layers' base is the one
    changed, the local layers keep theirs); older configs in rope_theta."""
    parameters = getattr(config, "rope_parameters", None)
    if not isinstance(parameters, dict):
        config.rope_theta = rope_theta
    elif isinstance(parameters.get("full_attention"), dict):
        parameters["full_attention"]["rope_theta"] = rope_theta
    else:
        parameters["rope_theta"] = rope_theta


def load_pretrained(source: str, rope_theta: float | None = None, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from a hub name or a local folder, with SDPA attention where the
    architecture has it (else eager: see architectures.attn_implementation).

    A folder holding a LoRA adapter (adapter_config.json, as train.py --lora-r saves) gives
    the base model its config names, wrapped with the adapter (a PeftModel); its tokenizer
    is the folder's when saved there, else the base's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recipes.lora import adapter_base, load_adapter

    base = adapter_base(source)
    weights = source if base is None else base
    config = load_config(weights, rope_theta)
    model = AutoModelForCausalLM.from_pretrained(
        weights, config=config, attn_implementation=attn_implementation(config), dtype=dtype
    )
    if base is None:
        return model, AutoTokenizer.from_pretrained(source)
    saved_tokenizer = (Path(source) / "tokenizer_config.json").is_file()
    return load_adapter(model, source), AutoTokenizer.from_pretrained(source if saved_tokenizer else base)


def check_config(config, topology, seq_length: int, mode: str) -> None:
    """What sequence parallelism cannot run yet, refused before the first forward (with the
    value and what would work) rather than from inside it."""
    config = config.get_text_config()  # a multimodal wrapper: its decoder's
    if (getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        raise ValueError(f"the model has attention_dropout={config.attention_dropout}; sequence parallelism needs 0.0")
    if topology.ulysses_degree > 1:  # query heads split unevenly where they must; a rank without one is refused
        heads = config.num_attention_heads
        ulysses_head_splits(heads, getattr(config, "num_key_value_heads", None) or heads, topology.ulysses_degree)
