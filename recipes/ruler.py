"""Long-context tasks after RULER (Hsieh et al., 2024, "RULER: What's the Real Context Size of
Your Long-Context Language Models?"), generated here for any tokenizer, with nothing downloaded.

The tasks follow the paper's definitions (Table 2 and its appendix); the wording and the word
lists are our own:

  niah_single_1/2/3   one needle ("One of the special magic numbers for <key> is: <value>.") in a
                      haystack of noise sentences (1), or of prose (2, 3; 3 with UUID values)
  niah_multikey_1/2/3 the needle among 3 distractor needles of other keys (1), or in a haystack
                      made only of other needles (2; 3 with UUID keys and values)
  niah_multivalue     one key with 4 values; all 4 are asked for
  niah_multiquery     4 needles of 4 keys; all 4 values are asked for
  vt                  variable tracking: a chain of 4 hops (VAR A = 12345, VAR B = VAR A, ...)
                      spread through noise; every name bound to the value is asked for
  cwe                 common words: a numbered list where 10 words appear 30 times and the
                      others 3 times; the 10 are asked for
  fwe                 frequent words: coded words drawn from a Zeta(2) law; the 3 most
                      frequent are asked for

Prompts are token ids, assembled from pieces each tokenized once, so a prompt's length is
exactly the length asked for: the haystack (whole sentences, then the first tokens of the
next one) takes what the fixed pieces leave. Needles go in between haystack sentences at their
depths. A sample is a pure function of (task, tokenizer, length, seed, index), so every rank
builds the same one. The score of an answer is RULER's: the share of the expected strings
present in it, case-insensitive.

The QA tasks of RULER (SQuAD, HotpotQA) need their datasets and are not offered here; through
eval_harness.py, lm-eval's own `ruler` group runs them where their data is available.
"""

from __future__ import annotations

import functools
import random
import re
import uuid
from dataclasses import dataclass, field

from recipes.needle import PASSKEY_FILLER

__all__ = ["TASKS", "RulerTask", "Sample", "make_sample", "score", "DEFAULT_LENGTHS"]

DEFAULT_LENGTHS = (512, 1024, 2048)
NOISE = PASSKEY_FILLER  # the paper's noise haystack: the same five sentences, repeated


@dataclass(frozen=True)
class RulerTask:
    name: str
    family: str  # niah, vt, cwe, fwe
    max_new_tokens: int
    haystack: str = "noise"  # noise, prose, needles (niah)
    keys: str = "words"  # words, uuids
    values: str = "numbers"  # numbers, words, uuids
    distractors: int = 0  # other keys' needles (niah_multikey_1)
    values_per_key: int = 1  # niah_multivalue
    queries: int = 1  # niah_multiquery


TASKS = {
    task.name: task
    for task in (
        RulerTask("niah_single_1", "niah", 32, haystack="noise"),
        RulerTask("niah_single_2", "niah", 32, haystack="prose"),
        RulerTask("niah_single_3", "niah", 64, haystack="prose", values="uuids"),
        RulerTask("niah_multikey_1", "niah", 32, haystack="prose", distractors=3),
        RulerTask("niah_multikey_2", "niah", 32, haystack="needles"),
        RulerTask("niah_multikey_3", "niah", 64, haystack="needles", keys="uuids", values="uuids"),
        RulerTask("niah_multivalue", "niah", 64, haystack="prose", values_per_key=4),
        RulerTask("niah_multiquery", "niah", 64, haystack="prose", queries=4),
        RulerTask("vt", "vt", 32),
        RulerTask("cwe", "cwe", 96),
        RulerTask("fwe", "fwe", 48),
    )
}


@dataclass
class Sample:
    task: str
    length: int
    index: int
    input_ids: list[int]  # exactly `length` tokens
    outputs: list[str]  # what a right answer contains
    max_new_tokens: int
    needle_positions: list[int] = field(default_factory=list)  # token index of each inserted piece


