"""Every supported architecture (easy_context.hf.architectures.SUPPORTED), in one process: what
each adds to its attention changes the result by far more than the tolerances (so the exactness
tests can fail), the logits head, refusals of unsupported types, keywords and mask functions,
and the README's tables."""

import re

import pytest
import torch
from exactness import architecture_reference as reference
from exactness import step
from tiny_models import ARCHITECTURES, WINDOW, tiny_batch, tiny_config, tiny_model

from easy_context import (
    apply_seq_parallel_monkey_patch,
    hf,
    remove_seq_parallel_monkey_patch,
)
from easy_context.hf import active_patch, admission
from easy_context.hf.architectures import check_training_config, logits_head, model_types_of

SEQ = 128
MODES = ["zigzag_ring_attn", "ulysses_attn", "dist_flash_attn"]  # one mode of each family
LOGITS_TOL, LOSS_TOL, GRAD_TOL = 1e-4, 1e-5, 1e-4  # as tests/distributed/test_models.py


def _sinks_off(model_type):
    """The reference with gpt-oss's sinks at -1e4 (no weight in any softmax)."""
    model = tiny_model(model_type)
    for name, p in model.named_parameters():
        if name.endswith(".sinks"):
            p.data.fill_(-1e4)
    input_ids, target_ids = tiny_batch(1, SEQ)
    return step(model, input_ids, None, target_ids)[0]


# (model type, what the feature is, overrides that switch it off)
FEATURES = [
    ("gemma2", "logit softcapping", dict(attn_logit_softcapping=None)),
    ("gemma2", "sliding window layers", dict(sliding_window=4096)),
    ("gemma3_text", "sliding window layers", dict(sliding_window=4096)),
    ("cohere2", "sliding window layers", dict(sliding_window=4096)),
    ("gpt_oss", "sliding window layers", dict(sliding_window=4096)),
    ("mixtral", "sliding window", dict(sliding_window=4096)),
    ("phi3", "sliding window", dict(sliding_window=4096)),
    ("starcoder2", "sliding window", dict(sliding_window=4096)),
    ("gpt_oss", "attention sinks", None),
]


@pytest.mark.parametrize(
    "model_type,feature,off", FEATURES, ids=lambda x: str(x).replace(" ", "_") if isinstance(x, str) else ""
)
def test_each_architecture_feature_changes_the_result(model_type, feature, off):
    assert WINDOW < SEQ
    with_feature = reference(model_type)[0]
    without = _sinks_off(model_type) if off is None else reference(model_type, **off)[0]
    change = (with_feature - without).abs().max().item()
    assert change > 1000 * LOGITS_TOL, f"{model_type}: {feature} changes the logits by only {change:.1e}"


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_logits_head_equals_the_models_own_logits(model_type):
    """train.py and the evaluations call the decoder and the output layer themselves: the
    architecture's final transform (softcap, scaling) must be applied the same way."""
    model = tiny_model(model_type).eval()
    input_ids, _ = tiny_batch(1, 32)
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=input_ids).last_hidden_state
        assert torch.equal(logits_head(model)(hidden), model(input_ids=input_ids).logits)


REFUSALS = [
    ("kimi_linear", "Kimi Delta Attention"),
    ("minimax", "lightning (linear) attention"),
    ("jamba", "Mamba"),
    ("recurrent_gemma", "RG-LRU"),
    ("llama4_text", "chunked-attention"),
    ("t5", "is untested: easy_context/hf/model_types.py records"),
    ("gemma3", "multimodal wrapper: pass the model itself, or its decoder's type gemma3_text"),
]


@pytest.mark.parametrize("model_type,reason", REFUSALS)
def test_unsupported_types_are_refused_at_patch_time_with_the_reason(model_type, reason):
    with pytest.raises(ValueError, match=re.escape(reason)):
        apply_seq_parallel_monkey_patch("zigzag_ring_attn", model_type)
    assert active_patch() is None


