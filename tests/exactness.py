"""What the exactness tests share: one training step over a (sharded) sequence, the errors of a
run against the single-process reference, and that reference: of an architecture
(`architecture_reference`) and of a mode test's case (`reference`: (model type, batch, dtype,
attn_implementation), the data of its data-parallel group)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tiny_models import tiny_batch, tiny_model

SEQ = 128  # the tests' sequence length (tests/distributed/test_models.py)


def step(model, input_ids, position_ids, target_ids, group=None, attention_mask=None):
    """Forward + backward of the token-weighted mean loss over the whole (sharded) sequence.

    Each rank back-propagates its own tokens' share; the full gradient is the sum over ranks.
    """
    logits = model(
        input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False
    ).logits
    loss_sum = F.cross_entropy(logits.flatten(0, 1).float(), target_ids.flatten(), ignore_index=-100, reduction="sum")
    stats = torch.stack([loss_sum.detach(), (target_ids != -100).sum().to(loss_sum.dtype)])
    if group is not None:
        dist.all_reduce(stats, group=group)
    (loss_sum / stats[1]).backward()
    return logits.detach(), (stats[0] / stats[1]).item()


def errors(got, want):
    """(max-abs logits error, abs loss error, worst per-parameter max-abs relative grad error)."""
    assert got[0].shape == want[0].shape and set(got[2]) == set(want[2])
    logits_err = (got[0].float() - want[0].float()).abs().max().item()
    loss_err = abs(got[1] - want[1])
    grad_err = max(
        ((got[2][n] - want[2][n]).abs().max() / want[2][n].abs().max().clamp(min=1e-12)).item() for n in want[2]
    )
    return logits_err, loss_err, grad_err


def architecture_reference(model_type, dtype=torch.float32, weights_dtype=None, seq=128, **overrides):
    """The unpatched model on the whole sequence; weights_dtype=bf16 with dtype fp32: the bf16
    model's rounded weights run in fp32 (the ground truth for bf16 errors)."""
    input_ids, target_ids = tiny_batch(1, seq)
    model = tiny_model(model_type, weights_dtype or dtype, **overrides).to(dtype)
    logits, loss = step(model, input_ids, None, target_ids)
    return logits, loss, {n: p.grad.float() for n, p in model.named_parameters()}


def data_seed(dp_rank):
    """Each data-parallel group (the ranks sharing one sequence) gets different data."""
    return 1 + dp_rank


def reference(case, dp_rank=0, weights_dtype=None, seq=SEQ):
    """The unpatched model on the full sequence. weights_dtype=bf16 with case dtype fp32:
    the bf16 model's rounded weights run in fp32, the ground truth for bf16 errors."""
    model_type, batch, dtype, impl = case
    model = tiny_model(model_type, weights_dtype or dtype, attn_implementation=impl).to(dtype)
    input_ids, target_ids = tiny_batch(batch, seq, seed=data_seed(dp_rank))
    logits, loss = step(model, input_ids, None, target_ids)
    return logits, loss, {n: p.grad.float() for n, p in model.named_parameters()}
