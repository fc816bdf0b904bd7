"""Public API behaviour that needs no process group: sharding, patch scope and undo."""

import pytest
import torch
from tiny_models import tiny_batch, tiny_model
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

import easy_context
from easy_context import (
    apply_seq_parallel_monkey_patch,
    prepare_dataloader,
    prepare_seq_parallel_inputs,
    remove_seq_parallel_monkey_patch,
)
from easy_context.core.kernels import FORWARD_CALLS
from easy_context.core.layout import Layout


@pytest.fixture(autouse=True)
def _unpatched():
    remove_seq_parallel_monkey_patch()
    yield
    remove_seq_parallel_monkey_patch()


@pytest.mark.slow
def test_import_needs_only_torch_and_transformers():
    import subprocess
    import sys

    code = (
        "import sys, easy_context; "
        "heavy = {'flash_attn', 'ring_flash_attn', 'yunchang', 'deepspeed', 'triton', 'peft'};"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))"
    )
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    )


@pytest.mark.parametrize("zigzag", [True, False])
@pytest.mark.parametrize("ring,ulysses", [(1, 1), (2, 1), (3, 1), (4, 1), (1, 4), (2, 2), (2, 3)])
def test_shard_unshard_roundtrip(zigzag, ring, ulysses):
    layout = Layout(zigzag, ring, ulysses)
    seq = layout.multiple * 5
    x = torch.arange(2 * seq).reshape(2, seq)
    pieces = [layout.shard(x, r) for r in range(layout.size)]
    assert torch.equal(layout.unshard(pieces), x)
    for r, piece in enumerate(pieces):
        assert torch.equal(piece[1] - seq, layout.local_indices(seq, r))


def test_usp_layout_gives_each_ring_rank_its_zigzag_share_in_ulysses_order():
    # ring 2 x Ulysses 2 over 16 tokens: ring rank 0 holds zigzag chunks 0 and 3.
    layout = Layout(zigzag=True, ring_degree=2, ulysses_degree=2)
    assert [layout.local_indices(16, r).tolist() for r in range(4)] == [
        [0, 1, 2, 3],
        [12, 13, 14, 15],
        [4, 5, 6, 7],
        [8, 9, 10, 11],
    ]


def test_zigzag_keeps_chunks_r_and_2p_minus_1_minus_r():
    ids = torch.arange(16).unsqueeze(0)
    local = prepare_seq_parallel_inputs("zigzag_ring_attn", ids, None, ids + 100, 1, 4, "cpu")
    assert local["local_input_ids"].tolist() == [[2, 3, 12, 13]]
    assert local["local_position_ids"].tolist() == [[2, 3, 12, 13]]  # global positions
    assert local["local_target_ids"].tolist() == [[102, 103, 112, 113]]
    none_targets = prepare_seq_parallel_inputs("zigzag_ring_attn", ids, None, None, 0, 4, "cpu")
    assert none_targets["local_target_ids"] is None


def test_data_parallel_returns_inputs_unchanged():
    ids, targets = tiny_batch(2, 24)
    pos = torch.arange(24).unsqueeze(0)
    local = prepare_seq_parallel_inputs("data_parallel", ids, pos, targets, 1, 4, "cpu")
    assert torch.equal(local["local_input_ids"], ids) and torch.equal(local["local_target_ids"], targets)
    assert torch.equal(local["local_position_ids"], pos)


def test_prepare_dataloader_shards_only_for_data_parallel():
    class Accelerator:
        def prepare(self, loader):
            return ("prepared", loader)

    assert prepare_dataloader("data_parallel", "loader", Accelerator()) == ("prepared", "loader")
    assert prepare_dataloader("zigzag_ring_attn", "loader", Accelerator()) == "loader"


def test_prepare_dataloader_splits_batches_over_data_parallel_groups_only():
    class Accelerator:
        num_processes = 4

        def __init__(self, rank):
            self.process_index = rank

    batches = list(range(11))
    seen = [list(prepare_dataloader("zigzag_ring_attn", batches, Accelerator(r), sp_size=2)) for r in range(4)]
    assert seen[0] == seen[1] == [0, 2, 4, 6, 8]  # SP group 0 (ranks 0, 1) reads the same batches
    assert seen[2] == seen[3] == [1, 3, 5, 7, 9]  # SP group 1; the odd tail batch is dropped
    assert len(prepare_dataloader("zigzag_ring_attn", batches, Accelerator(3), sp_size=2)) == 5


def _runs_sequence_parallel(model, seq=32):
    FORWARD_CALLS.start()
    ids, _ = tiny_batch(1, seq)
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    return FORWARD_CALLS.calls > 0


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_patch_covers_models_created_before_and_after_and_is_scoped(impl):
    before = tiny_model("llama", attn_implementation=impl)
    apply_seq_parallel_monkey_patch("zigzag_ring_attn", "llama")
    after = tiny_model("llama", attn_implementation=impl)
    other = tiny_model("qwen2", attn_implementation=impl)
    assert _runs_sequence_parallel(before) and _runs_sequence_parallel(after)
    assert not _runs_sequence_parallel(other)  # only the named model type is patched
    apply_seq_parallel_monkey_patch("zigzag_ring_attn", "qwen2")  # adds a type, keeps llama
    assert _runs_sequence_parallel(other) and _runs_sequence_parallel(after)


def test_remove_restores_transformers_registries():
    attention = dict(AttentionInterface._global_mapping)
    masks = dict(AttentionMaskInterface._global_mapping)
    model = tiny_model("llama")
    ids, _ = tiny_batch(1, 32)
    with torch.no_grad():
        want = model(input_ids=ids).logits
    apply_seq_parallel_monkey_patch("zigzag_ring_attn", "llama")
    assert AttentionInterface._global_mapping["sdpa"] is not attention["sdpa"]
    remove_seq_parallel_monkey_patch()
    assert AttentionInterface._global_mapping == attention and AttentionMaskInterface._global_mapping == masks
    assert not _runs_sequence_parallel(model)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, want)


def test_data_parallel_patch_leaves_models_alone():
    apply_seq_parallel_monkey_patch("zigzag_ring_attn", "llama")
    apply_seq_parallel_monkey_patch("data_parallel", "llama")
    assert not _runs_sequence_parallel(tiny_model("llama"))


def test_public_api_lists_modes_and_models():
    assert set(easy_context.MODE_NAMES) == {
        "zigzag_ring_attn",
        "dist_flash_attn",
        "ulysses_attn",
        "usp_attn",
        "data_parallel",
    }
    assert {"llama", "mistral", "qwen2", "qwen3"} <= set(easy_context.SUPPORTED_MODEL_TYPES)
