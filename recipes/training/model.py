"""The model with its loss (loaded, LoRA adapters, patched for sequence parallelism, FSDP2,
compiled), and its optimizer and learning-rate schedule."""

from __future__ import annotations

import torch

import easy_context as ec
from easy_context.hf.architectures import attn_implementation, check_training_config
from easy_context.hf.heads import placement_of
from easy_context.hf.loss import CausalLMLoss
from easy_context.modes import get_mode
from easy_context.versions import enable_activation_checkpointing
from recipes import fsdp
from recipes.data import byte_tokenizer
from recipes.lora import adapter_base, add_lora
from recipes.models import check_config, load_config, load_pretrained
from recipes.tiled_mlp import tile_mlps
from recipes.training.config import MemoryConfig, ModelConfig
from recipes.training.run import Run, fail
from recipes.training.sources import config_path


def build_model(run: Run):
    """(the model with its loss, patched for sequence parallelism; the tokenizer)."""
    config, accelerator = run.config, run.accelerator
    parallelism, seq_length = config.parallelism, config.data.seq_length
    run.stage.at("loading the model")
    # bf16 weights where asked (--param-dtype bf16) or where DeepSpeed keeps fp32 master
    # weights; otherwise fp32 weights (with --mixed_precision bf16, accelerate autocasts the compute).
    deepspeed_bf16 = run.deepspeed is not None and accelerator.mixed_precision == "bf16"
    dtype = torch.bfloat16 if deepspeed_bf16 or config.model.param_dtype == "bf16" else torch.float32
    model, tokenizer = load_model(config.model, config.memory, config.data.seed, dtype, accelerator.device)
    if config.memory.offload_checkpoints and accelerator.device.type == "cpu":
        accelerator.print(
            "--offload-checkpoints: the device is the CPU, so checkpointed layer inputs already live in host "
            "memory; nothing to offload"
        )
    try:
        # the split for this model's heads on these nodes: what the patch's context derives too
        run.topology = get_mode(parallelism.parallel_mode).topology(
            run.world, parallelism.sp_size, parallelism.ring_degree, placement_of(model, run.world)
        )
        get_mode(parallelism.parallel_mode).layout(run.topology).check_length(seq_length)
        check_config(model.config, run.topology, seq_length, parallelism.parallel_mode)
        check_training_config(model.config)
    except ValueError as error:
        fail(str(error))
    if config.data.document_masking and tokenizer.eos_token_id is None:
        fail("--document-masking needs a tokenizer with an EOS token (documents are separated by EOS)")
    if config.model.lora_r is not None:
        targets = config.model.lora_targets.split(",") if config.model.lora_targets else None
        try:
            model = add_lora(model, config.model.lora_r, config.model.lora_alpha, targets)
        except (ValueError, ImportError) as error:
            fail(f"--lora-r {config.model.lora_r}: {error}")
    ec.apply_seq_parallel_monkey_patch(
        parallelism.parallel_mode,
        model,
        sp_size=parallelism.sp_size,
        ring_degree=parallelism.ring_degree,
        document_split=run.document_split or None,
        mixer_strategy=parallelism.mixer_strategy,
    )
    trainable = CausalLMLoss(model, config.memory.loss_chunk_size)
    if parallelism.fsdp:
        run.stage.at("sharding the model (FSDP2)")
        fsdp.shard_model(
            trainable,
            model.get_decoder().layers,
            accelerator.device,
            accelerator.mixed_precision,
            parallelism.fsdp_offload,
        )
    if config.memory.compile:
        # In place: parameter names, and so checkpoints, stay those of the eager model. The
        # decoder is what the loss calls; the output layer runs in chunks under checkpointing.
        model.get_decoder().compile()
    return trainable, tokenizer


def load_model(model_config: ModelConfig, memory: MemoryConfig, seed: int, dtype, device):
    """(the model, its tokenizer): pretrained, or built from a config with random weights (seeded
    by `seed`), with the memory options that change the modules applied."""
    from transformers import AutoModelForCausalLM

    try:
        if model_config.from_config:  # random weights, byte tokenizer
            config = load_config(str(config_path(model_config.from_config)), model_config.rope_theta)
            tokenizer = byte_tokenizer()
            if config.vocab_size < len(tokenizer):
                fail(
                    f"--from-config {model_config.from_config}: vocab_size {config.vocab_size} is below the tokenizer's"
                )
            torch.manual_seed(seed)
            # Initialised where it runs, in its dtype: an 8B shape never exists in fp32 on the host.
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(
                    config, attn_implementation=attn_implementation(config), dtype=dtype
                )
        elif adapter_base(model_config.model) is not None:
            fail(
                f"--model {model_config.model} holds a LoRA adapter, not a model: pass its base "
                f"({adapter_base(model_config.model)}) as --model (with --lora-r to train a new adapter)"
            )
        else:
            model, tokenizer = load_pretrained(model_config.model, model_config.rope_theta, dtype)
    except (ValueError, OSError) as error:
        source = model_config.from_config or model_config.model
        fail(f"{'--from-config' if model_config.from_config else '--model'} {source}: {error}")
    if memory.activation_checkpointing:
        # On a CPU device the checkpointed inputs already live in host memory, and transformers'
        # offload pins its copies, which needs an accelerator: there the flag changes nothing.
        try:
            enable_activation_checkpointing(model, offload=memory.offload_checkpoints and device.type != "cpu")
        except ValueError as error:
            fail(f"--offload-checkpoints: {error}")
    if memory.tiled_mlp:
        tile_mlps(model, memory.tiled_mlp)
    return model, tokenizer


def build_optimizer(run: Run, trainable):
    optimisation, deepspeed = run.config.optimisation, run.deepspeed
    ds_config = deepspeed.deepspeed_config if deepspeed is not None else {}
    if deepspeed is not None:
        ds_config["train_micro_batch_size_per_gpu"] = run.config.data.batch_size
    params = [p for p in trainable.parameters() if p.requires_grad]
    if "optimizer" in ds_config:  # the DeepSpeed json builds it; "auto" values come from our flags
        if optimisation.optimizer != "adamw":
            fail(
                f"--optimizer {optimisation.optimizer}: the DeepSpeed config builds its own optimizer; drop one of them"
            )
        from accelerate.utils import DummyOptim  # exported only when deepspeed is installed

        optimizer = DummyOptim(params, lr=optimisation.learning_rate, weight_decay=optimisation.weight_decay)
    elif optimisation.optimizer == "sgd":  # no state: the memory a long-context headline is measured with
        optimizer = torch.optim.SGD(params, lr=optimisation.learning_rate, weight_decay=optimisation.weight_decay)
    else:
        optimizer = torch.optim.AdamW(params, lr=optimisation.learning_rate, weight_decay=optimisation.weight_decay)
    if "scheduler" in ds_config:
        from accelerate.utils import DummyScheduler

        # accelerate divides total_num_steps by the process count (it assumes every process
        # reads its own batches); our step count is global, so undo that.
        scheduler = DummyScheduler(
            optimizer,
            total_num_steps=optimisation.max_train_steps * run.world,
            warmup_num_steps=optimisation.warmup_steps,
        )
    else:
        from transformers import get_linear_schedule_with_warmup

        scheduler = get_linear_schedule_with_warmup(optimizer, optimisation.warmup_steps, optimisation.max_train_steps)
    return optimizer, scheduler
