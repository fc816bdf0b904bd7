"""TRL's DPOTrainer under sequence parallelism (prepare_trainer, hf/trainer.py).

DPOTrainer computes everything from the per-token log-probabilities its fused LM head
returns (trl.trainer.utils.add_fused_lm_head: `model(..., labels=..., fused_lm_head=True)`,
run in chunks, never the (S x vocab) logits): the policy's, the reference model's (or those it
precomputed), summed per sequence, then the loss type's formula, ld_alpha's split of each
completion, WPO's weights and its metrics. So its loss code stays TRL's own, and only those
forwards change: the forward TRL patched onto each model is wrapped here, and on a call with
the fused head

  1. the whole rows TRL built (chosen and rejected concatenated on the batch dimension,
     right-padded; the labels -100 outside the completions) have their labels shifted and are
     sharded as the SFT path shards a batch (hf/trainer.py's _Batches.shard: the same check
     that the SP group holds the same rows, the internal padding the layout needs);
  2. TRL's fused head scores this rank's shard from the pre-shifted labels (its shift_labels
     path, meant for context parallelism): this rank's per-token log-probs, in chunks;
  3. each per-token output is put at its tokens' positions of a zero (B, S) row and the rows are
     summed over the SP group (one all-reduce of them all; in the backward, one of the gradients
     that exist): every rank then holds the whole rows' values,
     and TRL's `per_token_logps.sum(dim=1)` is each sequence's sum over the shards.

Why an all-reduce of per-token rows rather than of the B per-sequence sums: TRL needs the
tokens' places (ld_alpha splits each completion at the shorter one's length, the "sft" loss
type and WPO average over tokens, the metrics count them), and B x S floats per output cost
nothing next to a forward. The backward of the all-reduce sums the ranks' gradients (each
the same, as every rank computes the same loss), P x this rank's share; DDP then averages
over the P ranks, which gives the one-process gradient.

GRPOTrainer scores its completions through the same fused head (hf/rl.py reuses
wrap_fused_forward for the policy, old-policy and reference forwards).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

__all__ = ["DPOSeqParallelMixin", "prepare_dpo", "is_dpo_trainer", "wrap_fused_forward", "sum_each_over_group"]

# FusedCausalLMOutput's per-token fields, all-reduced to whole rows; loss is recomputed on them.
PER_TOKEN_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")


def is_dpo_trainer(cls: type) -> bool:
    return any((c.__module__, c.__qualname__) == ("trl.trainer.dpo_trainer", "DPOTrainer") for c in cls.__mro__)


class _SumEachOverGroup(torch.autograd.Function):
    """all_reduce(SUM) over `group` of several same-shaped tensors in one collective. The backward
    all-reduces, again at once, only the gradients that exist: an output that no loss term used
    gets None, not zeros, so TRL's fused head skips that output's backward (the entropy's, an
    extra pass over every (token x vocab) chunk, unless the entropy bonus is on)."""

    @staticmethod
    def forward(ctx, group, *xs):
        ctx.group = group
        ctx.set_materialize_grads(False)
        stacked = torch.stack([x.detach() for x in xs])
        dist.all_reduce(stacked, group=group)
        return tuple(x.clone() for x in stacked)  # separate storages: TRL may change a row in place

    @staticmethod
    def backward(ctx, *grads):
        present = [i for i, grad in enumerate(grads) if grad is not None]
        summed = [None] * len(grads)
        if present:  # the same outputs on every rank: they all compute the same loss
            stacked = torch.stack([grads[i] for i in present])
            dist.all_reduce(stacked, group=ctx.group)
            for i, grad in zip(present, stacked):
                summed[i] = grad
        return (None, *summed)


def sum_each_over_group(xs: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Differentiable sums of each of `xs` over the ranks of `group` (xs themselves without a group)."""
    return list(xs) if group is None else list(_SumEachOverGroup.apply(group, *xs))


def check_dpo_trainer(trainer) -> None:
    """What the sharded forward cannot serve, refused by name."""
    if getattr(trainer, "_is_vision_dataset", False):
        raise ValueError(
            "prepare_trainer: DPOTrainer with images is not supported (pixel values and image tokens are not sharded)"
        )
    if getattr(trainer, "aux_loss_enabled", False):
        raise ValueError(
            "prepare_trainer: DPOTrainer's MoE router auxiliary loss (router_aux_loss_coef) is not supported: "
            "each rank would compute it over its own shard; set router_aux_loss_coef=0.0"
        )
    if getattr(trainer, "padding_free", False):
        raise ValueError("prepare_trainer: DPOTrainer with padding_free=True is not supported; set it to False")


