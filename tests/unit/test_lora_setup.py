"""LoRA and accelerate's parallelism in one process: train.py's LoRA setup (targets, defaults,
refusals), the replica guard's choice of weights for a PeftModel, adapter folders loaded by
the eval scripts' loader, and the refusal of accelerate's own context / sequence parallelism
(in prepare_trainer and for train.py's accelerator)."""

import types

import pytest
import torch
from tiny_models import tiny_batch, tiny_model

import easy_context as ec
from easy_context.hf import replicas
from easy_context.hf.accelerate_parallelism import check_accelerate_parallelism
from recipes.lora import adapter_base, add_lora, attention_projections


def test_default_targets_are_the_attention_projections_and_alpha_is_twice_r():
    model = tiny_model("llama")
    assert attention_projections(model) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    peft_model = add_lora(model, 4)
    config = peft_model.peft_config["default"]
    assert config.r == 4 and config.lora_alpha == 8
    assert set(config.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 4 * model.config.num_hidden_layers  # A and B on four projections per layer


def test_a_hybrids_default_targets_are_its_attention_and_mixer_projections():
    model = tiny_model("qwen3_next")  # the sweep's config
    mixer = ["in_proj_ba", "in_proj_qkvz"]  # Gated DeltaNet's inputs; not its out_proj, not the MoE's layers
    assert attention_projections(model) == sorted(mixer + ["k_proj", "o_proj", "q_proj", "v_proj"])


@pytest.mark.parametrize(
    "r,alpha,targets,message",
    [
        (0, None, None, "LoRA rank 0: use a whole number >= 1"),
        (4, -1.0, None, "LoRA alpha -1.0: use a number > 0"),
        (4, None, ["q_proj", "qkv"], "LoRA targets ['qkv'] are not linear layers of LlamaForCausalLM; it has ["),
    ],
)
def test_bad_lora_settings_are_refused_naming_the_value(r, alpha, targets, message):
    with pytest.raises(ValueError) as caught:
        add_lora(tiny_model("llama"), r, alpha, targets)
    assert message in str(caught.value)


def test_guard_samples_the_adapters_when_the_attention_is_frozen():
    mlp_only = add_lora(tiny_model("llama"), 4, targets=["gate_proj", "down_proj"])
    attention = mlp_only.get_base_model().model.layers[0].self_attn
    own = list(attention.parameters())
    assert replicas.weights_to_check(attention) == own  # not watched: the guard cannot know the model
    replicas.watch(mlp_only)
    checked = replicas.weights_to_check(attention)
    adapters = [p for p in mlp_only.parameters() if p.requires_grad]
    assert checked[: len(own)] == own and checked[len(own) :] == adapters and len(adapters) == 2 * 2 * 2

    on_attention = add_lora(tiny_model("llama"), 4)  # the module trains: its own weights show any drift
    replicas.watch(on_attention)
    attention = on_attention.get_base_model().model.layers[0].self_attn
    assert replicas.weights_to_check(attention) == list(attention.parameters())


def test_an_adapter_folder_loads_as_its_base_with_the_adapter(tmp_path):
    from recipes.data import byte_tokenizer
    from recipes.models import load_pretrained

    base, adapter = tmp_path / "base", tmp_path / "adapter"
    tiny_model("llama").save_pretrained(base)
    byte_tokenizer().save_pretrained(base)
    trained = add_lora(tiny_model("llama"), 4)
    trained.peft_config["default"].base_model_name_or_path = str(base)
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2, generator=torch.Generator().manual_seed(len(name)))
    trained.save_pretrained(adapter)
    assert adapter_base(str(adapter)) == str(base) and adapter_base(str(base)) is None
    model, tokenizer = load_pretrained(str(adapter))
    assert type(model).__name__ == "PeftModel" and tokenizer.eos_token is not None
    ids, _ = tiny_batch(1, 32)
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, trained.eval()(input_ids=ids).logits
        base_logits = tiny_model("llama")(input_ids=ids).logits
    assert torch.equal(got, want) and not torch.allclose(got, base_logits, atol=1e-3)
    assert not any(p.requires_grad for p in model.parameters())  # loaded for inference

    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    with pytest.raises(ValueError, match="names no base model"):
        adapter_base(str(adapter))


