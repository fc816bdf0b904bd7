"""The library versions easy-context supports, and the APIs that differ between them: one place.

SUPPORTED is what pyproject.toml declares (a test keeps the two equal) and what CI runs: the
fast tier of the tests on every floor, in an environment of its own, next to the whole suite on
the pinned versions. An installed version outside its range is refused with one message
(at `import easy_context` for torch and transformers, when it is first used for accelerate and peft);
EASY_CONTEXT_ALLOW_UNSUPPORTED=1 turns the refusal into a warning, to try a new release.

Within the supported ranges some transformers APIs changed (docs/compatibility.md lists
them, with the versions). The helpers below ask the installed library for the feature, a
method or a parameter name, never for a version string.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import os
import re
import warnings

__all__ = [
    "SUPPORTED",
    "UnsupportedVersionError",
    "check_supported",
    "supported",
    "requirement",
    "floor_requirements",
    "enable_activation_checkpointing",
    "cache_keyword",
    "output_cache",
]

# package -> (lowest supported release, first unsupported release). CI runs the fast tier on
# the floors, and scripts/gpu_check.sh on torch 2.11 + transformers 5.17 (what a typical CUDA
# image ships today). Older releases are not promised (docs/compatibility.md says why).
SUPPORTED = {
    "torch": ("2.11", None),
    "transformers": ("5.9", "6"),
    "accelerate": ("1.10.1", "2"),  # the train / eval extras
    "datasets": ("5.0", None),  # the train / eval extras; 5.0 is the first whose JSON streams declare their types
    "peft": ("0.21.2", "1"),  # the lora extra (train.py --lora-r, adapters in the eval scripts); the release tested
}


def floor_requirements() -> list[str]:
    """`package==floor` for every package in SUPPORTED: what CI's floor environment installs."""
    return [f"{package}=={floor}" for package, (floor, _) in SUPPORTED.items()]


class UnsupportedVersionError(ImportError):
    pass


def _release(text: str) -> tuple[int, ...]:
    """(major, minor, patch, ...): '2.11.0+cu130' -> (2, 11, 0); '6.0.0.dev0' -> (6, 0, 0)."""
    match = re.match(r"\d+(?:\.\d+)*", text)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def requirement(package: str) -> str:
    """The range of `package` as pyproject.toml writes it, e.g. 'transformers>=5.9,<6'."""
    floor, ceiling = SUPPORTED[package]
    return f"{package}>={floor}" + (f",<{ceiling}" if ceiling else "")


def supported(package: str, version: str) -> bool:
    floor, ceiling = SUPPORTED[package]
    release = _release(version)
    return release >= _release(floor) and (ceiling is None or release < _release(ceiling))


def check_supported(*packages: str) -> None:
    """Refuse (or, with EASY_CONTEXT_ALLOW_UNSUPPORTED=1, warn about) installed versions outside
    SUPPORTED. Packages that are not installed are left to their import."""
    for package in packages or tuple(SUPPORTED):
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
        if supported(package, version):
            continue
        message = (
            f"easy-context supports {requirement(package)}; {package} {version} is installed. "
            f'Install a supported release (pip install "{requirement(package)}"), or set '
            "EASY_CONTEXT_ALLOW_UNSUPPORTED=1 to try this one anyway."
        )
        if os.environ.get("EASY_CONTEXT_ALLOW_UNSUPPORTED") == "1":
            warnings.warn(message, stacklevel=2)
        else:
            raise UnsupportedVersionError(message)


# ------------------------------------------------------------------ transformers features
def enable_activation_checkpointing(model, offload: bool = False, use_reentrant: bool = False) -> None:
    """Checkpoint every decoder layer (recompute its activations in the backward); offload: keep
    the checkpointed layer inputs in pinned host memory.

    transformers 5.23 renamed gradient_checkpointing_enable(gradient_checkpointing_kwargs=, offload=)
    to activation_checkpointing_enable(activation_checkpointing_kwargs=, offload=) and deprecated
    the old name; offload= exists from 5.17."""
    options = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options, offload=offload)
        return
    extra = {"offload": True} if offload else {}
    if offload and "offload" not in inspect.signature(model.gradient_checkpointing_enable).parameters:
        raise ValueError(
            f"offloading checkpointed activations needs a transformers whose gradient checkpointing takes offload=; "
            f"transformers {_installed('transformers')} does not: upgrade it, or checkpoint without offload"
        )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options, **extra)


def cache_keyword(model) -> str:
    """The keyword the model's forward (and model.generate) takes a KV cache by: 'cache' in newer
    transformers (5.24 on; it still takes the old name, with a warning), 'past_key_values' before."""
    while not hasattr(model, "config") and hasattr(model, "module"):  # DDP / DeepSpeed engine
        model = model.module
    if callable(getattr(model, "get_base_model", None)):  # a PeftModel: its forward passes **kwargs on
        model = model.get_base_model()
    return _cache_keyword(type(model))


@functools.cache
def _cache_keyword(model_class) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    raise TypeError(
        f"{model_class.__name__}.forward takes neither cache= nor past_key_values=; it cannot decode with a KV cache"
    )


def output_cache(output):
    """The KV cache a model's forward returned (ModelOutput.cache or .past_key_values)."""
    return getattr(output, "cache", None) if "cache" in output else getattr(output, "past_key_values", None)


def _installed(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


if __name__ == "__main__":  # python3 easy_context/versions.py --floors (no install needed): the floor environment
    import sys

    if sys.argv[1:] != ["--floors"]:
        sys.exit("usage: python3 easy_context/versions.py --floors")
    print(" ".join(floor_requirements()))
