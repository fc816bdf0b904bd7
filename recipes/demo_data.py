"""Data for the demo's base model (scripts/pretrain_demo_base.py): a small BPE tokenizer, copy
rows and needle rows, and the two accuracies the training log follows.

A tiny model learns needle retrieval on CPU only through a copy circuit first (an induction
head: find the earlier occurrence of the current token, predict what followed it), so the
training mix has two kinds of rows:

- copy rows: random tokens in which spans are repeated from random earlier places, at varying
  distances (a span repeated at a fixed offset is learned positionally and teaches nothing about
  retrieval);
- needle rows: eval_needle.py's prompts (build_prompt, NEEDLE, CITIES) packed into one row, the
  answer tokens weighted up.

train.py's default job extends that base to a longer context on NeedleAnswerRows: needle rows
whose loss is on the answers alone.

Every function takes its random generator: the same generator state gives the same rows.
"""

from __future__ import annotations

import json
import math
import random

import torch

from recipes.data import embedded_prose
from recipes.needle import CITIES, NEEDLE, Haystack, Prompt, build_prompt

__all__ = [
    "ANSWER_WEIGHT",
    "COPY_WEIGHT",
    "EOS_TOKEN",
    "MIN_PROMPT",
    "OTHER_WEIGHT",
    "NeedleAnswerRows",
    "NeedleRows",
    "answer_accuracy",
    "copy_accuracy",
    "copy_row",
    "demo_batch",
    "demo_tokenizer",
    "random_number",
    "tokenizer_from_json",
]

EOS_TOKEN = "<|endoftext|>"
COPY_WEIGHT = 1.0  # a copied token (predictable from the span's earlier occurrence)
OTHER_WEIGHT = 0.2  # a random token of a copy row: unpredictable, kept only as a small signal
ANSWER_WEIGHT = 5.0  # the needle's answer: a handful of tokens in a row of hundreds
MIN_PROMPT = 64  # the shortest prompt packed into a needle row (room for needle, question, answer)
DIGITS = "0123456789"


def demo_tokenizer(vocab_size: int = 1024):
    """A byte-level BPE tokenizer trained on the embedded prose and the needle lines, with every
    group of 1-3 digits one token: numbers are cut into groups of at most three digits before
    BPE runs, and all 1,110 groups are in the vocabulary with the merges that build them, so a
    7-digit answer is 3 tokens after its space (the model retrieves 3 tokens, not 7 bytes)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    # the needle and question lines often enough that their words become single tokens
    lines = [NEEDLE.needle.format(key=c, value="") + NEEDLE.question.format(key=c, value="") for c in CITIES] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([embedded_prose(), *lines], trainer)

    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["model"]["merges"]]
    known = set(merges)

    def add(token: str, *ways: tuple[str, str]):
        vocab.setdefault(token, len(vocab))
        for merge in ways:
            if merge not in known:
                merges.append(merge)
                known.add(merge)

    for a in DIGITS:
        for b in DIGITS:
            add(a + b, (a, b))
    # a group of three is reached from whichever pair BPE merges first: both must lead to it
    for a in DIGITS:
        for b in DIGITS:
            for c in DIGITS:
                add(a + b + c, (a + b, c), (a, b + c))
    spec["model"]["merges"] = [list(m) for m in merges]
    return tokenizer_from_json(json.dumps(spec))


def tokenizer_from_json(text: str):
    """The transformers tokenizer of a `tokenizers` JSON text (demo_tokenizer's, or one saved
    with `tokenizer.backend_tokenizer.to_str()`)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(text), eos_token=EOS_TOKEN, bos_token=EOS_TOKEN)


def random_number(rng: random.Random, digits: int = 7) -> str:
    """`digits` random digits (a leading zero allowed: every digit group is trained)."""
    return "".join(rng.choice(DIGITS) for _ in range(digits))