def score(prediction: str, outputs: list[str]) -> float:
    """RULER's string_match_all: the share of the expected strings in the answer."""
    answer = re.sub(r"[\x00-\x1f]", "\n", prediction).strip().lower()
    return sum(output.lower() in answer for output in outputs) / len(outputs)


# ------------------------------------------------------------------------------ words
_CONSONANTS, _VOWELS = "bdfgklmnprstvz", "aeiou"


def _word(rng: random.Random, syllables: int = 3) -> str:
    """A pronounceable made-up word (keys, list words, coded words): 70^3 of them."""
    return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables))


def _distinct(rng: random.Random, make, count: int, avoid=()) -> list[str]:
    seen, result = set(avoid), []
    while len(result) < count:
        item = make()
        if item not in seen:
            seen.add(item)
            result.append(item)
    return result


def _value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randrange(1_000_000, 10_000_000))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return _word(rng)


def _key(rng: random.Random, kind: str) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4)) if kind == "uuids" else _word(rng)


# --------------------------------------------------------------------------- tokens
class _Pieces:
    """Token ids of text pieces, each tokenized on its own (no BOS), and the tokenizer's specials."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.specials = list(tokenizer("")["input_ids"])  # BOS, or nothing

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def many(self, texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []


@functools.lru_cache(maxsize=4)
def _sentences(tokenizer, kind: str) -> tuple[tuple[int, ...], ...]:
    """The noise or prose haystack as token ids, sentence by sentence (a join is then always a
    sentence start, whatever the vocabulary)."""
    if kind == "noise":
        text = NOISE
    else:
        from recipes.data import embedded_prose

        text = " ".join(embedded_prose().split())
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", text) if s]
    return tuple(tuple(ids) for ids in _Pieces(tokenizer).many([s + " " for s in sentences]))


def _fill(sentences, budget: int, rng: random.Random) -> list[list[int]]:
    """Whole sentences (cycling from a random start) holding exactly `budget` tokens in all;
    the last one cut to fit."""
    result, used, i = [], 0, rng.randrange(len(sentences))
    while used < budget:
        piece = list(sentences[i % len(sentences)])[: budget - used]
        result.append(piece)
        used += len(piece)
        i += 1
    return result


def _assemble(pieces: _Pieces, head: str, body: list[list[int]], inserts, tail: str, length: int):
    """specials + head + body with inserts (gap index, ids) + tail; (ids, insert positions)."""
    ids = pieces.specials + pieces.ids(head)
    positions, by_gap = [], {}
    for gap, insert in inserts:
        by_gap.setdefault(gap, []).append(insert)
    for gap, sentence in enumerate(body):
        for insert in by_gap.get(gap, []):
            positions.append(len(ids))
            ids += insert
        ids += sentence
    ids += pieces.ids(tail)
    assert len(ids) == length, (len(ids), length)  # the budget arithmetic below makes it so
    return ids, positions


def _budget(pieces: _Pieces, length: int, head: str, inserts: list[list[int]], tail: str, task: str) -> int:
    fixed = len(pieces.specials) + len(pieces.ids(head)) + sum(map(len, inserts)) + len(pieces.ids(tail))
    if fixed >= length:
        raise ValueError(
            f"{task}: {length} tokens leave no room for a haystack (the instructions, needles and "
            f"question take {fixed}); use a longer length"
        )
    return length - fixed


def _gaps_at_depths(body: list[list[int]], depths: list[float]) -> list[int]:
    """The sentence start nearest each depth (in haystack tokens), as the index of the sentence
    the insert goes before (never after the last one: it may be cut short)."""
    starts, total = [], 0
    for sentence in body:
        starts.append(total)
        total += len(sentence)
    return [min(range(len(starts)), key=lambda g: abs(starts[g] - d * total)) for d in depths]


# ----------------------------------------------------------------------------- tasks
def make_sample(task: str, tokenizer, length: int, seed: int = 0, index: int = 0, depth: float | None = None) -> Sample:
    """Sample `index` of `task` at exactly `length` tokens of `tokenizer`. depth (needle tasks):
    the asked needles start at the sentence start nearest this fraction of the haystack (0: the
    first sentence, 1: the last); the others, and every needle without it, at random depths."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; the tasks are {', '.join(TASKS)}")
    spec = TASKS[task]
    if depth is not None and (spec.family != "niah" or not 0.0 <= depth <= 1.0):
        raise ValueError(f"{task}: depth={depth} applies to the niah tasks only, as a fraction in [0, 1]")
    rng = random.Random(f"{seed}/{task}/{length}/{index}")
    pieces = _Pieces(tokenizer)
    build = {"niah": _niah, "vt": _variable_tracking, "cwe": _common_words, "fwe": _frequent_words}[spec.family]
    ids, positions, outputs = build(spec, pieces, length, rng, **({} if depth is None else {"depth": depth}))
    return Sample(task, length, index, ids, outputs, spec.max_new_tokens, positions)


