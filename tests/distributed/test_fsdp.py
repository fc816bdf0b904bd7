"""FSDP2 (`fully_shard`, train.py's --fsdp) under every mode: the gradients gathered from the
shards are the one-process gradients of the whole batch's token-mean loss. Adam hides a gradient
scale that is the same at every step, so the training runs (tests/recipes/test_fsdp.py) cannot
show a mis-scaled reduction; this compares the gradients themselves."""

import pytest
import torch
from ranks import run_ranks
from tiny_models import tiny_batch, tiny_model

import easy_context as ec
from easy_context.hf.loss import CausalLMLoss, global_token_mean
from easy_context.modes import get_mode
from recipes.fsdp import shard_model

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)

SEQ, ROWS_PER_GROUP = 128, 1
# GRAD_TOL: relative to each parameter's largest gradient (measured: at most 8.8e-7); a reduction
# averaged over the wrong ranks is off by a factor of 2 or more
LOSS_TOL, GRAD_TOL = 1e-5, 1e-5


def _gradients(rank, world, mode, options, sp_size):
    """(the token-mean loss, every parameter's whole gradient) after one backward."""
    model = tiny_model("llama")
    trainable = CausalLMLoss(model, loss_chunk_size=48)
    topology = get_mode(mode).topology(world, sp_size, options.get("ring_degree"))
    input_ids, target_ids = tiny_batch(ROWS_PER_GROUP * topology.dp_size, SEQ)
    rows = slice(topology.dp_rank(rank) * ROWS_PER_GROUP, (topology.dp_rank(rank) + 1) * ROWS_PER_GROUP)
    ec.apply_seq_parallel_monkey_patch(mode, model, sp_size=sp_size, **options)
    try:
        shard_model(trainable, model.get_decoder().layers, torch.device("cpu"), "no", offload=False)
        local = ec.prepare_seq_parallel_inputs(
            mode, input_ids[rows], None, target_ids[rows], rank, world, "cpu", sp_size=sp_size, **options
        )
        loss_sum = trainable(local["local_input_ids"], local["local_position_ids"], local["local_target_ids"])
        for_backward, mean = global_token_mean(loss_sum, local["local_target_ids"])
        for_backward.backward()
        return mean.item(), {name: p.grad.full_tensor() for name, p in trainable.named_parameters()}
    finally:
        ec.remove_seq_parallel_monkey_patch()


def _reference(rows: int):
    model = tiny_model("llama")
    trainable = CausalLMLoss(model, loss_chunk_size=48)
    input_ids, target_ids = tiny_batch(rows, SEQ)
    loss_sum = trainable(input_ids, None, target_ids)
    count = (target_ids != -100).sum()
    (loss_sum / count).backward()
    return (loss_sum / count).item(), {name: p.grad for name, p in trainable.named_parameters()}


def _each(rank, world, cases):
    return [_gradients(rank, world, *case) for case in cases]


MODES = [  # (mode, options, sp_size) at world 2
    ("zigzag_ring_attn", {}, None),
    ("dist_flash_attn", {}, None),
    ("ulysses_attn", {}, None),
    ("usp_attn", {"ring_degree": 2}, None),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "world,cases",
    [(2, MODES), (4, [("ulysses_attn", {}, 2)])],  # world 4: sp 2 x dp-shard 2, each data-parallel group its row
    ids=["every-mode-world2", "ulysses-sp2-dp2-world4"],
)
def test_fsdp_gradients_are_the_one_process_gradients(world, cases):
    results = run_ranks(_each, world, cases)  # one start of the ranks for all the cases
    for index, (mode, _, sp_size) in enumerate(cases):
        want_loss, want = _reference(ROWS_PER_GROUP * (world // (sp_size or world)))
        for rank, per_rank in enumerate(results):
            loss, grads = per_rank[index]
            assert set(grads) == set(want)
            worst = max(((grads[n] - g).abs().max() / g.abs().max().clamp(min=1e-12)).item() for n, g in want.items())
            print(f"{mode} w{world} rank {rank}: loss error {abs(loss - want_loss):.1e}, gradient error {worst:.1e}")
            assert abs(loss - want_loss) <= LOSS_TOL and worst <= GRAD_TOL, (mode, rank, loss, want_loss, worst)
