"""check_masks (hf/mask_check.py): the mask the unpatched model builds for each layer kind against
the one sequence parallelism attends with, on a meta skeleton of the config, at setup.

It must pass on every supported type's tiny config with and without a window and on every
released config, and stop the rule the patch had before issue 56 (a layer's window taken from
the attention call's sliding_window argument): PhiMoE windows in its mask only, OLMoE passes a
window its mask does not apply; both were 0.2 off in logits under that rule."""

import json
from pathlib import Path

import pytest
import torch
from tiny_models import WINDOW, tiny_config, tiny_model, window_variants
from transformers import AutoConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from easy_context import MaskDisagreement, check_masks, setup, teardown
from easy_context.hf import mask_check, model_types, patch
from easy_context.hf.architectures import SUPPORTED_MODEL_TYPES
from tools import released_configs
from tools.sweep_models import static_reason

RELEASED = Path(released_configs.CONFIGS)
# the supported types this transformers has, with their attention in its registry (the floor
# versions CI tests have fewer, and older code for some: codegen computes attention itself in 5.9)
INSTALLED = sorted(t for t in SUPPORTED_MODEL_TYPES if t in CONFIG_MAPPING and static_reason(t) is None)
# types whose tiny config has no attention layer (Mamba-2 has none; tests/distributed/test_model_masks.py
# runs Granite 4.0-H with attention)
ALL_MAMBA = {"granitemoehybrid", "mamba2"}


def argument_rule(call):
    """The window the patch attended with before issue 56: the call's argument."""
    return call.sliding_window


def _released(name):
    return AutoConfig.for_model(**json.loads((RELEASED / f"{name}.json").read_text()))


@pytest.mark.timeout(120)
def test_every_supported_type_agrees_with_and_without_a_window():
    checked, without_attention = 0, set()
    for model_type in INSTALLED:
        for overrides in [{}, *window_variants(model_type).values()]:
            config = tiny_config(model_type, sweep=True, **overrides)
            if model_type in model_types.MASKS_NOT_PROBED:
                with pytest.warns(UserWarning, match="not probed"):
                    assert check_masks(config) == []
                continue
            if not check_masks(config):
                without_attention.add(model_type)
            checked += 1
    assert checked > 2 * len(INSTALLED) - 10
    assert without_attention == ALL_MAMBA & set(INSTALLED), without_attention


def test_the_argument_rule_is_stopped_where_mask_and_argument_disagree():
    for model_type, window_in in (("phimoe", "the mask"), ("olmoe", "the argument")):
        layers = mask_check.layer_masks(tiny_config(model_type, sweep=True, sliding_window=WINDOW))
        mask_check.compare(layers)  # the rule now: the mask's window
        with pytest.raises(MaskDisagreement) as stopped:
            mask_check.compare(layers, window_of=argument_rule)
        message = str(stopped.value)
        assert f"sliding_window={layers[0].sliding_window}" in message, message
        query = int(message.split("query ")[1].split(",")[0])
        assert query >= WINDOW - 1, message  # the first pair a window of 40 decides
        if window_in == "the mask":
            assert f"a window of {WINDOW}" in message and "without a window" in message, message
        else:
            assert "applies no window" in message and f"in a window of {WINDOW}" in message, message
    # they agree
    mask_check.compare(mask_check.layer_masks(tiny_config("mistral", sweep=True)), window_of=argument_rule)


def _smallest_released_config_per_type() -> dict:
    configs = {}
    for name in released_configs.names():
        try:
            config = _released(name)
        except (KeyError, ValueError):  # a type or a rope format newer than this transformers
            continue
        smallest = configs.get(config.model_type)
        if config.model_type in INSTALLED and (
            smallest is None or config.num_hidden_layers < smallest[1].num_hidden_layers
        ):
            configs[config.model_type] = (name, config)
    return dict(configs.values())


@pytest.mark.timeout(120)
def test_released_configs_agree_and_the_argument_rule_stops_released_phimoe():
    """One released config per type, the shallowest (a skeleton's cost is its depth)."""
    configs = _smallest_released_config_per_type()
    stopped = []
    for name, config in configs.items():
        layers = mask_check.layer_masks(config)
        mask_check.compare(layers)
        try:
            mask_check.compare(layers, window_of=argument_rule)
        except MaskDisagreement:
            stopped.append(name)
    assert len(configs) >= 12 and [configs[name].model_type for name in stopped] == ["phimoe"], (
        sorted(configs),
        stopped,
    )


def test_the_check_reads_layer_kinds_and_rows_where_windows_differ():
    layers = check_masks(_released("google--gemma-2-2b-it"))
    found = {(mask_check.admission.mask_window(x.mask_function), x.sliding_window) for x in layers}
    assert found == {(4096, 4096), (None, None)}, found
    assert {4094, 4095, 4096, 8191, 8192} <= set(mask_check.rows([4096], 8194).tolist())


def test_setup_stops_before_training_on_a_disagreement(monkeypatch):
    """setup (and apply_seq_parallel_monkey_patch) run the check on the model's config; with the
    patch's window rule swapped back to the argument, OLMoE with a window stops there."""
    try:
        setup("zigzag_ring_attn", tiny_config("olmoe", sweep=True, sliding_window=WINDOW))  # the rule now
        teardown()
        monkeypatch.setattr(patch, "layer_window", lambda module, mask, kwargs: kwargs.get("sliding_window"))
        with pytest.raises(MaskDisagreement, match="OlmoeAttention"):  # a config setup has not checked yet
            setup("zigzag_ring_attn", tiny_config("olmoe", sweep=True, sliding_window=WINDOW + 1))
        assert patch.active() is None  # stopped before the patch was installed
    finally:
        teardown()


def test_the_check_leaves_the_registries_and_the_model_as_they_were():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    model = tiny_model("phimoe", sliding_window=WINDOW)
    before = {name: p.clone() for name, p in model.state_dict().items()}
    registries = set(AttentionInterface._global_mapping), set(AttentionMaskInterface._global_mapping)
    check_masks(model)
    assert (set(AttentionInterface._global_mapping), set(AttentionMaskInterface._global_mapping)) == registries
    assert all(torch.equal(before[name], p) for name, p in model.state_dict().items())
