"""Every supported architecture (easy_context.hf.architectures.SUPPORTED) in each mode family,
on 2 gloo ranks, against the unpatched model on the full sequence: logits, loss and every
parameter gradient, fp32. Plus: what each architecture adds to its attention changes the
single-process result by far more than the tolerance, so these tests can fail."""

import re

import pytest
import torch
import torch.distributed as dist

from ranks import run_ranks
from easy_context import (
    apply_seq_parallel_monkey_patch,
    gather_seq_parallel_outputs,
    prepare_seq_parallel_inputs,
    remove_seq_parallel_monkey_patch,
)
from easy_context import hf
from easy_context.hf import admission
from easy_context.hf.architectures import check_training_config, logits_head, model_types_of
from easy_context.hf import active_patch
from exactness import errors, step
from tiny_models import ARCHITECTURES, WINDOW, tiny_batch, tiny_config, tiny_model

SEQ = 128
MODES = ["zigzag_ring_attn", "ulysses_attn", "dist_flash_attn"]  # one mode of each family
LOGITS_TOL, LOSS_TOL, GRAD_TOL = 1e-4, 1e-5, 1e-4  # as tests/distributed/test_models.py


def architectures_worker(rank, world_size, mode, options=None, types=ARCHITECTURES, dtype=torch.float32):
    results = {}
    for model_type in types:
        model = tiny_model(model_type, dtype)
        apply_seq_parallel_monkey_patch(mode, model, **(options or {}))  # a model instance: its config names the type
        group = active_patch().groups().sp
        input_ids, target_ids = tiny_batch(1, SEQ)
        local = prepare_seq_parallel_inputs(mode, input_ids, None, target_ids, rank, world_size, "cpu")
        logits, loss = step(model, local["local_input_ids"], local["local_position_ids"], local["local_target_ids"], group)
        grads = {}
        for name, p in model.named_parameters():
            grads[name] = p.grad.float().contiguous()
            dist.all_reduce(grads[name], group=group)
        results[model_type] = (gather_seq_parallel_outputs(mode, logits), loss, grads)
        remove_seq_parallel_monkey_patch()
    return results


def reference(model_type, dtype=torch.float32, weights_dtype=None, **overrides):
    """The unpatched model on the whole sequence; weights_dtype=bf16 with dtype fp32: the bf16
    model's rounded weights run in fp32 (the ground truth for bf16 errors)."""
    input_ids, target_ids = tiny_batch(1, SEQ)
    model = tiny_model(model_type, weights_dtype or dtype, **overrides).to(dtype)
    logits, loss = step(model, input_ids, None, target_ids)
    return logits, loss, {n: p.grad.float() for n, p in model.named_parameters()}


def assert_exact(results, mode, types=ARCHITECTURES):
    failed = []
    for model_type in types:
        logits_err, loss_err, grad_err = errors(results[model_type], reference(model_type))
        print(f"{mode} {model_type}: logits {logits_err:.1e} loss {loss_err:.1e} grads {grad_err:.1e}")
        if not (logits_err <= LOGITS_TOL and loss_err <= LOSS_TOL and grad_err <= GRAD_TOL):
            failed.append((model_type, logits_err, loss_err, grad_err))
    assert not failed, failed


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", MODES)
def test_every_architecture_matches_single_process(mode):
    assert_exact(run_ranks(architectures_worker, 2, mode, timeout=540)[0], f"{mode} P=2")


FEATURE_TYPES = ("gemma2", "gpt_oss", "deepseek_v3", "cohere2")  # softcap, sinks, MLA, NoPE global layers


@pytest.mark.timeout(600)
def test_usp_at_four_ranks_splits_sinks_softcap_and_mla_over_ulysses_and_ring():
    results = run_ranks(architectures_worker, 4, "usp_attn", {"ring_degree": 2}, FEATURE_TYPES, timeout=540)[0]
    assert_exact(results, "usp_attn P=4 ring_degree=2", FEATURE_TYPES)


@pytest.mark.timeout(600)
def test_every_architecture_in_bf16_is_within_the_unpatched_models_own_error():
    """As tests/distributed/test_models.py's bf16 bound: our error against the fp32 truth is at most 2x
    (plus 1/256) that of the unpatched bf16 model itself."""
    results = run_ranks(architectures_worker, 2, "zigzag_ring_attn", None, ARCHITECTURES, torch.bfloat16, timeout=540)[0]
    failed = []
    for model_type in ARCHITECTURES:
        truth = reference(model_type, torch.float32, weights_dtype=torch.bfloat16)
        ours, theirs = errors(results[model_type], truth), errors(reference(model_type, torch.bfloat16), truth)
        print(f"zigzag P=2 bf16 {model_type}: ours {[f'{e:.1e}' for e in ours]} hf bf16 {[f'{e:.1e}' for e in theirs]}")
        if any(mine > 2 * baseline + 1 / 256 for mine, baseline in zip(ours, theirs)):
            failed.append((model_type, ours, theirs))
    assert not failed, failed


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


@pytest.mark.parametrize("model_type,feature,off", FEATURES, ids=lambda x: str(x).replace(" ", "_") if isinstance(x, str) else "")
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
    ("qwen3_next", "Gated DeltaNet"),
    ("falcon_h1", "Mamba-2"),
    ("jamba", "Mamba"),
    ("lfm2", "convolution"),
    ("llama4_text", "chunked-attention"),
    ("gpt2", "is not supported; supported: ['llama'"),
    ("gemma3", "a multimodal wrapper: pass the model itself, or its decoder's type gemma3_text"),
]


