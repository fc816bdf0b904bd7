"""Inputs the engine does not support fail loudly, naming the value and what would work."""

import pytest
import torch
from ranks import run_ranks
from tiny_models import tiny_batch, tiny_model

from easy_context import (
    apply_seq_parallel_monkey_patch,
    prepare_seq_parallel_inputs,
    remove_seq_parallel_monkey_patch,
)
from easy_context.versions import cache_keyword, output_cache

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
    with pytest.raises(ValueError, match="model type 't5' is untested: easy_context/hf/model_types.py records"):
        apply_seq_parallel_monkey_patch(MODE, "t5")
    with pytest.raises(ValueError, match="model type 'bloom' cannot run sequence parallel: attention outside"):
        apply_seq_parallel_monkey_patch(MODE, "bloom")
    with pytest.raises(TypeError, match="unknown option"):
        apply_seq_parallel_monkey_patch(MODE, "llama", ring_dgree=2)


def test_mask_with_zeros_inside_a_row_is_refused(patched):
    model = tiny_model("llama")
    ids, _ = tiny_batch(2, 32)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: accepted
    mask[0, 20:] = 0  # right padding: accepted
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
        mask[1, 10] = 0  # a hole between tokens
        with pytest.raises(ValueError, match="attention_mask row 1 has a 0 at position 10 between tokens"):
            model(input_ids=ids, attention_mask=mask)
    with pytest.raises(ValueError, match="row 1 has a 0 at position 10"):
        prepare_seq_parallel_inputs(MODE, ids, None, None, 0, 2, "cpu", attention_mask=mask)
    with pytest.raises(ValueError, match="0 \\(padding\\) and 1 \\(token\\) only"):
        prepare_seq_parallel_inputs(MODE, ids, None, None, 0, 2, "cpu", attention_mask=mask * 2)


def test_explicit_4d_mask_is_refused(patched):
    model = tiny_model("llama")
    ids, _ = tiny_batch(1, 16)
    with torch.no_grad(), pytest.raises(ValueError, match="explicit attention mask \\(4D or custom\\)"):
        model(input_ids=ids, attention_mask=torch.ones(1, 1, 16, 16, dtype=torch.bool).tril())


def test_attention_dropout_is_refused(patched):
    model = tiny_model("llama", attention_dropout=0.1).train()
    ids, _ = tiny_batch(1, 32)
    with pytest.raises(ValueError, match="attention dropout 0.1"):
        model(input_ids=ids)


def test_kv_cache_decoding_is_refused(patched):
    model = tiny_model("llama")
    ids, _ = tiny_batch(1, 32)
    with torch.no_grad():
        cache = output_cache(model(input_ids=ids, use_cache=True))
        with pytest.raises(ValueError, match="use_cache=False"):
            model(input_ids=ids[:, -1:], use_cache=True, **{cache_keyword(model): cache})


def _error_of(fn):
    try:
        fn()
    except ValueError as error:
        return str(error)
    return None


def _two_rank_errors_worker(rank, world_size):
    ids, _ = tiny_batch(1, 64)
    apply_seq_parallel_monkey_patch(MODE, "llama")
    local = prepare_seq_parallel_inputs(MODE, ids, None, None, rank, world_size, "cpu")
    model = tiny_model("llama")
    with torch.no_grad():
        forgotten_positions = _error_of(lambda: model(input_ids=local["local_input_ids"]))
        apply_seq_parallel_monkey_patch("ulysses_attn", "llama")
        local = prepare_seq_parallel_inputs("ulysses_attn", ids, None, None, rank, world_size, "cpu")
        one_head = tiny_model("llama", num_attention_heads=1, num_key_value_heads=1, head_dim=16, hidden_size=16)
        heads = _error_of(
            lambda: one_head(input_ids=local["local_input_ids"], position_ids=local["local_position_ids"])
        )
    return forgotten_positions, heads


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_forgotten_positions_and_too_few_heads_are_refused_on_every_rank():
    for rank, (positions, heads) in enumerate(run_ranks(_two_rank_errors_worker, 2)):
        assert positions and f"position_ids on rank {rank} of 2" in positions and "local_position_ids" in positions
        assert heads and "ulysses_degree=2 exceeds num_attention_heads=1" in heads
        assert "zigzag_ring_attn" in heads  # says what would work