def _niah(spec: RulerTask, pieces: _Pieces, length: int, rng: random.Random, depth: float | None = None):
    kind = {"numbers": "numbers", "words": "words", "uuids": "UUIDs"}[spec.values]
    keys = _distinct(rng, lambda: _key(rng, spec.keys), max(spec.queries, 1) + spec.distractors)
    asked = keys[: spec.queries]
    values = {key: [_value(rng, spec.values) for _ in range(spec.values_per_key)] for key in keys}
    needle = "One of the special magic {kind} for {key} is: {value}. "
    needles = [needle.format(kind=kind, key=key, value=value) for key in keys for value in values[key]]
    head = f"Some special magic {kind} are hidden in the text below. Remember them: a question about them follows.\n"
    query = ", ".join(asked[:-1]) + (" and " if len(asked) > 1 else "") + asked[-1]
    tail = (
        f"\nWhat are all the special magic {kind} for {query} in the text above? "
        f"The special magic {kind} for {query} in the text above are:"
    )
    needle_ids = pieces.many(needles)
    budget = _budget(pieces, length, head, needle_ids, tail, spec.name)
    if spec.haystack == "needles":  # needles of other keys, each key once, until the budget is spent
        sentences, used = [], set(keys)
        while sum(map(len, sentences)) < budget:
            others = _distinct(rng, lambda: _key(rng, spec.keys), 64, used)
            used.update(others)
            sentences += pieces.many([needle.format(kind=kind, key=k, value=_value(rng, spec.values)) for k in others])
        body = _fill(sentences, budget, rng)
    else:
        body = _fill(_sentences(pieces.tokenizer, spec.haystack), budget, rng)
    depths = sorted(rng.random() for _ in needle_ids)
    order = rng.sample(range(len(needle_ids)), len(needle_ids))  # which needle goes to which depth
    placed = list(zip(depths, order))
    if depth is not None:  # the asked keys' needles come first in `needles`
        placed = [(depth if i < len(asked) * spec.values_per_key else d, i) for d, i in placed]
    gaps = _gaps_at_depths(body, [d for d, _ in placed])
    inserts = [(g, needle_ids[i]) for g, (_, i) in zip(gaps, placed)]
    ids, positions = _assemble(pieces, head, body, inserts, tail, length)
    return ids, positions, [value for key in asked for value in values[key]]


