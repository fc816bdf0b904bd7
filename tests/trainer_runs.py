"""One HF Trainer run on tiny data, for tests/distributed/test_trainer.py (importable by spawned ranks);
`train_dpo`: TRL's DPOTrainer runs for tests/distributed/test_dpo_trainer.py; `train_grpo`: TRL's
GRPOTrainer and RLOOTrainer runs for tests/distributed/test_grpo_trainer.py.

`train(rank, world, spec)` trains a tiny Llama with transformers.Trainer (or TRL's
SFTTrainer) and returns the per-step losses, the eval loss and the final weights. With
spec["mode"] None it is the reference: the unpatched model in one process.
"""

from __future__ import annotations

import os
import random

import torch
from tiny_models import tiny_model

VOCAB = 260  # the byte tokenizer's 257 ids (256 = EOS, also the pad token) and a little room
# tests/tiny_models.py's models with the byte tokenizer's vocabulary: the tuned Llama, and (the
# ids as well) the sweep's model of spec["model_type"]
BYTE_LLAMA = dict(vocab_size=VOCAB, max_position_embeddings=1024)
BYTE_IDS = dict(vocab_size=VOCAB, pad_token_id=256, eos_token_id=256, bos_token_id=256)


def documents(count: int, seed: int) -> list[list[int]]:
    """Documents of 9-70 tokens (lengths that no layout divides), each ending with EOS."""
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(8, 70))] + [256] for _ in range(count)]


def tokenizer(padding_side: str = "right"):
    from recipes.data import byte_tokenizer

    result = byte_tokenizer()
    result.pad_token, result.padding_side = result.eos_token, padding_side
    return result


def collator(kind: str):
    from transformers import DataCollatorForLanguageModeling, DataCollatorWithFlattening

    if kind == "packed":
        return DataCollatorWithFlattening()  # one row per batch, position_ids restart per document
    return DataCollatorForLanguageModeling(tokenizer("left" if kind == "left-padded" else "right"), mlm=False)


class SeededShuffle:
    """The reference's shuffling: the rule prepare_trainer (and accelerate, when it shards a
    loader) follows: SeedableRandomSampler seeded with the run's seed, plus the epoch."""

    def _get_train_sampler(self, train_dataset=None):
        from accelerate.data_loader import SeedableRandomSampler

        return SeedableRandomSampler(data_source=train_dataset or self.train_dataset, data_seed=self.args.seed)


class WorkBalancedShuffle:
    """The reference's order under prepare_trainer(..., balance_work=True) with BALANCE_DP groups:
    the same sampler, each step's groups' batches read side by side by one process."""

    BALANCE_DP = 2

    def _get_train_sampler(self, train_dataset=None):
        from easy_context.core.work_order import WorkBalancedSampler
        from easy_context.hf.trainer import row_work

        work = row_work(train_dataset or self.train_dataset)
        return WorkBalancedSampler(work, self.BALANCE_DP, self._train_batch_size // self.BALANCE_DP, self.args.seed)


def _as_distributed(rank: int, world: int) -> None:
    """accelerate reads the launcher's variables; the process group already exists."""
    if world > 1:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))


