"""prepare_trainer(mode, grpo_trainer): TRL's GRPOTrainer at 2 ranks (one SP group) trains as the
unpatched GRPOTrainer in one process, sampling on: the completions (drawn by easy_context's
sharded generation, from SP rank 0's random state) are the same on both ranks and the same as
the one process's, and given them the per-step losses, every logged metric (rewards, KL,
entropy, clip ratios, completion lengths, token counts), every parameter's gradient at the first
step and the weights after the steps equal the one process's. Prompts of 3-40 bytes are
left-padded and completions end at different lengths (every 8th byte is an EOS), so rows are
padded at both ends; beta > 0 runs the reference model sharded, num_iterations=2 the old
policy's forward and the clipping; the loss types and options below cover the sequence-level
importance weights, the batch std of rewards and the entropy mask's gathered quantile.

fp32 tolerances as test_dpo_trainer.py's: losses 2e-5 (relative above 1; measured 1.2e-7), the
logged metrics 5e-5 (measured 2e-7; grad_norm among them), gradients 1e-6 (measured 9e-8; not
clipped: max_grad_norm=0) and weights 1e-6 after SGD steps of lr 0.1 (measured 1.2e-7).
GRPOConfig's bf16 default is set off; its gradient checkpointing stays on. Without the all-reduce
of per-token rows (hf/preference.py's sum_each_over_group replaced by the identity) the dapo run fails
at once: step-2 loss 0.262 against 0.217, first-step gradients off by 0.10, weights by 1e-2. The
unpatched GRPOTrainer under the patch (apply_seq_parallel_monkey_patch alone) fails at its first
rollout: transformers' generate runs the sharded attention on whole prompt rows ("sequence
length 38 is not divisible by 4, which the zigzag ring x2 layout over 2 ranks needs").

At 4 ranks: usp_attn over one SP group of 4 against the one process's own run, and 2
data-parallel groups of 2 against one process given both groups' completions side by side
(trainer_runs.replaying); LoRA with evaluate(), and bf16 within its bound, likewise. Every run
also compares, per backward of TRL's fused head, whether it computed the entropy's gradient:
with the all-reduce's backward handing zeros instead of None to unused outputs, every backward
computes it (a second pass over each token x vocab chunk) where one process computes none.

RLOOTrainer runs through the same machinery (hf/rl.py) with the same tolerances (measured:
losses 0, metrics 2e-7, gradients 3.9e-7, weights 1.2e-7). Without the all-reduce the
completions after the first update differ and, that check set aside, losses are off by 8e-2,
metrics by 1.0, gradients by 0.55 and weights by 0.19; with GRPO's module's gather replaced
instead of RLOO's own (rewards gathered from every rank) the metrics are off by 7e-2 and, with
normalize_advantages, the gradients by 7.5e-2.
"""

import functools
import tempfile

import pytest
from ranks import run_ranks
from trainer_runs import SGD_RUN, assert_within_bf16_bound, save_grpo_policy, train_grpo

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)

LOSS_TOL, METRIC_TOL, GRAD_TOL, WEIGHT_TOL = 2e-5, 5e-5, 1e-6, 1e-6
IGNORED = ("step_time",)  # wall-clock time
# GRPOConfig fields as (name, value) pairs, one trainer run each.
CLIPPED_KL = (("loss_type", "dapo"), ("beta", 0.1), ("num_iterations", 2))  # TRL's default loss type
CONFIGS = {
    "zigzag_ring_attn": (
        CLIPPED_KL,
        (("loss_type", "grpo"), ("scale_rewards", "batch"), ("top_entropy_quantile", 0.5), ("max_steps", 3)),
        # the reference model mixed with the policy after every step (TRL's SyncRefModelCallback)
        (("beta", 0.1), ("sync_ref_model", True), ("ref_model_sync_steps", 1), ("ref_model_mixup_alpha", 0.5)),
    ),
    "ulysses_attn": (
        CLIPPED_KL,
        (("loss_type", "bnpo"), ("beta", 0.05), ("importance_sampling_level", "sequence"), ("num_iterations", 2)),
        (("loss_type", "cispo"), ("num_iterations", 2)),
        (("loss_type", "sapo"), ("num_iterations", 2)),
        (("loss_type", "dr_grpo"), ("beta", 0.1)),
        # two reward functions normalised, then summed with weights; two rollouts' worth of
        # optimizer steps from one generation, each of 2 accumulated micro-batches
        (
            ("reward_weights", (1.0, 0.5)),
            ("multi_objective_aggregation", "normalize_then_sum"),
            ("gradient_accumulation_steps", 2),
            ("steps_per_generation", 2),
        ),
    ),
    "dist_flash_attn": (
        CLIPPED_KL,
        (("loss_type", "luspo"), ("importance_sampling_level", "sequence"), ("num_iterations", 2)),
        (("loss_type", "vespo"), ("num_iterations", 2)),
        # two-sided clipping, the adaptive entropy bonus (its controller reduces over processes),
        # truncated completions left out of the loss
        (
            ("delta", 1.5),
            ("entropy_coef", 0.01),
            ("use_adaptive_entropy", True),
            ("mask_truncated_completions", True),
            ("num_iterations", 2),
            ("max_steps", 3),
        ),
    ),
}
# RLOOConfig fields: the KL penalty folded into the gathered rewards (beta > 0 runs the reference
# sharded), the old policy's forward and the clipping (num_iterations=2), the normalised
# leave-one-out advantages and the clipped rewards.
RLOO_KL = (("beta", 0.1), ("num_iterations", 2), ("max_steps", 3))
RLOO_CONFIGS = {
    "zigzag_ring_attn": (RLOO_KL, (("beta", 0.0), ("normalize_advantages", True), ("max_steps", 3))),
    "ulysses_attn": (RLOO_KL, (("beta", 0.05), ("reward_clip_range", (3.0, 4.5)), ("num_iterations", 2))),
    "dist_flash_attn": (RLOO_KL, (("beta", 0.0), ("mask_truncated_completions", True))),
}
TRAINERS = {"grpo": CONFIGS, "rloo": RLOO_CONFIGS}


