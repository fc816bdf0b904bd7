"""What a hybrid model (recurrent or convolution layers beside attention) must also do exactly,
checked by the model sweep on every hybrid type and by tests/distributed/test_hybrids.py:

- packed documents: each mixer's state restarts at every document, so a packed row gives what
  each document gives alone (transformers' own torch paths carry the state across documents:
  the one-process model on the packed row is not the reference);
- generation: easy_context.generate (sharded prefill, the mixers' states kept after it) gives
  the tokens and the per-step logits of one process's model.generate.
"""

from __future__ import annotations

import inspect
import sys

import torch

from tools import exact_step

__all__ = [
    "DOCUMENTS",
    "GREEDY",
    "compare_generation",
    "each_document_alone",
    "packed_batch",
    "prompts",
    "run",
    "takes_positions",
    "with_long_memory",
]

# two rows of exact_step.SEQ = 128 tokens: documents that start inside runs (zigzag's runs are
# 32 tokens at 2 ranks, ulysses' 64) and at a run's first token, one shorter than a convolution's
# halo; and one document
DOCUMENTS = ([40, 50, 38], [64, 2, 62])
GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
NEW_TOKENS = 12


def takes_positions(model) -> bool:
    """Whether the model's forward takes position_ids (Mamba2ForCausalLM does not: one document
    per row)."""
    return "position_ids" in inspect.signature(type(model).forward).parameters


def packed_batch():
    """(input_ids, position_ids, target_ids) of two packed rows (DOCUMENTS)."""
    input_ids, target_ids = exact_step.batch()
    input_ids, target_ids = input_ids.repeat(2, 1), target_ids.repeat(2, 1)
    input_ids[1] = input_ids[1].flip(0)
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in DOCUMENTS])
    return input_ids, position_ids, target_ids


def each_document_alone(model):
    """(logits, loss, gradients) of the unpatched model on each document by itself, the loss
    over all of them at once."""
    import torch.nn.functional as F

    input_ids, _, target_ids = packed_batch()
    rows = []
    for row, lengths in enumerate(DOCUMENTS):
        ends = torch.tensor(lengths).cumsum(0).tolist()
        alone = [
            model(input_ids=input_ids[row : row + 1, e - n : e], use_cache=False).logits for n, e in zip(lengths, ends)
        ]
        rows.append(torch.cat(alone, 1))
    logits = torch.cat(rows)
    loss = F.cross_entropy(logits.flatten(0, 1), target_ids.flatten(), ignore_index=-100)
    loss.backward()
    grads = {n: (torch.zeros_like(p) if p.grad is None else p.grad) for n, p in model.named_parameters()}
    return logits.detach(), loss.item(), grads


def with_long_memory(model):
    """The tiny model with its mixers' states weighing in the next tokens' logits: slow decay
    (dt_bias -3: a state keeps most of itself per token), mixer inputs 5x and outputs 20x (random
    initialisation makes states of 1e-6 and mixer outputs a small part of the residual), and no
    skip connection (Mamba-2's D, which the output's norm would weigh against the state). A
    decoding step from a state off by half then moves the logits by 1e-2 (Mamba-2) to 0.7 (the
    gated delta rule), where at initialisation it moved them by 1e-6; a convolution state off by
    half, by 1e-1."""
    from easy_context.hf.mixers import mixer_layers

    with torch.no_grad():
        for module, _ in mixer_layers(model):
            output = "out_proj" if hasattr(module, "out_proj") else "o_proj"
            for name, child in module.named_children():
                if isinstance(child, torch.nn.Linear):
                    child.weight.mul_(20 if name == output else 5)
            if hasattr(module, "dt_bias"):
                module.dt_bias.fill_(-3.0)
            if hasattr(module, "D"):
                module.D.zero_()
    return model


def prompts(batch: int, length: int, left_pad=()):
    ids = torch.randint(3, 100, (batch, length), generator=torch.Generator().manual_seed(length))
    mask = torch.ones_like(ids)
    for row, pad in enumerate(left_pad):
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


def compare_generation(model, mode, ids, mask, **options):
    """(tokens equal, worst step-logits error) of easy_context.generate against one process's
    model.generate, greedy, NEW_TOKENS new tokens."""
    from easy_context import generate, remove_seq_parallel_monkey_patch

    kwargs = dict(GREEDY, max_new_tokens=NEW_TOKENS)
    want = model.generate(ids, attention_mask=mask, **kwargs)
    try:
        got = generate(mode, model, ids, attention_mask=mask, **kwargs, **options)
    finally:
        remove_seq_parallel_monkey_patch()
    error = max(float((a - b).abs().max()) for a, b in zip(got.logits, want.logits))
    return torch.equal(got.sequences, want.sequences), error


def run(model, rank: int, world_size: int, mode: str = "zigzag_ring_attn") -> dict:
    """The sweep's results for a hybrid `model` in `mode`: {"packed+<mode>": [logits, loss, grads,
    share of the bound], "generate+<mode>": [logits error, 0, 0, share of the bound] |
    {"error": ...}, "_notes": [why a check does not apply]}: packed rows where the model shows its
    mixers position_ids, generation where one process's model.generate runs."""
    import copy

    from easy_context import (
        apply_seq_parallel_monkey_patch,
        gather_seq_parallel_outputs,
        prepare_seq_parallel_inputs,
        remove_seq_parallel_monkey_patch,
    )
    from easy_context.hf import active_patch
    from easy_context.hf.mixers import forward_positions

    results, notes = {}, []
    module = sys.modules[type(model).__module__]
    if takes_positions(model):
        want = each_document_alone(copy.deepcopy(model))
        patched = copy.deepcopy(model)
        try:
            apply_seq_parallel_monkey_patch(mode, patched)
            input_ids, position_ids, target_ids = packed_batch()
            local = prepare_seq_parallel_inputs(mode, input_ids, position_ids, target_ids, rank, world_size, "cpu")
            got = exact_step.step(
                patched,
                local["local_input_ids"],
                local["local_position_ids"],
                local["local_target_ids"],
                active_patch().groups().sp,
            )
            logits = gather_seq_parallel_outputs(mode, got[0])
            seen = forward_positions(module) is not None
        finally:
            remove_seq_parallel_monkey_patch()
        if seen:
            results[f"packed+{mode}"] = list(exact_step.errors((logits, *got[1:]), want))
        else:
            notes.append("packed rows are one document to its mixers (the model shows them no position_ids)")
    else:
        notes.append("packed rows are one document to its mixers (the model takes no position_ids)")
    remembering = with_long_memory(copy.deepcopy(model)).eval()
    try:
        ids, mask = prompts(1, 5)
        remembering.generate(ids, attention_mask=mask, max_new_tokens=1)
    except Exception as error:  # noqa: BLE001 - transformers' own generate: nothing to match
        notes.append(f"one process's model.generate fails ({type(error).__name__}: {str(error)[:80]})")
        return {**results, "_notes": notes}
    same, error = compare_generation(remembering, mode, *prompts(2, 42, (0, 9)))
    key = f"generate+{mode}"
    if same:
        results[key] = [error, 0.0, 0.0, error / exact_step.LOGITS_TOL]
    else:
        results[key] = {"error": f"generate: other tokens than one process's model.generate (logits {error:.1e})"}
    return {**results, "_notes": notes}
