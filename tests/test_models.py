"""The patched models on P gloo ranks against the unpatched model on the full sequence:
logits, loss and every parameter gradient."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from distributed import run_ranks
from easy_context import (
    apply_seq_parallel_monkey_patch,
    gather_seq_parallel_outputs,
    prepare_seq_parallel_inputs,
    remove_seq_parallel_monkey_patch,
)
from tiny_models import MODEL_TYPES, tiny_batch, tiny_model

SEQ = 128
# (model type, batch, dtype, attn_implementation the model was created with)
FP32_CASES = [(m, b, torch.float32, "sdpa") for m in MODEL_TYPES for b in (1, 2)] + [("llama", 2, torch.float32, "eager")]
BF16_CASES = [(m, 1, torch.bfloat16, "sdpa") for m in MODEL_TYPES]
MODE = "zigzag_ring_attn"


def step(model, input_ids, position_ids, target_ids, group=None):
    """Forward + backward of the token-weighted mean loss over the whole (sharded) sequence.

    Each rank back-propagates its own tokens' share; the full gradient is the sum over ranks.
    """
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), target_ids.flatten(), ignore_index=-100, reduction="sum")
    stats = torch.stack([loss_sum.detach(), (target_ids != -100).sum().to(loss_sum.dtype)])
    if group is not None:
        dist.all_reduce(stats, group=group)
    (loss_sum / stats[1]).backward()
    return logits.detach(), (stats[0] / stats[1]).item()


def model_worker(rank, world_size, cases):
    for model_type in MODEL_TYPES:
        apply_seq_parallel_monkey_patch(MODE, model_type)
    results = {}
    for case in cases:
        model_type, batch, dtype, impl = case
        model = tiny_model(model_type, dtype, attn_implementation=impl)
        input_ids, target_ids = tiny_batch(batch, SEQ)
        local = prepare_seq_parallel_inputs(MODE, input_ids, None, target_ids, rank, world_size, "cpu")
        logits, loss = step(model, local["local_input_ids"], local["local_position_ids"], local["local_target_ids"],
                            dist.group.WORLD)
        grads = {}
        for name, p in model.named_parameters():
            grad = p.grad.float().contiguous()
            dist.all_reduce(grad)
            grads[name] = grad
        logits = gather_seq_parallel_outputs(MODE, logits)
        results[case] = (logits, loss, grads) if rank == 0 else None
    remove_seq_parallel_monkey_patch()
    return results


def reference(case):
    model_type, batch, dtype, impl = case
    model = tiny_model(model_type, dtype, attn_implementation=impl)
    input_ids, target_ids = tiny_batch(batch, SEQ)
    logits, loss = step(model, input_ids, None, target_ids)
    return logits, loss, {n: p.grad.float() for n, p in model.named_parameters()}


def fp32_reference_with_same_weights(case):
    """The bf16 model's (rounded) weights run in fp32: the ground truth for bf16 errors."""
    model_type, batch, _, impl = case
    model = tiny_model(model_type, torch.bfloat16, attn_implementation=impl).float()
    input_ids, target_ids = tiny_batch(batch, SEQ)
    logits, loss = step(model, input_ids, None, target_ids)
    return logits, loss, {n: p.grad for n, p in model.named_parameters()}


def errors(got, want):
    """(max-abs logits error, abs loss error, worst per-parameter max-abs relative grad error)."""
    logits_err = (got[0].float() - want[0].float()).abs().max().item()
    loss_err = abs(got[1] - want[1])
    grad_err = max(
        ((got[2][n] - want[2][n]).abs().max() / want[2][n].abs().max().clamp(min=1e-12)).item() for n in want[2]
    )
    assert set(got[2]) == set(want[2])
    return logits_err, loss_err, grad_err


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_patched_models_match_single_process_fp32(world_size):
    results = run_ranks(model_worker, world_size, FP32_CASES)[0]
    for case in FP32_CASES:
        logits_err, loss_err, grad_err = errors(results[case], reference(case))
        print(f"P={world_size} {case}: logits {logits_err:.1e} loss {loss_err:.1e} grads {grad_err:.1e}")
        assert logits_err <= 1e-4 and loss_err <= 1e-5 and grad_err <= 1e-4, case


@pytest.mark.timeout(400)
def test_patched_models_match_single_process_bf16():
    """bf16 bound: our error against the fp32 truth is at most 2x (plus 1/256) that of the
    unpatched bf16 model itself: sequence parallelism may round differently, never worse
    in kind. A wrong block or a lost gradient gives errors of order 1 and fails."""
    results = run_ranks(model_worker, 2, BF16_CASES)[0]
    for case in BF16_CASES:
        truth = fp32_reference_with_same_weights(case)
        ours, theirs = errors(results[case], truth), errors(reference(case), truth)
        print(f"P=2 {case}: ours {[f'{e:.1e}' for e in ours]} hf bf16 {[f'{e:.1e}' for e in theirs]}")
        for mine, baseline in zip(ours, theirs):
            assert mine <= 2 * baseline + 1 / 256, (case, ours, theirs)
