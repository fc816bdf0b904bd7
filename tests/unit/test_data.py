"""Training data: lazy Arrow rows equal the eager read, text is tokenized (once, then from
datasets' cache) and packed with EOS between documents, streams read the same rows in
order, bad data is refused naming its column or row, and the embedded default's retrieval
rows are in the format eval_needle.py scores."""

import json
import os
import re

import numpy as np
import pytest
import torch

from recipes.data import (
    BYTE_EOS_ID,
    PackedRows,
    StreamedRows,
    TokenRows,
    byte_tokenizer,
    document_positions,
    load_any_dataset,
    open_rows,
    retrieval_row,
    stdlib_token_stream,
    tokenize_documents,
    windows,
    with_retrieval_rows,
)
from recipes.needle import NEEDLE

DOCUMENTS = [
    "def f(x):\n    return x + 1\n",
    "Le café est très bon.",
    "a",
    "x" * 300,
    "import os\nprint(os.sep)\n",
    "Third line.\n" * 20,
    "ünïcödé ✓",
    "last document",
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def packed_stream(documents):
    """What packing must produce: the UTF-8 bytes of each document, then EOS."""
    return [t for d in documents for t in [*d.encode(), BYTE_EOS_ID]]


def test_token_rows_read_lazily_equal_the_eager_read(tmp_path):
    import datasets

    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 257, int(n)).tolist() for n in rng.integers(33, 80, 12)]
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(tmp_path / "ds")
    lazy = open_rows(str(tmp_path / "ds"), 33, byte_tokenizer())
    assert isinstance(lazy, TokenRows) and len(lazy) == 12
    eager = torch.tensor([r[:33] for r in rows])
    order = torch.randperm(12, generator=torch.Generator().manual_seed(3))
    assert torch.equal(lazy[order[:5]], eager[order[:5]]) and torch.equal(lazy[range(12)], eager)
    assert len(open_rows(str(tmp_path / "ds"), 33, byte_tokenizer(), max_rows=5)) == 5
    # a select() view (datasets keeps an index map): lengths and rows follow the view, so a
    # short row outside the view is not refused and one inside it is
    rows[4] = rows[4][:10]
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(tmp_path / "with-short")
    full = datasets.load_from_disk(str(tmp_path / "with-short"))
    view = TokenRows(full.select([7, 2, 9]), 33, "view")
    assert len(view) == 3 and torch.equal(view[[0, 1, 2]], eager[[7, 2, 9]])
    with pytest.raises(ValueError, match="row 1 has 10 tokens but 33 are needed"):
        TokenRows(full.select([7, 4]), 33, "view")


def test_packing_cuts_rows_exactly_at_document_ends():
    """Documents (token lists) whose ends fall on row boundaries, an empty one, one longer
    than two rows: every row equals the same cut of document, EOS, document, EOS ..."""
    import datasets

    length, eos = 8, 99
    documents = [list(range(1, 8)), list(range(10, 25)), [], list(range(30, 50)), [7], list(range(60, 66))]
    rows = PackedRows(datasets.Dataset.from_dict({"input_ids": documents}), length, eos, "docs")
    stream = [t for d in documents for t in [*d, eos]]
    assert len(rows) == len(stream) // length
    assert torch.equal(rows[range(len(rows))], torch.tensor(stream[: len(rows) * length]).view(-1, length))