def _accelerator(**sizes):
    """An accelerator stand-in holding accelerate's own ParallelismConfig; a size this accelerate
    does not have yet (sp_size arrived after cp_size) goes on an object with the same attributes."""
    import inspect

    from accelerate.parallelism_config import ParallelismConfig

    if set(sizes) <= set(inspect.signature(ParallelismConfig).parameters):
        return types.SimpleNamespace(parallelism_config=ParallelismConfig(**sizes))
    return types.SimpleNamespace(parallelism_config=types.SimpleNamespace(**{"cp_size": 1, **sizes}))


@pytest.mark.parametrize(
    "sizes,refused",
    [({}, None), ({"cp_size": 2}, "cp_size=2"), ({"sp_size": 4}, "sp_size=4"), ({"dp_shard_size": 2}, None)],
)
def test_accelerate_context_or_sequence_parallelism_is_refused(sizes, refused):
    accelerator = _accelerator(**sizes)
    if refused is None:
        check_accelerate_parallelism(accelerator, "zigzag_ring_attn")
        return
    with pytest.raises(ValueError) as caught:
        check_accelerate_parallelism(accelerator, "zigzag_ring_attn")
    message = str(caught.value)
    assert refused in message and "'zigzag_ring_attn'" in message and "to 1" in message and "\n" not in message
    check_accelerate_parallelism(types.SimpleNamespace(), "zigzag_ring_attn")  # an accelerate without the config


def test_prepare_trainer_refuses_accelerate_context_parallelism(tmp_path, monkeypatch):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    trainer = Trainer(model=tiny_model("llama"), args=args)
    config = _accelerator(cp_size=2).parallelism_config
    monkeypatch.setattr(type(trainer.accelerator), "parallelism_config", property(lambda self: config))
    try:
        with pytest.raises(ValueError, match="ParallelismConfig sets cp_size=2"):
            ec.prepare_trainer("ulysses_attn", trainer)
    finally:
        ec.remove_seq_parallel_monkey_patch()


def test_train_py_refuses_bad_lora_flags(capsys):
    import train

    for flags, messages in [
        (
            ["--lora-r", "0", "--from-scratch"],
            ["--lora-r must be >= 1, got 0", "--lora-r needs pretrained weights to adapt"],
        ),
        (["--lora-targets", "q_proj"], ["--lora-alpha and --lora-targets need --lora-r"]),
        (["--lora-r", "4", "--model", "m", "--lora-alpha", "0"], ["--lora-alpha must be > 0 (the adapters' scale"]),
    ]:
        with pytest.raises(SystemExit) as caught:
            train.parse_args(flags)
        err = capsys.readouterr().err
        assert caught.value.code == 2 and all(m in err for m in messages), (flags, err)
    config = train.parse_args(["--lora-r", "4"])  # no --model: the adapters go on the shipped demo base
    assert config.model.model == str(train.DEMO_BASE) and config.model.lora_r == 4


def test_train_py_refuses_accelerate_context_parallelism_and_an_adapter_as_the_model(tmp_path, capsys):
    import train

    args = train.parse_args(["--parallel-mode", "zigzag_ring_attn", "--output-dir", str(tmp_path)])
    accelerator = _accelerator(cp_size=2)
    accelerator.num_processes = 1
    with pytest.raises(SystemExit) as caught:
        train.set_up_run(args, accelerator, train.Stage())
    err = capsys.readouterr().err
    assert caught.value.code == 2 and "ParallelismConfig sets cp_size=2" in err and "'zigzag_ring_attn'" in err

    adapter = tmp_path / "adapter"
    trained = add_lora(tiny_model("llama"), 4)
    trained.peft_config["default"].base_model_name_or_path = "some/base"
    trained.save_pretrained(adapter)
    config = train.parse_args(["--model", str(adapter), "--output-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as caught:
        train.load_model(config.model, config.memory, config.data.seed, torch.float32, torch.device("cpu"))
    err = capsys.readouterr().err
    assert caught.value.code == 2 and "holds a LoRA adapter, not a model: pass its base (some/base)" in err


def test_the_eval_scripts_loader_refuses_accelerate_sequence_parallelism():
    from recipes.evaluation import load_scorer

    accelerator = _accelerator(sp_size=2)
    accelerator.process_index, accelerator.num_processes = 0, 1
    with pytest.raises(ValueError, match="ParallelismConfig sets sp_size=2"):
        load_scorer(accelerator, "no/such-model", "ulysses_attn", max_length=64)  # refused before loading
