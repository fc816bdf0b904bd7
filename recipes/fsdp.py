"""train.py's --fsdp: PyTorch FSDP2 (`fully_shard`) applied directly, one unit per decoder
layer, then the root (the model with its loss).

Why not accelerate's FSDP plugin: accelerate 1.15 turns FSDP on only for GPU-like distributed
types; on CPU its FSDP config raises no error, `Accelerator()` reports DistributedType.NO (every
process trains alone) and `Accelerator(cpu=True, fsdp_plugin=...)` wraps the model in DDP.
Driving `fully_shard` here runs the same code on CPU (gloo), where the tests prove it exact,
and on GPUs.

The gradient scale: every rank of a sequence-parallel group computes the gradient of its
shard of the sequence's loss, scaled by `global_token_mean` to `loss_sum * world / tokens`
(tokens counted over every rank). FSDP2 reduce-scatters the gradients with an average over
its mesh, which here is every rank, as DDP averages over every rank: the average of those
scaled gradients is sum(loss over all tokens) / tokens, the gradient of the one-process loss.
The SP groups sit inside the one shard group, so nothing else reduces them.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = ["ShardedTrainingState", "flag_errors", "refusal", "full_state_dict", "prepare", "shard_model"]


def flag_errors(settings) -> list[str]:
    """train.py's settings that cannot go with --fsdp (checked after parsing, before anything loads);
    `settings`: every setting by name (recipes.configuration.values_of)."""
    if not settings.fsdp:
        return ["--fsdp-offload needs --fsdp"] if settings.fsdp_offload else []
    errors = []
    if settings.compile:
        errors.append("--fsdp with --compile is not supported (compiling FSDP2's hooks is untested); drop one of them")
    if getattr(settings, "lora_r", None) is not None:
        errors.append(
            "--fsdp with --lora-r is not supported yet (sharding a PeftModel's frozen base is untested); "
            "drop --fsdp (LoRA's weights and optimizer state are small) or --lora-r"
        )
    return errors


def refusal(fsdp_requested: bool, accelerator) -> str | None:
    """Why this launch cannot run --fsdp (or accelerate's own FSDP), or None."""
    # On CPU accelerate ignores its FSDP config (the run would be DDP): refuse it by the launcher's variable too
    if accelerator.distributed_type.name == "FSDP" or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return (
            "accelerate's FSDP config is not supported by train.py (accelerate cannot run FSDP on CPU, so it is "
            "untested here); launch without it (torchrun, or accelerate launch with a plain multi-GPU config) "
            "and pass --fsdp"
        )
    if not fsdp_requested:
        return None
    if accelerator.state.deepspeed_plugin is not None:
        return "--fsdp with DeepSpeed: both shard the model; drop --fsdp, or launch without the DeepSpeed config"
    if accelerator.num_processes < 2:
        return (
            f"--fsdp shards over the processes, and this run has {accelerator.num_processes}; "
            "launch 2 or more (torchrun --nproc_per_node N train.py --fsdp ...)"
        )
    if accelerator.mixed_precision == "fp16":
        return (
            "--fsdp with --mixed_precision fp16 is not supported (fp16 needs a gradient scaler for sharded "
            "gradients); use bf16 or no"
        )
    return None


def shard_model(trainable: torch.nn.Module, decoder_layers, device: torch.device, mixed_precision: str, offload: bool):
    """Shard `trainable` in place over every rank: each decoder layer its own FSDP unit (its
    weights gathered just for its forward and backward), then the root (embeddings, final
    norm, output layer). Returns `trainable`. Call it before the optimizer is built: the
    parameters become DTensors."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    options = {"mesh": mesh}
    if mixed_precision == "bf16":
        # compute in bf16, reduce gradients and keep the sharded weights in fp32
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if offload:
        # pinned host memory needs an accelerator; on a CPU device the weights are on the host already
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type != "cpu")
    for layer in decoder_layers:
        fully_shard(layer, **options)
    fully_shard(trainable, **options)
    return trainable


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole (unsharded) state dict, on the host of rank 0 (the other ranks get an empty
    dict); a collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def prepare(accelerator, model: torch.nn.Module, optimizer, scheduler):
    """accelerate's wrappers for the optimizer (it steps once per --gradient-accumulate-every) and
    the schedule, with the optimizer left unregistered: accelerate's save_state would write rank
    0's shard of its state as if it were the whole. ShardedTrainingState checkpoints the model's
    and optimizer's shards instead. Returns (optimizer, scheduler)."""
    from accelerate.optimizer import AcceleratedOptimizer

    ShardedTrainingState(accelerator, model, optimizer)
    return AcceleratedOptimizer(optimizer, device_placement=False), accelerator.prepare(scheduler)


class ShardedTrainingState:
    """The model's and the optimizer's shards in train.py's checkpoints (accelerate's save_state
    folder keeps the schedule and the random states): every rank writes its own shards with
    torch.distributed.checkpoint into the folder's fsdp/. Registered with accelerate, which calls
    state_dict() on every rank as it saves, and load_state_dict() on every rank after it loaded
    the rest; its pre-hooks say which folder."""

    FOLDER = "fsdp"

    def __init__(self, accelerator, model: torch.nn.Module, optimizer):
        self.model, self.optimizer, self.folder = model, optimizer, None
        accelerator.register_save_state_pre_hook(lambda models, weights, folder: self._set_folder(folder))
        accelerator.register_load_state_pre_hook(lambda models, folder: self._set_folder(folder))
        accelerator.register_for_checkpointing(self)

    def _set_folder(self, folder) -> None:
        self.folder = Path(folder)

    def _shards(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer}

    def state_dict(self) -> dict:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._shards(), checkpoint_id=self.folder / self.FOLDER)
        return {"folder": self.FOLDER}

    def load_state_dict(self, saved: dict) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        shards = self._shards()
        dcp.load(shards, checkpoint_id=self.folder / saved["folder"])
        set_state_dict(
            self.model, self.optimizer, model_state_dict=shards["model"], optim_state_dict=shards["optimizer"]
        )
