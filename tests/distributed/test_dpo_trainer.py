"""prepare_trainer(mode, dpo_trainer): TRL's DPOTrainer at 2 ranks trains as the unpatched
DPOTrainer in one process on the same preference pairs (half long prompts with short answers,
half the reverse; rows that no layout divides): per-step losses, the logged rewards and
log-probs, the eval loss and the policy's weights after 2 SGD steps (lr 0.1, so a weight
difference is a gradient difference x 0.1), for each of TRL's 15 loss types, with the reference
model run sharded or its log-probs precomputed at construction.

fp32 tolerances, relative where a value is above 1: weights 1e-6 (with lr 0.1, a gradient
difference of 1e-5; measured at most 1e-8), losses and the eval loss 2e-5 (measured 4e-6), the
logged metrics 5e-5 (measured 8e-6: a sequence's summed log-prob of ~170 has an fp32 spacing of
1.5e-5, and the rewards are differences of two such sums). DPOConfig's bf16 default is set off;
its gradient checkpointing stays on. The same test with the all-reduce of hf/preference.py
removed fails at once (sigmoid: step-2 loss 0.780 against 0.872, weights off by 3.7e-4); with
only its backward's all-reduce removed (each rank's gradient 1/P of the sum's), the logged
grad_norm fails (the weights do not: max_grad_norm=1.0 clips the norm away).

Also: usp_attn over one SP group of 4 and zigzag_ring_attn over 2 data-parallel groups of 2
(against one process reading 4 pairs a step), dist_flash_attn, LoRA through TRL's peft_config
(the reference model being the policy with its adapters disabled), and bf16 autocast within
the bound of trainer_runs.assert_within_bf16_bound.
"""

import functools
import tempfile

import pytest
from ranks import run_ranks
from trainer_runs import SGD_RUN, assert_within_bf16_bound, save_preference_data, train_dpo

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)

LOSS_TOL, METRIC_TOL, WEIGHT_TOL = 2e-5, 5e-5, 1e-6
# grad_norm: the Trainer's, before max_grad_norm=1.0 clips it. The clipping scales a gradient of
# norm above 1 to norm 1, so the weights alone would not see a gradient off by a uniform factor
# (the backward of hf/preference.py's sum without its all-reduce: 1/P of it).
METRICS = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "num_tokens", "entropy", "grad_norm")
# (loss types, weighted together as TRL does with a list; precompute_ref_log_probs; other DPOConfig fields)
ZIGZAG = (
    (("sigmoid",), False, ()),
    (("ipo", "sft"), True, (("ld_alpha", 0.5),)),  # ld_alpha: completions split at the shorter one's length
)
LOSSES = ("hinge", "robust", "bco_pair", "apo_zero", "apo_down", "exo_pair", "nca_pair", "sppo_hard")
ULYSSES = (
    # use_weighting: WPO's weights from per-token log-probs (TRL 1.16 refuses it with aot, and its
    # in-place product fails in one process too with sft, hinge, ...: tested with sigmoid)
    (("sigmoid",), False, (("use_weighting", True),)),
    (LOSSES, False, ()),
    (("aot", "aot_unpaired", "discopop", "sigmoid_norm"), False, ()),
)


def _run(world: int, mode, configs, options=None, **spec) -> list:
    """spec: train_dpo's batch and bf16; options: prepare_trainer's."""
    with tempfile.TemporaryDirectory() as data:
        save_preference_data(data)
        configs = [(list(t), p, e) for t, p, e in configs]
        spec = dict(mode=mode, data=data, configs=configs, options=options or {}, **spec)
        return run_ranks(train_dpo, world, spec, timeout=300)


@functools.cache
def _reference(configs, batch: int = 2, bf16: bool = False) -> list:
    return _run(1, None, configs, batch=batch, bf16=bf16)[0]


def _off(value: float, reference: float) -> float:
    """The difference, relative to the reference where it is above 1."""
    return abs(value - reference) / max(1.0, abs(reference))


