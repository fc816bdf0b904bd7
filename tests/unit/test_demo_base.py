"""The shipped demo base (models/demo-base) and the data of train.py's default job that extends it.

- The checkpoint is the one its training log describes: the files hash to checksums.json, and
  the loaded model scores the log's last evaluation exactly, prompt for prompt.
- eval_needle.py's scoring, on a model that retrieves: a needle the base answers right scores
  1, teacher-forced and generated; the same prompt with a corrupted answer scores 0.
- NeedleAnswerRows: the loss is on the answers alone, and a row depends only on (seed, index).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from recipes.demo_data import NeedleAnswerRows, NeedleRows
from recipes.evaluation import SeqParallelScorer
from recipes.models import load_pretrained

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "models" / "demo-base"


def pretrain_script():
    """scripts/pretrain_demo_base.py as a module (scripts/ is not a package; train.py and
    eval_needle.py import from the repository root)."""
    spec = importlib.util.spec_from_file_location("pretrain_demo_base", ROOT / "scripts" / "pretrain_demo_base.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def base():
    model, tokenizer = load_pretrained(str(BASE))
    return model.eval(), tokenizer


def test_shipped_files_hash_to_their_checksums():
    checksums = json.loads((BASE / "checksums.json").read_text())
    assert set(checksums) == {"model.safetensors", "tokenizer.json"}
    for name, digest in checksums.items():
        assert hashlib.sha256((BASE / name).read_bytes()).hexdigest() == digest, name
    assert (BASE / "model.safetensors").stat().st_size <= 10 * 2**20  # the bound for a shipped model


def test_shipped_model_scores_its_logs_last_evaluation(base):
    model, tokenizer = base
    pretrain = pretrain_script()
    args = pretrain.parse_args(["--out", "unused"])  # the flags the shipped run used are the defaults
    log = [json.loads(line) for line in (BASE / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == args.steps
    needles = NeedleRows(tokenizer, max([length for _, length, _, _ in args.stages] + args.lengths))
    with torch.no_grad():
        scores = pretrain.EvalSet(needles, args).run(model)
    assert scores["needle"] == log[-1]["needle"]
    assert scores["copy"] == pytest.approx(log[-1]["copy"], abs=1e-6)
    # what the README says of the base: retrieval at its own context
    assert {s["length"]: s["exact"] for s in scores["needle"] if not s["distractors"]} == {256: 1.0, 512: 0.96875}


def test_eval_needle_scores_right_and_corrupted_answers(base):
    model, tokenizer = base
    import eval_needle

    config = eval_needle.parse_args(["--generate"])
    prompts, budget = config.prompts, config.answers.max_new_tokens
    scorer = SeqParallelScorer(model, "data_parallel", 0, 1, torch.device("cpu"))
    haystack = eval_needle.Haystack(tokenizer, eval_needle.haystack_text(prompts), min_tokens=512)
    prompt = eval_needle.make_prompt(prompts, tokenizer, haystack, 512, 0.5, 0)
    right = eval_needle.evaluate_prompt(scorer, tokenizer, prompt)
    right |= eval_needle.generate_answer(scorer, tokenizer, prompt, budget)
    assert right["correct"] and right["token_accuracy"] == 1.0 and right["generated_correct"]
    assert right["predicted"] == f" {prompt.value}" and right["generated"].startswith(f" {prompt.value}")

    # The same prompt asking for another number: every digit group differs from the needle's.
    other = "".join(str((int(d) + 5) % 10) for d in prompt.value)
    answer = tokenizer(f" {other}", add_special_tokens=False).input_ids
    corrupted = dataclasses.replace(prompt, input_ids=prompt.input_ids[: prompt.answer_start] + answer, value=other)
    wrong = eval_needle.evaluate_prompt(scorer, tokenizer, corrupted)
    wrong |= eval_needle.generate_answer(scorer, tokenizer, corrupted, budget)
    assert not wrong["correct"] and not wrong["generated_correct"]
    assert wrong["token_accuracy"] == 1 / len(answer)  # only the space before the number is right
    assert wrong["answer_nll"] > right["answer_nll"] + 5


def test_needle_answer_rows_train_the_answers_alone(base):
    _, tokenizer = base
    rows = NeedleAnswerRows(tokenizer, 1025, count=6, seed=3)
    ids, labels = rows[torch.tensor([4, 1])]
    assert ids.shape == labels.shape == (2, 1025) and len(rows) == 6
    again_ids, again_labels = NeedleAnswerRows(tokenizer, 1025, count=6, seed=3)[[1]]
    assert torch.equal(again_ids[0], ids[1]) and torch.equal(again_labels[0], labels[1])
    assert not torch.equal(NeedleAnswerRows(tokenizer, 1025, count=6, seed=4)[[1]][0][0], ids[1])

    for row_ids, row_labels in zip(ids, labels):
        trained = row_labels != -100
        assert torch.equal(row_labels[trained], row_ids[trained])
        # every trained stretch is one answer: a space and a 7-digit number, right after a question
        text = tokenizer.decode(row_ids.tolist())
        answers = [tokenizer.decode(row_ids[s].tolist()) for s in _runs(trained)]
        assert answers and all(a.startswith(" ") and a[1:].isdigit() and len(a) == 8 for a in answers)
        assert text.count("What is the special magic") == len(answers)
        assert text.count("The special magic") == 2 * len(answers)  # one needle per prompt, no distractors


def _runs(mask: torch.Tensor) -> list[slice]:
    """The maximal stretches of True in a 1-D mask."""
    runs, start = [], None
    for i, on in enumerate(mask.tolist() + [False]):
        if on and start is None:
            start = i
        elif not on and start is not None:
            runs.append(slice(start, i))
            start = None
    return runs


def test_train_py_default_job_extends_the_shipped_base():
    import train

    def job(config):
        model, optimisation = config.model, config.optimisation
        return model.model, model.rope_theta, optimisation.learning_rate, optimisation.max_train_steps

    config = train.parse_args([])
    assert (Path(config.model.model), *job(config)[1:]) == (BASE, 160000.0, 3e-4, 300)
    assert config.data.seq_length == 2048 and config.parallelism.parallel_mode == "zigzag_ring_attn"
    assert job(train.parse_args(["--from-scratch"])) == (None, None, 1e-3, 60)
    assert job(train.parse_args(["--model", "some/model"]))[1:] == (None, 1e-3, 60)
