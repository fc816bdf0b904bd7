"""TRL's GRPOTrainer and RLOOTrainer under sequence parallelism (prepare_trainer, hf/trainer.py).

Both trainers (TRL 1.16) share the structure changed here: `_generate_and_score_completions`
(rollout through `_generate` / `_generate_single_turn`, `_calculate_rewards`, advantages, metrics,
with the module-level gather / gather_object of their own module and the accelerator's
gather / reduce / process_index), `_compute_loss`, and the same
`_get_per_token_logps_and_entropies` through the fused LM head. RLOO differs in its loss (a
per-sequence clipped ratio of the summed log-probs, `.mean()` over the local rows), its
leave-one-out advantages and a KL penalty folded into the gathered rewards; all of it is computed
from the same (sharded, summed) per-token log-probs and the same gathered rewards, so it runs as is.

An SP group of P ranks is one process of TRL's: it reads one batch of prompts (the
trainer's dataloaders are prepared for the data-parallel groups, as for SFT), and every rank of
the group holds the same completions, rewards and advantages. Three things change:

  rollout    TRL's own transformers path (`unwrapped_model.generate`) is routed to
             easy_context's sharded generation (hf/generation.py: the prompts prefilled in the
             mode's layout, the KV cache sharded over the group, decoding and sampling
             transformers' own). Sampling draws the same tokens on every rank of a group because
             each generation starts from SP rank 0's random state (CPU and accelerator), sent
             over the group; the data-parallel groups keep their own states and prompts, so
             they still differ. Unpatched, `model.generate` would run the sharded attention on
             whole rows, as if the rows were this rank's shard.
  forwards   every log-prob forward after generation (the policy's, with its entropy; the old
             policy's; the reference model's or the reference adapter's) goes through the
             fused LM head TRL patched onto the model, which hf/preference.py's wrapper shards
             (the rows, labels -100 outside the completions, sharded as the SFT path shards a
             batch; this rank's per-token log-probs in chunks, never the (S x vocab) logits;
             then put into whole (B, S) rows and summed over the group, differentiably). So
             TRL's loss code (every loss type, clipping, the KL term, entropy masks) runs as is.
  counting   while TRL scores completions and computes the loss, its collectives see one
             process per SP group: the accelerator's gather / reduce / process_index /
             num_processes and the module's gather / gather_object (rewards, num_items_in_batch,
             the logged metrics and completions) keep SP rank 0's value of each group, so
             nothing is counted P times and advantages are normalised as TRL does per process.

The gradients: every rank of a group computes the same loss; the all-reduce's backward sums the
group's shares, and DDP's average over dp x P ranks gives the mean over the data-parallel groups,
which is what TRL's DDP over dp processes computes.

vLLM (use_vllm=True, server or colocate), continuous batching, rollout_func, tools and
environments, images, the MoE auxiliary loss and a reward model of the policy's (patched) type
are refused by name, for either trainer (check_rl_trainer).
"""

from __future__ import annotations

import contextlib
import functools
import sys

import torch
import torch.distributed as dist

from easy_context.hf.preference import wrap_fused_forward

__all__ = ["RL_TRAINERS", "RLSeqParallelMixin", "rl_trainer_base", "check_rl_trainer", "prepare_rl"]

# The RL trainers proven exact (tests/distributed/test_grpo_trainer.py), by (module, name).
RL_TRAINERS = (("trl.trainer.grpo_trainer", "GRPOTrainer"), ("trl.trainer.rloo_trainer", "RLOOTrainer"))

VLLM_REFUSAL = (
    "prepare_trainer: {name} with use_vllm=True (vLLM server or colocate) is not supported: every rank of "
    "a sequence-parallel group must score the same completions, and the vLLM paths generate per process. "
    "Use use_vllm=False: TRL's transformers generation, run by prepare_trainer with the prompts prefilled "
    "sharded and the KV cache sharded over the group (easy_context.generate), sampling identical on every "
    "rank of a group. (A vLLM rollout would need one request per SP group, its completions and sampling "
    "log-probs broadcast over the group, and weights synced from one rank per group.)"
)


