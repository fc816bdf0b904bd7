"""One training step of a tiny model, and its errors against the unpatched model in one process:
what the model sweep (sweep_models.py), its hybrid checks (hybrid_checks.py) and the released
configs (released_configs.py) compare. Imported by each; imports none of them."""

from __future__ import annotations

SEQ = 128
MODES = ("zigzag_ring_attn", "ulysses_attn", "dist_flash_attn")  # one mode of each family
LOGITS_TOL, LOSS_TOL, GRAD_TOL = 1e-4, 1e-5, 1e-4  # as tests/distributed/test_models.py
# A gradient entry this far below the model's largest is fp32 rounding whatever its parameter:
# 1e-6 of the largest is ten times fp32's epsilon.
FLOOR_OF_LARGEST = 1e-6


def errors(got, want, truth=None):
    """[logits, loss, grads] errors of `got` against the one-process fp32 run `want`, and the
    share of its bound that the worst quantity uses (<= 1: exact). A quantity's bound is the
    architecture tests' (LOGITS_TOL, LOSS_TOL absolute; GRAD_TOL relative to the parameter's
    largest gradient), or, where the one-process fp32 model is itself further than that from
    the fp64 `truth`, twice its own error: an ill-conditioned gradient (DiffLlama's lambdas:
    1.5e-4 relative in one process) or one that is zero in exact arithmetic (OPT's key bias)
    is held to what fp32 can give, not to a bound fp32 cannot meet."""
    logits = (got[0] - want[0]).abs().max().item()
    loss = abs(got[1] - want[1])
    grad, used = 0.0, 0.0
    if truth is None:
        truth = want
    largest = max(g.abs().max().item() for g in truth[2].values())
    used = max(
        (got[0] - truth[0]).abs().max().item() / max(LOGITS_TOL, 2 * (want[0] - truth[0]).abs().max().item()),
        abs(got[1] - truth[1]) / max(LOSS_TOL, 2 * abs(want[1] - truth[1])),
    )
    for name, g in want[2].items():
        grad = max(grad, ((got[2][name] - g).abs().max() / g.abs().max().clamp(min=1e-12)).item())
        exact = truth[2][name]
        bound = max(GRAD_TOL * exact.abs().max().item(), 2 * (g - exact).abs().max().item(), FLOOR_OF_LARGEST * largest)
        used = max(used, (got[2][name] - exact).abs().max().item() / bound)
    return logits, loss, grad, used


def step(model, input_ids, position_ids, target_ids, group, attention_mask=None):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    logits = model(
        input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False
    ).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    loss_sum = F.cross_entropy(logits.flatten(0, 1), target_ids.flatten(), ignore_index=-100, reduction="sum")
    stats = torch.stack([loss_sum.detach(), (target_ids != -100).sum().to(loss_sum.dtype)])
    if group is not None:
        dist.all_reduce(stats, group=group)
    (loss_sum / stats[1]).backward()
    grads = {}
    for name, p in model.named_parameters():
        grad = torch.zeros_like(p) if p.grad is None else p.grad.contiguous()
        if group is not None:
            dist.all_reduce(grad, group=group)
        grads[name] = grad
    return logits.detach(), (stats[0] / stats[1]).item(), grads


def batch():
    import torch

    from tools.tiny_configs import VOCAB

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, VOCAB, (1, SEQ + 1), generator=g)
    input_ids, target_ids = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    target_ids[:, : SEQ // 8] = -100
    return input_ids, target_ids
