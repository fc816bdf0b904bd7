"""The Hugging Face integration: the public API, the patch into transformers' registries, and
what runs on it (generation, the Trainer adapter, the replica guard).

    api.py            the EasyContext functions (apply_seq_parallel_monkey_patch, ...)
    patch.py          dispatchers installed into transformers' attention and mask registries
    architectures.py  the supported model types (one list) and why others are refused
    replicas.py       a guard: the ranks of an SP group must hold the same weights
    generation.py     generate: sharded prefill, a KV cache sharded over the SP group
    trainer.py        prepare_trainer: HF Trainer / TRL SFTTrainer in one line
"""

from easy_context.hf.patch import (
    SUPPORTED_MODEL_TYPES,
    ActivePatch,
    ShardedMask,
    active_patch,
    install,
    uninstall,
    world_size,
)

__all__ = ["SUPPORTED_MODEL_TYPES", "ActivePatch", "ShardedMask", "install", "uninstall", "active_patch", "world_size"]