def prepare_dpo(trainer, batches) -> None:
    """Wrap the fused forwards TRL patched onto the policy and the reference model (once)."""
    model = trainer.model
    if hasattr(model, "get_base_model") and hasattr(model, "peft_config"):
        model = model.get_base_model()  # where TRL put its fused head
    wrap_fused_forward(model, batches)
    if trainer.ref_model is not None:
        wrap_fused_forward(trainer.accelerator.unwrap_model(trainer.ref_model), batches)
    # TRL divides its token count (gathered over every process) by the ranks that read the same
    # batch, which it knows for tensor parallelism; an SP group's ranks read the same batch too.
    trainer._tp_size = getattr(trainer, "_tp_size", 1) * batches.topology.sp_size


def wrap_fused_forward(model, batches) -> None:
    fused = model.forward
    if getattr(fused, "_easy_context_sharded", False):
        return
    if "forward" not in vars(model):
        raise ValueError(
            f"prepare_trainer: {type(model).__name__} has no fused LM head from TRL's trainer "
            "(trl.trainer.utils.add_fused_lm_head); build the trainer with TRL >= 1.16"
        )

    @functools.wraps(fused)
    def sharded_forward(*args, fused_lm_head=False, **kwargs):
        if not fused_lm_head:  # generation, or a forward TRL makes for logits: not DPO's loss
            return fused(*args, **kwargs)
        return _sharded_fused_forward(fused, batches, args, kwargs)

    sharded_forward._easy_context_sharded = True
    model.forward = sharded_forward


def _sharded_fused_forward(fused, batches, args, kwargs):
    if args:
        raise ValueError("prepare_trainer: TRL's fused forward was called with positional arguments")
    labels = kwargs.pop("labels", None)
    if labels is None or kwargs.get("shift_labels") is not None:
        raise ValueError("prepare_trainer: TRL's fused forward needs whole-row labels (no shift_labels)")
    if kwargs.get("output_router_logits"):
        raise ValueError("prepare_trainer: the MoE router auxiliary loss is not supported under TRL's DPO / GRPO")
    rows = {name: kwargs.pop(name) for name in ("input_ids", "attention_mask", "position_ids") if name in kwargs}
    if kwargs.get("inputs_embeds") is not None:
        raise ValueError("prepare_trainer: TRL's fused forward needs input_ids (inputs_embeds are not sharded)")
    local, length = batches.shard({**rows, "labels": labels})
    targets = local.pop("labels")
    del local["shift_labels"]
    outputs = fused(**local, **kwargs, shift_labels=targets, fused_lm_head=True)
    whole = _whole_rows(outputs, local, batches, labels.shape[0], length)
    # TRL reads [:, -(S - 1):] of outputs shaped (B, S - 1); the last position has no target.
    for name, value in whole.items():
        setattr(outputs, name, value[:, : length - 1])
    mask = outputs.label_mask
    outputs.loss = -outputs.log_probs.sum() / mask.sum().clamp(min=1)
    return outputs


def _whole_rows(outputs, local: dict, batches, batch: int, length: int) -> dict:
    """Each per-token output of this rank's shard, put at its tokens' places in (B, padded S)
    rows and summed over the SP group (one differentiable all-reduce of them all)."""
    names = [name for name in PER_TOKEN_OUTPUTS if getattr(outputs, name, None) is not None]
    values = [getattr(outputs, name) for name in names]
    padded = length + batches.layout.padding(length)
    index = local.get("seq_parallel_index")
    if index is None:
        sp_rank = batches.topology.sp_rank(dist.get_rank() if dist.is_initialized() else 0)
        index = batches.layout.local_indices(padded, sp_rank)
    index = index.to(values[0].device).expand(batch, -1)
    rows = []
    for value in values:  # each its own graph: an output no loss term uses gets no gradient
        value = value.to(torch.float32)
        rows.append(value.new_zeros(batch, padded).scatter(1, index, value))
    rows = sum_each_over_group(rows, batches.sp_group)
    return {name: row.to(value.dtype) for name, row, value in zip(names, rows, values)}


class DPOSeqParallelMixin:
    """Put in front of DPOTrainer's class by prepare_trainer: its compute_loss runs as is (the
    forwards it makes are sharded); what would get whole rows through the patch is refused."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError(
                "prepare_trainer: DPOTrainer's return_outputs / compute_metrics (logits recomputed by a whole-row "
                "forward) are not supported; evaluate() without compute_metrics gives the loss and metrics"
            )
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        if self.precompute_ref_logps and eval_dataset is not None and not isinstance(eval_dataset, str):
            raise ValueError(
                "prepare_trainer: evaluate(eval_dataset=...) with precompute_ref_log_probs=True is not supported "
                "(its reference log-probs would be computed under the patch by every rank of a group); pass the "
                "dataset as eval_dataset when building the trainer"
            )
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
