"""Hybrid models' sequence mixers (mixers/, hf/mixers.py) beyond the sweep's fp32 check at 2 ranks:
Ulysses x ring at 4 ranks under both strategies, packed documents (exact against each document
alone) and padding, bf16 within the unpatched bf16 model's own error, the bytes each strategy
declares equal to the bytes it sends, and what is refused."""

import pytest
import torch
import torch.distributed as dist
from exactness import errors
from ranks import run_ranks
from tiny_models import tiny_model

from benchmarks.attention_comm import CommCounter
from easy_context import apply_seq_parallel_monkey_patch, remove_seq_parallel_monkey_patch
from easy_context.core.pieces import local_pieces
from easy_context.hf import active_patch
from easy_context.hf.mixers import mixer_shapes
from easy_context.mixers import STRATEGIES
from easy_context.mixers.costs import positions_traffic, traffic
from tools import exact_step
from tools.hybrid_checks import compare_generation, each_document_alone, packed_batch, prompts, with_long_memory

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)

LOGITS_TOL, LOSS_TOL, GRAD_TOL = 1e-4, 1e-5, 1e-4  # as tests/distributed/test_models.py
# one of each family: Gated DeltaNet, Mamba-2 with groups of B/C, Mamba-2 with one group, short convolutions
FAMILIES = ("qwen3_next", "nemotron_h", "bamba", "lfm2")


def sharded_step(model, mode, options, rank, world_size, counter=None):
    """Forward and backward of the patched model on this rank's shard; the counter (if any)
    counts the bytes sent in them alone."""
    from easy_context import gather_seq_parallel_outputs, prepare_seq_parallel_inputs

    apply_seq_parallel_monkey_patch(mode, model, **options)
    group = active_patch().groups().sp
    input_ids, target_ids = exact_step.batch()
    local = prepare_seq_parallel_inputs(mode, input_ids, None, target_ids, rank, world_size, "cpu", **options)
    if counter is not None:
        counter.bytes, counter.enabled = 0, True
    got = exact_step.step(
        model, local["local_input_ids"], local["local_position_ids"], local["local_target_ids"], group
    )
    if counter is not None:
        counter.enabled = False
    logits = gather_seq_parallel_outputs(mode, got[0], **{k: v for k, v in options.items() if k != "mixer_strategy"})
    return (logits.float(), got[1], {n: g.float() for n, g in got[2].items()})


def reference(model):
    input_ids, target_ids = exact_step.batch()
    got = exact_step.step(model, input_ids, None, target_ids, None)
    return (got[0].float(), got[1], {n: g.float() for n, g in got[2].items()})


def _usp_worker(rank, world_size):
    found = {}
    for model_type in FAMILIES:
        overrides = {"n_groups": 4} if model_type == "nemotron_h" else {}  # groups that split over 4 ranks
        want = reference(tiny_model(model_type, **overrides))
        for strategy in STRATEGIES:
            options = {"ring_degree": 2, "mixer_strategy": strategy}
            got = sharded_step(tiny_model(model_type, **overrides), "usp_attn", options, rank, world_size)
            remove_seq_parallel_monkey_patch()
            found[(model_type, strategy)] = errors(got, want)
    # generation: the prefill's runs cross Ulysses groups
    model = with_long_memory(tiny_model("qwen3_next")).eval()
    found["generate"] = compare_generation(model, "usp_attn", *prompts(2, 41, (0, 5)), ring_degree=2)
    return found


@pytest.mark.timeout(600)
def test_every_family_under_ulysses_and_ring_at_four_ranks_in_both_strategies():
    """usp_attn at 4 ranks (2 Ulysses x 2 ring, zigzag): runs of the sequence cross Ulysses groups,
    a rank holds one or two of them, and head exchange runs over all four ranks."""
    found = run_ranks(_usp_worker, 4, timeout=560)[0]
    same, error = found.pop("generate")
    print(f"usp_attn P=4 generate: tokens equal {same}, logits {error:.1e}")
    assert same and error <= LOGITS_TOL
    for case, (logits, loss, grads) in found.items():
        print(f"usp_attn P=4 {case}: logits {logits:.1e} loss {loss:.1e} grads {grads:.1e}")
        assert logits <= LOGITS_TOL and loss <= LOSS_TOL and grads <= GRAD_TOL, case


