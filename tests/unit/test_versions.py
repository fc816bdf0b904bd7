"""Supported versions: declared once (easy_context/versions.py), equal to pyproject.toml, refused
clearly outside their range; the transformers features that changed within it, found by feature."""

import re
import warnings
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_batch, tiny_model

from easy_context import versions
from easy_context.versions import SUPPORTED, UnsupportedVersionError, cache_keyword, check_supported, requirement

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_pyproject_declares_exactly_the_supported_ranges():
    declared = re.findall(r'"((?:torch|transformers|accelerate|datasets|peft)\b[^"]*)"', PYPROJECT.read_text())
    assert {re.match(r"[a-z]+", d).group(0) for d in declared} == set(SUPPORTED)
    for entry in declared:
        package = re.match(r"[a-z]+", entry).group(0)
        assert entry == requirement(package), (
            f"pyproject.toml says {entry!r}, easy_context/versions.py {requirement(package)!r}"
        )


def test_the_installed_versions_are_supported():
    check_supported()


@pytest.mark.parametrize(
    "package,version,ok",
    [
        ("transformers", "5.9.0", True),
        ("transformers", "5.24.0", True),
        ("transformers", "5.8.2", False),
        ("transformers", "6.0.0", False),
        ("transformers", "6.0.0.dev0", False),
        ("torch", "2.11.0+cu130", True),
        ("torch", "2.10.1", False),
        ("torch", "2.15.0", True),
        ("accelerate", "1.10.0", False),
        ("accelerate", "1.15.0", True),
    ],
)
def test_versions_outside_the_range_are_refused_naming_both(monkeypatch, package, version, ok):
    monkeypatch.delenv("EASY_CONTEXT_ALLOW_UNSUPPORTED", raising=False)
    monkeypatch.setattr(versions.importlib.metadata, "version", lambda name: version if name == package else "0")
    if ok:
        check_supported(package)
        return
    with pytest.raises(UnsupportedVersionError) as caught:
        check_supported(package)
    message = str(caught.value)
    assert f"{package} {version} is installed" in message and requirement(package) in message, message
    monkeypatch.setenv("EASY_CONTEXT_ALLOW_UNSUPPORTED", "1")
    with pytest.warns(UserWarning, match=re.escape(requirement(package))):
        check_supported(package)


class _NewCheckpointing:  # transformers >= 5.23
    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, every_n_layers=1, offload=False):
        self.called = ("activation_checkpointing_enable", activation_checkpointing_kwargs, offload)


class _OffloadCheckpointing:  # transformers 5.17 - 5.22
    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None, every_n_layers=1, offload=False):
        self.called = ("gradient_checkpointing_enable", gradient_checkpointing_kwargs, offload)


class _OldCheckpointing:  # transformers < 5.17
    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        self.called = ("gradient_checkpointing_enable", gradient_checkpointing_kwargs, False)


@pytest.mark.parametrize(
    "model_class,name",
    [(_NewCheckpointing, "activation_checkpointing_enable"), (_OffloadCheckpointing, "gradient_checkpointing_enable")],
)
def test_activation_checkpointing_is_enabled_by_whichever_name_the_model_has(model_class, name):
    for offload in (False, True):
        model = model_class()
        versions.enable_activation_checkpointing(model, offload=offload)
        assert model.called == (name, {"use_reentrant": False}, offload)


def test_offload_without_the_feature_is_refused_clearly():
    model = _OldCheckpointing()
    versions.enable_activation_checkpointing(model)
    assert model.called[0] == "gradient_checkpointing_enable"
    with pytest.raises(ValueError, match="offload=; transformers .* does not"):
        versions.enable_activation_checkpointing(_OldCheckpointing(), offload=True)


def test_the_installed_transformers_checkpoints_a_real_model_exactly():
    """Checkpointed and plain backward give the same gradients, whichever method this transformers has."""
    ids, _ = tiny_batch(1, 32)
    grads = []
    for checkpointed in (False, True):
        model = tiny_model("llama").train()
        if checkpointed:
            versions.enable_activation_checkpointing(model)
        model(input_ids=ids, use_cache=False).logits.sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-6)


def test_the_cache_keyword_is_read_from_the_models_signature():
    class New:
        config = None

        def forward(self, input_ids=None, cache=None, **kwargs): ...

    class Old:
        config = None

        def forward(self, input_ids=None, past_key_values=None, **kwargs): ...

    class Wrapper:  # DDP / DeepSpeed engine: forward(*inputs, **kwargs), the model in .module
        def __init__(self, module):
            self.module = module

        def forward(self, *inputs, **kwargs): ...

    assert cache_keyword(New()) == "cache" and cache_keyword(Old()) == "past_key_values"
    assert cache_keyword(Wrapper(Old())) == "past_key_values"
    model = tiny_model("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the installed transformers takes the keyword without a deprecation warning
        output = model(input_ids=tiny_batch(1, 8)[0], use_cache=True)
        cache = versions.output_cache(output)
        assert cache is not None
        model(input_ids=tiny_batch(1, 9)[0][:, -1:], use_cache=True, **{cache_keyword(model): cache})
