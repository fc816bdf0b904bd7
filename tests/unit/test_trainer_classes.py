"""prepare_trainer accepts only the trainers proven exact (transformers.Trainer, TRL's SFTTrainer,
DPOTrainer, GRPOTrainer and RLOOTrainer) and their subclasses that leave the loss and the inputs
alone; any other trainer (TRL's KTO, Reward, ... or a subclass with its own compute_loss) is
refused, naming the class and what is supported (issue 60: the class was not checked, and a
trainer computing its own loss from its own inputs got the SFT sharding in front of it)."""

import pytest
from tiny_models import tiny_model

import easy_context as ec


def _trainer(cls, tmp_path):
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    return cls(model=tiny_model("llama"), args=args)


def test_trainers_that_bring_their_own_loss_or_inputs_are_refused_by_name(tmp_path):
    from transformers import Trainer, TrainerCallback

    class OwnLossTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    class LoggingTrainer(Trainer):  # callbacks and logging only: trains as Trainer does
        def log(self, logs, start_time=None):
            super().log(logs, start_time)

    try:
        with pytest.raises(ValueError) as caught:
            ec.prepare_trainer("zigzag_ring_attn", _trainer(OwnLossTrainer, tmp_path))
        message = str(caught.value)
        assert "OwnLossTrainer (a subclass of transformers.Trainer) overrides ['compute_loss']" in message
        assert (
            "'trl.DPOTrainer', 'trl.GRPOTrainer', 'trl.RLOOTrainer', 'trl.SFTTrainer', 'transformers.Trainer'"
            in message
        )
        trainer = _trainer(LoggingTrainer, tmp_path)
        trainer.add_callback(TrainerCallback())
        assert ec.prepare_trainer("zigzag_ring_attn", trainer) is trainer
    finally:
        ec.remove_seq_parallel_monkey_patch()


def test_trl_trainers_not_proven_are_refused_and_the_proven_ones_accepted():
    """By class, without building them (GRPO and RLOO need a reward and generation). TRL is a test
    dependency of the pinned stage; the floors' fast tier installs only the library's floors."""
    trl = pytest.importorskip("trl", reason="TRL is not installed (the floor versions' stage)")
    from transformers import Trainer

    from easy_context.hf.trainer_admission import check_trainer_class

    for name in ("KTOTrainer", "RewardTrainer"):
        with pytest.raises(ValueError, match=f"prepare_trainer: {name} .*overrides .*compute_loss"):
            check_trainer_class(getattr(trl, name))
    own_rewards = type("OwnRewards", (trl.GRPOTrainer,), {"_calculate_rewards": lambda self, *a: None})
    overrides = r"OwnRewards \(a subclass of trl.GRPOTrainer\) overrides \['_calculate_rewards'\]"
    with pytest.raises(ValueError, match=overrides):
        check_trainer_class(own_rewards)
    own_rollout = type("OwnRollout", (trl.RLOOTrainer,), {"_generate_single_turn": lambda self, *a: None})
    overrides = r"OwnRollout \(a subclass of trl.RLOOTrainer\) overrides \['_generate_single_turn'\]"
    with pytest.raises(ValueError, match=overrides):
        check_trainer_class(own_rollout)
    from trl.experimental.gkd import GKDTrainer  # an SFTTrainer with its own loss

    with pytest.raises(ValueError, match=r"GKDTrainer \(a subclass of trl.SFTTrainer\) overrides"):
        check_trainer_class(GKDTrainer)
    for cls in (
        Trainer,
        trl.SFTTrainer,
        trl.DPOTrainer,
        trl.GRPOTrainer,
        trl.RLOOTrainer,
        type("Tagged", (trl.DPOTrainer,), {"_tag_names": ["x"]}),
    ):
        check_trainer_class(cls)
    with pytest.raises(ValueError, match="prepare_trainer: object is not a transformers.Trainer"):
        check_trainer_class(object)


def test_rl_rollouts_that_cannot_be_shared_over_a_group_are_refused():
    """A vLLM rollout (server or colocate) generates per process: refused for GRPO and RLOO alike,
    naming the trainer and what works."""
    trl = pytest.importorskip("trl", reason="TRL is not installed (the floor versions' stage)")
    from types import SimpleNamespace

    from easy_context.hf.rl import check_rl_trainer

    def unbuilt(cls, use_vllm=False, **attributes):  # the attributes TRL's __init__ sets, no model
        trainer = object.__new__(cls)
        trainer.__dict__.update(args=SimpleNamespace(use_vllm=use_vllm), use_vllm=use_vllm, **attributes)
        return trainer

    for cls in (trl.GRPOTrainer, trl.RLOOTrainer):
        name = cls.__name__
        with pytest.raises(ValueError, match=rf"{name} with use_vllm=True .*Use use_vllm=False: TRL's transformers"):
            check_rl_trainer(unbuilt(cls, use_vllm=True))
        with pytest.raises(ValueError, match=f"{name} with use_transformers_continuous_batching=True"):
            check_rl_trainer(unbuilt(cls, use_transformers_continuous_batching=True))
        check_rl_trainer(unbuilt(cls))
    with pytest.raises(ValueError, match="GRPOTrainer with tools / environment_factory"):
        check_rl_trainer(unbuilt(trl.GRPOTrainer, tools=[print]))


# What decides a trainer's loss and the batches that reach it, written out here rather than read
# from trainer_admission.LOSS_AND_INPUT_METHODS: a name dropped from that list would stop
# refusing the subclasses that override it, and a test iterating the list would not notice.
OWN_LOSS_OR_INPUTS = (
    "compute_loss",
    "_compute_loss",
    "compute_ref_log_probs",
    "training_step",
    "prediction_step",
    "_prepare_inputs",
    "_prepare_input",
    "get_batch_samples",
    "_generate_and_score_completions",
    "_generate",
    "_generate_single_turn",
    "_calculate_rewards",
    "_get_per_token_logps_and_entropies",
)


@pytest.mark.parametrize("method", OWN_LOSS_OR_INPUTS)
def test_a_subclass_overriding_any_loss_or_input_method_is_refused(method):
    """Each name, overridden by a subclass of transformers.Trainer (a name the base lacks, as
    TRL's rollout methods, counts as well: the subclass brings it), is refused naming it."""
    from transformers import Trainer

    from easy_context.hf.trainer_admission import check_trainer_class

    subclass = type("Own", (Trainer,), {method: lambda self, *args, **kwargs: None})
    with pytest.raises(ValueError, match=rf"Own \(a subclass of transformers.Trainer\) overrides \['{method}'\]"):
        check_trainer_class(subclass)