def padded_batch():
    """Row 0 left-padded by 11 tokens, row 1 right-padded by 7."""
    input_ids, _, target_ids = packed_batch()
    mask = torch.ones_like(input_ids)
    mask[0, :11], mask[1, -7:] = 0, 0
    target_ids = target_ids.masked_fill(mask == 0, -100)
    return input_ids, target_ids, mask


def masked_step(model, input_ids, target_ids, mask, group=None, position_ids=None):
    """exact_step.step with a padding mask; padding's logits are not compared."""
    logits, loss, grads = exact_step.step(model, input_ids, position_ids, target_ids, group, attention_mask=mask)
    return logits * mask[..., None], loss, grads


def _documents_worker(rank, world_size):
    from easy_context import gather_seq_parallel_outputs, prepare_seq_parallel_inputs

    found = {}
    for model_type in FAMILIES:
        packed_want = each_document_alone(tiny_model(model_type))
        padded_want = masked_step(tiny_model(model_type), *padded_batch())
        for mode in ("zigzag_ring_attn", "ulysses_attn"):
            for strategy in STRATEGIES:
                model = tiny_model(model_type)
                apply_seq_parallel_monkey_patch(mode, model, mixer_strategy=strategy)
                group = active_patch().groups().sp
                input_ids, position_ids, target_ids = packed_batch()
                local = prepare_seq_parallel_inputs(mode, input_ids, position_ids, target_ids, rank, world_size, "cpu")
                got = exact_step.step(
                    model, local["local_input_ids"], local["local_position_ids"], local["local_target_ids"], group
                )
                found[("packed", model_type, mode, strategy)] = errors(
                    (gather_seq_parallel_outputs(mode, got[0]), *got[1:]), packed_want
                )
                model = tiny_model(model_type)
                input_ids, target_ids, mask = padded_batch()
                local = prepare_seq_parallel_inputs(
                    mode, input_ids, None, target_ids, rank, world_size, "cpu", attention_mask=mask
                )
                got = masked_step(
                    model,
                    local["local_input_ids"],
                    local["local_target_ids"],
                    local["local_attention_mask"],
                    group,
                    local["local_position_ids"],
                )
                found[("padded", model_type, mode, strategy)] = errors(
                    (gather_seq_parallel_outputs(mode, got[0]), *got[1:]), padded_want
                )
                remove_seq_parallel_monkey_patch()
    # a model left to its default positions (0.. on every shard) would read a document per shard
    model = tiny_model("bamba")  # a mixer first: it refuses before any attention layer runs
    apply_seq_parallel_monkey_patch("zigzag_ring_attn", model)
    local = prepare_seq_parallel_inputs("zigzag_ring_attn", *packed_batch()[:1], None, None, rank, world_size, "cpu")
    try:
        model(input_ids=local["local_input_ids"], use_cache=False)
        found["default positions"] = None
    except ValueError as error:
        found["default positions"] = str(error)
    # a cache outside easy_context.generate's prefill
    model = tiny_model("qwen3_next")
    apply_seq_parallel_monkey_patch("zigzag_ring_attn", model)
    try:
        model(input_ids=local["local_input_ids"], position_ids=local["local_position_ids"], use_cache=True)
        found["cache"] = None
    except ValueError as error:
        found["cache"] = str(error)
    remove_seq_parallel_monkey_patch()
    return found


@pytest.mark.timeout(600)
def test_packed_documents_are_exact_against_each_document_alone_and_padding_against_the_padded_model():
    """Every mixer's state restarts at each document, in runs that a document start cuts and at a
    run's first token (2 ranks, zigzag's two runs per rank and ulysses' one, both strategies)."""
    found = run_ranks(_documents_worker, 2, timeout=560)[0]
    refusal = found.pop("default positions")
    assert refusal is not None and "are the model's default (0..63 on every rank)" in refusal, refusal
    refusal = found.pop("cache")
    assert refusal is not None and "a cache in a sharded forward of a hybrid layer is for easy_context" in refusal
    failed = []
    for case, (logits, loss, grads) in found.items():
        print(f"{case}: logits {logits:.1e} loss {loss:.1e} grads {grads:.1e}")
        if not (logits <= LOGITS_TOL and loss <= LOSS_TOL and grads <= GRAD_TOL):
            failed.append(case)
    assert not failed, failed


