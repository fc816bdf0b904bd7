"""What a trainer may bring to prepare_trainer under sequence parallelism (as admission.py says
what a model may bring): a trainer class proven exact, or a subclass of one that leaves its loss
and inputs alone, and arguments whose effect on shards is proven."""

from __future__ import annotations

from easy_context.hf.architectures import check_training_config
from easy_context.hf.preference import check_dpo_trainer, is_dpo_trainer
from easy_context.hf.rl import check_rl_trainer, rl_trainer_base

__all__ = ["SUPPORTED_TRAINERS", "LOSS_AND_INPUT_METHODS", "check_trainer_class", "check_trainer"]

# The trainer classes proven exact (tests/distributed/test_trainer.py, test_dpo_trainer.py,
# test_grpo_trainer.py: GRPO and RLOO), by (module, name): TRL is not imported to recognise
# its classes.
SUPPORTED_TRAINERS = (
    ("trl.trainer.dpo_trainer", "DPOTrainer"),
    ("trl.trainer.grpo_trainer", "GRPOTrainer"),
    ("trl.trainer.rloo_trainer", "RLOOTrainer"),
    ("trl.trainer.sft_trainer", "SFTTrainer"),
    ("transformers.trainer", "Trainer"),
)
# What a subclass of a supported trainer may not override: the loss, the batches that reach
# it, the steps that call it. A subclass that overrides none of them (callbacks, logging,
# samplers, saving) trains as its supported base does.
LOSS_AND_INPUT_METHODS = (
    "compute_loss",
    "_compute_loss",
    "compute_ref_log_probs",
    "training_step",
    "prediction_step",
    "_prepare_inputs",
    "_prepare_input",
    "get_batch_samples",
    # GRPOTrainer's and RLOOTrainer's rollout, scoring and log-prob forwards (hf/rl.py)
    "_generate_and_score_completions",
    "_generate",
    "_generate_single_turn",
    "_calculate_rewards",
    "_get_per_token_logps_and_entropies",
)


def check_trainer_class(cls: type) -> None:
    """Refuse a trainer class that is not one of SUPPORTED_TRAINERS, or a subclass of one that
    overrides one of LOSS_AND_INPUT_METHODS (TRL's KTO, ORPO, CPO, Reward, ...)."""
    supported = [f"{module.split('.')[0]}.{name}" for module, name in SUPPORTED_TRAINERS]
    base = next((c for c in cls.__mro__ if (c.__module__, c.__qualname__) in SUPPORTED_TRAINERS), None)
    if base is None:
        raise ValueError(f"prepare_trainer: {cls.__name__} is not a transformers.Trainer; supported: {supported}")
    changed = [name for name in LOSS_AND_INPUT_METHODS if getattr(cls, name, None) is not getattr(base, name, None)]
    if changed:
        where = "" if cls is base else f" (a subclass of {base.__module__.split('.')[0]}.{base.__qualname__})"
        raise ValueError(
            f"prepare_trainer: {cls.__name__}{where} overrides {changed}, so its loss or inputs are its own and "
            f"nothing proves them exact on shards; supported: {supported} and their subclasses that leave "
            f"{list(LOSS_AND_INPUT_METHODS)} alone"
        )


def check_trainer(trainer) -> None:
    """What prepare_trainer refuses of a trainer under sequence parallelism: its class, then its
    arguments and model."""
    check_trainer_class(type(trainer))
    args = trainer.args
    if getattr(args, "train_sampling_strategy", None) == "batch_rebalance":
        raise ValueError(
            "train_sampling_strategy='batch_rebalance' is not supported by prepare_trainer (its sampler "
            "gives every process its own batch; an SP group needs one); use 'random' or 'group_by_length'"
        )
    if getattr(args, "eval_use_gather_object", False):
        raise ValueError(
            "eval_use_gather_object=True is not supported by prepare_trainer; evaluation results must be tensors"
        )
    check_training_config(trainer.model.config)
    if is_dpo_trainer(type(trainer)):  # its own loss, from its fused LM head's log-probs (hf/preference.py)
        check_dpo_trainer(trainer)
        return
    if rl_trainer_base(type(trainer)) is not None:  # GRPO / RLOO: own loss and rollout (hf/rl.py)
        check_rl_trainer(trainer)
        return
    if getattr(args, "label_smoothing_factor", 0):
        raise ValueError(
            f"label_smoothing_factor={args.label_smoothing_factor} is not supported by prepare_trainer "
            "(the label smoother shifts labels after sharding); set it to 0"
        )
    if getattr(trainer, "compute_loss_func", None) is not None:
        raise ValueError(
            "compute_loss_func is not supported by prepare_trainer: it would get this rank's share of "
            "each row; the model's own loss (labels / shift_labels) is"
        )
    if not getattr(trainer, "model_accepts_loss_kwargs", True):
        raise ValueError(
            f"{type(trainer.model).__name__}.forward takes no **kwargs (num_items_in_batch, shift_labels); "
            "prepare_trainer needs a model whose loss takes them, as transformers' causal LMs do"
        )
