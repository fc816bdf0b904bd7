"""The offline RULER-style suite (recipes/ruler.py): prompts of exactly the length asked for in
two tokenizers (the shipped base's BPE and the byte tokenizer), deterministic, holding what
their expected answers say; an oracle scores 1 and a constant answer 0; the lm-eval task files
(recipes/ruler_tasks) name every task with its answer budget."""

import collections
import re
from pathlib import Path

import pytest
import yaml
from transformers import AutoTokenizer

from recipes import ruler
from recipes.data import byte_tokenizer
from recipes.ruler_tasks import TASKS_DIR

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
    from recipes.ruler_tasks import utils

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


# ------------------------------------------------- where the answers are: the inserted pieces, read back
NEEDLE = re.compile(r"One of the special magic (?:numbers|UUIDs) for (\S+) is: (\S+)\. ")
LINK = re.compile(r"VAR (\w+) = (VAR \w+|\d+)\. ")  # variable tracking's chain


def _layout(sample, tokenizer, piece):
    """The sample read back through its tokenizer: head and tail lengths (each its own text's tokens),
    and each inserted piece as (position, tokens, the regex `piece`'s groups, the haystack tokens
    before it); asserts every insert is whole (exactly the tokens of its text) and in the haystack."""
    ids, specials = sample.input_ids, tokenizer("")["input_ids"]
    text = tokenizer.decode(ids[len(specials) :])
    head = specials + tokenizer(text.split("\n")[0] + "\n", add_special_tokens=False)["input_ids"]
    tail = tokenizer("\n" + text.rsplit("\n", 1)[1], add_special_tokens=False)["input_ids"]
    assert ids[: len(head)] == head and ids[-len(tail) :] == tail, sample.task
    inserts = []
    for position in sample.needle_positions:
        match = piece.match(tokenizer.decode(ids[position : position + 160]))
        assert match, (sample.task, position, tokenizer.decode(ids[position : position + 60]))
        tokens = tokenizer(match.group(0), add_special_tokens=False)["input_ids"]
        assert ids[position : position + len(tokens)] == tokens, (sample.task, position, match.group(0))
        assert len(head) <= position and position + len(tokens) <= len(ids) - len(tail), (sample.task, position)
        inserts.append((position, len(tokens), match.groups()))
    inside = {i for p, n, _ in inserts for i in range(p, p + n)}
    haystack = [t for i, t in enumerate(ids[len(head) : len(ids) - len(tail)], len(head)) if i not in inside]
    before = lambda p: p - len(head) - sum(n for q, n, _ in inserts if q < p)  # haystack tokens before p
    return text, haystack, [(p, n, groups, before(p)) for p, n, groups in inserts]


def _asked_needles(sample, tokenizer):
    """A needle task's inserts, checked: one needle per (key, value), as many as the task's spec
    says; the asked keys' needles (keys read from the question) hold exactly the expected values,
    and no other needle anywhere in the prompt names an asked key or holds an expected value.
    (haystack tokens, asked inserts, other inserts, asked keys)."""
    spec = ruler.TASKS[sample.task]
    text, haystack, inserts = _layout(sample, tokenizer, NEEDLE)
    asked = re.split(r", | and ", re.search(r"for (\S.*?) in the text above\?", text.rsplit("\n", 1)[1]).group(1))
    assert len(asked) == spec.queries and len(set(asked)) == len(asked), (sample.task, asked)
    assert len(inserts) == (spec.queries + spec.distractors) * spec.values_per_key, (sample.task, len(inserts))
    expected = collections.Counter(
        (key, value)
        for i, key in enumerate(asked)
        for value in sample.outputs[i * spec.values_per_key : (i + 1) * spec.values_per_key]
    )
    assert len(sample.outputs) == spec.queries * spec.values_per_key, (sample.task, sample.outputs)
    mine = [insert for insert in inserts if insert[2][0] in asked]
    others = [insert for insert in inserts if insert[2][0] not in asked]
    assert collections.Counter(groups for _, _, groups, _ in mine) == expected, (sample.task, mine, sample.outputs)
    values = set(sample.outputs)
    everywhere = collections.Counter(pair for pair in NEEDLE.findall(text) if pair[0] in asked or pair[1] in values)
    assert everywhere == expected, (sample.task, everywhere, expected)  # the haystack repeats no asked key
    assert not {value for _, _, (_, value), _ in others} & values, (sample.task, others)
    return haystack, mine, others, asked


