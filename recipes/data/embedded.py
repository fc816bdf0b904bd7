"""The embedded offline default: data every Python installation already has.

A corpus made of the Python standard library's source files, a byte-level tokenizer built
locally (token id = byte value, plus one end-of-text token), English prose for needle
haystacks, and synthetic retrieval rows (needles hidden in that code, then asked about) in
exactly the format eval_needle.py scores: the right data for retrieval, though the tiny
model does not learn it within the default job's budget (docs/guides/evaluation.md).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import torch

from recipes.needle import CITIES, NEEDLE

__all__ = [
    "byte_tokenizer",
    "stdlib_source_files",
    "stdlib_token_stream",
    "windows",
    "embedded_prose",
    "stdlib_heldout_documents",
    "retrieval_row",
    "with_retrieval_rows",
    "BYTE_EOS_ID",
]

BYTE_EOS_ID = 256


def byte_tokenizer():
    """A transformers tokenizer whose ids are the UTF-8 bytes (0-255) and 256 = <|endoftext|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_to_char = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    ordered = sorted(byte_to_char, key=lambda ch: _bytes_to_unicode_inverse()[ch])
    vocab = {ch: i for i, ch in enumerate(ordered)}
    vocab["<|endoftext|>"] = BYTE_EOS_ID
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


def _bytes_to_unicode_inverse() -> dict:
    """GPT-2's reversible byte -> printable character map, inverted (character -> byte)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(b)
        else:
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in enumerate(chars)}


def stdlib_source_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    return [p for p in files if p.is_file()]


def stdlib_token_stream(max_tokens: int | None = None) -> np.ndarray:
    """Byte tokens of the standard library's sources, files in a fixed order, separated by EOS."""
    pieces, total = [], 0
    for path in stdlib_source_files():
        data = np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.int64)
        pieces += [data, np.array([BYTE_EOS_ID])]
        total += data.size + 1
        if max_tokens is not None and total >= max_tokens:
            break
    stream = np.concatenate(pieces)
    return stream if max_tokens is None else stream[:max_tokens]


def windows(stream: np.ndarray, length: int, max_rows: int | None = None) -> torch.Tensor:
    """Non-overlapping rows of `length` tokens from a token stream."""
    rows = stream.size // length
    if max_rows is not None:
        rows = min(rows, max_rows)
    return torch.from_numpy(stream[: rows * length].reshape(rows, length).copy())


def embedded_prose() -> str:
    """English prose every Python installation has (the default needle haystack): the
    language reference in pydoc_data, paragraphs separated by blank lines."""
    try:
        from pydoc_data.topics import topics

        texts = [topics[name] for name in sorted(topics)]
    except ImportError:  # some distributions strip pydoc_data: fall back to module docstrings
        import importlib

        texts = []
        for name in (
            "argparse",
            "collections",
            "dataclasses",
            "functools",
            "json",
            "logging",
            "pathlib",
            "re",
            "typing",
            "unittest",
        ):
            texts.append(importlib.import_module(name).__doc__ or "")
    return "\n\n".join(text.strip() for text in texts if text.strip())


def stdlib_heldout_documents(max_chars: int) -> list[str]:
    """Standard library source files taken from the END of the file order (train.py reads the
    stream from the start, so these are unseen unless a run trains on ~13M tokens)."""
    documents, total = [], 0
    for path in reversed(stdlib_source_files()):
        text = path.read_text(encoding="utf-8", errors="replace")
        documents.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return documents


def retrieval_document(
    code: np.ndarray, size: int, cities: list[str], rng: np.random.Generator, digits: int = 7
) -> np.ndarray:
    """About `size` byte tokens in eval_needle.py's format: a stretch of `code` (its EOS tokens,
    between files, turned into line breaks, so it is one document under --document-masking)
    with one needle "The special magic {city} number is: {digits}." per city at random line
    starts, then one question and answer per city in random order, then EOS. Several cities
    per document: an answer is found by its city, not by being the only number."""
    values = [str(rng.integers(10 ** (digits - 1), 10**digits)) for _ in cities]
    needles = [NEEDLE.needle.format(key=c, value=v).encode() + b" " for c, v in zip(cities, values)]
    questions = b"".join(
        (NEEDLE.question + NEEDLE.answer).format(key=cities[i], value=values[i]).encode()
        for i in rng.permutation(len(cities))
    )
    room = max(0, size - sum(map(len, needles)) - len(questions) - 1)  # haystack tokens (the EOS ends the document)
    haystack = np.where(code == BYTE_EOS_ID, ord("\n"), code)[:room]
    line_starts = np.flatnonzero(haystack[:-1] == ord("\n")) + 1
    places = np.sort(rng.choice(np.concatenate([[0], line_starts]), len(cities)))
    pieces, cursor = [], 0
    for place, needle in zip(places, needles):
        pieces += [haystack[cursor:place], np.frombuffer(needle, dtype=np.uint8)]
        cursor = place
    pieces += [haystack[cursor:], np.frombuffer(questions, dtype=np.uint8), [BYTE_EOS_ID]]
    return np.concatenate([np.asarray(p, dtype=np.int64) for p in pieces])


def retrieval_row(
    window: np.ndarray, rng: np.random.Generator, min_document: int = 64, max_needles: int = 4
) -> np.ndarray:
    """A row of retrieval documents made from a row of code (`window`) of the same length.
    Document sizes are log-uniform from `min_document` to the whole row, so the distance
    from needle to question covers every depth of every length up to the row's; the code
    they hide in is the window's own text, in order. No city appears twice in a row: without
    --document-masking a row's documents see each other, and a city hidden twice with two
    numbers would make the answer ambiguous."""
    length, pieces, used = window.size, [], 0
    unused = [CITIES[i] for i in rng.permutation(len(CITIES))]
    while length - used >= min_document and unused:
        size = int(np.exp(rng.uniform(np.log(min(min_document, length)), np.log(length))))
        count = int(rng.integers(1, max_needles + 1))
        cities, unused = unused[:count], unused[count:]
        document = retrieval_document(window[used:], min(size, length - used), cities, rng)
        pieces.append(document)
        used += document.size
    pieces.append(window[used:])  # the rest: code
    return np.concatenate(pieces)[:length]


def with_retrieval_rows(rows: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """`rows` (byte-token rows of code) with a `fraction` of them, chosen at random,
    rewritten by retrieval_row from their own text. A pure function of its arguments."""
    rng = np.random.default_rng(seed)
    chosen = rng.random(len(rows)) < fraction
    out = rows.clone()
    for i in np.flatnonzero(chosen):
        out[i] = torch.from_numpy(retrieval_row(rows[i].numpy(), rng))
    return out
