"""LoRA adapters (peft) for the scripts: wrap a model for training, find and load a saved adapter.

train.py `--lora-r R` wraps the loaded model with `add_lora` before the patch is applied
(the patch looks through the PeftModel to the model's type) and saves only the adapter,
with peft's save_pretrained, into --output-dir. The eval scripts take that folder as
--model: a folder holding adapter_config.json is an adapter, loaded onto the base model
its config names (`load_adapter`). peft is imported here, lazily: `import easy_context`
does not need it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from easy_context.hf.mixers import mixer_layers

__all__ = ["ADAPTER_CONFIG", "attention_projections", "add_lora", "adapter_base", "load_adapter"]

ADAPTER_CONFIG = "adapter_config.json"  # what peft's save_pretrained writes next to the adapter weights


def _peft():
    try:
        import peft
    except ImportError as error:
        raise ImportError('LoRA needs peft: pip install "easy-context[lora]"') from error
    from easy_context.versions import check_supported

    check_supported("peft")
    return peft


def attention_projections(model) -> list[str]:
    """The names of the linear layers inside the sequence mixers: the attention modules (q_proj,
    k_proj, v_proj, o_proj for Llama; qkv_proj for Phi-3; the MLA projections for DeepSeek-V3) and
    the input projections of a hybrid's recurrent and convolution mixers (Mamba-2's in_proj,
    Gated DeltaNet's in_proj_qkvz and in_proj_ba). LoRA's default targets, found in the model rather
    than listed per architecture."""
    names = set()
    for qualified, module in model.named_modules():
        parent, _, name = qualified.rpartition(".")
        in_attention = any(part in ("self_attn", "attention", "attn") for part in parent.split("."))
        if in_attention and isinstance(module, torch.nn.Linear):
            names.add(name)
    # a mixer's input projections only: mamba_ssm's fused path reads out_proj's weight itself (an
    # adapter there would be skipped), which is why peft refuses out_proj on Mamba models
    for layer, _ in mixer_layers(model):
        names.update(
            name
            for name, child in layer.named_children()
            if isinstance(child, torch.nn.Linear) and name.startswith("in_proj")
        )
    return sorted(names)


def add_lora(model, r: int, alpha: float | None = None, targets: list[str] | None = None):
    """The PeftModel training rank-`r` adapters on `targets` (default: the attention
    projections) with scale alpha / r (alpha default 2r); the model's own weights frozen."""
    if not isinstance(r, int) or r < 1:
        raise ValueError(f"LoRA rank {r!r}: use a whole number >= 1 (8-64 is usual)")
    alpha = 2 * r if alpha is None else alpha
    if not alpha > 0:
        raise ValueError(f"LoRA alpha {alpha!r}: use a number > 0 (the adapter's scale is alpha / r; default 2r)")
    available = attention_projections(model)
    linear = sorted({q.rpartition(".")[2] for q, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    if targets is None:
        targets = available
        if not targets:
            name = type(model).__name__
            raise ValueError(f"{name} has no linear layers in its attention or mixers: name LoRA targets")
    unknown = [t for t in targets if t not in linear]
    if unknown:
        raise ValueError(f"LoRA targets {unknown} are not linear layers of {type(model).__name__}; it has {linear}")
    peft = _peft()
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none")
    return peft.get_peft_model(model, config)


def adapter_base(source: str) -> str | None:
    """The base model an adapter folder was trained on (its adapter_config.json's
    base_model_name_or_path); None when `source` is not an adapter folder."""
    config_file = Path(source) / ADAPTER_CONFIG
    if not config_file.is_file():
        return None
    base = json.loads(config_file.read_text()).get("base_model_name_or_path")
    if not base:
        raise ValueError(
            f"{config_file} names no base model (base_model_name_or_path): set it to the model the adapter was "
            "trained on (train.py --lora-r writes it)"
        )
    return base


def load_adapter(model, source: str):
    """`model` (the base) with the adapter saved in `source`, for inference (weights frozen)."""
    return _peft().PeftModel.from_pretrained(model, source, is_trainable=False)
