"""The offline RULER-style suite (programs/ruler.py): prompts of exactly the length asked for in
two tokenizers (the shipped base's BPE and the byte tokenizer), deterministic, holding what
their expected answers say; an oracle scores 1 and a constant answer 0; the lm-eval task files
(programs/ruler_tasks) name every task with its answer budget."""

import collections
import re
from pathlib import Path

import pytest
import yaml
from transformers import AutoTokenizer

from easy_context.programs import ruler
from easy_context.programs.data import byte_tokenizer
from easy_context.programs.ruler_tasks import TASKS_DIR

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizers():
    return {"bpe": AutoTokenizer.from_pretrained(ROOT / "models" / "demo-base"), "bytes": byte_tokenizer()}


# lengths each tokenizer fits every task into (bytes: one token per character)
LENGTHS = {"bpe": (512, 1536), "bytes": (2048,)}


def test_every_prompt_has_the_exact_length_and_holds_its_answers(tokenizers):
    for kind, tokenizer in tokenizers.items():
        for length in LENGTHS[kind]:
            for task in ruler.TASKS:
                sample = ruler.make_sample(task, tokenizer, length, seed=3, index=1)
                assert len(sample.input_ids) == length, (kind, task, length, len(sample.input_ids))
                assert sample.input_ids[: len(tokenizer("")["input_ids"])] == tokenizer("")["input_ids"]
                text = tokenizer.decode(sample.input_ids)
                if task == "cwe":  # the 10 expected words are the 10 most frequent of the list
                    counts = collections.Counter(re.findall(r"^\d+\. (\w+)$", text, flags=re.M))
                    top = {w for w, _ in counts.most_common(10)}
                    assert top == set(sample.outputs) and counts.most_common(11)[-1][1] < counts[sample.outputs[0]]
                elif task == "fwe":  # the 3 expected words are the 3 most frequent coded words
                    words = collections.Counter(text.split("\n")[1].split())
                    assert [w for w, _ in words.most_common(3)] == sample.outputs, words.most_common(4)
                else:  # every expected value (or variable name) is in the prompt, at its insert
                    for output in sample.outputs:
                        assert output in text, (kind, task, output)
                    inserted = [tokenizer.decode(sample.input_ids[p : p + 40]) for p in sample.needle_positions]
                    assert all(s.startswith(("One of the special magic", "VAR ")) for s in inserted), inserted


def test_samples_are_deterministic_and_differ_by_seed_and_index(tokenizers):
    tokenizer = tokenizers["bpe"]
    for task in ruler.TASKS:
        a = ruler.make_sample(task, tokenizer, 1024, seed=0, index=0)
        assert a.input_ids == ruler.make_sample(task, tokenizer, 1024, seed=0, index=0).input_ids
        assert a.input_ids != ruler.make_sample(task, tokenizer, 1024, seed=1, index=0).input_ids
        assert a.input_ids != ruler.make_sample(task, tokenizer, 1024, seed=0, index=1).input_ids


def test_an_oracle_scores_one_and_a_constant_answer_zero(tokenizers):
    for task in ruler.TASKS:
        sample = ruler.make_sample(task, tokenizers["bpe"], 1024, seed=0, index=2)
        assert ruler.score(" " + ", ".join(sample.outputs) + ".", sample.outputs) == 1.0
        assert ruler.score(" 1234567", sample.outputs) == 0.0
    assert ruler.score("abc XYZ", ["xyz", "qqq"]) == 0.5  # case-insensitive, share of the expected strings


def test_too_short_a_length_and_unknown_tasks_are_refused(tokenizers):
    with pytest.raises(ValueError, match="niah_multiquery: 128 tokens leave no room for a haystack"):
        ruler.make_sample("niah_multiquery", tokenizers["bpe"], 128)
    with pytest.raises(ValueError, match="cwe: 300 tokens are too few"):
        ruler.make_sample("cwe", tokenizers["bpe"], 300)
    with pytest.raises(ValueError, match="unknown task 'niah'"):
        ruler.make_sample("niah", tokenizers["bpe"], 1024)


def test_the_lm_eval_task_files_name_every_task_with_its_budget():
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: f"!function {loader.construct_scalar(node)}")
    files = {p.name: yaml.load(p.read_text(), Loader=Loader) for p in TASKS_DIR.glob("*.yaml")}
    group = files.pop("ec_ruler.yaml")
    assert group["task"] == [f"ec_ruler_{t}" for t in ruler.TASKS]
    for task, spec in ruler.TASKS.items():
        config = files.pop(f"ec_ruler_{task}.yaml")
        assert config["task"] == f"ec_ruler_{task}" and config["custom_dataset"] == f"!function utils.{task}"
        assert config["generation_kwargs"]["max_gen_toks"] == spec.max_new_tokens, task
    assert not files, files
    template = yaml.load((TASKS_DIR / "_ec_ruler_template_yaml").read_text(), Loader=Loader)
    from easy_context.programs.ruler_tasks import utils

    assert [int(m["metric"]) for m in template["metric_list"]] == list(utils.METRIC_LENGTHS)
    assert set(ruler.DEFAULT_LENGTHS) <= set(utils.METRIC_LENGTHS)


def test_a_haystack_of_needles_names_each_key_once(tokenizers):
    """niah_multikey_2: the haystack is other keys' needles; no key may appear in two needles (the
    question would have two answers). 32K tokens: about 1,600 needles of 3-syllable words."""
    sample = ruler.make_sample("niah_multikey_2", tokenizers["bpe"], 32768, seed=0, index=0)
    keys = re.findall(r"special magic numbers for (\w+) is:", tokenizers["bpe"].decode(sample.input_ids))
    repeated = [key for key, count in collections.Counter(keys).items() if count > 1]
    assert len(keys) > 1000 and not repeated, (len(keys), repeated)


def test_a_chosen_depth_places_the_asked_needle(tokenizers):
    """depth 0: the asked needle opens the haystack; depth 1: it starts the last sentence (of the
    needles, the first and the last); the 3 distractors stay at random depths."""
    tokenizer = tokenizers["bpe"]
    first, last = (lambda p, ps: p == min(ps) < 64), (lambda p, ps: p == max(ps) > 1024 - 120)
    placed = {}
    for depth, where in ((0.0, first), (1.0, last)):
        sample = placed[depth] = ruler.make_sample("niah_multikey_1", tokenizer, 1024, seed=4, index=0, depth=depth)
        value = sample.outputs[0]
        asked = [p for p in sample.needle_positions if value in tokenizer.decode(sample.input_ids[p : p + 40])]
        assert len(asked) == 1 and where(asked[0], sample.needle_positions), (depth, asked, sample.needle_positions)
        assert len(sample.input_ids) == 1024 and len(sample.needle_positions) == 4
    plain = ruler.make_sample("niah_multikey_1", tokenizer, 1024, seed=4, index=0)
    assert plain.input_ids != placed[0.0].input_ids
    with pytest.raises(ValueError, match="vt: depth=0.5 applies to the niah tasks only"):
        ruler.make_sample("vt", tokenizer, 1024, depth=0.5)
