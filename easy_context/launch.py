"""Starting the scripts' accelerator the same way everywhere: NCCL on GPUs, gloo on CPU."""

from __future__ import annotations

import os

import torch

__all__ = ["make_accelerator", "fail"]


def make_accelerator(**kwargs):
    """An accelerate.Accelerator whose gradients are synchronised on every machine.

    Under torchrun on a machine without CUDA, a plain Accelerator reports DistributedType.NO
    and never wraps the model in DDP: every rank would step on its own shard's gradient.
    `cpu=True` gives MULTI_CPU (DDP over gloo) instead. DeepSpeed synchronises gradients
    itself, and cpu=True would silently drop it, so under `accelerate launch --use_deepspeed`
    we only ask for a gloo process group.
    """
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if not launched or _has_accelerator():
        accelerator = Accelerator(**kwargs)
    elif _deepspeed_requested(kwargs):
        accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")], **kwargs)
    else:
        kwargs.setdefault("cpu", True)
        accelerator = Accelerator(**kwargs)
    if launched and accelerator.distributed_type.name == "NO":
        raise RuntimeError(f"accelerate runs each of the {os.environ['WORLD_SIZE']} processes on its own "
                           "(DistributedType.NO): gradients would never be averaged")
    return accelerator


def _has_accelerator() -> bool:
    """CUDA, or another device torch knows (XPU, NPU, ...): accelerate picks its backend."""
    if torch.cuda.is_available():
        return True
    device_api = getattr(torch, "accelerator", None)  # torch >= 2.6
    return bool(device_api is not None and device_api.is_available())


def _deepspeed_requested(kwargs) -> bool:
    from accelerate.utils import str_to_bool

    return kwargs.get("deepspeed_plugin") is not None or bool(str_to_bool(os.environ.get("ACCELERATE_USE_DEEPSPEED", "false")))


def fail(script: str, message: str):
    """A clear message instead of a traceback (every rank exits the same way)."""
    import sys

    print(f"{script}: error: {message}", file=sys.stderr)
    sys.exit(2)