def test_text_is_tokenized_and_packed_with_eos_between_documents(tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": d, "id": i} for i, d in enumerate(DOCUMENTS)])
    length = 64
    rows = open_rows(path, length, byte_tokenizer())
    stream = packed_stream(DOCUMENTS)
    assert isinstance(rows, PackedRows) and len(rows) == len(stream) // length  # the incomplete last row is dropped
    want = torch.tensor(stream[: len(rows) * length]).view(-1, length)
    assert torch.equal(rows[range(len(rows))], want)
    assert torch.equal(rows[[3, 0]], want[[3, 0]])
    # document masking: positions restart right after every EOS, and at each row start
    positions = document_positions(want, BYTE_EOS_ID)
    after_eos = torch.zeros_like(want, dtype=torch.bool)
    after_eos[:, 1:] = want[:, :-1] == BYTE_EOS_ID
    after_eos[:, 0] = True
    assert torch.equal(positions == 0, after_eos)
    assert len(open_rows(path, length, byte_tokenizer(), max_rows=2)) == 2


def test_tokenizing_is_cached_by_datasets(tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in DOCUMENTS])
    tokenizer = byte_tokenizer()
    first = tokenize_documents(load_any_dataset(path), tokenizer, "text", path)
    files = [f["filename"] for f in first.cache_files]
    stamps = {f: os.stat(f).st_mtime_ns for f in files}
    second = tokenize_documents(load_any_dataset(path), byte_tokenizer(), "text", path)
    assert [f["filename"] for f in second.cache_files] == files  # the same cache file, read back
    assert all(os.stat(f).st_mtime_ns == stamps[f] for f in files)  # not written again
    assert second["input_ids"] == [list(d.encode()) for d in DOCUMENTS]


def test_a_stream_reads_the_packed_rows_in_order_and_resumes_exactly(tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in DOCUMENTS])
    length = 48
    packed = open_rows(path, length, byte_tokenizer())
    streamed = open_rows(path, length, byte_tokenizer(), streaming=True)
    assert isinstance(streamed, StreamedRows)
    every = packed[range(len(packed))]
    assert torch.equal(streamed.read(0, len(packed)), every)
    # past the end the stream starts over: epoch 2 reads the same rows in the same order
    assert torch.equal(streamed.read(len(packed) + 1, 2), every[1:3])
    # a fresh reader (a resumed run) asked for row 5 first reads what the first one read there
    assert torch.equal(open_rows(path, length, byte_tokenizer(), streaming=True).read(5, 2), every[5:7])
    # token rows stream too, truncated like TokenRows
    ids = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": list(range(i, i + 40))} for i in range(4)])
    assert torch.equal(
        open_rows(ids, 33, byte_tokenizer(), streaming=True).read(0, 4), open_rows(ids, 33, byte_tokenizer())[range(4)]
    )


