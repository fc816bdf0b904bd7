"""train.py and the eval scripts on model types beyond Llama: train.py trains each like
data_parallel, eval_ppl runs Gemma 2 (softcap) and eval_needle runs gpt-oss (sinks) exactly."""

import pytest
from script_runs import ok, read_csv, run_script, train
from tiny_models import tiny_model

pytestmark = pytest.mark.slow  # starts processes (tests/conftest.py)

SEQ = 128
MODES = ["zigzag_ring_attn", "ulysses_attn", "dist_flash_attn"]  # one mode of each family
LOGITS_TOL, LOSS_TOL, GRAD_TOL = 1e-4, 1e-5, 1e-4  # as tests/distributed/test_models.py

SCRIPT_RUNS = {
    "gemma2": ["--parallel-mode", "zigzag_ring_attn"],
    "gpt_oss": ["--parallel-mode", "dist_flash_attn", "--activation-checkpointing"],
    "deepseek_v3": ["--parallel-mode", "ulysses_attn"],
    # hybrids: Gated DeltaNet by state passing in the zigzag layout under FSDP2, Mamba-2 by head
    # exchange with LoRA adapters (on the attention layers' q, k, v, o)
    "qwen3_next": ["--parallel-mode", "zigzag_ring_attn", "--mixer-strategy", "state_passing", "--fsdp"],
    "nemotron_h": ["--parallel-mode", "ulysses_attn", "--mixer-strategy", "head_exchange", "--lora-r", "4"],
}
# flags of a run that the one-process reference runs with too
SHARED = {"--lora-r"}


def saved_tiny_model(path, model_type):
    """A tiny model of `model_type` (tests/tiny_models.py: a hybrid's is the sweep's) with the
    byte tokenizer, saved like train.py saves one."""
    from recipes.data import BYTE_EOS_ID, byte_tokenizer

    tiny_model(model_type, vocab_size=BYTE_EOS_ID + 1, eos_token_id=BYTE_EOS_ID).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model_type", SCRIPT_RUNS)
def test_train_py_trains_any_supported_type_like_data_parallel(tmp_path, model_type):
    model = saved_tiny_model(tmp_path / "model", model_type)
    steps = ["--model", str(model), "--max-train-steps", "2"]
    flags = SCRIPT_RUNS[model_type]
    shared = [x for i, flag in enumerate(flags) if flag in SHARED for x in flags[i : i + 2]]
    want, _ = train(tmp_path, "dp", 1, "--parallel-mode", "data_parallel", *steps, *shared)
    got, _ = train(tmp_path, "parallel", 2, *SCRIPT_RUNS[model_type], *steps)
    assert len(got) == 2 and max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (got, want)


@pytest.mark.timeout(600)
def test_eval_ppl_runs_gemma2_exactly(tmp_path):
    import csv

    model = saved_tiny_model(tmp_path / "model", "gemma2")
    flags = ["--model", str(model), "--min-tokens", "128", "--max-tokens", "256", "--samples", "1", "--hide-progress"]
    single, parallel = tmp_path / "single.csv", tmp_path / "parallel.csv"
    ok(run_script("eval_ppl.py", *flags, "--parallel-mode", "data_parallel", "--output-file", str(single)))
    ok(
        run_script(
            "eval_ppl.py", *flags, "--parallel-mode", "ulysses_attn", "--output-file", str(parallel), processes=2
        )
    )
    got, want = ([float(x) for x in read_csv(p, csv.reader)[1][1:]] for p in (parallel, single))
    assert len(got) == 2 and all(abs(a - b) <= 1e-5 * b for a, b in zip(got, want)), (got, want)


@pytest.mark.timeout(600)
def test_eval_needle_runs_gpt_oss_exactly(tmp_path):
    model = saved_tiny_model(tmp_path / "model", "gpt_oss")
    flags = [
        "--model",
        str(model),
        "--min-context-length",
        "300",
        "--max-context-length",
        "300",
        "--depth-interval",
        "0.5",
        "--num-samples",
        "1",
        "--num-distractor",
        "1",
        "--hide-progress",
    ]
    ok(
        run_script(
            "eval_needle.py", *flags, "--parallel-mode", "data_parallel", "--output-dir", str(tmp_path / "single")
        )
    )
    ok(
        run_script(
            "eval_needle.py",
            *flags,
            "--parallel-mode",
            "dist_flash_attn",
            "--output-dir",
            str(tmp_path / "parallel"),
            processes=2,
        )
    )
    single, parallel = (read_csv(tmp_path / d / "needle_model.csv") for d in ("single", "parallel"))
    assert len(parallel) == len(single) == 3
    for a, b in zip(parallel, single):
        assert (a["predicted"], a["tokens"], a["value"]) == (b["predicted"], b["tokens"], b["value"])
        assert abs(float(a["answer_nll"]) - float(b["answer_nll"])) <= 1e-5
