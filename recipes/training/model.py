"""The model with its loss (loaded, LoRA adapters, patched for sequence parallelism, FSDP2,
compiled), and its optimizer and learning-rate schedule."""

from __future__ import annotations

import torch

import easy_context as ec
from easy_context.hf.architectures import attn_implementation, check_training_config
from easy_context.hf.context import placement_of
from easy_context.hf.loss import CausalLMLoss
from easy_context.modes import get_mode
from easy_context.versions import enable_activation_checkpointing
from recipes import fsdp
from recipes.data import byte_tokenizer
from recipes.lora import adapter_base, add_lora
from recipes.models import check_config, load_config, load_pretrained
from recipes.tiled_mlp import tile_mlps
from recipes.training.run import Run, fail
from recipes.training.sources import config_path


def build_model(run: Run):
    """(the model with its loss, patched for sequence parallelism; the tokenizer)."""
    args, accelerator = run.args, run.accelerator
    run.stage.at("loading the model")
    # bf16 weights where asked (--param-dtype bf16) or where DeepSpeed keeps fp32 master
    # weights; otherwise fp32 weights (with --mixed_precision bf16, accelerate autocasts the compute).
    deepspeed_bf16 = run.deepspeed is not None and accelerator.mixed_precision == "bf16"
    dtype = torch.bfloat16 if deepspeed_bf16 or args.param_dtype == "bf16" else torch.float32
    model, tokenizer = load_model(args, dtype, accelerator.device)
    if args.offload_checkpoints and accelerator.device.type == "cpu":
        accelerator.print(
            "--offload-checkpoints: the device is the CPU, so checkpointed layer inputs already live in host "
            "memory; nothing to offload"
        )
    try:
        # the split for this model's heads on these nodes: what the patch's context derives too
        run.topology = get_mode(args.parallel_mode).topology(
            run.world, args.sp_size, args.ring_degree, placement_of(model, run.world)
        )
        get_mode(args.parallel_mode).layout(run.topology).check_length(args.seq_length)
        check_config(model.config, run.topology, args.seq_length, args.parallel_mode)
        check_training_config(model.config)
    except ValueError as error:
        fail(str(error))
    if args.document_masking and tokenizer.eos_token_id is None:
        fail("--document-masking needs a tokenizer with an EOS token (documents are separated by EOS)")
    if args.lora_r is not None:
        targets = args.lora_targets.split(",") if args.lora_targets else None
        try:
            model = add_lora(model, args.lora_r, args.lora_alpha, targets)
        except (ValueError, ImportError) as error:
            fail(f"--lora-r {args.lora_r}: {error}")
    ec.apply_seq_parallel_monkey_patch(
        args.parallel_mode,
        model,
        sp_size=args.sp_size,
        ring_degree=args.ring_degree,
        document_split=run.document_split or None,
        mixer_strategy=args.mixer_strategy,
    )
    trainable = CausalLMLoss(model, args.loss_chunk_size)
    if args.fsdp:
        run.stage.at("sharding the model (FSDP2)")
        fsdp.shard_model(
            trainable, model.get_decoder().layers, accelerator.device, accelerator.mixed_precision, args.fsdp_offload
        )
    if args.compile:
        # In place: parameter names, and so checkpoints, stay those of the eager model. The
        # decoder is what the loss calls; the output layer runs in chunks under checkpointing.
        model.get_decoder().compile()
    return trainable, tokenizer


def load_model(args, dtype, device):
    from transformers import AutoModelForCausalLM

    try:
        if args.from_config:  # random weights, byte tokenizer
            config = load_config(str(config_path(args.from_config)), args.rope_theta)
            tokenizer = byte_tokenizer()
            if config.vocab_size < len(tokenizer):
                fail(f"--from-config {args.from_config}: vocab_size {config.vocab_size} is below the byte tokenizer's")
            torch.manual_seed(args.seed)
            # Initialised where it runs, in its dtype: an 8B shape never exists in fp32 on the host.
            with torch.device(device):
                model = AutoModelForCausalLM.from_config(
                    config, attn_implementation=attn_implementation(config), dtype=dtype
                )
        elif adapter_base(args.model) is not None:
            fail(
                f"--model {args.model} holds a LoRA adapter, not a model: pass its base "
                f"({adapter_base(args.model)}) as --model (with --lora-r to train a new adapter)"
            )
        else:
            model, tokenizer = load_pretrained(args.model, args.rope_theta, dtype)
    except (ValueError, OSError) as error:
        fail(f"--model {args.model or args.from_config}: {error}")
    if args.activation_checkpointing:
        # On a CPU device the checkpointed inputs already live in host memory, and transformers'
        # offload pins its copies, which needs an accelerator: there the flag changes nothing.
        try:
            enable_activation_checkpointing(model, offload=args.offload_checkpoints and device.type != "cpu")
        except ValueError as error:
            fail(f"--offload-checkpoints: {error}")
    if args.tiled_mlp:
        tile_mlps(model, args.tiled_mlp)
    return model, tokenizer


def build_optimizer(run: Run, trainable):
    args, deepspeed = run.args, run.deepspeed
    ds_config = deepspeed.deepspeed_config if deepspeed is not None else {}
    if deepspeed is not None:
        ds_config["train_micro_batch_size_per_gpu"] = args.batch_size
    params = [p for p in trainable.parameters() if p.requires_grad]
    if "optimizer" in ds_config:  # the DeepSpeed json builds it; "auto" values come from our flags
        if args.optimizer != "adamw":
            fail(f"--optimizer {args.optimizer}: the DeepSpeed config builds its own optimizer; drop one of them")
        from accelerate.utils import DummyOptim  # exported only when deepspeed is installed

        optimizer = DummyOptim(params, lr=args.learning_rate, weight_decay=args.weight_decay)
    elif args.optimizer == "sgd":  # no state: the memory a long-context headline is measured with
        optimizer = torch.optim.SGD(params, lr=args.learning_rate, weight_decay=args.weight_decay)
    else:
        optimizer = torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay)
    if "scheduler" in ds_config:
        from accelerate.utils import DummyScheduler

        # accelerate divides total_num_steps by the process count (it assumes every process
        # reads its own batches); our step count is global, so undo that.
        scheduler = DummyScheduler(
            optimizer, total_num_steps=args.max_train_steps * run.world, warmup_num_steps=args.warmup_steps
        )
    else:
        from transformers import get_linear_schedule_with_warmup

        scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, args.max_train_steps)
    return optimizer, scheduler