def _generation_worker(rank, world_size):
    found = {}
    for model_type in FAMILIES:
        model = with_long_memory(tiny_model(model_type)).eval()
        for mode in ("zigzag_ring_attn", "ulysses_attn"):
            # a prefill of 36 tokens (every run whole), and of 40 left-padded rows that the layout pads at the end
            found[(model_type, mode, "one row")] = compare_generation(model, mode, *prompts(1, 37))
            found[(model_type, mode, "left-padded")] = compare_generation(model, mode, *prompts(2, 42, (0, 9)))
    return found


@pytest.mark.timeout(600)
def test_generation_with_a_sharded_prefill_matches_one_process():
    """easy_context.generate keeps the mixers' states after the sharded prefill (whole, on every
    rank) and decodes as one process does: the same tokens, the same logits at every step."""
    found = run_ranks(_generation_worker, 2, timeout=560)[0]
    failed = []
    for case, (same, error) in found.items():
        print(f"{case}: tokens equal {same}, logits {error:.1e}")
        if not (same and error <= LOGITS_TOL):
            failed.append(case)
    assert not failed, failed


def _bf16_worker(rank, world_size):
    found = {}
    for model_type in FAMILIES:
        for strategy in STRATEGIES:
            options = {"mixer_strategy": strategy}
            got = sharded_step(tiny_model(model_type, torch.bfloat16), "zigzag_ring_attn", options, rank, world_size)
            remove_seq_parallel_monkey_patch()
            found[(model_type, strategy)] = got
    return found


@pytest.mark.timeout(600)
def test_bf16_is_within_the_unpatched_bf16_models_own_error():
    """As test_architectures_exact's bf16 bound: our error against the fp32 run of the bf16
    model's weights is at most 2x (plus 1/256) that of the unpatched bf16 model itself; the
    scans accumulate in fp32 (transformers' torch paths, and our summaries)."""
    found = run_ranks(_bf16_worker, 2, timeout=560)[0]
    failed = []
    for (model_type, strategy), ours in found.items():
        truth = reference(tiny_model(model_type, torch.bfloat16).float())
        theirs = errors(reference(tiny_model(model_type, torch.bfloat16)), truth)
        mine = errors(ours, truth)
        print(f"bf16 {model_type} {strategy}: ours {[f'{e:.1e}' for e in mine]} hf {[f'{e:.1e}' for e in theirs]}")
        if any(m > 2 * t + 1 / 256 for m, t in zip(mine, theirs)):
            failed.append((model_type, strategy, mine, theirs))
    assert not failed, failed


# models whose every layer is a mixer: the bytes counted are the mixers' alone
PURE = {
    "mamba2 groups of 2": ("mamba2", {}),
    "mamba2 one group": ("mamba2", {"n_groups": 1}),
    "gated delta rule": ("qwen3_next", {"layer_types": ["linear_attention"] * 2}),
    "short convolutions": ("lfm2", {"layer_types": ["conv"] * 2}),
}


def _bytes_worker(rank, world_size):
    CommCounter.install(dist)
    found = {}
    for name, (model_type, overrides) in PURE.items():
        for mode in ("zigzag_ring_attn", "ulysses_attn"):  # two runs on rank 0, one on each
            for strategy in STRATEGIES:
                model = tiny_model(model_type, **overrides)
                sharded_step(model, mode, {"mixer_strategy": strategy}, rank, world_size, CommCounter.instance)
                layout = active_patch().layout()
                remove_seq_parallel_monkey_patch()
                seq = exact_step.SEQ
                runs = max(len(local_pieces(layout, seq, r)) for r in range(world_size))
                declared = sum(traffic(strategy, s) for s in mixer_shapes(model, 1, seq, world_size, runs))
                if model_type != "mamba2":  # Mamba2Model takes no position_ids: one document per row
                    declared += positions_traffic(1, seq, world_size)
                found[(name, mode, strategy)] = (CommCounter.instance.bytes, declared)
    return found


@pytest.mark.timeout(600)
def test_each_strategy_sends_the_bytes_it_declares():
    for rank_found in run_ranks(_bytes_worker, 2, timeout=560):
        for case, (sent, declared) in rank_found.items():
            print(f"{case}: sent {sent} B, declared {declared} B")
            assert sent == declared and sent > 0, case
