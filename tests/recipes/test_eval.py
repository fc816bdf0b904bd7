"""Evaluation: the sequence-parallel scorer equals one process, eval_ppl.py / eval_needle.py
under torchrun (P = 2) give what one process gives, and needles land where asked for
several tokenizers."""

from __future__ import annotations

import csv
import json
import os
import random
import subprocess
import sys

import pytest
import torch
from ranks import require_deepspeed, run_ranks
from script_runs import ROOT, ok, read_csv, run_script
from tiny_models import VOCAB, tiny_model

from recipes.data import BYTE_EOS_ID, byte_tokenizer, embedded_prose
from recipes.needle import CITIES, NEEDLE, PASSKEY, PASSKEY_FILLER, Haystack, build_prompt, chat_frame


# ------------------------------------------------------------------ scorer vs one process
def scorer_worker(rank, world_size, mode, length):
    import easy_context as ec
    from recipes.evaluation import SeqParallelScorer

    model = tiny_model("llama", initializer_range=0.1).eval()  # wider logits than the default: no argmax near-ties
    ids = torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(3))
    targets = torch.cat([ids[1:], torch.tensor([-100])])
    targets[: length // 5] = -100  # score only a part, as the needle and sliding windows do
    with torch.no_grad():
        logits = model(ids[None]).logits[0].float()  # unpatched, whole sequence
    ec.apply_seq_parallel_monkey_patch(mode, "llama")
    try:
        scores = SeqParallelScorer(model, mode, rank, world_size, "cpu", chunk_size=37).score(ids, targets)
    finally:
        ec.remove_seq_parallel_monkey_patch()
    return logits, targets, scores


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["zigzag_ring_attn", "ulysses_attn", "dist_flash_attn"])
def test_scorer_equals_single_process(mode):
    length = 203  # divides by neither 2 nor 4: padded and masked
    for logits, targets, scores in run_ranks(scorer_worker, 2, mode, length):
        scored = targets != -100
        want_nll = torch.nn.functional.cross_entropy(logits[scored], targets[scored], reduction="none")
        assert torch.equal(scores.scored, scored)
        assert (scores.nll[scored] - want_nll).abs().max() <= 1e-5
        assert (scores.nll[~scored] == 0).all() and (scores.predictions[~scored] == -100).all()
        assert abs(scores.nll[scored].double().sum() - want_nll.double().sum()) <= 1e-4  # so the perplexity too
        top2 = logits[scored].topk(2).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-4  # where the argmax is not a near-tie
        assert clear.float().mean() > 0.95
        assert torch.equal(scores.predictions[scored][clear], logits[scored].argmax(-1)[clear])


