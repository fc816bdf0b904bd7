"""Starting the scripts' accelerator the same way everywhere: NCCL on GPUs, gloo on CPU."""

from __future__ import annotations

import os

import torch

__all__ = ["make_accelerator", "fail"]


def make_accelerator(**kwargs):
    """An accelerate.Accelerator; under torchrun / accelerate launch on a machine without
    CUDA the process group uses gloo (accelerate would otherwise pick nothing usable)."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    handlers = [InitProcessGroupKwargs(backend="gloo")] if launched and not torch.cuda.is_available() else []
    return Accelerator(kwargs_handlers=handlers, **kwargs)


def fail(script: str, message: str):
    """A clear message instead of a traceback (every rank exits the same way)."""
    import sys

    print(f"{script}: error: {message}", file=sys.stderr)
    sys.exit(2)
