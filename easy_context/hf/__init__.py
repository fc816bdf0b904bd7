"""The Hugging Face integration: the public API, the patch into transformers' registries, and
what runs on it (generation, the Trainer adapter, the replica guard).

    context.py        SequenceParallel: a mode with its options, topology and groups, resolved once
    heads.py          the decoder's heads, each layer's checked against the Ulysses degree, and the Placement
    api.py            the functions named by mode (apply_seq_parallel_monkey_patch, generate,
                      prepare_trainer, ...): each finds its context and calls it
    patch.py          dispatchers installed into transformers' attention and mask registries
    compiled.py       under torch.compile: the attention as one custom operator
    rope.py           RoPE whose frequencies follow the length (dynamic, longrope): the SP group's length
    mixers.py         the model's sequence mixers (Mamba-2, Gated DeltaNet, convolutions) sequence parallel
    forward_positions.py  the position_ids a model's forward got, for types that do not pass them on
    model_types.py    the record: every causal-LM type, supported or refused and why
    modeling.py       where transformers keeps a model type's code
    admission.py      what a model may bring (keywords, mask functions, head dims), checked per call
    mask_check.py     check_masks: the model's own mask per layer kind against the patch's, at setup
    architectures.py  the supported model types (one list) and why others are refused
    replicas.py       a guard: the ranks of an SP group must hold the same weights
    generation.py     generate in a context: prompt checks, sharded prefill, then transformers' decoding
    sharded_cache.py  ShardedKVCache: the KV cache sharded over the SP group, exact attention per step
    trainer.py        prepare_trainer in a context: HF Trainer / TRL SFT / DPO / GRPO / RLOO trainers in one line
    trainer_admission.py  the trainer classes and arguments prepare_trainer accepts, checked
    preference.py     TRL's DPOTrainer: its fused log-prob forwards sharded, per-token outputs summed over the group
    rl.py             TRL's GRPO / RLOO: the rollout drawn once per SP group, its log-prob forwards sharded as DPO's
    loss.py           the causal-LM loss of a shard: chunked cross entropy, its share of the global token mean
    accelerate_parallelism.py  refuses accelerate's own context / sequence parallelism next to ours
"""

from easy_context.core.collectives import world_size
from easy_context.hf.architectures import SUPPORTED_MODEL_TYPES
from easy_context.hf.context import SequenceParallel, active
from easy_context.hf.patch import ShardedMask, install, uninstall

# The names of release 0.1's easy_context.hf module.
ActivePatch = SequenceParallel
active_patch = active

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "SequenceParallel",
    "ActivePatch",
    "ShardedMask",
    "install",
    "uninstall",
    "active",
    "active_patch",
    "world_size",
]