def train(rank: int, world: int, spec: dict) -> dict:
    """spec: mode, options, collator, batch, accumulate, steps, out, save_steps, resume, sft, lora (a rank),
    model_type (a tiny model of that type; default a tiny Llama), model_dir (pretrained weights
    instead), documents ({"train": rows, "eval": rows} of token ids; default: random bytes),
    learning_rate (default 0.5), balance_work (prepare_trainer's; the reference reads
    WorkBalancedShuffle's order)."""
    _as_distributed(rank, world)
    from datasets import Dataset
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import easy_context as ec

    losses = []

    class RecordLoss(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    rows = spec.get("documents") or {"train": documents(48, seed=1), "eval": documents(8, seed=2)}
    train_set, eval_set = (Dataset.from_dict({"input_ids": rows[split]}) for split in ("train", "eval"))
    common = dict(
        output_dir=spec["out"],
        per_device_train_batch_size=spec["batch"],
        per_device_eval_batch_size=spec.get("eval_batch", 2),
        gradient_accumulation_steps=spec["accumulate"],
        max_steps=spec["steps"],
        learning_rate=spec.get("learning_rate", 0.5),
        optim="sgd",
        lr_scheduler_type="linear",
        warmup_steps=0,
        logging_steps=1,
        save_steps=spec.get("save_steps") or spec["steps"] + 1,
        save_strategy="steps" if spec.get("save_steps") else "no",
        report_to=[],
        use_cpu=True,
        seed=7,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    if spec.get("model_dir"):  # pretrained weights (tests/real_model.py)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], attn_implementation="sdpa", dtype=torch.float32)
    elif spec.get("model_type") is None:
        model = tiny_model("llama", **BYTE_LLAMA)
    else:
        model = tiny_model(spec["model_type"], sweep=True, **BYTE_IDS, **spec.get("config", {}))
    if spec.get("lora"):  # rank-r adapters on the attention projections; the base frozen
        from recipes.lora import add_lora

        model = add_lora(model, spec["lora"])
    if spec.get("sft"):
        from trl import SFTConfig, SFTTrainer

        config = SFTConfig(
            **common,
            packing=spec["collator"] == "packed",
            padding_free=spec["collator"] == "padding-free",
            max_length=None if spec["collator"] == "padding-free" else 256,
            bf16=spec.get("bf16", False),
        )
        trainer_class = SFTTrainer if spec["mode"] else type("ReferenceSFTTrainer", (SeededShuffle, SFTTrainer), {})
        trainer = trainer_class(
            model=model,
            args=config,
            train_dataset=train_set,
            eval_dataset=eval_set,
            processing_class=tokenizer(),
            callbacks=[RecordLoss()],
        )
    else:
        shuffle = WorkBalancedShuffle if spec.get("balance_work") else SeededShuffle
        trainer_class = Trainer if spec["mode"] else type("ReferenceTrainer", (shuffle, Trainer), {})
        trainer = trainer_class(
            model=model,
            args=TrainingArguments(**common),
            train_dataset=train_set,
            eval_dataset=eval_set,
            data_collator=collator(spec["collator"]),
            callbacks=[RecordLoss()],
        )
    if spec["mode"] is not None:
        options = spec.get("options", {})
        ec.prepare_trainer(spec["mode"], trainer, balance_work=spec.get("balance_work", False), **options)
    trainer.train(resume_from_checkpoint=spec.get("resume"))
    eval_loss = trainer.evaluate()["eval_loss"]
    predicted = trainer.predict(eval_set)  # logits of whole rows; padding's are meaningless
    predictions = torch.as_tensor(predicted.predictions) * torch.as_tensor(predicted.label_ids != -100).unsqueeze(-1)
    ec.remove_seq_parallel_monkey_patch()
    weights = {k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()}
    return {"losses": losses, "eval_loss": eval_loss, "weights": weights, "predictions": predictions}


def train_and_resume(rank: int, world: int, spec: dict) -> dict:
    """Train with a checkpoint at step spec["save_steps"], then train again from it."""
    whole = train(rank, world, spec)
    resumed = train(rank, world, dict(spec, save_steps=None, resume=f"{spec['out']}/checkpoint-{spec['save_steps']}"))
    return {"whole": whole, "resumed": resumed}


def misuse(rank: int, world: int) -> dict:
    """What prepare_trainer says to setups it cannot make exact (2 ranks): a Trainer without
    DDP, and ranks of one SP group handed different rows."""
    _as_distributed(rank, world)
    import tempfile

    from transformers import Trainer, TrainingArguments

    import easy_context as ec

    errors = {}
    with tempfile.TemporaryDirectory() as out:
        for use_cpu in (False, True):
            trainer = Trainer(
                model=tiny_model("llama", **BYTE_LLAMA),
                args=TrainingArguments(output_dir=out, use_cpu=use_cpu, report_to=[]),
            )
            try:
                ec.prepare_trainer("zigzag_ring_attn", trainer)
            except ValueError as error:
                errors[f"use_cpu={use_cpu}"] = str(error)
    ids = torch.arange(16).reshape(1, 16) + rank  # rank-dependent rows
    try:
        trainer._seq_parallel.shard({"input_ids": ids, "labels": ids})
    except ValueError as error:
        errors["different rows"] = str(error)
    ec.remove_seq_parallel_monkey_patch()
    return errors


# The TRL runs compared with one process (DPO, GRPO, RLOO): plain SGD at a constant rate, every
# step logged, nothing saved.
SGD_RUN = dict(
    learning_rate=0.1,
    optim="sgd",
    lr_scheduler_type="constant",
    logging_steps=1,
    save_strategy="no",
    report_to=[],
    use_cpu=True,
    seed=7,
    disable_tqdm=True,
)


def recorder(into: list, grads: dict | None = None):
    """A TrainerCallback appending every log to `into`; given `grads`, it also keeps the first
    optimizer step's gradients there."""
    from transformers import TrainerCallback

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            into.append(dict(logs or {}))

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if grads is not None and not grads:
                grads.update({k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None})

    return Record()


def assert_within_bf16_bound(ours: list, truth: dict, theirs: dict, lr: float) -> None:
    """The bf16 bound of tests/distributed/test_mixed_precision.py for trainer runs: against the
    fp32 run `truth`, each of `ours` (one per rank) errs in each step's loss, the eval loss, the
    first step's gradients (where recorded) and the weights at most twice the unpatched one-process
    bf16 run `theirs`, plus 1/256 (losses, gradients) or lr/256 (weights after SGD steps of lr)."""

    def errors(run: dict) -> dict:
        found = {f"loss {i}": abs(a["loss"] - b["loss"]) for i, (a, b) in enumerate(zip(run["logs"], truth["logs"]))}
        assert len(run["logs"]) == len(truth["logs"]) == len(found) > 0
        if "eval_loss" in truth:
            found["eval loss"] = abs(run["eval_loss"] - truth["eval_loss"])
        for name in ("grads", "weights"):
            if truth.get(name):
                found[name] = max((run[name][k] - v).abs().max().item() for k, v in truth[name].items())
        return found

    bound = errors(theirs)
    slack = {name: lr / 256 if name == "weights" else 1 / 256 for name in bound}
    for rank, run in enumerate(ours):
        mine = errors(run)
        print(f"BF16 rank {rank}: ours {mine} one-process bf16 {bound}")
        assert all(mine[k] <= 2 * bound[k] + slack[k] for k in bound), f"rank {rank}: ours {mine}, bf16 {bound}"


def preference_pairs(count: int, seed: int) -> dict:
    """Text preference pairs for the byte tokenizer: half with long prompts and short answers,
    half the reverse (row lengths that no layout divides)."""
    rng = random.Random(seed)

    def text(low, high):
        return "".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randrange(low, high)))

    rows = {"prompt": [], "chosen": [], "rejected": []}
    for i in range(count):
        long_prompt = i % 2 == 0
        rows["prompt"].append(text(40, 70) if long_prompt else text(2, 6))
        rows["chosen"].append(text(1, 5) if long_prompt else text(30, 60))
        rows["rejected"].append(text(1, 5) if long_prompt else text(30, 60))
    return rows


