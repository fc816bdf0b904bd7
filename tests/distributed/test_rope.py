"""Every rope type of transformers' ROPE_INIT_FUNCTIONS (and the plain rotary), in every mode,
against the unpatched model in one process: training steps (logits, loss, every gradient) and
evaluation forwards below and above the original context, generation whose prompt starts below
it and decodes past it, and Gemma 3's per-layer-type rope parameters (a local base of its own).

`dynamic` and `longrope` pick their frequencies from the length of the input (and `dynamic`
keeps state from call to call), so each case is a sequence of calls on one model: above the
original context, below it (dynamic resets), above again; the reference makes the same calls."""

import copy

import pytest
import torch
import torch.distributed as dist
from exactness import errors, step
from ranks import run_ranks
from tiny_models import VOCAB, tiny_batch, tiny_model
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from benchmarks import dispatch_counts
from easy_context import (
    apply_seq_parallel_monkey_patch,
    gather_seq_parallel_outputs,
    generate,
    prepare_seq_parallel_inputs,
    remove_seq_parallel_monkey_patch,
)
from easy_context.hf import active_patch
from easy_context.hf.architectures import PROVEN_ROPE_TYPES
from easy_context.hf.rope import length_dependent
from tools.tiny_configs import rope_parameters

LOGITS_TOL, LOSS_TOL, GRAD_TOL = 1e-4, 1e-5, 1e-4  # as tests/distributed/test_models.py
ORIGINAL = 32  # the original context of every rope type here (max_position_embeddings too)
# Lengths above and below it. At 2 ranks a contiguous shard of 64 tokens ends at 32 (not above
# the original context), a zigzag shard at 48: both pick other frequencies than the whole.
ABOVE, BELOW = 64, 24
HALF_HEAD = 8  # the tiny models' head dim is 16
ROPES = {rope: rope_parameters(rope, ORIGINAL, HALF_HEAD) for rope in sorted(set(ROPE_INIT_FUNCTIONS) | {"default"})}
MODES = ["zigzag_ring_attn", "ulysses_attn", "dist_flash_attn", "usp_attn", "data_parallel"]


def rope_model(rope_type, model_type="llama", **overrides):
    parameters = {"rope_type": rope_type, "rope_theta": 10000.0, **ROPES[rope_type]}
    if model_type == "gemma3_text":  # the global layers take the type; the local ones a base of their own
        parameters = {
            "full_attention": parameters,
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
        }
    return tiny_model(model_type, rope_parameters=parameters, max_position_embeddings=ORIGINAL, **overrides)


def cases():
    """(rope type, model type): every type on Llama; the length-dependent ones on Gemma 3 too."""
    found = [(rope, "llama") for rope in ROPES]
    found += [(rope, "gemma3_text") for rope in ROPES if length_dependent(rope)]
    return found


def calls(model, mode, rank, world_size, group):
    """A training step above the original context, evaluation forwards below and above it:
    [(logits, loss, grads)] with the gradients of the training step."""
    results = []
    for seq, train in ((ABOVE, True), (BELOW, False), (ABOVE, False)):
        model.train(train)
        model.zero_grad()
        input_ids, target_ids = tiny_batch(1, seq, seed=seq)
        if mode is not None:
            local = prepare_seq_parallel_inputs(mode, input_ids, None, target_ids, rank, world_size, "cpu")
            input_ids, target_ids = local["local_input_ids"], local["local_target_ids"]
            position_ids = local["local_position_ids"]
        else:
            position_ids = None
        with torch.set_grad_enabled(train):
            logits, loss = step(model, input_ids, position_ids, target_ids, group) if train else (None, None)
            if not train:
                logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
        if mode is not None:
            logits = gather_seq_parallel_outputs(mode, logits)
        grads = {}
        if train:
            for name, p in model.named_parameters():
                grads[name] = p.grad.float().contiguous()
                if group is not None:
                    dist.all_reduce(grads[name], group=group)
        results.append((logits, loss, grads))
    return results


def _training_worker(rank, world_size, mode, options):
    worst = {}
    for rope, model_type in cases():
        model = rope_model(rope, model_type)
        reference = calls(copy.deepcopy(model), None, 0, 1, None)
        apply_seq_parallel_monkey_patch(mode, model, **options)
        group = active_patch().groups().sp if active_patch() else None
        sharded = calls(model, mode, rank, world_size, group)
        remove_seq_parallel_monkey_patch()
        train = errors(sharded[0], reference[0])
        evals = [(sharded[i][0] - reference[i][0]).abs().max().item() for i in (1, 2)]
        worst[(rope, model_type)] = (max(train[0], *evals), train[1], train[2])
    return worst


def _check(worst, what):
    failed = {
        case: e for case, e in worst.items() if not (e[0] <= LOGITS_TOL and e[1] <= LOSS_TOL and e[2] <= GRAD_TOL)
    }
    for case, e in worst.items():
        print(f"{what} {case}: logits {e[0]:.1e} loss {e[1]:.1e} grads {e[2]:.1e}")
    assert not failed, failed


