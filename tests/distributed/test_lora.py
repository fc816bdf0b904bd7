"""LoRA (peft PeftModel) through the library: prepare_trainer trains the adapters exactly like the
unpatched single-process Trainer in every mode, generate decodes a PeftModel like its own
generate, and the replica guard sees adapters that drift wherever they sit.

fp32 tolerances: losses 1e-5, adapter (and frozen base) weights 1e-6, the Trainer tests' own
bounds (test_trainer.py); decoding logits test_generation.py's 1e-4.
"""

import tempfile

import pytest
import torch
from generation_runs import GREEDY, LOGITS_TOL, compare, prompts
from ranks import run_ranks
from tiny_models import tiny_batch, tiny_model
from trainer_runs import train

from easy_context import apply_seq_parallel_monkey_patch, prepare_seq_parallel_inputs, remove_seq_parallel_monkey_patch
from easy_context.hf import replicas

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)

LOSS_TOL, WEIGHT_TOL = 1e-5, 1e-6
RANK = 4
SEQ = 64
SPEC = dict(batch=2, accumulate=2, steps=3, collator="packed", lora=RANK)
MODES = [
    ("zigzag_ring_attn", {}),
    ("dist_flash_attn", {}),
    ("ulysses_attn", {}),
    ("usp_attn", {"ring_degree": 2}),
]


def _train_modes(rank, world, modes, out):
    """The Trainer run of each (mode, options) in turn, in the same ranks (one start-up)."""
    return [
        train(rank, world, dict(SPEC, mode=mode, options=options, out=f"{out}/{i}"))
        for i, (mode, options) in enumerate(modes)
    ]


@pytest.mark.timeout(600)
def test_lora_trainer_matches_single_process_in_every_mode():
    """Adapters on q/k/v/o, the base frozen, packed rows, GA 2, SGD: per-step losses, eval
    loss, every weight (adapters trained, base untouched) and predict() logits."""
    with tempfile.TemporaryDirectory() as out:
        reference = run_ranks(_train_modes, 1, [(None, {})], out, timeout=240)[0][0]
        per_rank = run_ranks(_train_modes, 2, MODES, out, timeout=480)
    adapters = [k for k in reference["weights"] if "lora_" in k]
    assert adapters and any(reference["weights"][k].abs().max() > 0 for k in adapters if "lora_B" in k)
    for (mode, _), results in zip(MODES, zip(*per_rank)):
        for rank, result in enumerate(results):
            assert len(result["losses"]) == len(reference["losses"]) == SPEC["steps"]
            loss = max(abs(a - b) for a, b in zip(result["losses"], reference["losses"]))
            eval_loss = abs(result["eval_loss"] - reference["eval_loss"])
            weights = max((result["weights"][k] - w).abs().max().item() for k, w in reference["weights"].items())
            logits = (result["predictions"] - reference["predictions"]).abs().max().item()
            print(f"LORA {mode} rank {rank}: loss {loss:.1e} eval {eval_loss:.1e} weights {weights:.1e}", end=" ")
            print(f"logits {logits:.1e}")
            assert loss <= LOSS_TOL and eval_loss <= LOSS_TOL and weights <= WEIGHT_TOL and logits <= WEIGHT_TOL, (
                mode,
                rank,
                loss,
                eval_loss,
                weights,
                logits,
            )


def _peft_model(targets, seed=0):
    """A tiny Llama with rank-4 adapters whose B is random (peft starts it at zero, which would
    make the adapted model the base model)."""
    from recipes.lora import add_lora

    model = add_lora(tiny_model("llama", seed=seed), RANK, targets=targets)
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2)
    return model


def _generate_worker(rank, world, mode):
    model = _peft_model(None).eval()
    base = tiny_model("llama").eval()
    ids, mask = prompts(2, 37, seed=4, left_pad=(0, 5))
    adapted = compare(model, mode, ids, mask)
    differs = not torch.equal(
        base.generate(ids, attention_mask=mask, **{**GREEDY, "max_new_tokens": 40}).sequences, adapted[2]
    )
    return adapted, differs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["usp_attn"])  # all-to-all and ring; every mode: test_generation.py
def test_generate_decodes_a_peft_model_like_one_process(mode):
    per_rank = run_ranks(_generate_worker, 2, mode, timeout=280)
    for (same, error, sequences), differs in per_rank:
        print(f"{mode}: tokens equal {same}, step logits {error:.1e}, adapter changes the tokens {differs}")
        assert same and error <= LOGITS_TOL and differs
        assert torch.equal(sequences, per_rank[0][0][2])


def _train_without_sync(rank, world, targets):
    """Two ranks, no DDP (each steps on its own shard's gradient), adapters on `targets`: the
    guard's error, or None, and the forwards run."""
    model = _peft_model(targets)
    apply_seq_parallel_monkey_patch("zigzag_ring_attn", model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    input_ids, targets_ids = tiny_batch(1, SEQ)
    local = prepare_seq_parallel_inputs("zigzag_ring_attn", input_ids, None, targets_ids, rank, world, "cpu")
    forwards = 0
    try:
        for _ in range(3):
            forwards += 1
            logits = model(input_ids=local["local_input_ids"], position_ids=local["local_position_ids"]).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), local["local_target_ids"].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    except replicas.ReplicaDriftError as caught:
        return str(caught), forwards
    finally:
        remove_seq_parallel_monkey_patch()
    return None, forwards


@pytest.mark.timeout(200)
def test_guard_sees_adapters_outside_the_attention():
    """Adapters on the MLPs only: the attention's weights stay frozen and equal, yet the
    adapters drift from the first step; the guard must stop the run at forward 2."""
    for error, forwards in run_ranks(_train_without_sync, 2, ["gate_proj", "down_proj"], timeout=180):
        assert error is not None and "not being averaged" in error and forwards == 2, (error, forwards)
