"""Data for training and evaluation: the embedded offline default and user datasets.

The embedded default needs nothing downloaded: a corpus made of the Python standard
library's source files (every machine with Python has them) and a byte-level tokenizer
built locally (token id = byte value, plus one end-of-text token).
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "byte_tokenizer", "stdlib_token_stream", "windows", "load_token_rows", "load_any_dataset",
    "embedded_prose", "stdlib_heldout_documents", "document_positions", "BYTE_EOS_ID",
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
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
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


def document_positions(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Position ids that restart at 0 after every EOS (the EOS ends its own document): HF's
    packing convention, so no token attends across a document boundary."""
    batch, seq = input_ids.shape
    index = torch.arange(seq, device=input_ids.device).expand(batch, seq)
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = input_ids[:, :-1] == eos_id
    return index - torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values


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
        for name in ("argparse", "collections", "dataclasses", "functools", "json", "logging", "pathlib", "re", "typing", "unittest"):
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


def load_any_dataset(name_or_path: str, split: str = "train", subset: str | None = None):
    """A datasets.Dataset from a hub name (+ subset), a `save_to_disk` folder, or a
    .json/.jsonl/.parquet/.txt file (.txt: one row, column 'text')."""
    import datasets

    if os.path.isdir(name_or_path):
        dataset = datasets.load_from_disk(name_or_path)
    elif os.path.isfile(name_or_path):
        suffix = Path(name_or_path).suffix
        kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(suffix)
        if suffix == ".txt":
            return datasets.Dataset.from_dict({"text": [Path(name_or_path).read_text(encoding="utf-8", errors="replace")]})
        if kind is None:
            raise ValueError(f"dataset file {name_or_path!r}: use .json, .jsonl, .parquet or .txt, or a save_to_disk folder")
        try:
            dataset = datasets.load_dataset(kind, data_files=name_or_path, split="train")
        except datasets.exceptions.DatasetsError as error:  # malformed rows, mixed schemas (not ValueError)
            cause = " ".join(str(error.__cause__ or error).split())[:300]
            raise ValueError(f"dataset file {name_or_path!r} cannot be read as {kind}: {cause}") from error
    else:
        dataset = datasets.load_dataset(name_or_path, subset, split=split)
    if isinstance(dataset, datasets.DatasetDict):
        if split not in dataset:
            raise ValueError(f"dataset {name_or_path!r} has splits {list(dataset)}, not {split!r}")
        dataset = dataset[split]
    return dataset


def load_token_rows(name_or_path: str, length: int, split: str = "train", max_rows: int | None = None) -> torch.Tensor:
    """Rows of `length` tokens from a dataset with an `input_ids` column (see load_any_dataset).
    Longer rows are truncated; shorter rows are an error (sequence parallelism needs every
    row at full length)."""
    dataset = load_any_dataset(name_or_path, split)
    if "input_ids" not in dataset.column_names:
        raise ValueError(
            f"dataset {name_or_path!r} has no 'input_ids' column (columns: {dataset.column_names}); "
            "tokenize it first (rows of token ids at least --seq-length + 1 long)"
        )
    count = len(dataset) if max_rows is None else min(len(dataset), max_rows)
    rows = []
    for i, ids in enumerate(dataset.select(range(count))["input_ids"]):
        if len(ids) < length:
            raise ValueError(
                f"dataset row {i} has {len(ids)} tokens but {length} are needed (--seq-length + 1); "
                "filter short rows out, pack documents into longer rows, or lower --seq-length"
            )
        rows.append(torch.tensor(ids[:length], dtype=torch.long))
    if not rows:
        raise ValueError(f"dataset {name_or_path!r} is empty")
    return torch.stack(rows)