def _variable_tracking(spec: RulerTask, pieces: _Pieces, length: int, rng: random.Random, hops: int = 4):
    names = _distinct(rng, lambda: "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)), hops + 1)
    value = str(rng.randrange(10_000, 100_000))
    chain = [f"VAR {names[0]} = {value}. "] + [f"VAR {names[i + 1]} = VAR {names[i]}. " for i in range(hops)]
    head = "Remember the variable assignments in the text below; a question about them follows.\n"
    tail = (
        f"\nFind every variable that is assigned the value {value} in the text above, directly or through "
        f"other variables. Answer: the variables assigned the value {value} are:"
    )
    chain_ids = pieces.many(chain)
    budget = _budget(pieces, length, head, chain_ids, tail, spec.name)
    body = _fill(_sentences(pieces.tokenizer, "noise"), budget, rng)
    gaps = _gaps_at_depths(body, sorted(rng.random() for _ in chain))  # in chain order
    ids, positions = _assemble(pieces, head, body, list(zip(gaps, chain_ids)), tail, length)
    return ids, positions, names


def _list_sample(spec, pieces: _Pieces, length: int, rng, entries_for, head: str, tail: str, least: int = 1):
    """A list task: as many entries (entries_for(n): token ids of the list with n) as fit, then
    noise to the exact length. (ids, positions, n)."""
    fixed = len(pieces.specials) + len(pieces.ids(head)) + len(pieces.ids(tail))
    fits = lambda n: fixed + sum(map(len, entries_for(n))) <= length  # noqa: E731
    if not fits(least):
        raise ValueError(f"{spec.name}: {length} tokens are too few for its shortest list; use a longer length")
    low, high = least, length
    while low < high:  # the largest n whose list fits
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    listed = [token for entry in entries_for(low) for token in entry]
    rest = length - fixed - len(listed)
    body = [listed] + (_fill(_sentences(pieces.tokenizer, "noise"), rest, rng) if rest else [])
    ids, positions = _assemble(pieces, head, body, [], tail, length)
    return ids, positions, low


def _common_words(spec: RulerTask, pieces: _Pieces, length: int, rng: random.Random, common=10, rarely=3):
    """The common words appear up to 30 times (the paper's count at long lengths), fewer in a
    short prompt, but always more often than the others (3 times)."""
    vocabulary = _distinct(rng, lambda: _word(rng), common + max(1, length // 4))
    entry_tokens = max(1, len(pieces.ids(f"10. {vocabulary[0]}\n")))
    often = max(rarely + 1, min(30, length // (2 * common * entry_tokens)))
    shuffle_seed = rng.random()

    @functools.cache
    def entries_for(rare: int) -> tuple:
        rare = min(rare, len(vocabulary) - common)
        words = vocabulary[:common] * often + vocabulary[common : common + rare] * rarely
        random.Random(shuffle_seed).shuffle(words)
        return tuple(tuple(ids) for ids in pieces.many([f"{i + 1}. {w}\n" for i, w in enumerate(words)]))

    head = "Below is a numbered list of words. Some of them appear many times.\n"
    tail = f"\nWhat are the {common} most common words in the list above? Answer: the {common} most common words are:"
    ids, positions, _ = _list_sample(spec, pieces, length, rng, entries_for, head, tail, least=0)
    return ids, positions, vocabulary[:common]


def _frequent_words(spec: RulerTask, pieces: _Pieces, length: int, rng: random.Random, alpha=2.0, top=3):
    vocabulary = _distinct(rng, lambda: _word(rng, 2), 400)
    stream = rng.choices(vocabulary, [1 / (rank + 1) ** alpha for rank in range(len(vocabulary))], k=length)
    coded = tuple(tuple(ids) for ids in pieces.many([w + " " for w in stream]))  # more words than can fit
    head = "Read the coded text below and count how often each coded word appears.\n"
    tail = f"\nWhat are the {top} most frequent coded words in the text above? Answer: the {top} most frequent are:"
    ids, positions, listed = _list_sample(spec, pieces, length, rng, lambda n: coded[:n], head, tail)
    counts = {}
    for word in stream[:listed]:
        counts[word] = counts.get(word, 0) + 1
    return ids, positions, sorted(counts, key=lambda w: (-counts[w], vocabulary.index(w)))[:top]