@pytest.mark.parametrize(
    "mode,options,message",
    [
        ("zigzag_ring_attn", {"sp_size": 3}, "sp_size=3 does not divide the world size 4; choose one of \\[1, 2, 4\\]"),
        ("usp_attn", {"ring_degree": 3}, "ring_degree=3 does not divide sp_size=4"),
        ("zigzag_ring_attn", {"ring_degree": 2}, "zigzag_ring_attn uses ring_degree=4 for sp_size=4.*usp_attn"),
        ("ulysses_attn", {"ring_degree": 2}, "ulysses_attn uses ring_degree=1"),
        ("data_parallel", {"sp_size": 2}, "data_parallel has no sequence parallelism"),
    ],
)
def test_impossible_parallel_layouts(mode, options, message):
    ids = torch.zeros(1, 64, dtype=torch.long)
    with pytest.raises(ValueError, match=message):
        prepare_seq_parallel_inputs(mode, ids, None, None, 0, 4, "cpu", **options)


def test_usp_length_must_divide_ring_and_ulysses():
    ids = torch.zeros(1, 36, dtype=torch.long)  # ring 2 (zigzag: 4 chunks) x Ulysses 2 needs a multiple of 8
    with pytest.raises(ValueError, match="sequence length 36 is not divisible by 8"):
        prepare_seq_parallel_inputs("usp_attn", ids, None, None, 0, 4, "cpu", ring_degree=2)


def test_options_must_agree_with_the_patch(patched):
    apply_seq_parallel_monkey_patch("usp_attn", "llama", ring_degree=1)
    ids = torch.zeros(1, 64, dtype=torch.long)
    with pytest.raises(ValueError, match="ring_degree=2 differs from ring_degree=1"):
        prepare_seq_parallel_inputs("usp_attn", ids, None, None, 0, 1, "cpu", ring_degree=2)


def test_patched_model_on_an_unsupported_attention_implementation_is_refused(patched):
    from types import SimpleNamespace

    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    module = SimpleNamespace(config=SimpleNamespace(model_type="llama"))
    q = torch.zeros(1, 4, 8, 16)
    with pytest.raises(ValueError, match="attn_implementation='flex_attention' is not supported"):
        AttentionInterface._global_mapping["flex_attention"](module, q, q, q, None)
    with pytest.raises(ValueError, match="attn_implementation='flash_attention_3' is not supported"):
        AttentionMaskInterface._global_mapping["flash_attention_3"](config=module.config)


def _layers_of_4_and_2_heads(kind: str):
    """A 2-layer model whose layer 1 has 2 query heads, layer 0 and the config 4: Laguna's
    per-layer head counts, or a Llama with its layer 1's attention built with 2 heads."""
    if kind == "laguna":
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        if "laguna" not in CONFIG_MAPPING:
            pytest.skip("this transformers has no Laguna (per-layer head counts)")
        return tiny_model("laguna", num_attention_heads_per_layer=[4, 2])
    from transformers.models.llama.modeling_llama import LlamaAttention

    model = tiny_model("llama")  # 4 query heads, 2 K/V heads, head_dim 16
    config = model.config.__class__(**{**model.config.to_dict(), "num_attention_heads": 2, "head_dim": 16})
    narrow = LlamaAttention(config, layer_idx=1)
    narrow.num_heads = 2  # what the module keeps of its own count, as Laguna's do
    model.model.layers[1].self_attn = narrow
    return model


@pytest.mark.parametrize("kind", ["laguna", "llama with one narrow layer"])
def test_a_layer_with_fewer_heads_than_the_ulysses_degree_is_refused_at_setup(kind, monkeypatch):
    """At 4 Ulysses ranks, setup refuses the layer of 2 heads by name (the config says 4, so a
    check of the config alone passes and the layer fails at its first forward); at 2 (usp_attn,
    ring_degree 2) every layer splits, and the heads of each layer are the module's own."""
    from easy_context.core import collectives
    from easy_context.core.groups import NODE_SIZE_VARIABLES
    from easy_context.hf.heads import check_layer_heads, layer_heads

    model = _layers_of_4_and_2_heads(kind)
    assert [heads for _, heads, _ in layer_heads(model)] == [4, 2]
    for name in NODE_SIZE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(collectives, "world_size", lambda: 4)
    refusal = (
        r"layer model\.layers\.1\.self_attn \((Laguna|Llama)Attention\): ulysses_degree=4 exceeds num_attention_heads=2"
    )
    try:
        with pytest.raises(ValueError, match=refusal + ".*use a Ulysses degree of at most 2"):
            apply_seq_parallel_monkey_patch("ulysses_attn", model)
        with pytest.raises(ValueError, match=refusal):
            apply_seq_parallel_monkey_patch("usp_attn", model, ring_degree=1)
    finally:
        remove_seq_parallel_monkey_patch()
    check_layer_heads(model, 2)  # usp_attn with ring_degree 2: each layer's heads split over 2
