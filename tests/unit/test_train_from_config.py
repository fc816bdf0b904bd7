"""train.py --from-config (issue 57): a model shape from a config with random weights, built on
the device in --param-dtype, with --optimizer and --no-save. End to end under torchrun:
tests/recipes/test_train.py (--from-config tiny-llama trains exactly as --from-scratch)."""

from __future__ import annotations

import types

import pytest
import torch

from recipes.training import sources
from recipes.training.config import parse_config
from recipes.training.model import build_optimizer, load_model


def test_the_8b_preset_is_llama_3_1_8b_and_builds_on_the_meta_device():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(sources.config_path("llama-3.1-8b")))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248  # Llama-3.1-8B's count
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {"llama-3.1-8b", "qwen3-8b", "mistral-7b", "tiny-llama"} <= set(sources.presets())


def test_a_tiny_config_in_bf16_with_sgd_builds_where_it_runs():
    config = parse_config(["--from-config", "tiny-llama", "--param-dtype", "bf16", "--optimizer", "sgd", "--no-save"])
    optimisation = config.optimisation
    assert config.model.model is None and config.checkpoints.no_save
    assert (optimisation.learning_rate, optimisation.max_train_steps) == (1e-3, 60)
    model, tokenizer = load_model(config.model, config.memory, config.data.seed, torch.bfloat16, torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config.num_hidden_layers == 4 and len(tokenizer) <= model.config.vocab_size
    run = types.SimpleNamespace(config=config, deepspeed=None, world=1)
    optimizer, _ = build_optimizer(run, model)
    assert type(optimizer) is torch.optim.SGD


@pytest.mark.parametrize("flags, dtype", [(["--param-dtype", "bf16"], torch.bfloat16), ([], torch.float32)])
def test_the_model_train_py_builds_has_its_weights_in_param_dtype(flags, dtype):
    """From the command line to the model the loss wraps (build_model, one process, data_parallel):
    --param-dtype bf16 gives bf16 weights, the default fp32 ones."""
    from recipes.training.model import build_model
    from recipes.training.run import Run

    config = parse_config(["--from-config", "tiny-llama", *flags, "--parallel-mode", "data_parallel", "--no-save"])
    accelerator = types.SimpleNamespace(
        device=torch.device("cpu"), mixed_precision="no", print=print, num_processes=1, process_index=0
    )
    run = Run(config, accelerator, types.SimpleNamespace(at=lambda stage: None), None, None, None)
    trainable, _ = build_model(run)
    assert {p.dtype for p in trainable.parameters()} == {dtype}


def test_from_config_weights_are_from_scratch_weights():
    scratch = parse_config(["--from-scratch"])
    named = parse_config(["--from-config", str(sources.SCRATCH_CONFIG / "config.json")])
    assert scratch.model.from_config == str(sources.SCRATCH_CONFIG)
    a, _ = load_model(scratch.model, scratch.memory, scratch.data.seed, torch.float32, torch.device("cpu"))
    b, _ = load_model(named.model, named.memory, named.data.seed, torch.float32, torch.device("cpu"))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--from-config", "no-such-shape"], "--from-config no-such-shape: no such config.json, folder or preset"),
        (["--from-config", "tiny-llama", "--model", "M"], "drop --model M or --from-config"),
        (["--from-config", "tiny-llama", "--lora-r", "8"], "--from-config starts from random ones"),
        (["--optimizer", "lion"], "invalid choice: 'lion'"),
        (["--param-dtype", "fp16"], "invalid choice: 'fp16'"),
    ],
)
def test_bad_from_config_flags_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        parse_config(argv)
    assert stopped.value.code == 2 and message in capsys.readouterr().err