def test_each_answer_is_inserted_whole_in_the_needle_that_answers_the_question(tokenizers):
    """Every task: its expected answers are in the prompt, each in the inserted piece that makes it
    the answer (the asked key's needle, the chain's link), never a distractor's; the list tasks
    (cwe, fwe) insert nothing and hold their answers in the list."""
    for kind, tokenizer in tokenizers.items():
        for task, spec in ruler.TASKS.items():
            for seed in (0, 5):
                sample = ruler.make_sample(task, tokenizer, LENGTHS[kind][0], seed=seed, index=2)
                if spec.family == "niah":
                    _asked_needles(sample, tokenizer)
                elif spec.family == "vt":  # names[0] = value, names[i + 1] = names[i], inserted in chain order
                    text, _, inserts = _layout(sample, tokenizer, LINK)
                    value = re.search(r"assigned the value (\d+) in the text above", text).group(1)
                    links = [groups for _, _, groups, _ in inserts]
                    chain = [(sample.outputs[0], value)] + [
                        (name, f"VAR {previous}") for previous, name in zip(sample.outputs, sample.outputs[1:])
                    ]
                    assert links == chain and sample.needle_positions == sorted(sample.needle_positions), (task, links)
                    assert LINK.findall(text) == chain, (task, LINK.findall(text))  # no other assignment
                else:
                    assert spec.family in ("cwe", "fwe") and sample.needle_positions == [], (task, spec.family)
                    body = tokenizer.decode(sample.input_ids).split("\n")[1:-1]  # between the head and the question
                    listed = collections.Counter(re.sub(r"^\d+\. ", "", line) for line in body)
                    if spec.family == "fwe":
                        listed = collections.Counter(" ".join(body).split())
                    assert all(listed[answer] > 1 for answer in sample.outputs), (task, sample.outputs, listed)
                    with pytest.raises(ValueError, match=f"{task}: depth=0.5 applies to the niah tasks only"):
                        ruler.make_sample(task, tokenizer, LENGTHS[kind][0], depth=0.5)


def test_a_chosen_depth_puts_the_asked_needles_at_the_nearest_sentence_start(tokenizers):
    """make_sample's rule, for every needle task: the asked needles (all of them, together) start at
    the haystack's sentence start nearest depth x its haystack tokens; the haystack and the other
    needles stay where they were. Swept over 21 depths: each depth's insert is no farther from its
    target than any sentence start seen in the sweep (every insert starts a sentence), 0 is the
    haystack's first token, and the needles move only forward as the depth grows."""
    depths = [i / 20 for i in range(21)]
    for kind, tokenizer in tokenizers.items():
        for task, spec in ruler.TASKS.items():
            if spec.family != "niah":
                continue
            for seed in (0, 1):
                placed, starts = [], set()
                for depth in depths:
                    sample = ruler.make_sample(task, tokenizer, LENGTHS[kind][0], seed=seed, index=0, depth=depth)
                    haystack, mine, others, _ = _asked_needles(sample, tokenizer)
                    at = {before for _, _, _, before in mine}
                    assert len(at) == 1, (kind, task, depth, mine)  # the asked needles go in together
                    placed.append((depth, at.pop(), haystack, [(groups, b) for _, _, groups, b in others]))
                    starts.update(before for _, _, _, before in mine + others)
                _, first, haystack, distractors = placed[0]
                assert first == 0, (kind, task, seed, first)
                for depth, before, same_haystack, same_distractors in placed:
                    assert same_haystack == haystack and same_distractors == distractors, (kind, task, depth)
                    target = depth * len(haystack)
                    nearer = [s for s in starts if abs(s - target) < abs(before - target)]
                    assert not nearer, (kind, task, seed, depth, before, target, sorted(starts))
                assert [b for _, b, _, _ in placed] == sorted(b for _, b, _, _ in placed), (kind, task, seed)