@pytest.mark.parametrize("model_type,reason", REFUSALS)
def test_unsupported_types_are_refused_at_patch_time_with_the_reason(model_type, reason):
    with pytest.raises(ValueError, match=re.escape(reason)):
        apply_seq_parallel_monkey_patch("zigzag_ring_attn", model_type)
    assert active_patch() is None


def test_a_hybrid_model_instance_is_refused_by_its_layer_types():
    """A model instance is read from its config: a hybrid type by name, and any config whose
    layer_types hold a layer that is not attention, whatever its model_type says."""
    from transformers import Qwen3NextConfig

    hybrid = Qwen3NextConfig(**{k: v for k, v in tiny_config("qwen3").to_dict().items() if k in ("vocab_size", "hidden_size")},
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match="Gated DeltaNet"):
        apply_seq_parallel_monkey_patch("zigzag_ring_attn", hybrid)
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
            return attention_interface(self, hidden_states, hidden_states, hidden_states, attention_mask,
                                       scaling=self.scaling, position_bias=None, **kwargs)

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
SCRIPT_RUNS = {
    "gemma2": ["--parallel_mode", "zigzag_ring_attn"],
    "gpt_oss": ["--parallel_mode", "dist_flash_attn", "--activation-checkpointing"],
    "deepseek_v3": ["--parallel_mode", "ulysses_attn"],
}


def saved_tiny_model(path, model_type):
    """A tiny model of `model_type` with the byte tokenizer, saved like train.py saves one."""
    from easy_context.programs.data import BYTE_EOS_ID, byte_tokenizer

    tiny_model(model_type, vocab_size=BYTE_EOS_ID + 1, eos_token_id=BYTE_EOS_ID).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model_type", SCRIPT_RUNS)
def test_train_py_trains_any_supported_type_like_data_parallel(tmp_path, model_type):
    from test_train import train

    model = saved_tiny_model(tmp_path / "model", model_type)
    steps = ["--model", str(model), "--max-train-steps", "2"]
    want, _ = train(tmp_path, "dp", 1, "--parallel_mode", "data_parallel", *steps)
    got, _ = train(tmp_path, "parallel", 2, *SCRIPT_RUNS[model_type], *steps)
    assert len(got) == 2 and max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (got, want)


@pytest.mark.timeout(600)
def test_eval_ppl_runs_gemma2_exactly(tmp_path):
    import csv

    from test_eval import ok, run_script

    model = saved_tiny_model(tmp_path / "model", "gemma2")
    flags = ["--model", str(model), "--min-tokens", "128", "--max-tokens", "256", "--samples", "1", "--hide-progress"]
    single, parallel = tmp_path / "single.csv", tmp_path / "parallel.csv"
    ok(run_script("eval_ppl.py", *flags, "--parallel_mode", "data_parallel", "--output-file", str(single)))
    ok(run_script("eval_ppl.py", *flags, "--parallel_mode", "ulysses_attn", "--output-file", str(parallel), processes=2))
    got, want = ([float(x) for x in list(csv.reader(open(p)))[1][1:]] for p in (parallel, single))
    assert len(got) == 2 and all(abs(a - b) <= 1e-5 * b for a, b in zip(got, want)), (got, want)


def test_the_readme_lists_exactly_the_supported_and_refused_types():
    from pathlib import Path

    from easy_context.hf.architectures import markdown_tables

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("<!-- model-types:begin -->\n", 1)[1].split("\n<!-- model-types:end -->", 1)[0]
    assert block == markdown_tables(), "README out of date: paste the output of python -m tools.model_types_table"


@pytest.mark.timeout(600)
def test_eval_needle_runs_gpt_oss_exactly(tmp_path):
    import csv

    from test_eval import ok, run_script

    model = saved_tiny_model(tmp_path / "model", "gpt_oss")
    flags = ["--model", str(model), "--min_context_length", "300", "--max_context_length", "300",
             "--depth_interval", "0.5", "--num_samples", "1", "--num_distractor", "1", "--hide_progress"]
    ok(run_script("eval_needle.py", *flags, "--parallel_mode", "data_parallel", "--output_dir", str(tmp_path / "single")))
    ok(run_script("eval_needle.py", *flags, "--parallel_mode", "dist_flash_attn", "--output_dir", str(tmp_path / "parallel"),
                  processes=2))
    single, parallel = (list(csv.DictReader(open(tmp_path / d / "needle_model.csv"))) for d in ("single", "parallel"))
    assert len(parallel) == len(single) == 3
    for a, b in zip(parallel, single):
        assert (a["predicted"], a["tokens"], a["value"]) == (b["predicted"], b["tokens"], b["value"])
        assert abs(float(a["answer_nll"]) - float(b["answer_nll"])) <= 1e-5


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
        for build, position_ids, padding in ((create_causal_mask, positions, None),
                                             (create_sliding_window_causal_mask, positions, None),
                                             (create_causal_mask, packed, None),
                                             (create_sliding_window_causal_mask, positions, torch.ones(1, 16, dtype=torch.long))):
            mask = build(config, embeds, padding, None, position_ids=position_ids)  # None: no cache (its keyword was renamed in 5.x)
            assert isinstance(mask, hf.ShardedMask)
        with pytest.raises(ValueError, match=r"attention mask with \[.*blockwise_overlay.*\(for example bidirectional"):
            create_causal_mask(config, embeds, None, None, position_ids=positions,
                               or_mask_function=blockwise_overlay(torch.zeros(1, 16, dtype=torch.long)),
                               and_mask_function=sliding_window_overlay(8))
    finally:
        remove_seq_parallel_monkey_patch()
