"""easy-context: exact sequence-parallel attention for Hugging Face causal LMs.

Public API (everything a training or evaluation script needs):

    apply_seq_parallel_monkey_patch(mode, model_or_type, **options)   a type ("llama") or a model
    remove_seq_parallel_monkey_patch()
    prepare_seq_parallel_inputs(mode, input_ids, position_ids, target_ids, rank, world_size, device,
                                attention_mask=None, **options)
    prepare_dataloader(mode, dataloader, accelerator, **options)
    prepare_trainer(mode, trainer, **options)   HF Trainer / TRL SFTTrainer in one line
    gather_seq_parallel_outputs(mode, local_tensor, dim=1, token_index=None, **options)
    generate(mode, model, input_ids, attention_mask=None, **options_and_generate_kwargs)
                                    model.generate with the prompt's KV cache sharded over the group
    options: sp_size (ranks sharing one sequence; world = dp x sp), ring_degree (usp_attn),
             document_split (a layout per packed row: equal work per rank)

Architecture (one file or folder per concern):
    architectures.py   the supported model types (one list) and why others are refused
    kernels.py         local attention block -> (out, lse) and its backward; CPU/CUDA backends, masks
    masking.py         documents, padding and windows described once; the kernel calls they imply
    ring.py            the ring core: direct K/V exchange per step, log-sum-exp merging, exact backward
    layout.py          how tokens are split over an SP group (zigzag/contiguous x Ulysses)
    process_groups.py  world = dp x sp, sp = ring x ulysses; groups created once
    modes.py           mode registry; one subpackage per mode holds only what differs:
      zigzag_ring_attn/  the zigzag block plan for the ring core
      ulysses_attn/      sequence<->heads all-to-all, KV-head replication
      usp_attn/          Ulysses x ring split of the SP group
      data_parallel/     no sequence parallelism
    generation.py      generate: sharded prefill, a KV cache sharded over the SP group, HF's decoding
    hf.py              the single transformers integration point (attention + mask registries)
    api.py             the functions above
    trainer.py         prepare_trainer: data by SP group, sharded batches, exact loss for HF Trainer
    replicas.py        a guard: the ranks of an SP group must hold the same weights
    versions.py        supported versions (pyproject's ranges) and the transformers APIs that changed
Around it, for the scripts (train.py, eval_needle.py, eval_ppl.py):
    evaluation.py      score whole sequences over an SP group (no grad, per-token results)
    needle.py          needle / passkey prompts for any tokenizer
    balance.py         document_split: a layout per packed row that balances the ranks' work
    launch.py          start (accelerator, --dist-timeout), fail (exit codes), shut down cleanly
    models.py, data.py, loss.py, tiled_mlp.py, plots.py
"""

from easy_context import old_paths
from easy_context.versions import check_supported

old_paths.install()
check_supported("torch", "transformers")  # one clear message, before a missing name fails an import below

from easy_context.hf.api import (  # noqa: E402
    apply_seq_parallel_monkey_patch,
    gather_seq_parallel_outputs,
    prepare_dataloader,
    prepare_seq_parallel_inputs,
    remove_seq_parallel_monkey_patch,
)
from easy_context.hf.architectures import SUPPORTED_MODEL_TYPES
from easy_context.hf.generation import generate
from easy_context.hf.trainer import prepare_trainer
from easy_context.modes import BUILT_MODES, MODE_NAMES

__version__ = "0.1.0"

__all__ = [
    "apply_seq_parallel_monkey_patch",
    "remove_seq_parallel_monkey_patch",
    "prepare_seq_parallel_inputs",
    "prepare_dataloader",
    "prepare_trainer",
    "gather_seq_parallel_outputs",
    "generate",
    "SUPPORTED_MODEL_TYPES",
    "MODE_NAMES",
    "BUILT_MODES",
]
