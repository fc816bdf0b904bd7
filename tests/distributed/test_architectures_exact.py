"""The architectures whose features the tests switch on one by one (tests/tiny_models.py), at 4
gloo ranks under usp_attn and in bf16, against the unpatched model on the full sequence: logits,
loss and every parameter gradient. Every supported type in fp32 at 2 ranks in each mode family
is tools/sweep_models.py's (tests/recipes/test_model_sweep.py)."""

import pytest
import torch
import torch.distributed as dist
from exactness import architecture_reference as reference
from exactness import errors, step
from ranks import run_ranks
from tiny_models import ARCHITECTURES, tiny_batch, tiny_model

from easy_context import (
    apply_seq_parallel_monkey_patch,
    gather_seq_parallel_outputs,
    prepare_seq_parallel_inputs,
    remove_seq_parallel_monkey_patch,
)
from easy_context.hf import active_patch

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)

SEQ = 128
LOGITS_TOL, LOSS_TOL, GRAD_TOL = 1e-4, 1e-5, 1e-4  # as tests/distributed/test_models.py


def architectures_worker(rank, world_size, mode, options=None, types=ARCHITECTURES, dtype=torch.float32):
    results = {}
    for model_type in types:
        model = tiny_model(model_type, dtype)
        apply_seq_parallel_monkey_patch(mode, model, **(options or {}))  # a model instance: its config names the type
        group = active_patch().groups().sp
        input_ids, target_ids = tiny_batch(1, SEQ)
        local = prepare_seq_parallel_inputs(mode, input_ids, None, target_ids, rank, world_size, "cpu")
        logits, loss = step(
            model, local["local_input_ids"], local["local_position_ids"], local["local_target_ids"], group
        )
        grads = {}
        for name, p in model.named_parameters():
            grads[name] = p.grad.float().contiguous()
            dist.all_reduce(grads[name], group=group)
        results[model_type] = (gather_seq_parallel_outputs(mode, logits), loss, grads)
        remove_seq_parallel_monkey_patch()
    return results


def assert_exact(results, mode, types=ARCHITECTURES):
    failed = []
    for model_type in types:
        logits_err, loss_err, grad_err = errors(results[model_type], reference(model_type))
        print(f"{mode} {model_type}: logits {logits_err:.1e} loss {loss_err:.1e} grads {grad_err:.1e}")
        if not (logits_err <= LOGITS_TOL and loss_err <= LOSS_TOL and grad_err <= GRAD_TOL):
            failed.append((model_type, logits_err, loss_err, grad_err))
    assert not failed, failed


FEATURE_TYPES = ("gemma2", "gpt_oss", "deepseek_v3", "cohere2")  # softcap, sinks, MLA, NoPE global layers


@pytest.mark.timeout(600)
def test_usp_at_four_ranks_splits_sinks_softcap_and_mla_over_ulysses_and_ring():
    results = run_ranks(architectures_worker, 4, "usp_attn", {"ring_degree": 2}, FEATURE_TYPES, timeout=540)[0]
    assert_exact(results, "usp_attn P=4 ring_degree=2", FEATURE_TYPES)


@pytest.mark.timeout(600)
def test_every_architecture_in_bf16_is_within_the_unpatched_models_own_error():
    """As tests/distributed/test_models.py's bf16 bound: our error against the fp32 truth is at most 2x
    (plus 1/256) that of the unpatched bf16 model itself."""
    results = run_ranks(architectures_worker, 2, "zigzag_ring_attn", None, ARCHITECTURES, torch.bfloat16, timeout=540)[
        0
    ]
    failed = []
    for model_type in ARCHITECTURES:
        truth = reference(model_type, torch.float32, weights_dtype=torch.bfloat16)
        ours, theirs = errors(results[model_type], truth), errors(reference(model_type, torch.bfloat16), truth)
        print(f"zigzag P=2 bf16 {model_type}: ours {[f'{e:.1e}' for e in ours]} hf bf16 {[f'{e:.1e}' for e in theirs]}")
        if any(mine > 2 * baseline + 1 / 256 for mine, baseline in zip(ours, theirs)):
            failed.append((model_type, ours, theirs))
    assert not failed, failed
