"""The EasyContext functions, so existing scripts keep working: each names its mode and finds
the sequence-parallel context of the call (hf/context.py), which does the work.

Options shared by every function (keyword-only):
  sp_size      ranks that share one sequence (default: the whole world); world = dp x sp
  ring_degree  the ring part of an SP group under usp_attn (default 1: pure Ulysses)
  document_split  modes whose SeqParallelMode.document_split is True, with packed rows: each
               row gets a layout of its own so every rank does the same work; True cuts every
               document over the ring the way the mode cuts one causal row, "workload" keeps
               documents whole on one rank each and cuts only the longest (less traffic); the
               model is then called with seq_parallel_index=local["local_token_index"]
Functions called after apply_seq_parallel_monkey_patch default to the options it was given.
"""

from __future__ import annotations

import torch

from easy_context.hf.context import OPTIONS, context_for, setup, teardown

# Release 0.1's easy_context.generation also offered these; its old path now leads here (old_paths.py).
from easy_context.hf.sharded_cache import ShardedKVCache, kv_bytes  # noqa: F401

__all__ = [
    "apply_seq_parallel_monkey_patch",
    "remove_seq_parallel_monkey_patch",
    "prepare_seq_parallel_inputs",
    "prepare_dataloader",
    "gather_seq_parallel_outputs",
    "prepare_trainer",
    "generate",
]


def apply_seq_parallel_monkey_patch(mode: str, model_or_type, **options) -> None:
    """Make models of a type run `mode`'s sequence-parallel attention (easy_context.setup,
    without the context it returns).

    model_or_type: a model type ("llama", see SUPPORTED_MODEL_TYPES) or a model instance (or
    its config), whose decoder's type is used (a multimodal wrapper's text config included).
    Affects models whose attn_implementation is sdpa, eager or flash_attention_2, created
    before or after this call. Process groups are created here when torch.distributed is
    initialised, else at the first forward. Calling it again with the same mode and options
    adds model types; with others it switches every patched type. Undo with
    remove_seq_parallel_monkey_patch().
    """
    setup(mode, model_or_type, **options)


def remove_seq_parallel_monkey_patch() -> None:
    """Restore transformers' own attention and mask functions."""
    teardown()


def prepare_seq_parallel_inputs(
    mode: str, input_ids, position_ids, target_ids, rank: int, world_size: int, device, attention_mask=None, **options
) -> dict:
    """Keep this rank's share of a batch of full sequences.

    rank/world_size are global; the rank's place in its SP group follows from sp_size.
    input_ids (B, S); position_ids (B, S), (1, S) or None (0..S-1): packed documents restart
    their positions (HF's convention: a document starts where position_ids[i] !=
    position_ids[i-1] + 1); target_ids (B, S) are next-token targets already aligned with
    input_ids (shift before sharding; -100 is ignored by losses) or None; attention_mask
    (B, S) 0/1 marks padding (zeros at the start and/or end of a row) or None.
    Returns local_input_ids, local_position_ids (the positions of the local tokens, so RoPE
    is right), local_target_ids and local_attention_mask, on `device`. Pass
    attention_mask=local["local_attention_mask"] and position_ids=local["local_position_ids"]
    to the model. data_parallel returns the inputs unchanged (moved to `device`).

    document_split (True or "workload"): each row gets a layout of its own; the result also has
    local_token_index (B, S_local), each local token's position in its row, for the model
    (seq_parallel_index=) and gather_seq_parallel_outputs (token_index=).
    """
    context = context_for("prepare_seq_parallel_inputs", mode, options)
    return context.shard(
        input_ids, position_ids, target_ids, attention_mask, rank=rank, world_size=world_size, device=device
    )


def prepare_dataloader(mode: str, dataloader, accelerator, **options):
    """data_parallel: the accelerator shards batches over all ranks. Sequence-parallel modes:
    batches are split over the data-parallel groups only (every rank of an SP group reads
    the same full sequences and keeps its share through prepare_seq_parallel_inputs); a
    shuffling sampler without a generator gets one seeded alike on every rank."""
    return context_for("prepare_dataloader", mode, options).dataloader(dataloader, accelerator)


def gather_seq_parallel_outputs(
    mode: str, local: torch.Tensor, dim: int = 1, token_index=None, **options
) -> torch.Tensor:
    """All-gather the SP group's local tensors (logits, predictions) back into sequence order.

    Not differentiable; every rank of the SP group gets its group's full tensor. Under
    document_split pass token_index=local["local_token_index"] (dim must be 1).
    """
    return context_for("gather_seq_parallel_outputs", mode, options).gather(local, dim=dim, token_index=token_index)


def prepare_trainer(mode: str, trainer, balance_work=False, **options):
    """Make a transformers.Trainer, or TRL's SFTTrainer, DPOTrainer, GRPOTrainer or RLOOTrainer,
    train `mode`.

    Other trainer classes that override the loss or the inputs (TRL's KTO, ORPO, ...)
    are refused by name (hf/trainer_admission.py: SUPPORTED_TRAINERS, LOSS_AND_INPUT_METHODS).

    Call it after creating the trainer and before trainer.train(); every rank calls it.
    Applies the monkey patch for the trainer's model type (if not applied yet) with
    `options` (sp_size, ring_degree, document_split) and returns the same trainer.
    balance_work (True, or one number per train row): the data-parallel groups of each step
    get rows of equal attention work instead of a random deal (SequenceParallel.trainer).
    """
    # Options not given default to an active patch's for this mode (and may not contradict them).
    return context_for("prepare_trainer", mode, options).trainer(trainer, balance_work)


def generate(mode: str, model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
    """`model.generate(input_ids, attention_mask=..., **kwargs)` with the prompt prefilled in
    `mode`'s layout and the KV cache sharded over the SP group; returns what model.generate
    returns, the same on every rank of the group.

    Patches the model's type for `mode` when it is not patched yet (as prepare_trainer does).
    Every rank of an SP group passes the same input_ids (B, S) and attention_mask (B, S)
    (0 = padding; left padding, as for model.generate) and the same generate kwargs; sampling
    needs the same seed on every rank (torch.manual_seed). Options sp_size, ring_degree,
    document_split as everywhere else; other keywords go to model.generate (max_new_tokens,
    do_sample, num_beams, ...).
    """
    options = {name: kwargs.pop(name) for name in OPTIONS if name in kwargs}
    return context_for("generate", mode, options).generate(model, input_ids, attention_mask, **kwargs)
