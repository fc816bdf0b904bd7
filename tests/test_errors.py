"""Inputs the engine does not support fail loudly, naming the value and what would work."""

import pytest
import torch

from distributed import run_ranks
from easy_context import (
    apply_seq_parallel_monkey_patch,
    prepare_seq_parallel_inputs,
    remove_seq_parallel_monkey_patch,
)
from tiny_models import tiny_batch, tiny_model

MODE = "zigzag_ring_attn"


@pytest.fixture
def patched():
    apply_seq_parallel_monkey_patch(MODE, "llama")
    apply_seq_parallel_monkey_patch(MODE, "mistral")
    yield
    remove_seq_parallel_monkey_patch()


def test_length_not_divisible_names_length_and_multiple():
    ids = torch.zeros(1, 100, dtype=torch.long)
    with pytest.raises(ValueError, match=r"sequence length 100 is not divisible by 8, .*zigzag ring x4 .*96 or 104"):
        prepare_seq_parallel_inputs(MODE, ids, None, None, 0, 4, "cpu")


def test_unknown_and_unbuilt_modes_and_model_types():
    with pytest.raises(ValueError, match="unknown parallel mode 'ring'.*zigzag_ring_attn"):
        apply_seq_parallel_monkey_patch("ring", "llama")
    with pytest.raises(ValueError, match="model type 'gpt2' is not supported.*llama"):
        apply_seq_parallel_monkey_patch(MODE, "gpt2")
    with pytest.raises(TypeError, match="unknown option"):
        apply_seq_parallel_monkey_patch(MODE, "llama", ring_dgree=2)


def test_packed_position_ids_are_refused():
    ids = torch.zeros(1, 16, dtype=torch.long)
    packed = torch.cat([torch.arange(8), torch.arange(8)]).unsqueeze(0)
    with pytest.raises(ValueError, match="packed sequences are not supported"):
        prepare_seq_parallel_inputs(MODE, ids, packed, None, 0, 2, "cpu")


def test_padding_mask_is_refused(patched):
    model = tiny_model("llama")
    ids, _ = tiny_batch(2, 32)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)  # all ones: no padding, accepted
        mask[1, :5] = 0
        with pytest.raises(ValueError, match="padding attention_mask"):
            model(input_ids=ids, attention_mask=mask)


def test_sliding_window_shorter_than_sequence_is_refused(patched):
    model = tiny_model("mistral", sliding_window=16)
    ids, _ = tiny_batch(1, 32)
    with torch.no_grad(), pytest.raises(ValueError, match="sliding_window=16 is shorter than the sequence \\(32 tokens\\)"):
        model(input_ids=ids)
    with torch.no_grad():
        tiny_model("mistral", sliding_window=32)(input_ids=ids)  # window covers it: fine


def test_attention_dropout_is_refused(patched):
    model = tiny_model("llama", attention_dropout=0.1).train()
    ids, _ = tiny_batch(1, 32)
    with pytest.raises(ValueError, match="attention dropout 0.1"):
        model(input_ids=ids)


def test_kv_cache_decoding_is_refused(patched):
    model = tiny_model("llama")
    ids, _ = tiny_batch(1, 32)
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).cache
        with pytest.raises(ValueError, match="use_cache=False"):
            model(input_ids=ids[:, -1:], cache=cache, use_cache=True)


def _missing_positions_worker(rank, world_size):
    apply_seq_parallel_monkey_patch(MODE, "llama")
    ids, _ = tiny_batch(1, 64)
    local = prepare_seq_parallel_inputs(MODE, ids, None, None, rank, world_size, "cpu")
    try:
        with torch.no_grad():
            tiny_model("llama")(input_ids=local["local_input_ids"])  # position_ids forgotten
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.timeout(120)
def test_forgotten_position_ids_are_refused_on_every_rank():
    messages = run_ranks(_missing_positions_worker, 2)
    for rank, message in enumerate(messages):
        assert message and f"position_ids on rank {rank} of 2" in message and "local_position_ids" in message
