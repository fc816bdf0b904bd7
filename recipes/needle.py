"""Needle-in-a-haystack and passkey prompts, built for any tokenizer.

Depth is measured in tokens of the final prompt: a needle at depth d starts at token
round(d * (C - n)) of the context, where C is the context's length in tokens (haystack plus
inserted sentences, before the question) and n the needle's, so depth 0 is the first
sentence and depth 1 ends right before the question. The needle goes to the sentence start
nearest that token, and sentence starts are found in the text (never from token ids of a
particular vocabulary). Distractor sentences are placed first and the needle's place in the
haystack is chosen so that the distractors before it do not push it off its depth.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field

__all__ = ["Task", "NEEDLE", "PASSKEY", "PASSKEY_FILLER", "CITIES", "Haystack", "Prompt", "build_prompt", "chat_frame"]


@dataclass(frozen=True)
class Task:
    """What is hidden and asked: format strings over {key} and {value}."""

    name: str
    needle: str
    question: str  # a completion cue: the answer follows it directly
    answer: str
    request: str  # the same question asked as a user's turn (a chat template's prompts)


NEEDLE = Task(
    "needle",
    needle="The special magic {key} number is: {value}.",
    question="\nWhat is the special magic {key} number? The special magic {key} number is:",
    answer=" {value}",
    request="\n\nWhat is the special magic {key} number in the text above? Answer with the number only.",
)
# Landmark Attention's passkey retrieval: a key line in a repeated filler.
PASSKEY = Task(
    "passkey",
    needle="The pass key is {value}. Remember it. {value} is the pass key.",
    question="\nWhat is the pass key? The pass key is",
    answer=" {value}",
    request="\n\nWhat is the pass key in the text above? Answer with the number only.",
)
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
CITIES = (
    "Chicago",
    "Yangon",
    "Antananarivo",
    "Colombo",
    "Almaty",
    "Sydney",
    "Mexico City",
    "Seattle",
    "Lagos",
    "Amsterdam",
    "Belgrade",
    "Cairo",
    "Baghdad",
    "Damascus",
    "Kigali",
    "Dakar",
    "Sofia",
    "Victoria",
    "Tashkent",
    "Mumbai",
    "Barcelona",
    "Kabul",
    "Lima",
    "Oslo",
    "Montevideo",
    "Helsinki",
    "Hanoi",
    "Quito",
    "Tbilisi",
)

# A sentence ends at . ! or ? (optionally followed by closing quotes or brackets) and
# whitespace, or at a paragraph break; the next sentence starts after that whitespace.
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*\s+|\n\s*\n\s*")


def _token_spans(tokenizer, text: str) -> list[tuple[int, int]]:
    """The (start, end) character span of each token of `text`."""
    if getattr(tokenizer, "is_fast", False):
        return [
            tuple(span)
            for span in tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        ]
    # Slow tokenizers have no offsets: tokenize sentence by sentence and give each token its
    # sentence's span (positions are then exact at sentence starts, which is all we use).
    spans, begin = [], 0
    for end in [m.end() for m in _SENTENCE_END.finditer(text)] + [len(text)]:
        spans += [(begin, end)] * len(tokenizer(text[begin:end], add_special_tokens=False)["input_ids"])
        begin = end
    return spans


def _tokens_before(spans: list[tuple[int, int]], char: int) -> int:
    """How many tokens end at or before `char` (the index of the token holding `char`)."""
    return bisect.bisect_right([end for _, end in spans], char)


class Haystack:
    """A long text tokenized once, with the token index of every sentence start."""

    def __init__(self, tokenizer, text: str, min_tokens: int):
        if not text.strip():
            raise ValueError("the haystack text is empty")
        # one space inside paragraphs, one blank line between them
        paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
        piece = "\n\n".join(p for p in paragraphs if p) + "\n\n"
        text, spans = piece, _token_spans(tokenizer, piece)
        if len(spans) < min_tokens:  # repeat the text until it is long enough
            text = piece * (min_tokens // len(spans) + 2)
            spans = _token_spans(tokenizer, text)
        self.text, self.token_starts = text, [start for start, _ in spans]
        # Each sentence start as (index of the token holding its first character, char offset).
        chars = [0] + [m.end() for m in _SENTENCE_END.finditer(text) if m.end() < len(text)]
        ends = [end for _, end in spans]
        self.sentences = [(bisect.bisect_right(ends, c), c) for c in chars]

    def __len__(self) -> int:
        return len(self.token_starts)

    def char_at(self, token: int) -> int:
        """Character offset where token `token` starts (the text's end past the last token)."""
        return self.token_starts[token] if token < len(self.token_starts) else len(self.text)

    def sentence_start_near(self, token: float, limit: int) -> tuple[int, int]:
        """The sentence start (token, char) nearest `token` among those at or before `limit`."""
        candidates = self.sentences[: max(1, bisect.bisect_right(self.sentences, (limit, float("inf"))))]
        i = bisect.bisect_left(candidates, (token, -1))
        near = candidates[max(0, i - 1) : i + 1]
        return min(near, key=lambda c: abs(c[0] - token))

    def sentence_length_at(self, token: int) -> int:
        """Tokens in the sentence containing `token` (what 'within one sentence' means)."""
        i = bisect.bisect_right(self.sentences, (token, float("inf")))
        start = self.sentences[max(0, i - 1)][0]
        end = self.sentences[i][0] if i < len(self.sentences) else len(self)
        return max(1, end - start)


@dataclass
class Prompt:
    input_ids: list[int]  # the prompt, then the answer
    answer_start: int  # index of the first answer token
    needle_position: int  # token index where the needle starts (measured in input_ids)
    requested_position: int  # where depth asked it to start
    haystack_position: int  # the haystack token the needle was snapped from (to a sentence start)
    depth: float
    actual_depth: float
    key: str
    value: str
    distractors: list = field(default_factory=list)


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


CHAT_SLOT = "\x00the user's message\x00"  # a text no template or haystack holds


def chat_frame(tokenizer) -> tuple[str, str]:
    """What the tokenizer's chat template puts before and after one user message, up to the
    assistant's turn: the haystack and the request go between them, the answer after."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the tokenizer has no chat template: leave out --chat-template (a base model completes the cue)"
        )
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": CHAT_SLOT}], add_generation_prompt=True, tokenize=False
    )
    before, found, after = text.partition(CHAT_SLOT)
    if not found:
        raise ValueError("the tokenizer's chat template does not show the user's message as given")
    return before, after


def build_prompt(
    tokenizer,
    haystack: Haystack,
    task: Task,
    length: int,
    depth: float,
    key: str,
    value: str,
    distractors: list[tuple[str, float]] = (),
    chat: tuple[str, str] | None = None,
) -> Prompt:
    """A prompt of at most `length` tokens (usually exactly) with the needle at `depth`.

    distractors: (sentence, depth) pairs, other needles placed at their own depths.
    chat: chat_frame(tokenizer): the haystack and task.request become the user's turn and the
    answer (the bare value) the assistant's; without it the haystack ends in task.question,
    which the answer completes.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be within [0, 1], got {depth}")
    needle = task.needle.format(key=key, value=value) + " "
    if chat is None:
        prefix, question, answer = "", task.question.format(key=key, value=value), task.answer
    else:
        prefix, question, answer = chat[0], task.request.format(key=key, value=value) + chat[1], "{value}"
    answer_ids = tokenizer(answer.format(key=key, value=value), add_special_tokens=False)["input_ids"]
    # BOS (or nothing); or the chat template's header, special tokens written in it
    specials = len(tokenizer(prefix, add_special_tokens=not prefix)["input_ids"])
    needle_tokens = _count(tokenizer, needle)
    inserted = [(d + " ", depth_d, _count(tokenizer, d + " ")) for d, depth_d in distractors]
    fixed = specials + _count(tokenizer, question) + len(answer_ids)
    budget = length - fixed - needle_tokens - sum(n for _, _, n in inserted)  # haystack tokens
    if budget < 1:
        raise ValueError(
            f"context length {length} leaves no room for the haystack: the needle, question, answer and "
            f"{len(inserted)} distractor(s) take {length - budget} tokens; use a longer context or fewer distractors"
        )
    if budget > len(haystack):
        raise ValueError(f"the haystack holds {len(haystack)} tokens, {budget} needed; build it with more tokens")

    best = None
    for _ in range(8):  # re-tokenization can merge tokens across the joins: adjust the budget
        prompt = _assemble(
            tokenizer,
            haystack,
            task,
            budget,
            depth,
            needle,
            needle_tokens,
            question,
            inserted,
            answer_ids,
            key,
            value,
            specials,
            prefix,
        )
        excess = len(prompt.input_ids) - length
        if excess <= 0 and (best is None or len(prompt.input_ids) > len(best.input_ids)):
            best = prompt
        if excess == 0 or budget - excess > len(haystack):
            break
        budget -= excess
        if budget < 1:
            break
    if best is None:
        raise ValueError(f"could not fit the prompt into {length} tokens with this tokenizer")
    return best


def _assemble(
    tokenizer,
    haystack,
    task,
    budget,
    depth,
    needle,
    needle_tokens,
    question,
    inserted,
    answer_ids,
    key,
    value,
    specials,
    prefix,
) -> Prompt:
    context_tokens = budget + needle_tokens + sum(n for _, _, n in inserted)
    target = round(depth * (context_tokens - needle_tokens))  # needle start, in context tokens
    # The needle's depth comes first. A distractor goes before it only if it fits entirely
    # before `target` (with the other ones before it); the others go after. Each piece's
    # haystack position is its context position minus the inserted tokens before it.
    wanted = sorted((round(d * (context_tokens - n)), text, n) for text, d, n in inserted)
    before, after, used = [], [], 0
    for t, text, n in wanted:
        if t < target and used + n <= target:
            before.append((t - used, text))
            used += n
        else:
            after.append((t, text, n))
    h = target - used  # the needle's position in haystack tokens
    needle_at = haystack.sentence_start_near(h, budget)
    insertions = [(needle_at[1], 1, needle)]
    for a, text in before:
        insertions.append((min(haystack.sentence_start_near(min(a, h), budget)[1], needle_at[1]), 0, text))
    shift = used + needle_tokens
    for t, text, n in after:
        insertions.append((max(haystack.sentence_start_near(max(t - shift, h), budget)[1], needle_at[1]), 2, text))
        shift += n
    end = haystack.char_at(budget)
    pieces, cursor, needle_char = [], 0, 0
    for place, _, text in sorted(insertions, key=lambda x: (x[0], x[1])):
        pieces.append(haystack.text[cursor:place])
        if text is needle:
            needle_char = sum(len(p) for p in pieces)
        pieces.append(text)
        cursor = place
    pieces.append(haystack.text[cursor:end] + question)
    prompt_text = "".join(pieces)
    # a chat template writes its own special tokens (as apply_chat_template, none are added);
    # the needle is found in the whole text: the template's last token may merge with the haystack's first
    prompt_ids = tokenizer(prefix + prompt_text, add_special_tokens=not prefix)["input_ids"]
    added = 0 if prefix else specials
    position = added + _tokens_before(_token_spans(tokenizer, prefix + prompt_text), len(prefix) + needle_char)
    context = len(prompt_ids) - _count(tokenizer, question) - specials
    return Prompt(
        input_ids=list(prompt_ids) + list(answer_ids),
        answer_start=len(prompt_ids),
        needle_position=position,
        requested_position=specials + target,
        haystack_position=h,
        depth=depth,
        actual_depth=(position - specials) / max(1, context - needle_tokens),
        key=key,
        value=value,
        distractors=[
            text.strip() for _, _, text in sorted(insertions, key=lambda x: (x[0], x[1])) if text is not needle
        ],
    )