def save_preference_data(folder: str) -> None:
    """The train and eval pairs on disk: TRL caches precomputed reference log-probs next to a
    dataset's files, which an in-memory dataset lacks (and every rank must read one folder)."""
    from datasets import Dataset

    Dataset.from_dict(preference_pairs(8, seed=3)).save_to_disk(f"{folder}/train")
    Dataset.from_dict(preference_pairs(4, seed=4)).save_to_disk(f"{folder}/eval")


def train_dpo(rank: int, world: int, spec: dict) -> list:
    """TRL's DPOTrainer for each of spec["configs"] (loss_type list, precompute_ref_log_probs, other
    DPOConfig fields as (name, value) pairs), one after the other, on save_preference_data(spec["data"]):
    per-step losses and logged DPO metrics, the eval loss, the final policy weights. spec["batch"]:
    pairs per device (2); spec["bf16"]: bf16 autocast; spec["lora"]: LoRA adapters of that rank (the
    reference model: the adapters disabled). spec["mode"] None: the unpatched reference
    in one process."""
    _as_distributed(rank, world)
    import tempfile

    from datasets import load_from_disk
    from trl import DPOConfig, DPOTrainer

    import easy_context as ec

    results = []
    for loss_type, precompute, extra in spec["configs"]:
        records = []

        with tempfile.TemporaryDirectory() as out:
            config = DPOConfig(
                output_dir=out,
                per_device_train_batch_size=spec.get("batch", 2),
                per_device_eval_batch_size=2,
                max_steps=spec.get("steps", 2),
                **SGD_RUN,
                loss_type=loss_type,
                beta=0.5,
                label_smoothing=0.1 if {"robust", "exo_pair"} & set(loss_type) else 0.0,
                precompute_ref_log_probs=precompute,
                bf16=spec.get("bf16", False),  # DPOConfig's default is True; gradient checkpointing stays on
                max_length=None,
                dataset_num_proc=None,
                **dict(extra),
            )
            trainer_class = DPOTrainer if spec["mode"] else type("ReferenceDPOTrainer", (SeededShuffle, DPOTrainer), {})
            torch.manual_seed(0)  # the adapters' initial weights
            trainer = trainer_class(
                model=tiny_model("llama", **BYTE_LLAMA),
                ref_model=None if spec.get("lora") else tiny_model("llama", **BYTE_LLAMA),
                peft_config=lora_config(spec.get("lora")),
                args=config,
                train_dataset=load_from_disk(f"{spec['data']}/train"),
                eval_dataset=load_from_disk(f"{spec['data']}/eval"),
                processing_class=tokenizer(),
                callbacks=[recorder(records)],
            )
            if spec["mode"] is not None:
                ec.prepare_trainer(spec["mode"], trainer, **spec.get("options", {}))
            trainer.train()
            eval_loss = trainer.evaluate()["eval_loss"]
            ec.remove_seq_parallel_monkey_patch()
            model = trainer.accelerator.unwrap_model(trainer.model)
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        train_logs = [log for log in records if "loss" in log]
        results.append({"logs": train_logs, "eval_loss": eval_loss, "weights": weights})
    return results