# ------------------------------------------------------------------ the scripts, end to end
@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A tiny random Llama with the byte tokenizer, saved like train.py saves its model."""
    path = tmp_path_factory.mktemp("model")
    model = tiny_model("llama", vocab_size=BYTE_EOS_ID + 1, initializer_range=0.1)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_eval_ppl_parallel_equals_single_process(tmp_path, saved_model):
    flags = [
        "--model",
        str(saved_model),
        "--min-tokens",
        "99",
        "--max-tokens",
        "396",
        "--sliding-window",
        "64",
        "--samples",
        "2",
        "--hide-progress",
    ]
    single, parallel = tmp_path / "single.csv", tmp_path / "parallel.csv"
    ok(run_script("eval_ppl.py", *flags, "--parallel-mode", "data_parallel", "--output-file", str(single)))
    out = ok(run_script("eval_ppl.py", *flags, "--output-file", str(parallel), processes=2)).stdout
    rows = {name: read_csv(path, csv.reader) for name, path in (("single", single), ("parallel", parallel))}
    assert rows["single"][0] == rows["parallel"][0] == ["model", "99", "198", "396"]  # 99, 198: padded for zigzag x2
    got, want = [float(x) for x in rows["parallel"][1][1:]], [float(x) for x in rows["single"][1][1:]]
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(got, want)), (got, want)
    assert all(1 < b < 10 * VOCAB for b in want)  # a random model: close to the vocabulary size, finite
    details = json.loads(parallel.with_suffix(".json").read_text())["perplexity"][str(saved_model)]
    assert {d["tokens"] for d in details.values()} == {2 * (396 - 1)}  # every token of each sample, at every length
    for suffix in (".png", ".pdf"):
        assert parallel.with_suffix(suffix).stat().st_size > 1000
    assert "| model | 99 | 198 | 396 |" in out

    truncated = tmp_path / "truncated.csv"
    ok(run_script("eval_ppl.py", *flags, "--truncate", "--output-file", str(truncated), processes=2))
    counts = json.loads(truncated.with_suffix(".json").read_text())["perplexity"][str(saved_model)]
    assert [counts[n]["tokens"] for n in ("99", "198", "396")] == [2 * 98, 2 * 197, 2 * 395]

    plot = ok(
        subprocess.run(
            [
                sys.executable,
                "-m",
                "tools.plot_ppl",
                str(single),
                str(truncated),
                "--output",
                str(tmp_path / "both.png"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
    )
    assert (tmp_path / "both.png").stat().st_size > 1000 and (tmp_path / "both.pdf").exists(), plot.stdout


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_eval_needle_parallel_equals_single_process_and_writes_the_grid(tmp_path, saved_model):
    flags = [
        "--model",
        str(saved_model),
        "--min-context-length",
        "300",
        "--max-context-length",
        "900",
        "--context-interval",
        "300",
        "--depth-interval",
        "0.5",
        "--num-samples",
        "2",
        "--num-distractor",
        "2",
        "--hide-progress",
        "--generate",
        "--max-new-tokens",
        "6",
    ]
    ok(
        run_script(
            "eval_needle.py", *flags, "--parallel-mode", "data_parallel", "--output-dir", str(tmp_path / "single")
        )
    )
    out = ok(run_script("eval_needle.py", *flags, "--output-dir", str(tmp_path / "parallel"), processes=2)).stdout
    single = read_csv(tmp_path / "single" / f"needle_{saved_model.name}.csv")
    parallel = read_csv(tmp_path / "parallel" / f"needle_{saved_model.name}.csv")
    assert [(r["context_length"], r["depth"], r["sample"]) for r in parallel] == [
        (str(n), str(d), str(s)) for n in (300, 600, 900) for d in (0.0, 0.5, 1.0) for s in (0, 1)
    ]
    for a, b in zip(parallel, single):
        assert (a["predicted"], a["correct"], a["tokens"], a["value"]) == (
            b["predicted"],
            b["correct"],
            b["tokens"],
            b["value"],
        )
        # --generate: the free-form answer, generated with the cache sharded over 2 ranks, is one process's
        assert (a["generated"], a["generated_correct"]) == (b["generated"], b["generated_correct"])
        assert abs(float(a["answer_nll"]) - float(b["answer_nll"])) <= 1e-5
        assert int(a["tokens"]) <= int(a["context_length"]) and a["distractors"] == "2"
    summary = json.loads((tmp_path / "parallel" / f"needle_{saved_model.name}.json").read_text())
    assert len(summary["accuracy"]) == 9 and len(summary["samples"]) == 18 and len(summary["generate_accuracy"]) == 9
    assert "generated answer, exact digits" in out
    for heatmap in (f"needle_{saved_model.name}.png", f"needle_{saved_model.name}_generate.png"):
        assert (tmp_path / "parallel" / heatmap).stat().st_size > 1000
    assert "overall accuracy" in out

    ok(
        run_script(
            "eval_needle.py",
            "--model",
            str(saved_model),
            "--task",
            "passkey",
            "--min-context-length",
            "200",
            "--max-context-length",
            "200",
            "--depth-interval",
            "1",
            "--num-samples",
            "1",
            "--output-dir",
            str(tmp_path / "passkey"),
            "--hide-progress",
        )
    )
    rows = read_csv(tmp_path / "passkey" / f"passkey_{saved_model.name}.csv")
    assert [r["depth"] for r in rows] == ["0.0", "1.0"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_eval_needle_under_deepspeed_zero3_inference_equals_torchrun(tmp_path, saved_model):
    """The GPU recipe's path (accelerate + DeepSpeed ZeRO-3 inference) on CPU: every rank must
    make the same module calls, or ZeRO-3's parameter gathers mismatch and hang."""
    require_deepspeed()
    flags = [
        "--model",
        str(saved_model),
        "--min-context-length",
        "300",
        "--max-context-length",
        "600",
        "--context-interval",
        "300",
        "--depth-interval",
        "0.5",
        "--num-samples",
        "1",
        "--hide-progress",
        "--generate",
        "--max-new-tokens",
        "5",
    ]
    ok(run_script("eval_needle.py", *flags, "--output-dir", str(tmp_path / "torchrun"), processes=2))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    ok(
        subprocess.run(
            [
                sys.executable,
                "-m",
                "accelerate.commands.launch",
                "--config_file",
                str(ROOT / "accelerate_configs" / "cpu_deepspeed_inference.yaml"),
                str(ROOT / "eval_needle.py"),
                *flags,
                "--output-dir",
                str(tmp_path / "deepspeed"),
            ],
            capture_output=True,
            text=True,
            timeout=400,
            env=env,
            cwd=ROOT,
        )
    )
    name = f"needle_{saved_model.name}.csv"
    a = read_csv(tmp_path / "torchrun" / name)
    b = read_csv(tmp_path / "deepspeed" / name)
    assert len(a) == len(b) == 6
    for x, y in zip(a, b):
        assert x["predicted"] == y["predicted"] and abs(float(x["answer_nll"]) - float(y["answer_nll"])) <= 1e-5
        assert x["generated"] == y["generated"]  # generate under ZeRO-3 (synced_gpus: every rank steps together)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_eval_scripts_refuse_bad_input_clearly(tmp_path):
    """Launched: no model where the default one is looked for (exit 2, one line, no traceback)."""
    for script in ("eval_needle.py", "eval_ppl.py"):
        result = run_script(script, cwd=tmp_path)  # no outputs/ here
        assert result.returncode == 2 and "no model at outputs/tiny-llama" in result.stderr, result.stderr[-2000:]
        assert "Traceback" not in result.stderr, result.stderr[-2000:]