def test_a_hybrid_model_instance_is_refused_by_its_layer_types():
    """A model instance is read from its config: a hybrid type whose mixers are not implemented
    by name, and any config whose layer_types hold a layer that is not attention, whatever its
    model_type says, unless its modeling code calls the mixers through the seams we implement
    (hf/mixers.py: Mamba-2, Gated DeltaNet, short convolutions)."""
    from transformers import JambaConfig, Qwen3NextConfig

    from easy_context.hf import mixers
    from easy_context.hf.modeling import modeling_module

    with pytest.raises(ValueError, match="Mamba"):
        apply_seq_parallel_monkey_patch("zigzag_ring_attn", JambaConfig(num_hidden_layers=2))
    gated_deltanet = Qwen3NextConfig(num_hidden_layers=2)
    if mixers.covers(modeling_module("qwen3_next")):  # transformers with the mixer seams (5.25)
        apply_seq_parallel_monkey_patch("zigzag_ring_attn", gated_deltanet)
        remove_seq_parallel_monkey_patch()
    else:  # an older one: refused, naming the seams it lacks
        with pytest.raises(ValueError, match="does not call through the seams|layers of type"):
            apply_seq_parallel_monkey_patch("zigzag_ring_attn", gated_deltanet)
    disguised = tiny_config("llama")
    disguised.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match=r"layers of type \['linear_attention'\]"):
        apply_seq_parallel_monkey_patch("ulysses_attn", disguised)
    assert active_patch() is None


def test_a_multimodal_config_patches_its_text_decoder():
    from transformers import Gemma3Config

    config = Gemma3Config(text_config=tiny_config("gemma3_text").to_dict())
    assert model_types_of(config) == ["gemma3_text"]
    apply_seq_parallel_monkey_patch("zigzag_ring_attn", config)
    try:
        assert active_patch().model_types == frozenset({"gemma3_text"})
    finally:
        remove_seq_parallel_monkey_patch()


def test_an_attention_keyword_we_do_not_implement_is_refused():
    """A model whose attention module passes its attention function a keyword we do not
    implement (here T5's position_bias) stops with its name instead of running without it.
    Keywords the caller passed the model (Trainer's shift_labels) pass through."""
    import transformers.models.llama.modeling_llama as llama

    class BiasedAttention(llama.LlamaAttention):
        def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
            attention_interface = None
            return attention_interface(
                self,
                hidden_states,
                hidden_states,
                hidden_states,
                attention_mask,
                scaling=self.scaling,
                position_bias=None,
                **kwargs,
            )

    plain = tiny_model("llama").model.layers[0].self_attn
    biased = BiasedAttention(plain.config, 0)
    with pytest.raises(ValueError, match=r"BiasedAttention passes \['position_bias'\]"):
        admission.logit_options(biased, {"scaling": 0.25})
    with pytest.raises(ValueError, match="non-causal"):
        admission.logit_options(plain, {"is_causal": False})
    passed = {"softcap": 2.0, "s_aux": torch.zeros(4), "sliding_window": None, "shift_labels": torch.zeros(3)}
    assert admission.logit_options(plain, passed).keys() == {"softcap", "sinks"}
    for model_type in ARCHITECTURES:  # what every supported model passes is known
        for layer in tiny_model(model_type).model.layers[:1]:
            admission.logit_options(layer.self_attn, {})


def test_moe_router_loss_is_refused_for_training():
    config = tiny_config("mixtral", output_router_logits=True)
    with pytest.raises(ValueError, match="output_router_logits=True"):
        check_training_config(config)
    check_training_config(tiny_config("mixtral"))


# (type, mode and flags): eager attention + final softcap; sinks + MoE through dist_flash's
# checkpoint-aware reuse of the attention output; MLA through Ulysses
def test_the_model_types_page_lists_exactly_the_supported_and_refused_types():
    from pathlib import Path

    from easy_context.hf.architectures import markdown_tables

    page = (Path(__file__).resolve().parents[2] / "docs" / "model_types.md").read_text()
    block = page.split("<!-- model-types:begin -->\n", 1)[1].split("\n<!-- model-types:end -->", 1)[0]
    assert block == markdown_tables(), "docs/model_types.md out of date: paste python -m tools.model_types_table"


