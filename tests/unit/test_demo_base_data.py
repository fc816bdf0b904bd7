"""The demo base's data (recipes/demo_data.py): a 7-digit answer is a few tokens,
copy rows repeat earlier spans with the promised weights, needle rows are exactly L tokens with
the answer weighted up, the same seed gives the same batches, and the two accuracies score an
oracle 1 and a constant predictor 0."""

import random
import re
from types import SimpleNamespace

import pytest
import torch

from recipes.demo_data import (
    ANSWER_WEIGHT,
    COPY_WEIGHT,
    OTHER_WEIGHT,
    NeedleRows,
    answer_accuracy,
    copy_accuracy,
    copy_row,
    demo_batch,
    demo_tokenizer,
)


@pytest.fixture(scope="module")
def tokenizer():
    return demo_tokenizer()


@pytest.fixture(scope="module")
def needles(tokenizer):
    return NeedleRows(tokenizer, 512)


def test_a_seven_digit_answer_is_at_most_four_tokens(tokenizer):
    rng = random.Random(0)
    numbers = ["0000000", "1000000", "9999999", "1234567"] + [str(rng.randrange(10**7)).zfill(7) for _ in range(200)]
    for number in numbers:
        ids = tokenizer(" " + number, add_special_tokens=False)["input_ids"]
        assert len(ids) <= 4, (number, tokenizer.convert_ids_to_tokens(ids))
        assert tokenizer.decode(ids) == " " + number
    groups = [str(i).zfill(width) for width in (1, 2, 3) for i in range(10**width)]
    assert len(groups) == 1110
    assert all(len(tokenizer(g, add_special_tokens=False)["input_ids"]) == 1 for g in groups)
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer("")["input_ids"] == []  # prompts start with the text: no BOS to count


def test_the_tokenizer_is_the_same_every_time(tokenizer):
    assert demo_tokenizer().backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()


@pytest.mark.parametrize("length", [64, 128, 256, 512])
def test_copy_rows_repeat_earlier_spans(length):
    longest = max(8, length // 6)
    for seed in range(20):
        ids, weights = copy_row(random.Random(seed), length)
        assert len(ids) == len(weights) == length
        assert all(1 <= t < 1024 for t in ids)
        assert set(weights) <= {COPY_WEIGHT, OTHER_WEIGHT}
        # each run of copied tokens, with the span's first token before it, is one repeated span
        runs = [m.span() for m in re.finditer("c+", "".join("c" if w == COPY_WEIGHT else "." for w in weights))]
        assert runs, "a row without a copied span"
        for begin, end in runs:
            start = begin - 1  # the span's first token: not announced, so weighted OTHER_WEIGHT
            span = ids[start:end]
            assert 6 <= len(span) <= longest
            assert any(ids[s : s + len(span)] == span for s in range(0, start - len(span) + 1)), (seed, start)


@pytest.mark.parametrize("length", [128, 256, 512])
def test_needle_rows_are_length_tokens_with_answers_weighted(tokenizer, needles, length):
    for seed in range(5):
        ids, weights = needles.row(random.Random(seed), length)
        assert len(ids) == len(weights) == length
        assert set(weights) <= {0.0, 1.0, ANSWER_WEIGHT}
        marks = "".join({0.0: "p", 1.0: ".", ANSWER_WEIGHT: "a"}[w] for w in weights)
        assert re.fullmatch(r"(\.+a+\.)+p*", marks), marks  # prompt, answer, EOS; then padding
        assert all(ids[i] == tokenizer.eos_token_id for i, m in enumerate(marks) if m == "p")
        for begin, end in (m.span() for m in re.finditer("a+", marks)):
            assert re.fullmatch(r" \d{7}", tokenizer.decode(ids[begin:end]))
            assert tokenizer.decode(ids[:begin]).endswith("number is:")
            assert ids[end] == tokenizer.eos_token_id


def test_the_same_seed_gives_the_same_batches(needles):
    first = demo_batch(random.Random(7), needles, 256, 0.3, 6)
    again = demo_batch(random.Random(7), needles, 256, 0.3, 6)
    other = demo_batch(random.Random(8), needles, 256, 0.3, 6)
    assert first[0].shape == first[1].shape == (6, 256)
    assert first[0].dtype == torch.int64 and first[1].dtype == torch.float32
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], other[0])


def fake_model(vocab: int, oracle: bool):
    """hidden state = one-hot of the next token (oracle) or of token 0; the output layer is the identity."""

    def base(input_ids, use_cache):
        target = torch.roll(input_ids, -1, dims=1) if oracle else torch.zeros_like(input_ids)
        return SimpleNamespace(last_hidden_state=torch.nn.functional.one_hot(target, vocab).float())

    return SimpleNamespace(model=base, lm_head=lambda hidden: hidden)


def test_the_accuracies_score_an_oracle_one_and_a_constant_zero(tokenizer, needles):
    rng = random.Random(0)
    prompts = [needles.prompt(rng, length, 0) for length in (200, 256, 256)]  # unequal lengths: padded
    rows = [copy_row(rng, 128) for _ in range(3)]
    oracle, constant = fake_model(len(tokenizer), True), fake_model(len(tokenizer), False)
    assert answer_accuracy(oracle, prompts, tokenizer.eos_token_id, chunk=2) == {
        "exact": 1.0,
        "per_token": [1.0] * 4,
    }
    assert copy_accuracy(oracle, rows) == 1.0
    assert answer_accuracy(constant, prompts, tokenizer.eos_token_id)["exact"] == 0.0
    assert copy_accuracy(constant, rows) == 0.0