def test_eval_scripts_refuse_bad_flags_clearly(tmp_path, capsys):
    """Each eval script's flag checks, in this process: exit 2 with the reason."""
    import eval_needle
    import eval_ppl
    import eval_ruler

    cases = [
        (eval_needle, ["--task", "passkey", "--num-distractor", "2"], "--num-distractor applies to the needle task"),
        (eval_needle, ["--min-context-length", "900", "--max-context-length", "100"], "--min-context-length <= --max"),
        (eval_needle, ["--haystack-dir", str(tmp_path)], "no .txt files there"),
        (eval_ppl, ["--dataset", "a", "--tokenized", "b"], "not both"),
        (eval_ruler, ["--tasks", "vt,frob", "--samples", "0"], "--tasks: unknown ['frob']"),
    ]
    for script, flags, message in cases:
        with pytest.raises(SystemExit) as exit_:
            script.parse_args(flags)
        assert exit_.value.code == 2 and message in capsys.readouterr().err, (script.__name__, flags)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_eval_ruler_answers_as_one_process_and_writes_the_table(tmp_path):
    """eval_ruler.py at P=2 (zigzag_ring_attn) on the shipped base: a row per (task, length,
    sample), each with the answer model.generate gives to the same prompt in one process and its
    RULER score; the table (a task too long for a length: left out, and said), CSV and heatmap."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recipes import ruler

    demo = str(ROOT / "models" / "demo-base")
    flags = ["--model", demo, "--tasks", "niah_multikey_2,vt,cwe", "--lengths", "256,512", "--samples", "2"]
    result = ok(run_script("eval_ruler.py", *flags, "--output-dir", str(tmp_path), "--hide-progress", processes=2))
    assert "| cwe | - | " in result.stdout, result.stdout  # cwe's list does not fit 256 tokens
    with open(tmp_path / "ruler_demo-base.csv", newline="") as f:  # answers hold newlines
        rows = list(csv.DictReader(f))
    assert [(r["task"], r["length"], r["sample"]) for r in rows] == [
        (task, length, sample)
        for task in ("niah_multikey_2", "vt", "cwe")
        for length in ("256", "512")
        for sample in ("0", "1")
        if (task, length) != ("cwe", "256")
    ]
    model, tokenizer = AutoModelForCausalLM.from_pretrained(demo), AutoTokenizer.from_pretrained(demo)
    for row in rows:
        sample = ruler.make_sample(row["task"], tokenizer, int(row["length"]), 0, int(row["sample"]))
        prompt = torch.tensor([sample.input_ids])
        output = model.generate(prompt, max_new_tokens=sample.max_new_tokens, do_sample=False, pad_token_id=0)
        answer = tokenizer.decode(output[0, prompt.shape[1] :], skip_special_tokens=True)
        assert row["answer"] == answer and float(row["score"]) == ruler.score(answer, sample.outputs), row
    summary = json.loads((tmp_path / "ruler_demo-base.json").read_text())
    assert set(summary["scores"]) == {f"{r['task']}/{r['length']}" for r in rows} and "cwe/256" in summary["too_short"]
    assert (tmp_path / "ruler_demo-base.png").stat().st_size > 0


# ------------------------------------------------------------------ needle placement
def local_bpe(kind: str):
    """A BPE tokenizer trained here on the embedded prose (no download): GPT-2 style byte-level
    or SentencePiece style (Metaspace), vocabulary 600."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None if kind == "bytelevel" else "<unk>"))
    if kind == "bytelevel":
        tokenizer.pre_tokenizer, tokenizer.decoder = (
            pre_tokenizers.ByteLevel(add_prefix_space=False),
            decoders.ByteLevel(),
        )
        trainer = trainers.BpeTrainer(
            vocab_size=600, special_tokens=["<s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
    else:
        tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>", "<unk>"])
    tokenizer.train_from_iterator([embedded_prose()[:100_000]], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", unk_token=None if kind == "bytelevel" else "<unk>"
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["bytes", "bytelevel_bpe", "metaspace_bpe"])
def test_needle_lands_at_the_requested_depth_within_one_sentence(kind):
    tokenizer = byte_tokenizer() if kind == "bytes" else local_bpe(kind.split("_")[0])
    haystack = Haystack(tokenizer, embedded_prose()[:60_000], min_tokens=3000)
    rng = random.Random(0)
    checked = 0
    for length in (600, 3000):
        for depth in [i / 10 for i in range(11)]:
            for distractors in (0, 3):
                city, *others = rng.sample(CITIES, 1 + distractors)
                inserted = [(NEEDLE.needle.format(key=c, value=rng.randrange(10**6)), rng.random()) for c in others]
                prompt = build_prompt(tokenizer, haystack, NEEDLE, length, depth, city, "4817263", inserted)
                needle = NEEDLE.needle.format(key=city, value="4817263")
                assert len(prompt.input_ids) <= length and len(prompt.input_ids) >= length - 2
                # the needle starts inside the token at needle_position (a token may also hold
                # the end of the sentence before it, e.g. ".\n\nThe" with Metaspace)
                text = tokenizer.decode(prompt.input_ids[prompt.needle_position : prompt.answer_start])
                first = tokenizer.decode(prompt.input_ids[prompt.needle_position : prompt.needle_position + 1])
                assert 0 <= text.find(needle) < len(first), (kind, depth, text[:80])
                assert tokenizer.decode(prompt.input_ids[: prompt.answer_start]).count("4817263") == 1
                assert tokenizer.decode(prompt.input_ids[prompt.answer_start :]).strip() == "4817263"
                # within one sentence of the requested token (plus a token of join effects)
                error = abs(prompt.needle_position - prompt.requested_position)
                assert error <= haystack.sentence_length_at(prompt.haystack_position) + 2, (
                    kind,
                    length,
                    depth,
                    distractors,
                    error,
                )
                assert len(prompt.distractors) == distractors
                checked += 1
    assert checked == 44


def test_passkey_prompt_and_too_short_contexts():
    tokenizer = byte_tokenizer()
    haystack = Haystack(tokenizer, PASSKEY_FILLER, min_tokens=1000)
    prompt = build_prompt(tokenizer, haystack, PASSKEY, 1000, 0.5, key="", value="68231")
    text = tokenizer.decode(prompt.input_ids)
    assert (
        text.endswith("What is the pass key? The pass key is 68231") and "The pass key is 68231. Remember it." in text
    )
    assert len(prompt.input_ids) == 1000 and abs(prompt.actual_depth - 0.5) < 0.05
    with pytest.raises(ValueError, match="leaves no room for the haystack"):
        build_prompt(tokenizer, haystack, PASSKEY, 60, 0.5, key="", value="68231")


CHAT = (
    "{% for m in messages %}<s>[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


@pytest.mark.timeout(120)
def test_a_chat_prompt_is_the_template_around_the_haystack_and_the_request():
    """--chat-template: the tokens before the answer are exactly what apply_chat_template makes of
    the user's turn (haystack, then the request), the needle is still at its depth, and the
    answer is the bare value after the assistant's header."""
    tokenizer = local_bpe("bytelevel")
    haystack = Haystack(tokenizer, embedded_prose()[:60_000], min_tokens=3000)
    with pytest.raises(ValueError, match="the tokenizer has no chat template: leave out --chat-template"):
        chat_frame(tokenizer)
    tokenizer.chat_template = CHAT
    for depth in (0.0, 0.5, 1.0):
        prompt = build_prompt(tokenizer, haystack, NEEDLE, 2000, depth, "Oslo", "4817263", chat=chat_frame(tokenizer))
        asked = tokenizer.decode(prompt.input_ids[: prompt.answer_start])
        request = NEEDLE.request.format(key="Oslo")
        assert asked.startswith("<s>[user] ") and asked.endswith(request + "\n[assistant] "), asked[-120:]
        user = asked.removeprefix("<s>[user] ").removesuffix("\n[assistant] ")
        want = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        assert prompt.input_ids[: prompt.answer_start] == list(want)
        assert tokenizer.decode(prompt.input_ids[prompt.answer_start :]) == "4817263"
        assert 1990 <= len(prompt.input_ids) <= 2000 and abs(prompt.actual_depth - depth) < 0.02, prompt.actual_depth
        needle = NEEDLE.needle.format(key="Oslo", value="4817263")
        first = tokenizer.decode(prompt.input_ids[prompt.needle_position : prompt.needle_position + 1])
        assert 0 <= tokenizer.decode(prompt.input_ids[prompt.needle_position :]).find(needle) < len(first)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_generate_script_parallel_equals_single_process(tmp_path, saved_model):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The special magic number is 4821. " * 12 + "What is the special magic number? It is")
    flags = ["--model", str(saved_model), "--prompt-file", str(prompt), "--max-new-tokens", "24"]
    for extra in ([], ["--do-sample", "--temperature", "1.5", "--seed", "7"]):
        single = ok(run_script("tools.generate", *flags, *extra, "--parallel-mode", "data_parallel"))
        for mode in ("zigzag_ring_attn", "ulysses_attn"):
            parallel = ok(run_script("tools.generate", *flags, *extra, "--parallel-mode", mode, processes=2))
            assert parallel.stdout == single.stdout and parallel.stdout.strip(), (extra, mode)
            assert f"{mode} over 2 process(es)" in parallel.stderr and "K/V cache on this rank" in parallel.stderr
    missing = run_script("tools.generate", "--model", str(saved_model), "--prompt-file", str(tmp_path / "none.txt"))
    assert missing.returncode == 2 and "none.txt: no such file" in missing.stderr
