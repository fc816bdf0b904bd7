"""easy-context: exact sequence-parallel attention for Hugging Face causal LMs.

Public API (everything a training or evaluation script needs):

    sp = setup(mode, model_or_type, **options)   resolve the mode, topology and groups once; patch the model type
        sp.shard(input_ids, position_ids=None, target_ids=None, attention_mask=None)   this rank's share
        sp.gather(local, dim=1, token_index=None)   the SP group's tensors back in sequence order
        sp.dataloader(loader, accelerator)   one data stream per SP group
        sp.trainer(trainer)                  HF Trainer / TRL SFTTrainer / DPOTrainer in one line
        sp.generate(model, input_ids, attention_mask=None, **generate_kwargs)   KV cache sharded
        sp.check_same(tensors, error)        every rank of the SP group holds the same tensors
    teardown()                               transformers' own attention again
    check_masks(model_or_config)             the model's own masks against the patch's, per layer kind
                                             (setup runs it; raises MaskDisagreement)
    global_token_mean(loss_sum, targets)     a shard's loss sum as its share of the sequence's token mean
    chunked_cross_entropy_sum(hidden, head, targets)   the loss without full-vocabulary logits
    CausalLMLoss(model, loss_chunk_size)     a causal LM returning that chunked loss sum
    options: sp_size (ranks sharing one sequence; world = dp x sp), ring_degree (usp_attn),
             document_split (a layout per packed row: equal work per rank)

  The EasyContext names, thin wrappers over the same context:
    apply_seq_parallel_monkey_patch(mode, model_or_type, **options)
    remove_seq_parallel_monkey_patch()
    prepare_seq_parallel_inputs(mode, input_ids, position_ids, target_ids, rank, world_size, device,
                                attention_mask=None, **options)
    prepare_dataloader(mode, dataloader, accelerator, **options)
    prepare_trainer(mode, trainer, **options)
    gather_seq_parallel_outputs(mode, local_tensor, dim=1, token_index=None, **options)
    generate(mode, model, input_ids, attention_mask=None, **options_and_generate_kwargs)

Package map (rooms; docs/architecture.md draws them):
    core/       the engine, never imports transformers: kernels, backends/, masking, global_mask,
                executor (rounds of units, prefetch, send-back), blocks, ring, p2p, collectives,
                layout, balance, groups, remat
    mixers/     sequence mixers besides attention (convolutions, scans) under both strategies
    modes/      one file per mode over the engine; the registry (SeqParallelMode, get_mode) in
                __init__, the pieces of their cost declarations in costs.py
    hf/         the transformers integration: context (SequenceParallel), api, patch, admission, mask_check,
                architectures, replicas, generation, sharded_cache, trainer, preference, loss
    versions.py supported versions (pyproject's ranges) and the transformers APIs that changed
    old_paths.py  old import paths (easy_context.zigzag_ring_attn, easy_context.programs, ...), until a date

What train.py, the eval scripts and the planner need beyond this (flags, data pipelines,
checkpoints, evaluation tasks, the planner) is the `recipes` package beside this one: it uses
the library as any user does, and the library never imports it.
"""

from easy_context import old_paths
from easy_context.versions import check_supported

old_paths.install()
check_supported("torch", "transformers")  # one clear message, before a missing name fails an import below

from easy_context.hf.api import (  # noqa: E402
    apply_seq_parallel_monkey_patch,
    gather_seq_parallel_outputs,
    generate,
    prepare_dataloader,
    prepare_seq_parallel_inputs,
    prepare_trainer,
    remove_seq_parallel_monkey_patch,
)
from easy_context.hf.architectures import SUPPORTED_MODEL_TYPES  # noqa: E402
from easy_context.hf.context import SequenceParallel, setup, teardown  # noqa: E402
from easy_context.hf.loss import CausalLMLoss, chunked_cross_entropy_sum, global_token_mean  # noqa: E402
from easy_context.hf.mask_check import MaskDisagreement, check_masks  # noqa: E402
from easy_context.modes import BUILT_MODES, MODE_NAMES  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "setup",
    "teardown",
    "SequenceParallel",
    "apply_seq_parallel_monkey_patch",
    "remove_seq_parallel_monkey_patch",
    "prepare_seq_parallel_inputs",
    "prepare_dataloader",
    "prepare_trainer",
    "gather_seq_parallel_outputs",
    "generate",
    "check_masks",
    "MaskDisagreement",
    "global_token_mean",
    "chunked_cross_entropy_sum",
    "CausalLMLoss",
    "SUPPORTED_MODEL_TYPES",
    "MODE_NAMES",
    "BUILT_MODES",
]