def grpo_prompts(count: int, seed: int) -> dict:
    """Text prompts of 3-40 bytes (left-padded to different lengths in a batch)."""
    rng = random.Random(seed)
    letters = "abcdefghij klmnop"
    return {"prompt": ["".join(rng.choice(letters) for _ in range(rng.randrange(3, 40))) for _ in range(count)]}


def byte_reward(completions, completion_ids, **kwargs) -> list[float]:
    """A rule-based reward: the mean of each completion's token ids mod 7 (varies within a group)."""
    return [sum(i % 7 for i in ids) / max(1, len(ids)) for ids in completion_ids]


def save_grpo_policy(folder: str) -> None:
    """The tiny Llama on disk: GRPOTrainer builds its reference model from the policy's path. Every
    8th byte also ends a completion (TRL reads the model's eos ids), so completions have different
    lengths and are right-padded."""
    model = tiny_model("llama", **BYTE_LLAMA)
    model.generation_config.eos_token_id = [256, *range(0, 256, 8)]
    model.save_pretrained(folder)


def train_grpo(rank: int, world: int, spec: dict) -> list:
    """TRL's GRPOTrainer (or RLOOTrainer: spec["trainer"] "rloo") for each of spec["configs"]
    (GRPOConfig / RLOOConfig fields as (name, value) pairs), one after the other, sampling on:
    per-step losses and logged metrics, every rank's completions (token ids, as the reward
    function got them), the gradients of the first step, the weights after the steps and, per
    backward of TRL's fused head, whether it computed the entropy's gradient (entropy_gradients_seen).
    spec["mode"] None: the unpatched reference in one process; spec["replay"] (one list per config)
    makes it generate nothing and take those completions instead, one list of rows per rollout.
    spec["batch"]: rows per device (4); spec["bf16"]: bf16 autocast; spec["lora"]: LoRA adapters of
    that rank (with beta > 0 the reference is the policy with its adapters disabled);
    spec["evaluate"]: then trainer.evaluate() on 4 other prompts (its metrics but the timings)."""
    _as_distributed(rank, world)
    import tempfile

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    import easy_context as ec

    rloo = spec.get("trainer", "grpo") == "rloo"
    entropy_grads = entropy_gradients_seen()
    config_class, trainer_class = (RLOOConfig, RLOOTrainer) if rloo else (GRPOConfig, GRPOTrainer)

    results = []
    for index, extra in enumerate(spec["configs"]):
        logs, grads, drawn = [], {}, []
        entropy_grads.clear()
        replayed = list(spec["replay"][index]) if spec.get("replay") else None

        def reward(completions, completion_ids, drawn=drawn, **kwargs):
            drawn.append([list(ids) for ids in completion_ids])
            return byte_reward(completions, completion_ids)

        reward.__name__ = "byte_reward"
        rewards = [reward]
        if "reward_weights" in dict(extra):  # a config weighing two reward functions: the second, the length
            rewards.append(lambda completion_ids, **kwargs: [float(len(ids)) for ids in completion_ids])
        with tempfile.TemporaryDirectory() as out:
            config = config_class(
                output_dir=out,
                per_device_train_batch_size=spec.get("batch", 4),
                num_generations=4,
                max_completion_length=10,
                **SGD_RUN,
                bf16=spec.get("bf16", False),  # both configs default to True; gradient checkpointing stays on
                max_grad_norm=0.0,  # no clipping: the gradients compared are the loss's own
                model_init_kwargs={"dtype": "float32", "attn_implementation": "sdpa"},
                **{"max_steps": 2, **dict(extra)},
            )
            torch.manual_seed(0)  # the adapters' initial weights
            trainer = (trainer_class if replayed is None else replaying(trainer_class, replayed, rloo))(
                model=spec["policy"],  # save_grpo_policy's folder: with beta > 0 TRL loads its reference from it
                peft_config=lora_config(spec.get("lora")),
                reward_funcs=rewards,
                args=config,
                train_dataset=Dataset.from_dict(grpo_prompts(8, seed=5)),
                eval_dataset=Dataset.from_dict(grpo_prompts(4, seed=6)) if spec.get("evaluate") else None,
                processing_class=tokenizer("left"),
                callbacks=[recorder(logs, grads)],
            )
            if spec["mode"] is not None:
                ec.prepare_trainer(spec["mode"], trainer, **spec.get("options", {}))
            trainer.train()
            evaluated = trainer.evaluate() if spec.get("evaluate") else {}
            ec.remove_seq_parallel_monkey_patch()
            model = trainer.accelerator.unwrap_model(trainer.model)
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        assert not replayed, f"{len(replayed)} replayed rollouts left unused"
        train_logs = [log for log in logs if "loss" in log]
        result = {"logs": train_logs, "grads": grads, "weights": weights, "completions": drawn}
        result["entropy_grads"] = list(entropy_grads)
        timings = ("runtime", "per_second", "step_time")
        results.append({**result, "eval": {k: v for k, v in evaluated.items() if not any(t in k for t in timings)}})
    return results


