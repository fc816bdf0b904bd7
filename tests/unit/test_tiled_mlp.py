"""recipes/tiled_mlp.py: tiles change no number, tiling again changes only the tile size, a
forward another wrapper set is kept, and a tiled MLP is no reference cycle (its module is freed
by reference counting: the long-context probes' honest ceiling, tests/unit/test_bench_long_context.py)."""

import gc
import weakref

import torch

from recipes.tiled_mlp import TiledForward, tile_mlps
from tests.tiny_models import tiny_batch, tiny_model


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_tiles_change_no_number_and_tiling_again_changes_the_tile_size():
    ids = tiny_batch(1, 48)[0]
    model = tiny_model("llama")
    loss, grads = loss_and_grads(model, ids)
    assert tile_mlps(model, 16) == 2
    tiled_loss, tiled_grads = loss_and_grads(model, ids)
    torch.testing.assert_close(tiled_loss, loss)
    for name, grad in grads.items():
        torch.testing.assert_close(tiled_grads[name], grad, msg=name)
    tile_mlps(model, 8)  # again: the new size, over the class's own forward (not over the old tiles)
    forward = model.model.layers[0].mlp.forward
    assert isinstance(forward, TiledForward) and forward.tile_size == 8 and forward.untiled is None
    torch.testing.assert_close(loss_and_grads(model, ids)[0], loss)


def test_a_forward_another_wrapper_set_is_kept_and_called():
    model = tiny_model("llama")
    mlp = model.model.layers[0].mlp
    seen = []

    def wrapped(hidden_states):  # an instance-level forward, as a hook library sets one
        seen.append(hidden_states.shape[1])
        return type(mlp).forward(mlp, hidden_states)

    mlp.forward = wrapped
    tile_mlps(model, 16)
    model(input_ids=torch.zeros(1, 40, dtype=torch.long))
    assert seen == [16, 16, 8], seen


def test_a_tiled_mlp_is_freed_by_reference_counting():
    model = tiny_model("llama")
    tile_mlps(model, 16)
    mlp = weakref.ref(model.model.layers[0].mlp)
    gc.disable()
    try:
        del model
        assert mlp() is None, "the tiled MLP outlived its model: a reference cycle holds it"
    finally:
        gc.enable()