def test_every_proven_rope_type_is_one_transformers_has_and_the_others_are_refused():
    """The proven list holds transformers' ROPE_INIT_FUNCTIONS plus the plain rotary (older
    releases have fewer); a rope type outside it (a future one) is refused, naming it."""
    assert set(ROPE_INIT_FUNCTIONS) | {"default"} <= PROVEN_ROPE_TYPES == set(ROPES)
    model = rope_model("dynamic")
    model.config.rope_parameters["rope_type"] = "not_a_rope"
    with pytest.raises(ValueError, match=r"rope type \['not_a_rope'\].*proven: \['default'"):
        apply_seq_parallel_monkey_patch("zigzag_ring_attn", model)
    assert active_patch() is None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_rope_type_trains_and_evaluates_exactly_in_every_mode_at_two_ranks():
    results = run_ranks(_all_modes_worker, 2, timeout=560)[0]
    for mode in MODES:
        _check(results[mode], f"{mode} P=2")
    # What predicts the GPU cost: the group's length adds no host sync to transformers' own
    # (its dynamic update syncs in one process too), and none per layer.
    syncs = results["syncs"]
    print("host syncs per forward (ours 2 layers, ours 4 layers, one process):", syncs)
    for rope in ("dynamic", "longrope"):
        ours, ours_4_layers, theirs = syncs[rope]
        assert ours == ours_4_layers, (rope, syncs)
        assert ours - syncs["default"][0] <= theirs - syncs["default"][2], (rope, syncs)


def _all_modes_worker(rank, world_size):
    results = {mode: _training_worker(rank, world_size, mode, {}) for mode in MODES}
    results["syncs"] = _sync_counts(rank, world_size)
    return results


def _sync_counts(rank, world_size, mode="zigzag_ring_attn"):
    """rope type -> host syncs of one forward: (patched 2 layers, patched 4 layers, unpatched)."""
    found = {}
    input_ids, _ = tiny_batch(1, ABOVE)
    for rope in ("default", "dynamic", "longrope"):
        counts = []
        for layers in (2, 4):
            model = rope_model(rope, num_hidden_layers=layers).eval()
            apply_seq_parallel_monkey_patch(mode, model)
            local = prepare_seq_parallel_inputs(mode, input_ids, None, None, rank, world_size, "cpu")
            counts.append(_forward_syncs(model, local["local_input_ids"], local["local_position_ids"]))
            remove_seq_parallel_monkey_patch()
        counts.append(_forward_syncs(rope_model(rope).eval(), input_ids, None))
        found[rope] = tuple(counts)
    return found


def _forward_syncs(model, input_ids, position_ids) -> int:
    def forward():
        with torch.no_grad():
            model(input_ids=input_ids, position_ids=position_ids, use_cache=False)

    return dispatch_counts.count_case(forward).syncs


def _generation_worker(rank, world_size, mode):
    """Greedy generation from fresh copies of one model (dynamic's state is the history of its
    calls): a prompt below the original context that decodes past it, and one above it."""
    results = {}
    greedy = dict(do_sample=False, eos_token_id=None, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    for rope, model_type in [c for c in cases() if length_dependent(c[0])] + [("default", "llama")]:
        model = rope_model(rope, model_type).eval()
        for length, new in ((20, 24), (50, 8)):
            ids = torch.randint(3, VOCAB, (2, length), generator=torch.Generator().manual_seed(length))
            mask = torch.ones_like(ids)
            mask[1, :5] = 0  # a left-padded row
            want = copy.deepcopy(model).generate(ids, attention_mask=mask, max_new_tokens=new, **greedy)
            got = generate(mode, copy.deepcopy(model), ids, attention_mask=mask, max_new_tokens=new, **greedy)
            remove_seq_parallel_monkey_patch()
            error = max(float((a - b).abs().max()) for a, b in zip(got.logits, want.logits))
            results[(rope, model_type, length)] = (torch.equal(got.sequences, want.sequences), error)
    return results


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_generation_with_every_length_dependent_rope_matches_model_generate():
    results = run_ranks(_generation_modes_worker, 2, timeout=560)[0]
    failed = {case: r for case, r in results.items() if not (r[0] and r[1] <= LOGITS_TOL)}
    for case, (same, error) in results.items():
        print(f"generate {case}: tokens equal {same}, step logits {error:.1e}")
    assert not failed, failed


def _generation_modes_worker(rank, world_size):
    found = {}
    for mode in ("zigzag_ring_attn", "ulysses_attn", "dist_flash_attn", "usp_attn"):
        found.update({(mode, *case): r for case, r in _generation_worker(rank, world_size, mode).items()})
    return found


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_length_dependent_rope_under_usp_at_four_ranks():
    """Ulysses x ring: the ranks of one ring group hold other lengths than their Ulysses peers."""
    worst = run_ranks(_usp_worker, 4, timeout=560)[0]
    _check(worst, "usp_attn P=4 ring_degree=2")


def _usp_worker(rank, world_size):
    return _training_worker(rank, world_size, "usp_attn", {"ring_degree": 2})
