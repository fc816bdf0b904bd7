"""The ranks of one sequence-parallel group must hold the same weights: a guard.

Every rank of an SP group computes the gradient of its own shard of the sequence; only
once they are averaged (DDP, DeepSpeed) is it the gradient of the whole sequence. A script
that never synchronises them (for example accelerate's Accelerator with only a gloo process
group under torchrun on CPU: DistributedType.NO, no DDP) does not crash. Every rank steps
on its own shard's gradient and the replicas drift apart, so the results are silently wrong.

The check: at a patched forward, each rank sums the bit patterns of a fixed sample of the
attention module's weights (the first SAMPLE values of each parameter, read as integers).
Integer sums are exact and independent of the order of the reduction, so replicas that hold
the same weights give the same sum bit for bit, and one weight that differs by one rounding
step (a relative 1e-7 in fp32; fine-tuning at lr 1e-5 drifts far more in one step) changes
it. One all-gather of one number per rank compares the sums, and every rank raises the same
error if they differ. It runs at forwards 1, 2, 4, 8, ... and every CHECK_EVERY-th forward (the first
check also catches unseeded, different initial weights). That is one small collective
every CHECK_EVERY forwards: 0.1-0.3% of a step (see benchmarks/bench_replica_check.py).
Parameters sharded across ranks (ZeRO-3, DTensor) are skipped: each rank holds a
different piece of them by design, and their owner keeps them consistent.

Weights that never train cannot drift, so a frozen attention module would hide the drift
of the weights that do train: LoRA adapters on the MLPs only, or on other layers. When none
of the module's weights is trainable, the sample adds the trainable weights of the model
that holds it, wherever they are, for models the patch was given (`watch`: setup with a
model, prepare_trainer); a trainable attention module is enough on its own (without
averaged gradients every trainable weight drifts).
"""

from __future__ import annotations

import os
import weakref

import torch

from easy_context.core.collectives import all_gather

__all__ = ["check_replicas", "check_replica_weights", "check_every", "ReplicaDriftError", "watch", "weights_to_check"]

# Checks every CHECK_EVERY-th forward; 0 turns the guard off. None: read
# EASY_CONTEXT_REPLICA_CHECK_EVERY (default 16) at the first patched forward, so that a bad
# value is refused there, as one line from the scripts, not at `import easy_context`.
CHECK_EVERY: int | None = None
SAMPLE = 4096  # values per parameter: weights that drift drift everywhere, a sample shows it
_forwards = 0
_watched: weakref.WeakSet = weakref.WeakSet()  # models the patch was given (their trainable weights)


class ReplicaDriftError(RuntimeError):
    pass


def check_every() -> int:
    global CHECK_EVERY
    if CHECK_EVERY is None:
        text = os.environ.get("EASY_CONTEXT_REPLICA_CHECK_EVERY", "16")
        if not text.strip().isdigit():
            raise ValueError(
                f"EASY_CONTEXT_REPLICA_CHECK_EVERY={text!r}: use a whole number >= 0 (0 turns the guard off)"
            )
        CHECK_EVERY = int(text)
    return CHECK_EVERY


def _due(count: int) -> bool:
    every = check_every()
    return every > 0 and (count & (count - 1) == 0 or count % every == 0)


def _replicated(param: torch.Tensor) -> bool:
    if param.numel() == 0 or getattr(param, "ds_id", None) is not None:  # ZeRO-3 partition
        return False
    return type(param).__name__ != "DTensor"


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element size -> same-width integer


def checksum(module_or_weights, device) -> torch.Tensor:
    """(1,) int64: the sum of the bit patterns of a fixed sample of the module's (or the list
    of weights') replicated weights (wrapping on overflow: any equal inputs give an equal sum)."""
    weights = module_or_weights.parameters() if isinstance(module_or_weights, torch.nn.Module) else module_or_weights
    total = torch.zeros(1, dtype=torch.int64, device=device)
    for p in weights:
        if _replicated(p) and p.dtype.is_floating_point:
            sample = p.detach().reshape(-1)[:SAMPLE].contiguous()
            total += sample.view(_BITS[sample.element_size()]).to(device=device, dtype=torch.int64).sum()
    return total


def watch(model) -> None:
    """Let the guard find `model`'s trainable weights (a PeftModel's adapters) from any of its
    attention modules. Held weakly: a model that is deleted is forgotten."""
    if isinstance(model, torch.nn.Module):
        _watched.add(model)


def weights_to_check(module: torch.nn.Module) -> list:
    """The attention module's weights and, when none of them trains, the trainable weights
    of the watched model that holds the module (in the model's parameter order, the same on
    every rank)."""
    weights = list(module.parameters())
    if any(p.requires_grad for p in weights):
        return weights
    for model in list(_watched):
        if any(m is module for m in model.modules()):
            return weights + [p for p in model.parameters() if p.requires_grad]
    return weights


def check_replicas(module: torch.nn.Module, group, sp_rank: int, device) -> None:
    """Called once per patched forward on every rank of the SP group (`group` None: one rank)."""
    _check(lambda: weights_to_check(module), type(module).__name__, group, sp_rank, device)


def check_replica_weights(weights: list, name: str, group, sp_rank: int, device) -> None:
    """check_replicas for the weights of a module named `name` (the compiled path holds the
    module's weights, not the module; under torch.compile the sample stays the module's)."""
    _check(lambda: weights, name, group, sp_rank, device)


def _check(weights, name: str, group, sp_rank: int, device) -> None:
    """`weights`: a callable, called only when a check is due (it may walk the model)."""
    global _forwards
    _forwards += 1
    if not _due(_forwards) or group is None:
        return
    local = checksum(weights(), device)
    sums = torch.cat(all_gather(local, group)).tolist()
    if len(set(sums)) > 1:
        raise ReplicaDriftError(
            f"the ranks of this sequence-parallel group hold different weights (checksums of "
            f"{name}'s weights by SP rank: {sums}; "
            f"forward {_forwards}, this is SP rank {sp_rank}). Their gradients are not being averaged, "
            "so each rank trains on its own shard of the sequence and the results are wrong. "
            "Wrap the model in DistributedDataParallel or DeepSpeed. With accelerate on a machine "
            "without CUDA, create Accelerator(cpu=True) (it gives MULTI_CPU + DDP); a gloo process "
            "group alone gives DistributedType.NO and no gradient averaging. Also seed every rank "
            "alike before creating the model."
        )