def rl_trainer_base(cls: type) -> type | None:
    """The class of RL_TRAINERS that `cls` is or derives from (None for any other trainer)."""
    return next((c for c in cls.__mro__ if (c.__module__, c.__qualname__) in RL_TRAINERS), None)


def check_rl_trainer(trainer) -> None:
    """What the sharded rollout and forwards cannot serve, refused by name."""
    args, name = trainer.args, (rl_trainer_base(type(trainer)) or type(trainer)).__name__
    if getattr(trainer, "use_vllm", False) or getattr(args, "use_vllm", False):
        raise ValueError(VLLM_REFUSAL.format(name=name))
    refused = {
        "use_transformers_continuous_batching=True": getattr(trainer, "use_transformers_continuous_batching", False),
        "rollout_func (its completions would have to be the same on every rank of an SP group)": (
            getattr(trainer, "rollout_func", None) is not None
        ),
        "tools / environment_factory (the tool loop is not proven on shards)": bool(getattr(trainer, "tools", None))
        or getattr(trainer, "environment_factories", None) is not None,
        "a vision-language model (pixel values and image tokens are not sharded)": getattr(trainer, "_is_vlm", False),
        "the MoE router auxiliary loss (router_aux_loss_coef; set it to 0.0)": getattr(
            trainer, "aux_loss_enabled", False
        ),
    }
    policy_type = getattr(getattr(getattr(trainer, "model", None), "config", None), "model_type", None)
    refused["a reward model of the policy's type (the patch would run it sharded on whole rows)"] = policy_type and any(
        getattr(getattr(f, "config", None), "model_type", None) == policy_type
        for f in getattr(trainer, "reward_funcs", ())
    )
    for what, present in refused.items():
        if present:
            raise ValueError(
                f"prepare_trainer: {name} with {what} is not supported; what works: text prompts, reward "
                "functions (or reward models of another model type), use_vllm=False, TRL's loss types, beta (KL), "
                "num_iterations"
            )


def prepare_rl(trainer, batches) -> None:
    """Shard the fused forwards, route generation, rescale the generation batch to the groups."""
    model = trainer.model
    base = model.get_base_model() if hasattr(model, "get_base_model") and hasattr(model, "peft_config") else model
    wrap_fused_forward(base, batches)  # where TRL put its fused head
    if trainer.ref_model is not None:
        wrap_fused_forward(trainer.accelerator.unwrap_model(trainer.ref_model), batches)
    _route_generation(trainer.accelerator.unwrap_model(model), batches.context)
    # TRL sized the generation batch for world_size processes; there are dp_size of them.
    args, dp = trainer.args, batches.topology.dp_size
    args.generation_batch_size = args.per_device_train_batch_size * dp * args.steps_per_generation
    if args.generation_batch_size % trainer.num_generations:
        raise ValueError(
            f"prepare_trainer: per_device_train_batch_size x data-parallel groups ({dp}) x steps_per_generation "
            f"= {args.generation_batch_size} is not a multiple of num_generations={trainer.num_generations}"
        )
    trainer._rl_collectives = _OnePerGroup(trainer.accelerator, batches, rl_trainer_base(type(trainer)).__module__)


def _route_generation(model, context) -> None:
    """model.generate -> easy_context's sharded generation (which calls model.generate itself)."""
    original = model.generate
    if getattr(original, "_easy_context_sharded", False):
        return
    inside = []

    @functools.wraps(original)
    def generate(input_ids=None, attention_mask=None, **kwargs):
        if inside:  # generate_in's own call: transformers' decoding with the sharded cache
            return original(input_ids, attention_mask=attention_mask, **kwargs)
        # TRL generates with the model in training mode (its dropout disabled); the sharded
        # generation runs in eval mode, the same forward without dropout.
        inside.append(model.training)
        model.eval()
        try:
            return context.generate(model, input_ids, attention_mask, **kwargs)
        finally:
            model.train(inside.pop())

    generate._easy_context_sharded = True
    model.generate = generate


