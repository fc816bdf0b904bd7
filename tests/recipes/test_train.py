"""train.py end to end on CPU (torchrun, gloo): every mode trains like data_parallel, the
memory options change nothing numerically, bad input is refused. (Resume, killed saves,
timeouts and non-finite losses: test_reliability.py; DeepSpeed: test_deepspeed.py.)"""

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from script_runs import ROOT, train

from easy_context.hf.loss import chunked_cross_entropy_sum


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_mode_and_the_memory_options_train_like_data_parallel(tmp_path):
    steps = ["--max-train-steps", "4", "--gradient-accumulate-every", "2"]
    want, _ = train(tmp_path, "dp", 1, "--parallel-mode", "data_parallel", *steps)
    runs = {
        "zigzag": ["--parallel-mode", "zigzag_ring_attn"],
        "ulysses": ["--parallel-mode", "ulysses_attn"],
        # the same shape named by its config: --from-config trains exactly as --from-scratch did
        "dist_flash": ["--parallel-mode", "dist_flash_attn", "--from-config", "configs/tiny-llama/config.json"],
        "zigzag+memory": [
            "--parallel-mode",
            "zigzag_ring_attn",
            "--activation-checkpointing",
            "--tiled-mlp",
            "48",
            "--loss-chunk-size",
            "50",
        ],
    }
    for name, flags in runs.items():
        got, _ = train(tmp_path, name, 2, *flags, *steps)
        # Four steps: AdamW's first update is nearly sign(gradient), blind to gradient scale;
        # the later steps are not, so a missing or mis-scaled gradient reduction shows here.
        assert len(got) == 4 and max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (name, got, want)
    # bf16 parameters, plain SGD, nothing saved: the flags of the 8B headline, on the tiny shape
    got, out = train(
        tmp_path,
        "bf16+sgd",
        2,
        "--parallel-mode",
        "zigzag_ring_attn",
        "--param-dtype",
        "bf16",
        "--optimizer",
        "sgd",
        "--no-save",
        "--from-config",
        "tiny-llama",
        "--max-train-steps",
        "2",
        "--gradient-accumulate-every",
        "2",
    )
    # random bf16 weights drawn in bf16 (not fp32 ones rounded): a loss near ln(vocab) that is finite
    assert len(got) == 2 and all(abs(loss - math.log(257)) < 0.3 for loss in got), got
    assert not list(out.glob("*.safetensors")) and not (out / "config.json").exists()


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000])
def test_chunked_loss_equals_cross_entropy_with_ignored_targets(chunk):
    torch.manual_seed(0)
    hidden = torch.randn(2, 33, 16, requires_grad=True)
    head = torch.nn.Linear(16, 50, bias=False)
    targets = torch.randint(0, 50, (2, 33))
    targets[0, :5] = -100
    targets[1, 20:] = -100
    got = chunked_cross_entropy_sum(hidden, head, targets, chunk_size=chunk)
    got.backward()
    got_grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    want = F.cross_entropy(head(hidden).flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    want.backward()
    assert torch.allclose(got, want, rtol=1e-6, atol=0)  # a sum of about 190: measured 1.5e-5 (one ulp)
    assert torch.allclose(got_grads[0], hidden.grad, atol=1e-6) and torch.allclose(
        got_grads[1], head.weight.grad, atol=1e-6
    )


def run_train_single(*flags):
    """train.py in one plain process (no torchrun): returns (exit code, stderr)."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *flags], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    return result.returncode, result.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bad_inputs_get_clear_messages(tmp_path):
    short = tmp_path / "short.jsonl"
    short.write_text("\n".join(json.dumps({"input_ids": list(range(n))}) for n in (600, 100)))
    no_ids = tmp_path / "text.jsonl"
    no_ids.write_text(json.dumps({"text": "hello"}))
    # a model whose tokenizer is not the byte tokenizer: its embedded corpus is needle documents
    # only, so --retrieval-fraction (the byte-level corpus' share of them) is refused for it
    from transformers import AutoConfig, AutoModelForCausalLM

    from recipes.data import byte_tokenizer

    other = tmp_path / "other-tokenizer"
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ROOT / "configs" / "tiny-llama")).save_pretrained(other)
    tokenizer = byte_tokenizer()
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(other)
    foreign_ids = tmp_path / "foreign.jsonl"  # tokenized with a larger vocabulary than the byte model's 257
    foreign_ids.write_text("\n".join(json.dumps({"input_ids": [5] * 100 + [300] * 200}) for _ in range(2)))
    cases = [
        (["--dataset", str(short), "--seq-length", "512"], "row 1 has 100 tokens but 513 are needed"),
        (["--dataset", str(no_ids)], "has 6 tokens (with one EOS per document), fewer than one row of 2049"),
        (
            ["--dataset", str(no_ids), "--text-column", "body"],
            "has no 'body' column (columns: ['text']); give --text-column",
        ),
        (["--streaming"], "--streaming needs --dataset"),
        (
            ["--model", str(other), "--seq-length", "256", "--retrieval-fraction", "0.2"],
            "--retrieval-fraction 0.2: the embedded corpus of a model with its own tokenizer is all needle documents",
        ),
        (
            ["--dataset", str(foreign_ids), "--seq-length", "256", "--max-train-steps", "1"],
            "step 1: the data holds token id 300, outside the model's vocabulary (0..256)",
        ),
        (
            ["--dataset", str(no_ids), "--retrieval-fraction", "0.2"],
            "--retrieval-fraction applies to the embedded corpus",
        ),
        (["--parallel-mode", "zigzag_ring_attn", "--ring-degree", "2"], "--ring-degree applies to usp_attn only"),
        (["--learning-rate", "0"], "--learning-rate must be > 0"),
        (["--offload-checkpoints"], "--offload-checkpoints needs --activation-checkpointing"),
        (["--resume-from-checkpoint", str(tmp_path)], "not a checkpoint folder"),
    ]
    for flags, message in cases:
        job = [] if "--model" in flags else ["--from-scratch"]  # the byte-level job, as before the demo base
        code, stderr = run_train_single("--output-dir", str(tmp_path / "out"), "--log-with", "none", *job, *flags)
        assert code == 2 and message in stderr and "Traceback" not in stderr, (flags, stderr[-2000:])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_document_masking_trains_like_data_parallel(tmp_path):
    """--document-masking: positions restart after each EOS in every mode, and the losses equal
    the data_parallel run with the same flag (which differs from the run without it)."""
    # Rows of byte tokens with an EOS (256) every 5-60 tokens: many documents per row.
    rng = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(16):
        row = torch.randint(0, 256, (257,), generator=rng)
        row[torch.randint(0, 257, (12,), generator=rng)] = 256
        rows.append(row.tolist())
    data = tmp_path / "documents.jsonl"
    data.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    steps = ["--max-train-steps", "3", "--dataset", str(data), "--document-masking"]
    want, _ = train(tmp_path, "dp", 1, "--parallel-mode", "data_parallel", *steps)
    unmasked, _ = train(tmp_path, "dp-unmasked", 1, "--parallel-mode", "data_parallel", *steps[:-1])
    assert max(abs(a - b) for a, b in zip(want, unmasked)) > 1e-4  # the rows do hold documents
    runs = {mode: ["--parallel-mode", mode] for mode in ("zigzag_ring_attn", "dist_flash_attn", "ulysses_attn")}
    runs["zigzag+balance"] = ["--parallel-mode", "zigzag_ring_attn", "--balance-documents"]  # document_split
    # document_split="workload": documents whole on one rank, the longest cut
    runs["dist_flash+balance"] = ["--parallel-mode", "dist_flash_attn", "--balance-documents", "workload"]
    for name, flags in runs.items():
        got, _ = train(tmp_path, name, 2, *flags, *steps)
        assert len(got) == 3 and max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (name, got, want)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("streaming", [False, True], ids=["arrow", "streaming"])
def test_a_text_dataset_trains_packed_and_resumes_exactly(tmp_path, streaming):
    """--dataset with a text column: tokenized and packed (no separate script), read lazily
    (or streamed); a resumed run reads exactly the rows of the uninterrupted one. Read lazily,
    over two data-parallel groups: in the order by attention work (--data-order balanced, the
    default), which differs from the random order and resumes as exactly."""
    from recipes.data import stdlib_source_files

    documents = [path.read_text(encoding="utf-8", errors="replace")[:3000] for path in stdlib_source_files()[:40]]
    data = tmp_path / "corpus.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    flags = [
        "--dataset",
        str(data),
        "--max-train-steps",
        "4",
        "--checkpointing-steps",
        "2",
        "--document-masking",
        *(["--streaming"] if streaming else ["--sp-size", "1"]),  # arrow: 2 data-parallel groups
    ]
    straight, out = train(tmp_path, "straight", 2, *flags)
    assert len(straight) == 4 and straight[-1] < straight[0]
    resumed, _ = train(tmp_path, "straight", 2, *flags, "--resume-from-checkpoint", str(out / "checkpoint-2"))
    assert resumed[-2:] == straight[2:]  # steps 3 and 4, bit for bit
    if not streaming:
        in_random_order, _ = train(tmp_path, "random-order", 2, *flags, "--data-order", "random")
        assert in_random_order != straight