def _run(world: int, mode, configs, trainer="grpo", spec=None, **options) -> list:
    """spec: train_grpo's batch, bf16 and replay; options: prepare_trainer's."""
    with tempfile.TemporaryDirectory() as folder:
        save_grpo_policy(f"{folder}/policy")
        run = dict(mode=mode, configs=[list(c) for c in configs], policy=f"{folder}/policy", options=options)
        return run_ranks(train_grpo, world, {**run, "trainer": trainer, **(spec or {})}, timeout=300)


@functools.cache
def _references(trainer: str = "grpo") -> dict:
    every = tuple(dict.fromkeys(c for configs in TRAINERS[trainer].values() for c in configs))
    return dict(zip(every, _run(1, None, every, trainer)[0]))


def _off(value: float, reference: float) -> float:
    """The difference, relative to the reference where it is above 1."""
    return abs(value - reference) / max(1.0, abs(reference))


def _assert_exact(results: list, configs, mode: str, trainer: str = "grpo", references=None, sp: int = 0) -> None:
    """Every rank's run of each config against the one process's (references: one per config;
    by default _references(trainer), whose completions must be the SP group's too). sp: the SP
    group size (default: every rank); each group's ranks must draw alike."""
    sp = sp or len(results)
    for index, config in enumerate(configs):
        label = f"{trainer} {mode} {dict(config)}"
        expected = references[index] if references else _references(trainer)[config]
        runs = [rank_runs[index] for rank_runs in results]
        for rank, result in enumerate(runs):  # (a) one draw per SP group
            assert result["completions"] == runs[rank - rank % sp]["completions"], f"{label}: rank {rank} drew apart"
        if not references:  # (b) the one process's completions
            assert runs[0]["completions"] == expected["completions"], f"{label}: completions differ from one process's"
        for rank, result in enumerate(runs):
            got, want = result["logs"], expected["logs"]
            assert len(got) == len(want) > 0 and [sorted(g) for g in got] == [sorted(w) for w in want], (label, got)
            loss = max(_off(a["loss"], b["loss"]) for a, b in zip(got, want))
            metrics = max(
                _off(a[k], b[k]) for a, b in zip(got, want) for k in b if k not in IGNORED and b[k] is not None
            )
            grads = max((result["grads"][k] - g).abs().max().item() for k, g in expected["grads"].items())
            weights = max((result["weights"][k] - w).abs().max().item() for k, w in expected["weights"].items())
            assert set(result["grads"]) == set(expected["grads"]) and expected["grads"], label
            assert result["eval"].keys() == expected["eval"].keys(), label
            # the fused head's entropy backward runs where one process runs it (the bonus), else never
            assert result["entropy_grads"] == expected["entropy_grads"], (label, result["entropy_grads"])
            evaluated = max((_off(v, expected["eval"][k]) for k, v in result["eval"].items()), default=0.0)
            metrics = max(metrics, evaluated)
            print(
                f"DIFFERENCES rank {rank} {label}: loss {loss:.1e} metrics {metrics:.1e} grads {grads:.1e} "
                f"weights {weights:.1e}"
            )
            assert loss <= LOSS_TOL and metrics <= METRIC_TOL and grads <= GRAD_TOL and weights <= WEIGHT_TOL, (
                f"rank {rank} {label}: loss {loss:.2e}, metrics {metrics:.2e}, grads {grads:.2e}, "
                f"weights {weights:.2e}; losses {[a['loss'] for a in got]} vs {[b['loss'] for b in want]}"
            )


