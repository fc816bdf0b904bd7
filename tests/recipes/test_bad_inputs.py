"""The bad-input sweep (docs/bad_inputs.md lists every refusal and its test): each bad input
gets one line naming the value and what would work, exit code 2 for the scripts, never a
traceback. Flag checks run in-process (argparse); everything after startup runs the script."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import easy_context as ec

ROOT = Path(__file__).resolve().parents[2]


def script_module(name: str):
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py") + "_script", ROOT / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FLAG_CASES = [  # (script, flags, message): refused by parse_args before anything loads
    ("eval_needle.py", ["--max-new-tokens", "5"], "--max-new-tokens needs --generate and a value >= 1, got 5"),
    ("tools/generate.py", ["--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    ("tools/generate.py", ["--prompt", "x", "--top-p", "0.9"], "--temperature/--top-p/--top-k need --do-sample"),
    ("tools/generate.py", [], "one of --prompt-file and --prompt is required"),
    ("tools/generate.py", ["--prompt", "x", "--prompt-file", "p.txt"], "give --prompt-file or --prompt, not both"),
    ("train.py", ["--seq-length", "0"], "--seq-length must be >= 1, got 0"),
    ("train.py", ["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    ("train.py", ["--max-train-steps", "0"], "--max-train-steps must be >= 1, got 0"),
    ("train.py", ["--gradient-accumulate-every", "0"], "--gradient-accumulate-every must be >= 1, got 0"),
    ("train.py", ["--loss-chunk-size", "0"], "--loss-chunk-size must be >= 1, got 0"),
    ("train.py", ["--balance-documents"], "--balance-documents needs --document-masking"),
    ("train.py", ["--fsdp-offload"], "--fsdp-offload needs --fsdp"),
    ("train.py", ["--fsdp", "--compile"], "--fsdp with --compile is not supported"),
    ("train.py", ["--fsdp", "--lora-r", "8", "--model", "base"], "--fsdp with --lora-r is not supported yet"),
    (
        "train.py",
        ["--warmup-steps", "100", "--max-train-steps", "60"],
        "--warmup-steps must be between 0 and --max-train-steps (60), got 100",
    ),
    ("train.py", ["--from-scratch", "--model", "M"], "from random weights; drop --model M or --from-scratch"),
    ("train.py", ["--from-scratch", "--lora-r", "8"], "--lora-r needs pretrained weights to adapt (the adapter"),
    ("train.py", ["--checkpointing-steps", "-1"], "--checkpointing-steps must be >= 0, got -1"),
    ("train.py", ["--save-total-limit", "0"], "--save-total-limit must be >= 1, got 0"),
    ("train.py", ["--skip-nonfinite-steps", "-1"], "--skip-nonfinite-steps must be >= 0, got -1"),
    ("train.py", ["--tiled-mlp", "-1"], "--tiled-mlp must be >= 0, got -1"),
    (
        "train.py",
        ["--compile", "--activation-checkpointing"],
        "--compile with --activation-checkpointing is not supported",
    ),
    ("train.py", ["--max-rows", "0"], "--max-rows must be >= 1, got 0"),
    (
        "train.py",
        ["--dist-timeout", "0"],
        "argument --dist-timeout: must be a number of seconds in (0, 1e+06], got '0'",
    ),
    (
        "train.py",
        ["--dist-timeout", "inf"],
        "argument --dist-timeout: must be a number of seconds in (0, 1e+06], got 'inf'",
    ),
    ("train.py", ["--parallel-mode", "ring"], "argument --parallel-mode/--parallel_mode: invalid choice: 'ring'"),
    ("eval_needle.py", ["--context-interval", "0"], "--context-interval must be >= 1, got 0"),
    ("eval_needle.py", ["--depth-interval", "1.5"], "--depth-interval must be in (0, 1], got 1.5"),
    ("eval_needle.py", ["--num-samples", "0"], "--num-samples and --rnd-number-digits must be >= 1, got 0"),
    ("eval_needle.py", ["--num-distractor", "-1"], "--num-distractor must be between 0 and"),
    ("eval_needle.py", ["--ring-degree", "2"], "--ring-degree applies to usp_attn only"),
    ("eval_needle.py", ["--dist-timeout", "-5"], "argument --dist-timeout: must be a number of seconds"),
    # both ends of --depth: past parse_args, 1.5 loads the model and then skips every needle task as too short
    ("eval_ruler.py", ["--depth", "1.5"], "--depth must be a fraction in [0, 1], got 1.5"),
    ("eval_ruler.py", ["--depth", "-0.1"], "--depth must be a fraction in [0, 1], got -0.1"),
    ("eval_ppl.py", ["--min-tokens", "1"], "need 2 <= --min-tokens <= --max-tokens, got 1 and 4096"),
    ("eval_ppl.py", ["--sliding-window", "0"], "--sliding-window must be >= 1, got 0"),
    ("eval_ppl.py", ["--samples", "-1"], "--samples must be >= 0, got -1"),
    ("eval_ppl.py", ["--ring-degree", "2"], "--ring-degree applies to usp_attn only"),
    ("eval_ppl.py", ["--dist-timeout", "abc"], "argument --dist-timeout: must be a number of seconds"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script,flags,message", FLAG_CASES, ids=[f"{s}:{' '.join(f)}" for s, f, _ in FLAG_CASES])
def test_flags_are_refused_with_one_line(script, flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        script_module(script).parse_args(flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def run(script, *flags, env=None):
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    result = subprocess.run(
        [sys.executable, str(ROOT / script), *flags],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=environment,
    )
    return result.returncode, result.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_refuses_bad_runs_with_one_line(tmp_path):
    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text('{"input_ids": [1, 2, 3]}\n{"input_ids": [1, 2\n')
    csv_file = tmp_path / "rows.csv"
    csv_file.write_text("input_ids\n1\n")
    no_checkpoint = tmp_path / "empty"
    no_checkpoint.mkdir()
    foreign = tmp_path / "hf-checkpoint"  # an HF Trainer checkpoint: its trainer_state.json has other keys
    foreign.mkdir()
    (foreign / "trainer_state.json").write_text(json.dumps({"global_step": 10, "log_history": []}))
    out = tmp_path / "out"
    common = ["--output-dir", str(out), "--log-with", "none", "--seq-length", "256", "--max-train-steps", "1"]
    small = [*common, "--from-scratch"]  # the byte-level tiny Llama: nothing to load
    cases = [
        ([*small, "--dataset", str(malformed)], "cannot be read as json: JSON parse error"),
        ([*small, "--dataset", str(csv_file)], "use .json, .jsonl, .parquet or .txt"),
        ([*common, "--model", str(tmp_path / "no-such-model")], f"--model {tmp_path / 'no-such-model'}:"),
        (
            [*small, "--output-dir", str(no_checkpoint), "--resume-from-checkpoint", "latest"],
            "latest: no checkpoint in",
        ),
        ([*small, "--resume-from-checkpoint", str(foreign)], "not a train.py checkpoint"),
        ([*small, "--sp-size", "2"], "sp_size=2 does not divide the world size 1; choose one of [1]"),
        ([*small, "--batch-size", "4", "--max-rows", "2"], "2 rows of 257 tokens are fewer than one step needs (4)"),
        ([*small, "--fsdp"], "--fsdp shards over the processes, and this run has 1; launch 2 or more"),
    ]
    for flags, message in cases:
        code, stderr = run("train.py", *flags)
        assert code == 2 and message in stderr and "Traceback" not in stderr, (flags, stderr[-2000:])
    # accelerate launch with an FSDP config: on CPU accelerate would silently run DDP instead
    code, stderr = run("train.py", *small, env={"ACCELERATE_USE_FSDP": "true"})
    assert (
        code == 2 and "accelerate's FSDP config is not supported by train.py" in stderr and "Traceback" not in stderr
    ), stderr[-2000:]

    # A checkpoint whose flags differ from this run's: refused before anything is loaded from it.
    code, stderr = run("train.py", *small, "--max-rows", "4", "--max-train-steps", "2", "--checkpointing-steps", "1")
    assert code == 0, stderr[-2000:]
    code, stderr = run(
        "train.py", *small, "--max-rows", "4", "--max-train-steps", "3", "--resume-from-checkpoint", "latest"
    )
    assert (
        code == 2 and "these flags differ from the checkpoint (checkpoint, now): {'max_train_steps': (2, 3)}" in stderr
    ), stderr[-2000:]

    # A refusal raised mid-run by the library: one line with the step and phase, not a traceback.
    code, stderr = run("train.py", *small, "--max-rows", "2", env={"EASY_CONTEXT_KERNEL": "flash_attn"})
    assert code == 2 and "train.py: error: step 1 (forward): EASY_CONTEXT_KERNEL='flash_attn' cannot run" in stderr
    assert "Traceback" not in stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_eval_scripts_refuse_impossible_layouts():
    for script in ("eval_ppl.py", "eval_needle.py"):
        code, stderr = run(script, "--model", str(ROOT / "configs" / "tiny-llama"), "--sp-size", "3")
        assert code == 2 and "sp_size=3 does not divide the world size 1" in stderr and "Traceback" not in stderr, (
            stderr
        )


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_bad_replica_check_setting_is_refused_at_the_first_forward(tmp_path):
    code, stderr = run(
        "train.py",
        "--from-scratch",
        "--output-dir",
        str(tmp_path),
        "--log-with",
        "none",
        "--seq-length",
        "256",
        "--max-rows",
        "2",
        "--max-train-steps",
        "1",
        env={"EASY_CONTEXT_REPLICA_CHECK_EVERY": "often"},
    )
    assert code == 2 and "Traceback" not in stderr
    assert (
        "train.py: error: step 1 (forward): EASY_CONTEXT_REPLICA_CHECK_EVERY='often': use a whole number >= 0" in stderr
    )


def test_api_refuses_malformed_inputs():
    ids = torch.zeros(2, 16, dtype=torch.long)
    with pytest.raises(ValueError, match="rank 4 is outside world_size 4"):
        ec.prepare_seq_parallel_inputs("zigzag_ring_attn", ids, None, ids, 4, 4, "cpu")
    with pytest.raises(ValueError, match=r"input_ids must have shape \(batch, seq_len\), got \(16,\)"):
        ec.prepare_seq_parallel_inputs("zigzag_ring_attn", ids[0], None, ids[0], 0, 2, "cpu")
    with pytest.raises(ValueError, match=r"position_ids must have shape \(batch, seq_len\) = \(2, 16\), got \(2, 15\)"):
        ec.prepare_seq_parallel_inputs("zigzag_ring_attn", ids, ids[:, :15], ids, 0, 2, "cpu")
    with pytest.raises(ValueError, match="document_split=True works with .* not 'ulysses_attn'"):
        ec.prepare_seq_parallel_inputs("ulysses_attn", ids, None, ids, 0, 2, "cpu", document_split=True)
    with pytest.raises(ValueError, match=r"document_split='work' is not one of None, False, True .* or 'workload'"):
        ec.prepare_seq_parallel_inputs("zigzag_ring_attn", ids, None, ids, 0, 2, "cpu", document_split="work")


def test_tiled_mlp_refuses_a_tile_size_of_zero():
    from tiny_models import tiny_model

    from recipes.tiled_mlp import tile_mlps

    with pytest.raises(ValueError, match="tile size must be positive, got 0"):
        tile_mlps(tiny_model("llama"), 0)


def test_script_helpers_refuse_bad_values(tmp_path):
    """The library pieces behind the scripts: models, data, needle prompts, plots, masks."""
    import datasets
    from tiny_models import tiny_config
    from transformers import BloomConfig

    from easy_context.core.groups import Topology
    from easy_context.core.masking import SequenceMask
    from recipes.data import byte_tokenizer, load_any_dataset
    from recipes.models import check_config, load_config
    from recipes.needle import PASSKEY, PASSKEY_FILLER, Haystack, build_prompt
    from recipes.plots import read_perplexity_csv

    BloomConfig(n_layer=1, hidden_size=8, n_head=2).save_pretrained(tmp_path / "bloom")
    with pytest.raises(ValueError, match="model type 'bloom' cannot run sequence parallel: attention outside"):
        load_config(str(tmp_path / "bloom"))
    with pytest.raises(ValueError, match="the model has attention_dropout=0.1; sequence parallelism needs 0.0"):
        check_config(tiny_config("llama", attention_dropout=0.1), Topology(2, 2, 2), 64, "zigzag_ring_attn")
    check_config(  # 3 query heads split 2 + 1 over Ulysses 2; 4 ranks would leave one without a head
        tiny_config("llama", num_attention_heads=3, num_key_value_heads=1, hidden_size=48),
        Topology(2, 2, 1),
        64,
        "ulysses_attn",
    )
    with pytest.raises(ValueError, match="ulysses_degree=4 exceeds num_attention_heads=3"):
        check_config(
            tiny_config("llama", num_attention_heads=3, num_key_value_heads=1, hidden_size=48),
            Topology(4, 4, 1),
            64,
            "ulysses_attn",
        )

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]]})}).save_to_disk(
        tmp_path / "splits"
    )
    with pytest.raises(ValueError, match=r"has splits \['train'\], not 'test'"):
        load_any_dataset(str(tmp_path / "splits"), split="test")

    tokenizer = byte_tokenizer()
    with pytest.raises(ValueError, match="the haystack text is empty"):
        Haystack(tokenizer, "   ", min_tokens=100)
    haystack = Haystack(tokenizer, PASSKEY_FILLER, min_tokens=200)
    with pytest.raises(ValueError, match=r"depth must be within \[0, 1\], got 1.5"):
        build_prompt(tokenizer, haystack, PASSKEY, 200, 1.5, key="", value="68231")
    with pytest.raises(ValueError, match="tokens, .* needed; build it with more tokens"):
        build_prompt(tokenizer, haystack, PASSKEY, 20 * len(haystack), 0.5, key="", value="68231")

    (tmp_path / "other.csv").write_text("name,256\nx,1.0\n")
    with pytest.raises(ValueError, match="not an eval_ppl.py CSV"):
        read_perplexity_csv(tmp_path / "other.csv")
    with pytest.raises(ValueError, match="sliding_window must be >= 1, got 0"):
        SequenceMask.from_positions(torch.arange(8)[None]).with_window(0)


@pytest.mark.timeout(60)
def test_paths_are_checked_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """A path to nothing given as --model, a corrupt --from-config and an --output-dir that
    cannot be written: refused by the flag checks, each naming its flag, before any model loads."""
    corrupt = tmp_path / "config.json"
    corrupt.write_text('{"model_type": "llama", ')
    a_file = tmp_path / "file"
    a_file.write_text("")
    takes = "no such folder; --model takes a local folder, a hub name (name or namespace/name) or a downloadable model"
    cases = [
        ("train.py", ["--model", "no/such/dir"], f"--model no/such/dir: {takes}"),
        ("train.py", ["--model", "./missing"], f"--model ./missing: {takes}"),
        ("train.py", ["--from-config", str(corrupt)], f"--from-config {corrupt}: {corrupt} is not a valid JSON file"),
        (
            "train.py",
            ["--output-dir", str(a_file / "out")],
            f"--output-dir {a_file / 'out'}: {a_file} is a file, not a folder; choose another --output-dir",
        ),
        ("eval_needle.py", ["--output-dir", str(a_file)], f"--output-dir {a_file}: {a_file} is a file, not a folder"),
    ]
    for script, flags, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            script_module(script).parse_args(flags)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and message in err and "Traceback" not in err, (flags, err)
    from recipes import configuration

    monkeypatch.setattr(configuration.os, "access", lambda path, mode: False)  # as for a non-root user
    with pytest.raises(SystemExit):
        script_module("train.py").parse_args(["--output-dir", str(tmp_path / "new" / "out")])
    assert (
        f"--output-dir {tmp_path / 'new' / 'out'}: cannot create it: {tmp_path} is not writable"
        in capsys.readouterr().err
    )
    monkeypatch.undo()
    from recipes.evaluation import resolve_model
    from recipes.models import NoSuchModelFolder

    with pytest.raises(NoSuchModelFolder, match=f"^--model /no/such/model: {re.escape(takes)}"):
        resolve_model("/no/such/model")  # the eval scripts: one line from it (their fail)
    assert resolve_model("namespace/name") == "namespace/name"  # a hub name: the hub's to answer

    # a JSON the model cannot be built from: named as --from-config too, not as --model
    from recipes.training.config import MemoryConfig, ModelConfig
    from recipes.training.model import load_model

    corrupt.write_text('{"model_type": "no-such-type"}')
    with pytest.raises(SystemExit):
        load_model(ModelConfig(from_config=str(corrupt)), MemoryConfig(), 0, torch.float32, torch.device("cpu"))
    assert f"train.py: error: --from-config {corrupt}: " in capsys.readouterr().err
