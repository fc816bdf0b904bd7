"""The replica guard (easy_context/hf/replicas.py) and the accelerator the scripts create.

The broken setup of issue 12: under torchrun on CPU, an Accelerator with only a gloo
process group is DistributedType.NO and never wraps the model in DDP; every rank steps on
its own shard's gradient. The guard must stop it at the next check, on every rank alike;
make_accelerator (train.py, the evals) gives DDP and trains on untroubled.
"""

import os

import pytest
import torch
from ranks import run_ranks
from tiny_models import tiny_batch, tiny_model

from easy_context import apply_seq_parallel_monkey_patch, prepare_seq_parallel_inputs, remove_seq_parallel_monkey_patch
from easy_context.hf import replicas

SEQ = 64


def _launched_by_torchrun(rank, world):
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",
    )  # the group exists already; never dialled


def _train_steps(rank, world, setup: str, steps: int = 3):
    """An EasyContext-style loop; returns (distributed type, error message or None, forwards run)."""
    _launched_by_torchrun(rank, world)
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    from recipes.launch import make_accelerator

    if setup == "gloo-group-only":
        accelerator = Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    else:
        accelerator = make_accelerator()
    model = tiny_model("llama", seed=0)
    apply_seq_parallel_monkey_patch("zigzag_ring_attn", "llama")
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    input_ids, targets = tiny_batch(1, SEQ)
    local = prepare_seq_parallel_inputs("zigzag_ring_attn", input_ids, None, targets, rank, world, "cpu")
    error, forwards = None, 0
    try:
        for _ in range(steps):
            forwards += 1
            logits = model(input_ids=local["local_input_ids"], position_ids=local["local_position_ids"]).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), local["local_target_ids"].flatten())
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    except replicas.ReplicaDriftError as caught:
        error = str(caught)
    finally:
        remove_seq_parallel_monkey_patch()
    return accelerator.distributed_type.name, error, forwards


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_guard_stops_training_without_gradient_sync():
    results = run_ranks(_train_steps, 2, "gloo-group-only", timeout=180)
    for distributed_type, error, forwards in results:
        assert distributed_type == "NO"  # the broken setup: a process group but no DDP
        assert error is not None and forwards == 2, (error, forwards)  # caught at the first check after a step
        assert "Accelerator(cpu=True)" in error and "not being averaged" in error


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_make_accelerator_gives_ddp_and_the_guard_stays_quiet():
    for distributed_type, error, forwards in run_ranks(_train_steps, 2, "make_accelerator", 4, timeout=180):
        assert distributed_type == "MULTI_CPU" and error is None and forwards == 4


def _forward_with_seed(rank, world, seed):
    model = tiny_model("llama", seed=seed)
    apply_seq_parallel_monkey_patch("ulysses_attn", "llama")
    input_ids, _ = tiny_batch(1, SEQ)
    local = prepare_seq_parallel_inputs("ulysses_attn", input_ids, None, None, rank, world, "cpu")
    try:
        model(input_ids=local["local_input_ids"], position_ids=local["local_position_ids"])
        return None
    except replicas.ReplicaDriftError as caught:
        return str(caught)
    finally:
        remove_seq_parallel_monkey_patch()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_guard_catches_different_initial_weights():
    """Ranks that forgot to seed alike: caught at the first forward, on every rank."""
    assert run_ranks(_forward_with_seed, 2, 0, timeout=100) == [None, None]  # the same seed: quiet
    errors = run_ranks(_forward_by_rank, 2, timeout=100)
    assert all(e is not None and "forward 1" in e for e in errors), errors


def _forward_by_rank(rank, world):
    return _forward_with_seed(rank, world, seed=rank)


def test_guard_schedule():
    due = [n for n in range(1, 70) if replicas._due(n)]
    assert due == [1, 2, 4, 8, 16, 32, 48, 64]


def _forward_then_nudge_one_weight(rank, world, relative):
    """Two checked forwards (1 and 2); between them SP rank 1 changes one attention weight by
    `relative` (at least one fp32 rounding step). Returns (error at forward 1, at forward 2)."""
    model = tiny_model("llama", seed=0)
    apply_seq_parallel_monkey_patch("zigzag_ring_attn", "llama")
    input_ids, _ = tiny_batch(1, SEQ)
    local = prepare_seq_parallel_inputs("zigzag_ring_attn", input_ids, None, None, rank, world, "cpu")
    errors = []
    try:
        for forward in (1, 2):
            if forward == 2 and rank == 1 and relative:
                weight = model.model.layers[0].self_attn.q_proj.weight
                with torch.no_grad():
                    old = weight[0, 0].clone()
                    new = (old.double() * (1 + relative)).float()
                    weight[0, 0] = new if new != old else torch.nextafter(old, old * 2)
                    assert weight[0, 0] != old
            try:
                model(input_ids=local["local_input_ids"], position_ids=local["local_position_ids"])
                errors.append(None)
            except replicas.ReplicaDriftError as caught:
                errors.append(str(caught))
    finally:
        remove_seq_parallel_monkey_patch()
    return errors


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_guard_sees_one_weight_off_by_one_rounding_step():
    """Fine-tuning at lr 1e-5 moves weights by about 1e-5 relative per step; a guard that lets a
    relative 1e-7 on one weight of one rank through would let unsynchronised fine-tuning through."""
    assert run_ranks(_forward_then_nudge_one_weight, 2, 0.0, timeout=100) == [[None, None]] * 2
    for errors in run_ranks(_forward_then_nudge_one_weight, 2, 1e-7, timeout=100):
        assert errors[0] is None and errors[1] is not None and "forward 2" in errors[1], errors


def test_checksum_is_exact_and_order_free():
    model = tiny_model("llama", seed=0)
    attention = model.model.layers[0].self_attn
    before = replicas.checksum(attention, "cpu")
    assert torch.equal(before, replicas.checksum(tiny_model("llama", seed=0).model.layers[0].self_attn, "cpu"))
    with torch.no_grad():
        weight = attention.o_proj.weight
        weight[3, 5] = torch.nextafter(weight[3, 5], torch.tensor(1.0))  # one rounding step
    assert not torch.equal(before, replicas.checksum(attention, "cpu"))