def _assert_exact(results: list, reference: list, what: str) -> None:
    for rank, runs in enumerate(results):
        for (result, expected), label in zip(zip(runs, reference), what):
            got, want = result["logs"], expected["logs"]
            assert len(got) == len(want) > 0, (label, got, want)
            loss = max(_off(a["loss"], b["loss"]) for a, b in zip(got, want))
            metrics = max(_off(a[m], b[m]) for a, b in zip(got, want) for m in METRICS)
            eval_loss = _off(result["eval_loss"], expected["eval_loss"])
            weights = max((result["weights"][k] - w).abs().max().item() for k, w in expected["weights"].items())
            print(
                f"DIFFERENCES rank {rank} {label}: loss {loss:.1e} metrics {metrics:.1e} eval {eval_loss:.1e} "
                f"weights {weights:.1e}"
            )
            assert loss <= LOSS_TOL and metrics <= METRIC_TOL and eval_loss <= LOSS_TOL and weights <= WEIGHT_TOL, (
                f"rank {rank} {label}: loss {loss:.2e}, metrics {metrics:.2e}, eval loss {eval_loss:.2e}, "
                f"weights {weights:.2e}; losses {[a['loss'] for a in got]} vs {[b['loss'] for b in want]}"
            )


@pytest.mark.timeout(300)
def test_dpo_trainer_matches_single_process():
    """zigzag_ring_attn: sigmoid (the reference model sharded), then ipo + sft with ld_alpha
    (precomputed reference log-probs); ulysses_attn: sigmoid with WPO weighting, then the other 12
    loss types in two weighted sums (TRL 1.16 offers 15)."""
    for mode, configs in (("zigzag_ring_attn", ZIGZAG), ("ulysses_attn", ULYSSES)):
        results = _run(2, mode, configs)
        _assert_exact(results, _reference(configs), [f"{mode} {t} {dict(e)}" for t, _, e in configs])


SIGMOID = ((("sigmoid",), False, ()),)  # the reference model run sharded


@pytest.mark.timeout(400)
def test_dpo_trainer_at_4_ranks():
    """usp_attn over one SP group of 4 (Ulysses x ring, ring_degree 2); zigzag_ring_attn over 2
    data-parallel groups of 2 (sp_size=2), against one process reading both groups' pairs (4 per
    step) in the same order."""
    _assert_exact(_run(4, "usp_attn", SIGMOID, dict(ring_degree=2)), _reference(SIGMOID), ["usp_attn sp4 sigmoid"])
    results = _run(4, "zigzag_ring_attn", SIGMOID, dict(sp_size=2))
    _assert_exact(results, _reference(SIGMOID, batch=4), ["zigzag_ring_attn dp2 x sp2 sigmoid"])


@pytest.mark.timeout(300)
def test_dpo_trainer_with_lora_and_dist_flash_attn():
    """LoRA (TRL's peft_config; the reference model is the policy with its adapters disabled)
    under zigzag_ring_attn; and dist_flash_attn (the reference model sharded) at 2 ranks."""
    lora, reference = _run(2, "zigzag_ring_attn", SIGMOID, lora=4), _run(1, None, SIGMOID, lora=4)[0]
    assert any("lora_" in name for name in reference[0]["weights"])
    _assert_exact(lora, reference, ["zigzag_ring_attn LoRA sigmoid"])
    _assert_exact(_run(2, "dist_flash_attn", SIGMOID), _reference(SIGMOID), ["dist_flash_attn sigmoid"])


@pytest.mark.timeout(300)
def test_dpo_trainer_bf16_within_its_bound():
    """bf16 autocast (DPOConfig's default), zigzag_ring_attn at 2 ranks, within the bound of
    trainer_runs.assert_within_bf16_bound (measured: losses 2.1e-3 against the one process's
    3.1e-4 + 1/256, weights 4.6e-5 against 4.1e-5; without the all-reduce, losses 9.3e-2)."""
    ours = [runs[0] for runs in _run(2, "zigzag_ring_attn", SIGMOID, bf16=True)]
    assert_within_bf16_bound(ours, _reference(SIGMOID)[0], _reference(SIGMOID, bf16=True)[0], SGD_RUN["learning_rate"])