def entropy_gradients_seen() -> list:
    """A list that gets, for each backward of TRL's fused LM head (trl.kernels'
    ChunkedLogProbFunction), whether it was given a gradient for the entropy: that costs a
    second pass over every (token x vocab) chunk, which a loss without the entropy bonus skips."""
    from trl.kernels import chunked_logprob

    function, seen = chunked_logprob.ChunkedLogProbFunction, []
    backward = function.backward

    def recording(ctx, grad_logprobs, grad_entropy, *rest):
        seen.append(grad_entropy is not None)
        return backward(ctx, grad_logprobs, grad_entropy, *rest)

    function.backward = staticmethod(recording)  # this rank's process only
    return seen


def lora_config(rank: int | None):
    """TRL's peft_config for rank-`rank` adapters on the attention projections (None: none); with
    it the reference model is the policy with its adapters disabled."""
    if not rank:
        return None
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def replaying(trainer_class: type, rollouts: list, rloo: bool) -> type:
    """`trainer_class` taking each rollout's completions from `rollouts` (popped in order) instead
    of generating: the one-process reference given another run's completions (the rows of every
    data-parallel group side by side, or a bf16 run's draw)."""

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        completions = rollouts.pop(0)
        assert len(completions) == len(prompt_ids), (len(completions), len(prompt_ids))
        return completions if rloo else (completions, None)

    name = f"Replaying{trainer_class.__name__}"
    return type(name, (trainer_class,), {"_generate_single_turn": _generate_single_turn})