def _side_by_side(results: list, sp: int) -> list:
    """Each config's rollouts as one process would hold them: every data-parallel group's rows
    (its SP rank 0's), group after group, rollout by rollout."""
    configs = range(len(results[0]))
    return [[sum(rows, []) for rows in zip(*(r[i]["completions"] for r in results[::sp]))] for i in configs]


@pytest.mark.timeout(420)
def test_grpo_trainer_matches_single_process():
    """zigzag_ring_attn, ulysses_attn and dist_flash_attn at 2 ranks: TRL 1.16's loss types dapo
    (with the KL term and 2 iterations per generation), grpo, bnpo (sequence-level importance
    weights), cispo, sapo and dr_grpo."""
    for mode, configs in CONFIGS.items():
        _assert_exact(_run(2, mode, configs), configs, mode)


@pytest.mark.timeout(420)
def test_rloo_trainer_matches_single_process():
    """RLOOTrainer through the same machinery (hf/rl.py), zigzag_ring_attn, ulysses_attn and
    dist_flash_attn at 2 ranks: its leave-one-out advantages, the KL penalty in the rewards, the clipped per-sequence
    ratio over num_iterations=2, normalize_advantages and reward_clip_range."""
    for mode, configs in RLOO_CONFIGS.items():
        _assert_exact(_run(2, mode, configs, "rloo"), configs, mode, "rloo")


@pytest.mark.timeout(120)
def test_grpo_data_parallel_groups_draw_their_own_completions():
    """sp_size=1 at 2 ranks: two data-parallel groups of one rank, each with its own prompts and
    completions (the group's shared draw does not make the groups alike)."""
    results = _run(2, "zigzag_ring_attn", (CLIPPED_KL,), sp_size=1)
    assert results[0][0]["completions"] != results[1][0]["completions"]


@pytest.mark.timeout(500)
def test_grpo_and_rloo_at_4_ranks():
    """GRPO and RLOO, each: usp_attn over one SP group of 4 (Ulysses x ring, ring_degree 2)
    against the one process's own run (its completions too); zigzag_ring_attn over 2
    data-parallel groups of 2 (sp_size=2), whose groups draw their own completions, against one
    process given them side by side (8 rows per step: TRL's DDP over 2 processes)."""
    for trainer, config in (("grpo", CLIPPED_KL), ("rloo", RLOO_KL)):
        results = _run(4, "usp_attn", (config,), trainer, ring_degree=2)
        _assert_exact(results, (config,), "usp_attn sp4", trainer)
        results = _run(4, "zigzag_ring_attn", (config,), trainer, sp_size=2)
        assert results[0][0]["completions"] != results[2][0]["completions"], "the data-parallel groups drew alike"
        reference = _run(1, None, (config,), trainer, dict(batch=8, replay=_side_by_side(results, 2)))[0]
        _assert_exact(results, (config,), "zigzag_ring_attn dp2 x sp2", trainer, reference, sp=2)


@pytest.mark.timeout(300)
def test_grpo_and_rloo_with_lora_then_evaluate():
    """LoRA (TRL's peft_config), zigzag_ring_attn at 2 ranks, with the KL term against the policy
    with its adapters disabled and 2 iterations, then trainer.evaluate() (its own sampled
    rollout and loss): the one process's completions, and every eval metric too."""
    spec = dict(lora=4, evaluate=True)
    for trainer, config in (("grpo", CLIPPED_KL), ("rloo", RLOO_KL)):
        reference = _run(1, None, (config,), trainer, spec)[0]
        assert reference[0]["grads"] and all("lora_" in name for name in reference[0]["grads"])  # the base frozen
        assert reference[0]["eval"]["eval_loss"] is not None
        results = _run(2, "zigzag_ring_attn", (config,), trainer, spec)
        _assert_exact(results, (config,), "LoRA + evaluate", trainer, reference)


@pytest.mark.timeout(300)
def test_grpo_and_rloo_bf16_within_their_bound():
    """bf16 autocast (both configs' default), zigzag_ring_attn at 2 ranks, with the KL term and 2
    iterations: the SP group draws alike; given its completions, the fp32 and the bf16
    one-process runs are the references, and trainer_runs.assert_within_bf16_bound the bound
    (measured for GRPO: first-step gradients 1.0e-3 against the one process's 1.4e-3, weights
    1.0e-4 against 1.4e-4; without the all-reduce, gradients 0.10)."""
    for trainer, config in (("grpo", CLIPPED_KL), ("rloo", RLOO_KL)):
        ours = _run(2, "zigzag_ring_attn", (config,), trainer, dict(bf16=True))
        assert ours[0][0]["completions"] == ours[1][0]["completions"], trainer
        replay = _side_by_side(ours, 2)
        truth, theirs = (_run(1, None, (config,), trainer, dict(bf16=b, replay=replay))[0][0] for b in (False, True))
        assert_within_bf16_bound([runs[0] for runs in ours], truth, theirs, SGD_RUN["learning_rate"])