class _OnePerGroup:
    """TRL's collectives with one process per SP group (SP rank 0's values)."""

    def __init__(self, accelerator, batches, module: str):
        self.accelerator, self.batches, self.module = accelerator, batches, module  # the trainer's TRL module
        topology = batches.topology
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.dp_rank, self.sp_rank = topology.dp_rank(self.rank), topology.sp_rank(self.rank)
        self.dp_size, self.sp_size = topology.dp_size, topology.sp_size

    def gather(self, tensor):
        return self.batches.gather_sp_rank_0(tensor)

    def reduce(self, tensor, reduction="sum", scale=1.0):
        total = self.gather(tensor[None]).sum(0) * scale
        return total / self.dp_size if reduction == "mean" else total

    def gather_object(self, values: list) -> list:
        if not dist.is_initialized():
            return list(values)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, list(values))
        return [item for rank, part in enumerate(every) if rank % self.sp_size == 0 for item in part]

    def share_random_state(self) -> None:
        """Every rank of the SP group takes SP rank 0's random state (CPU and accelerator)."""
        group = self.batches.sp_group
        if group is None:
            return
        device = self.accelerator.device
        states = [torch.get_rng_state()]
        if device.type == "cuda":
            states.append(torch.cuda.get_rng_state(device))
        for i, state in enumerate(states):
            moved = state.to(device) if dist.get_backend(group) == "nccl" else state.clone()
            dist.broadcast(moved, group=group, group_src=0)
            states[i] = moved.cpu()
        torch.set_rng_state(states[0])
        if device.type == "cuda":
            torch.cuda.set_rng_state(states[1], device)

    def _view(self, cls: type) -> type:
        """The accelerator's class with its collectives and process counts over the groups."""
        if getattr(self, "_view_of", (None,))[0] is not cls:
            one = self
            self._view_of = (
                cls,
                type(
                    f"OnePerSeqParallelGroup{cls.__name__}",
                    (cls,),
                    {
                        "gather": lambda _, x: one.gather(x),
                        "gather_for_metrics": lambda _, x, use_gather_object=False: one.gather(x),
                        "reduce": lambda _, x, reduction="sum", scale=1.0: one.reduce(x, reduction, scale),
                        "process_index": property(lambda _: one.dp_rank),
                        "num_processes": property(lambda _: one.dp_size),
                    },
                ),
            )
        return self._view_of[1]

    @contextlib.contextmanager
    def installed(self):
        """While TRL scores completions or computes its loss: its collectives over the groups."""
        trl_module = sys.modules[self.module]  # its module-level gather / gather_object

        accelerator, saved = self.accelerator, (trl_module.gather, trl_module.gather_object)
        cls = type(accelerator)
        trl_module.gather, trl_module.gather_object = self.gather, self.gather_object
        accelerator.__class__ = self._view(cls)
        try:
            yield
        finally:
            accelerator.__class__ = cls
            trl_module.gather, trl_module.gather_object = saved


class RLSeqParallelMixin:
    """Put in front of GRPOTrainer's or RLOOTrainer's class by prepare_trainer: its generation, scoring and loss
    run as they are, the forwards sharded and the collectives one per SP group."""

    def _generate_and_score_completions(self, inputs):
        collectives = self._rl_collectives
        collectives.share_random_state()
        with collectives.installed():
            output = super()._generate_and_score_completions(inputs)
        collectives.share_random_state()  # TRL then shuffles the rows with the process's random state
        return output

    def _compute_loss(self, model, inputs):
        with self._rl_collectives.installed():
            return super()._compute_loss(model, inputs)