def test_a_mask_we_cannot_describe_is_refused_not_replaced():
    """transformers composes masks from functions; ours describes causality, padding, packed
    documents and windows. A mask with anything else (Gemma 3's bidirectional image blocks:
    blockwise_overlay OR'd in) is refused when it is built."""
    from transformers.masking_utils import (
        blockwise_overlay,
        create_causal_mask,
        create_sliding_window_causal_mask,
        sliding_window_overlay,
    )

    config = tiny_config("gemma3_text")
    config._attn_implementation = "sdpa"
    embeds, positions = torch.zeros(1, 16, 64), torch.arange(16)[None]
    packed = torch.cat([torch.arange(8), torch.arange(8)])[None]
    apply_seq_parallel_monkey_patch("zigzag_ring_attn", "gemma3_text")
    try:
        for build, position_ids, padding in (
            (create_causal_mask, positions, None),
            (create_sliding_window_causal_mask, positions, None),
            (create_causal_mask, packed, None),
            (create_sliding_window_causal_mask, positions, torch.ones(1, 16, dtype=torch.long)),
        ):
            mask = build(
                config, embeds, padding, None, position_ids=position_ids
            )  # None: no cache (its keyword was renamed in 5.x)
            assert isinstance(mask, hf.ShardedMask)
            # the window the layer attends with is the one the model's own mask applies
            assert mask.window == (config.sliding_window if build is create_sliding_window_causal_mask else None)
        with pytest.raises(ValueError, match=r"attention mask with \[.*blockwise_overlay.*\(for example bidirectional"):
            create_causal_mask(
                config,
                embeds,
                None,
                None,
                position_ids=positions,
                or_mask_function=blockwise_overlay(torch.zeros(1, 16, dtype=torch.long)),
                and_mask_function=sliding_window_overlay(8),
            )
    finally:
        remove_seq_parallel_monkey_patch()


def test_a_layer_attends_with_the_window_of_its_mask_not_of_its_argument():
    """PhiMoE windows in its mask and passes no argument; OLMoE passes the config's window and
    masks without it. The unpatched sdpa/eager model applies the mask, so the patch does too, and
    says once when the argument disagrees. Only where no mask was built is the argument used."""
    import warnings

    from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_causal_mask_function

    from easy_context.hf import admission, patch

    assert admission.mask_window(None) is None
    assert admission.mask_window(causal_mask_function) is None
    assert admission.mask_window(sliding_window_causal_mask_function(7)) == 7
    assert admission.mask_window(and_masks(sliding_window_causal_mask_function(7), causal_mask_function)) == 7
    with pytest.raises(ValueError, match=r"several sliding windows at once \(\[5, 7\]\)"):
        admission.mask_window(and_masks(sliding_window_causal_mask_function(7), sliding_window_causal_mask_function(5)))

    class Attention(torch.nn.Module):
        pass

    module = Attention()
    assert patch.layer_window(module, patch.ShardedMask(None, 40), {}) == 40  # PhiMoE
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        assert patch.layer_window(module, patch.ShardedMask(None, None), {"sliding_window": 40}) is None  # OLMoE
        assert patch.layer_window(module, patch.ShardedMask(None, None), {"sliding_window": 40}) is None
    assert len(told) == 1 and "passes sliding_window=40" in str(told[0].message), [str(w.message) for w in told]
    assert patch.layer_window(module, patch.ShardedMask(None, 40), {"sliding_window": 40}) == 40
    assert patch.layer_window(module, None, {"sliding_window": 40}) == 40  # no mask built for the call


def test_types_that_run_another_familys_code_have_their_rotary_found(monkeypatch):
    """EXAONE, InternLM3, IQuestCoder (Llama's code), Param2MoE, Sarvam (GLM-4-MoE's, DeepSeek-V3's)
    have no modeling file of their own: the rope patch must find the rotary of the code they run,
    or `dynamic` rope picks each rank's own length (the sweep's variants: logits off by 7e-2).
    Those this transformers has are asked; the lookup itself is asked on any version, with
    Llama's modeling file made to look absent."""
    import importlib
    import sys

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from easy_context.hf import modeling, rope

    for model_type in ("exaone", "internlm3", "iquestcoder", "param2moe", "sarvam_mla", "sarvam_moe"):
        if model_type in CONFIG_MAPPING:
            assert rope.rotary_classes(model_type), model_type
    from transformers import LlamaForCausalLM  # the code the type runs is there; only its name differs

    real_import = importlib.import_module

    def without_modeling_llama(name, *args):
        if name == "transformers.models.llama.modeling_llama":  # the name modeling_module looks up
            raise ImportError(name)
        return real_import(name, *args)

    monkeypatch.setattr(importlib, "import_module", without_modeling_llama)
    found = modeling.modeling_module.__wrapped__("llama")  # past functools.cache
    assert found is sys.modules[LlamaForCausalLM.__module__]