def test_a_stream_is_split_between_data_parallel_groups(tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": f"document number {i} " * 2} for i in range(20)])
    parts = [open_rows(path, 16, byte_tokenizer(), streaming=True, dp_rank=r, dp_size=2).read(0, 5) for r in range(2)]
    assert not torch.equal(parts[0], parts[1])
    text = [bytes(t if t != BYTE_EOS_ID else ord("|") for t in torch.cat([*part]).tolist()).decode() for part in parts]
    assert text[0].startswith("document number 0 ") and "number 2 " in text[0] and "number 1 " not in text[0]
    assert text[1].startswith("document number 1 ") and "number 3 " in text[1] and "number 0 " not in text[1]


def test_bad_data_is_refused_naming_the_column_or_row(tmp_path):
    tokenizer = byte_tokenizer()
    cases = [
        ([{"body": "x"}], "has no 'text' column (columns: ['body']); give --text-column"),
        ([{"text": "fine"}, {"text": "  \n"}], "row 1 of column 'text' is empty"),
        ([{"text": 5}], "column 'text' holds Value('int64'), not text"),
        ([{"text": "fine"}, {"text": None}], "row 1 of column 'text' is NoneType, not text"),
        ([{"input_ids": "abc"}], "column 'input_ids' holds Value('string'), not lists of token ids"),
        ([{"input_ids": list(range(40))}, {"input_ids": [1, 2]}], "row 1 has 2 tokens but 33 are needed"),
        ([{"text": "tiny"}], "has 5 tokens (with one EOS per document), fewer than one row of 33"),
    ]
    for i, (rows, message) in enumerate(cases):
        path = write_jsonl(tmp_path / f"bad{i}.jsonl", rows)
        with pytest.raises(ValueError, match=re.escape(message)):
            open_rows(path, 33, tokenizer)
    for i, (rows, message) in enumerate(
        [
            (
                [{"input_ids": list(range(40))}, {"input_ids": None}],
                "row 1 of column 'input_ids' is null or holds a null token id",
            ),
            (
                [{"input_ids": list(range(40))}, {"input_ids": [1, None] * 20}],
                "row 1 of column 'input_ids' is null or holds",
            ),
        ]
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            open_rows(write_jsonl(tmp_path / f"null{i}.jsonl", rows), 33, tokenizer)
    # streams: the column type up front where the stream declares it (datasets >= 5 does for
    # JSON), else at the first row read
    path = write_jsonl(tmp_path / "float-stream.jsonl", [{"input_ids": [0.5] * 40}])
    with pytest.raises(
        ValueError, match=re.escape("column 'input_ids' holds List(Value('float64')), not lists of token ids")
    ):
        open_rows(path, 33, tokenizer, streaming=True).read(0, 1)
    path = write_jsonl(tmp_path / "null-stream.jsonl", [{"input_ids": list(range(40))}, {"input_ids": None}])
    with pytest.raises(ValueError, match="streamed row 1 of column 'input_ids' is not a list of token ids"):
        open_rows(path, 33, tokenizer, streaming=True).read(0, 2)
    (tmp_path / "broken.jsonl").write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(ValueError, match="cannot be read"):
        open_rows(str(tmp_path / "broken.jsonl"), 33, tokenizer, streaming=True)
    path = write_jsonl(tmp_path / "short-stream.jsonl", [{"input_ids": [1, 2]}])
    with pytest.raises(ValueError, match="streamed row 0 has 2 tokens but 33 are needed"):
        open_rows(path, 33, tokenizer, streaming=True).read(0, 1)
    no_eos = byte_tokenizer()
    no_eos.eos_token = None
    with pytest.raises(ValueError, match="packing text needs a tokenizer with an EOS token"):
        open_rows(write_jsonl(tmp_path / "ok.jsonl", [{"text": "fine"}]), 33, no_eos)


def fill_pattern(template: str) -> re.Pattern:
    """A regex matching `template` with any city as {key} (the same one each time) and 7 digits as {value}."""
    pattern = re.escape(template).replace(r"\{key\}", "(?P<key>[A-Za-z ]+?)", 1).replace(r"\{key\}", "(?P=key)")
    return re.compile(pattern.replace(r"\{value\}", r"(?P<value>\d{7})"))


def test_the_embedded_retrieval_rows_are_in_eval_needle_format():
    """Every question in a retrieval row is eval_needle.py's question for a city whose needle
    (eval_needle.py's needle sentence) comes earlier in the same document, followed by that
    needle's number as the answer; the rows keep their length, and the mix is reproducible."""
    rows = windows(stdlib_token_stream(24 * 1025), 1025)
    mixed = with_retrieval_rows(rows, 0.5, seed=1)
    assert mixed.shape == rows.shape and torch.equal(mixed, with_retrieval_rows(rows, 0.5, seed=1))
    changed = [i for i in range(len(rows)) if not torch.equal(mixed[i], rows[i])]
    assert 6 <= len(changed) <= 18
    needle, qa = fill_pattern(NEEDLE.needle), fill_pattern(NEEDLE.question + NEEDLE.answer)
    answered = 0
    for i in changed:
        for document in bytes(t if t < 256 else 0 for t in mixed[i].tolist()).decode("latin-1").split("\0"):
            hidden = {m["key"]: (m["value"], m.end()) for m in needle.finditer(document)}
            for m in qa.finditer(document):
                value, needle_end = hidden[m["key"]]
                assert value == m["value"] and needle_end <= m.start(), document[-300:]
                answered += 1
    assert answered >= 3 * len(changed)
    # a single row: documents of several sizes, the rest of the row is the window's code
    row = retrieval_row(rows[0].numpy(), np.random.default_rng(0))
    assert row.shape == (1025,) and (row == BYTE_EOS_ID).sum() >= 1