def copy_row(rng: random.Random, length: int, vocab: int = 1024) -> tuple[list[int], list[float]]:
    """`length` random token ids in [1, vocab) in which spans of 6 to max(8, length // 6) tokens
    repeat an earlier span, each from a random earlier place and with random gaps between spans.
    Weights: COPY_WEIGHT on the copied tokens after a span's first (which no earlier token
    announces), OTHER_WEIGHT elsewhere."""
    ids = [rng.randrange(1, vocab) for _ in range(length)]
    weights = [OTHER_WEIGHT] * length
    longest = max(8, length // 6)
    pos = rng.randint(8, max(8, length // 4))
    while pos < length - 8:
        # the source ends before the span starts: every copied token was visible before
        n = min(rng.randint(6, longest), length - pos, pos)
        src = rng.randint(0, pos - n)
        ids[pos : pos + n] = ids[src : src + n]
        weights[pos + 1 : pos + n] = [COPY_WEIGHT] * (n - 1)
        pos += n + rng.randint(0, longest)
    return ids, weights


class NeedleRows:
    """eval_needle.py's needle prompts for `tokenizer`, alone or packed into training rows."""

    def __init__(self, tokenizer, max_length: int):
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id
        self.haystack = Haystack(tokenizer, embedded_prose(), max_length)

    def prompt(self, rng: random.Random, length: int, distractors: int | None = None, number=random_number) -> Prompt:
        """A prompt of at most `length` tokens, needle at a random depth; `distractors` other
        cities' needles (None: 0 to 3 at random, fewer in short prompts where they would crowd
        out the haystack)."""
        if distractors is None:
            distractors = rng.randrange(1 + min(3, (length - MIN_PROMPT) // 40))
        city, *others = rng.sample(CITIES, 1 + distractors)
        hidden = [(NEEDLE.needle.format(key=other, value=number(rng)), rng.random()) for other in others]
        return build_prompt(
            self.tokenizer, self.haystack, NEEDLE, length, rng.random(), key=city, value=number(rng), distractors=hidden
        )

    def row(
        self, rng: random.Random, length: int, uniform_sizes: bool = False, distractors: int | None = None
    ) -> tuple[list[int], list[float]]:
        """Exactly `length` tokens: prompts of log-uniform sizes (so needle-to-question distances
        cover every length up to the row's; `uniform_sizes`: uniform, so long distances are
        common), each followed by EOS, each with `distractors` (as prompt() takes them); weight
        1 on every token, the answer's ANSWER_WEIGHT; a tail too short for a prompt is EOS with
        weight 0."""
        ids, weights = [], []
        while length - len(ids) > MIN_PROMPT:
            room = length - len(ids) - 1  # the EOS after the prompt
            if uniform_sizes:
                size = min(room, rng.randint(MIN_PROMPT, length))
            else:
                size = min(room, int(math.exp(rng.uniform(math.log(MIN_PROMPT), math.log(length)))))
            prompt = self.prompt(rng, size, distractors)
            answer = len(prompt.input_ids) - prompt.answer_start
            ids += [*prompt.input_ids, self.eos]
            weights += [1.0] * prompt.answer_start + [ANSWER_WEIGHT] * answer + [1.0]
        pad = length - len(ids)
        return ids + [self.eos] * pad, weights + [0.0] * pad


class NeedleAnswerRows:
    """`count` needle rows of `length` tokens for `tokenizer`, with labels: a row's label is its
    token on the answers and -100 (not trained) elsewhere, so the loss is on the answers alone.
    Prompt sizes are uniform up to the row's length, and no prompt has distractors (as in
    eval_needle.py's default). Row i is a pure function of (seed, i), built when read: a resumed
    run reads the rows the uninterrupted run would have.

    Measured while extending the shipped base from 512 to 2,048 tokens (RoPE base 160,000):
    - one process, 200 steps of one row: 2,048-token prompts were answered 0.66 of the time when
      every token was trained, 1.00 with the loss on the answers alone (0.97 with the answers
      weighted 5x);
    - train.py's default job, eval_needle.py at 256-2,048 tokens x 5 depths x 4 samples: with 0-3
      distractors per training prompt 0.93 (200 steps) and 0.94 (600 steps), the misses at depth
      0 beyond 1,536 tokens; without distractors 0.98 (300 steps), and the loss fell from ~1.4
      to ~0.02 (the base cannot tell the asked city from the others, see its log)."""

    def __init__(self, tokenizer, length: int, count: int, seed: int):
        self.needles = NeedleRows(tokenizer, length)
        self.length, self.count, self.seed = length, count, seed

    def __len__(self) -> int:
        return self.count

    def row(self, index: int) -> tuple[list[int], list[int]]:
        rng = random.Random(f"{self.seed}/{index}")
        ids, weights = self.needles.row(rng, self.length, uniform_sizes=True, distractors=0)
        return ids, [token if weight == ANSWER_WEIGHT else -100 for token, weight in zip(ids, weights)]

    def __getitem__(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """(input ids, labels), both (len(indices), length) int64."""
        rows = [self.row(int(i)) for i in torch.as_tensor(indices).reshape(-1)]
        return torch.tensor([ids for ids, _ in rows]), torch.tensor([labels for _, labels in rows])


def demo_batch(
    rng: random.Random, needles: NeedleRows, length: int, copy_share: float, size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`size` rows of `length` tokens, each a copy row with probability `copy_share`, else a
    needle row: (input ids (size, length) int64, loss weights of the same shape, float32). A
    token's weight applies to predicting it."""
    rows = [copy_row(rng, length) if rng.random() < copy_share else needles.row(rng, length) for _ in range(size)]
    return torch.tensor([ids for ids, _ in rows]), torch.tensor([w for _, w in rows])


@torch.no_grad()
def answer_accuracy(model, prompts: list[Prompt], eos: int, chunk: int = 16) -> dict:
    """Greedy, teacher-forced: the share of prompts whose answer tokens are all predicted, and
    the share right at each answer token (answers of equal token counts). `model` is a
    transformers causal LM with .model and .lm_head; the output layer runs on the answer
    positions only."""
    hits = []
    for i in range(0, len(prompts), chunk):
        part = prompts[i : i + chunk]
        width = max(len(p.input_ids) for p in part)  # right padding: a causal model never sees it
        ids = torch.tensor([p.input_ids + [eos] * (width - len(p.input_ids)) for p in part])
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        rows = torch.tensor([r for r, p in enumerate(part) for _ in range(p.answer_start, len(p.input_ids))])
        cols = torch.tensor([c for p in part for c in range(p.answer_start, len(p.input_ids))])
        predicted = model.lm_head(hidden[rows, cols - 1]).argmax(-1)
        hits.append((predicted == ids[rows, cols]).view(len(part), -1))  # answers of one length
    hits = torch.cat(hits)
    return {"exact": hits.all(1).float().mean().item(), "per_token": hits.float().mean(0).tolist()}


@torch.no_grad()
def copy_accuracy(model, rows: list[tuple[list[int], list[float]]]) -> float:
    """Greedy, teacher-forced: the share of copied tokens (copy_row's COPY_WEIGHT) predicted."""
    ids = torch.tensor([r for r, _ in rows])
    copied = torch.tensor([w for _, w in rows])[:, 1:] == COPY_WEIGHT
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]
    return (model.lm_head(hidden[copied]).argmax(-1) == ids[:, 1:][copied]).float().mean().item()
