"""Training rows from user datasets, read only when a step needs them.

A training row is `length` tokens (seq_length + 1: inputs and their next-token targets).
Three sources, one interface (`len(rows)` and `rows[indices] -> (n, length) LongTensor`,
the same as a tensor of rows, so train.py's micro_batch reads them alike; PackedRows also
gives each row's attention work, `row_products`, for the data-parallel order by work):

- TokenRows: a dataset with an `input_ids` column whose rows are at least `length` long,
  truncated to `length`.
- PackedRows: documents (token ids, e.g. a tokenized text column) concatenated with EOS after
  each one and cut into rows of `length`; the last, incomplete row is dropped (no padding).

Both read datasets' memory-mapped Arrow storage: a step touches the pages of its own rows,
so memory does not grow with the dataset. Row lengths come from the list column's offsets,
so every row is checked before training starts without reading a single token.

- StreamedRows: a streamed (`--streaming`) dataset of either kind, read in order.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from recipes.data.work import packed_row_products

__all__ = [
    "document_positions",
    "load_any_dataset",
    "TokenRows",
    "PackedRows",
    "StreamedRows",
    "tokenize_documents",
    "open_rows",
]


def document_positions(input_ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Position ids that restart at 0 after every EOS (the EOS ends its own document): HF's
    packing convention, so no token attends across a document boundary."""
    batch, seq = input_ids.shape
    index = torch.arange(seq, device=input_ids.device).expand(batch, seq)
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[:, 0] = True
    starts[:, 1:] = input_ids[:, :-1] == eos_id
    return index - torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values


def load_any_dataset(name_or_path: str, split: str = "train", subset: str | None = None, streaming: bool = False):
    """A datasets.Dataset (or IterableDataset with streaming) from a hub name (+ subset), a
    `save_to_disk` folder, or a .json/.jsonl/.parquet/.txt file (.txt: one row per file,
    column 'text'). Files and hub datasets are Arrow-backed and cached by datasets."""
    import datasets

    if os.path.isdir(name_or_path):
        dataset = datasets.load_from_disk(name_or_path)
        if isinstance(dataset, datasets.DatasetDict):
            dataset = _split(dataset, name_or_path, split)
        return dataset.to_iterable_dataset() if streaming else dataset
    if os.path.isfile(name_or_path):
        suffix = Path(name_or_path).suffix
        kind = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}.get(suffix)
        if kind is None:
            raise ValueError(
                f"dataset file {name_or_path!r}: use .json, .jsonl, .parquet or .txt, or a save_to_disk folder"
            )
        options = {"sample_by": "document"} if kind == "text" else {}
        try:
            dataset = datasets.load_dataset(
                kind, data_files=name_or_path, split="train", streaming=streaming, **options
            )
        except datasets.exceptions.DatasetsError as error:  # malformed rows, mixed schemas (not ValueError)
            cause = " ".join(str(error.__cause__ or error).split())[:300]
            raise ValueError(f"dataset file {name_or_path!r} cannot be read as {kind}: {cause}") from error
        return dataset
    try:
        dataset = datasets.load_dataset(name_or_path, subset, streaming=streaming)
    except datasets.exceptions.DatasetsError as error:  # not found offline, generation failures (not ValueError)
        raise ValueError(f"dataset {name_or_path!r} cannot be loaded: {' '.join(str(error).split())[:300]}") from error
    return _split(dataset, name_or_path, split)


def _split(dataset, name: str, split: str):
    if split not in dataset:
        raise ValueError(f"dataset {name!r} has splits {list(dataset)}, not {split!r}")
    return dataset[split]


# ------------------------------------------------------------------------ Arrow rows
def _list_lengths(dataset, column: str) -> np.ndarray:
    """Length of every row's list in `column`, from the Arrow offsets (no values read)."""
    import pyarrow.compute as pc

    lengths = pc.list_value_length(dataset.data.column(column))
    if dataset._indices is not None:  # a select()/shuffle() view: datasets keeps the row map here
        lengths = lengths.take(dataset._indices.column(0))
    return lengths.to_numpy(zero_copy_only=False).astype(np.int64)


def _feature_name(feature) -> str:
    """A column type as datasets >= 4 prints it (Value('int64'), List(Value('float64'))), whatever
    the installed datasets prints (3.x: Value(dtype='int64', id=None), Sequence(feature=...))."""
    inner = getattr(feature, "feature", None)
    if inner is not None:
        return f"List({_feature_name(inner)})"
    if isinstance(feature, list) and len(feature) == 1:
        return f"List({_feature_name(feature[0])})"
    dtype = getattr(feature, "dtype", None)
    return f"Value({dtype!r})" if type(feature).__name__ == "Value" and dtype else str(feature)


def _check_token_column_type(dataset, column: str, name: str) -> None:
    import datasets

    list_types = tuple(t for t in (getattr(datasets, n, None) for n in ("Sequence", "List", "LargeList")) if t)
    feature = dataset.features.get(column)
    inner = getattr(feature, "feature", None)
    if not isinstance(feature, list_types) or not (
        isinstance(inner, datasets.Value) and inner.dtype.startswith(("int", "uint"))
    ):
        raise ValueError(f"dataset {name!r}: column {column!r} holds {_feature_name(feature)}, not lists of token ids")


def _check_token_column(dataset, column: str, name: str) -> None:
    """`column` holds lists of integers without nulls (checked on Arrow metadata and null
    bitmaps, no token read)."""
    import pyarrow.compute as pc

    _check_token_column_type(dataset, column, name)
    lists = dataset.data.column(column)
    if lists.null_count or pc.list_flatten(lists).null_count:
        first = next(
            (i for i, ids in enumerate(lists.to_pylist()) if ids is None or None in ids), None
        )  # only on error
        raise ValueError(
            f"dataset {name!r}: row {first} of column {column!r} is null or holds a null token id; "
            "drop or fill such rows"
        )


def _token_lists(dataset, column: str, indices) -> list[np.ndarray]:
    """The token lists of rows `indices`, as numpy views into the memory-mapped Arrow data
    (nothing is copied until a caller slices and converts them)."""
    table = dataset.with_format("arrow")[indices]
    return [
        chunk[i].values.to_numpy(zero_copy_only=False)
        for chunk in table.column(column).chunks
        for i in range(len(chunk))
    ]


class TokenRows:
    """Rows of a dataset's `input_ids` column, each truncated to `length` tokens."""

    def __init__(self, dataset, length: int, name: str, max_rows: int | None = None, column: str = "input_ids"):
        _check_token_column(dataset, column, name)
        lengths = _list_lengths(dataset, column)[:max_rows]
        if lengths.size == 0:
            raise ValueError(f"dataset {name!r} is empty")
        short = np.flatnonzero(lengths < length)
        if short.size:
            raise ValueError(
                f"dataset {name!r}: row {short[0]} has {lengths[short[0]]} tokens but {length} are needed "
                f"(--seq-length + 1), and {short.size} of {lengths.size} rows are that short; filter short rows out, "
                "give a text column instead (documents are then packed into full rows), or lower --seq-length"
            )
        self.dataset, self.column, self.length, self.rows = dataset, column, length, lengths.size

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, indices) -> torch.Tensor:
        lists = _token_lists(self.dataset, self.column, [int(i) for i in indices])
        return torch.from_numpy(np.stack([ids[: self.length] for ids in lists]).astype(np.int64))


class PackedRows:
    """Documents packed into rows: document, EOS, document, EOS, ... cut every `length`
    tokens. A document longer than what is left of a row continues in the next one (with
    --document-masking its positions restart at each row start, as for any row). The index is
    one cumulative count per document; a row reads only the documents it overlaps."""

    def __init__(
        self, documents, length: int, eos_id: int, name: str, max_rows: int | None = None, column: str = "input_ids"
    ):
        _check_token_column(documents, column, name)
        self.ends = np.cumsum(_list_lengths(documents, column) + 1)  # +1: the EOS after each document
        total = int(self.ends[-1]) if self.ends.size else 0
        self.rows = total // length if max_rows is None else min(total // length, max_rows)
        if self.rows == 0:
            raise ValueError(
                f"dataset {name!r} has {total} tokens (with one EOS per document), fewer than one row "
                f"of {length} (--seq-length + 1)"
            )
        self.documents, self.column, self.length, self.eos_id = documents, column, length, eos_id

    def __len__(self) -> int:
        return self.rows

    def row_products(self) -> np.ndarray:
        """Each row's attention query x key products under --document-masking (its documents'
        L(L+1)/2), from the document lengths alone (data.work balances DP groups by it)."""
        return packed_row_products(self.ends, self.length, self.rows)

    def __getitem__(self, indices) -> torch.Tensor:
        return torch.stack([self._row(int(i)) for i in indices])

    def _row(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.rows:
            raise IndexError(f"row {index} of {self.rows}")
        begin, end = index * self.length, (index + 1) * self.length
        first = int(np.searchsorted(self.ends, begin, side="right"))
        last = int(np.searchsorted(self.ends, end - 1, side="right"))
        skip = begin - (int(self.ends[first - 1]) if first else 0)  # tokens of the first document in earlier rows
        pieces, need = [], self.length
        for ids in _token_lists(self.documents, self.column, range(first, last + 1)):
            # slice the memory-mapped view before converting: a row of a long document
            # copies its own tokens only
            for piece in (ids[skip : skip + need], np.array([self.eos_id])[max(0, skip - ids.size) :]):
                pieces.append(piece[:need].astype(np.int64))
                need -= pieces[-1].size
            skip = 0
        return torch.from_numpy(np.concatenate(pieces))


# ----------------------------------------------------------------------- streaming
class StreamedRows:
    """Rows of a streamed dataset, read in order: row i is the i-th row of the stream (which
    starts over, a new epoch, when it runs out). Reading an earlier row than the last one
    read starts the stream again, so a resumed run reads exactly what the uninterrupted run
    read. `make_stream()` returns a fresh iterator of rows (1-D int64 arrays of `length`)."""

    def __init__(self, make_stream, name: str):
        self.make_stream, self.name = make_stream, name
        self.stream, self.position, self.size = None, 0, None  # size: rows per epoch, once known

    def read(self, start: int, count: int) -> torch.Tensor:
        return torch.stack([torch.from_numpy(self._row(start + k)) for k in range(count)])

    def _row(self, index: int) -> np.ndarray:
        if self.size is not None:
            index %= self.size  # every epoch reads the same rows in the same order
        if self.stream is None or index < self.position:
            self.stream, self.position = self.make_stream(), 0
        while True:
            row = next(self.stream, None)
            if row is None:  # the end of one pass over the data: the stream starts over
                if self.position == 0:
                    raise ValueError(f"dataset {self.name!r} yields no row of the sequence length")
                self.size, self.stream, self.position = self.position, self.make_stream(), 0
                index %= self.size
                continue
            self.position += 1
            if self.position - 1 == index:
                return row


def _stream_token_rows(stream, column: str, length: int, name: str):
    for i, example in enumerate(stream):
        ids = np.asarray(example[column] if isinstance(example[column], list) else [None])
        if ids.dtype.kind not in "iu":
            raise ValueError(
                f"dataset {name!r}: streamed row {i} of column {column!r} is not a list of token ids "
                f"({str(example[column])[:60]})"
            )
        if ids.size < length:
            raise ValueError(
                f"dataset {name!r}: streamed row {i} has {ids.size} tokens but {length} are needed "
                "(--seq-length + 1); give a text column instead (documents are then packed) or lower --seq-length"
            )
        yield ids[:length]


def _stream_packed_rows(stream, column: str, length: int, eos_id: int):
    buffer, held = [], 0
    for example in stream:
        buffer += [np.asarray(example[column], dtype=np.int64), np.array([eos_id])]
        held += len(example[column]) + 1
        if held >= length:
            joined = np.concatenate(buffer)
            cut = joined.size // length * length
            yield from joined[:cut].reshape(-1, length)
            buffer, held = [joined[cut:]], joined.size - cut
    # the last, incomplete row is dropped (never padded), as in PackedRows


# ------------------------------------------------------------------------- text
def tokenize_documents(dataset, tokenizer, text_column: str, name: str):
    """`dataset` with its text column replaced by `input_ids` (no special tokens; PackedRows
    adds the EOS after each document). Uses datasets' map, whose cache makes a second run
    with the same data and tokenizer read the tokens back instead of tokenizing again."""
    import datasets

    columns = _columns(dataset, name)
    if text_column not in columns:
        raise ValueError(
            f"dataset {name!r} has no {text_column!r} column (columns: {columns}); give --text-column, "
            "or a dataset with an input_ids column"
        )
    feature = dataset.features[text_column] if dataset.features else None
    if feature is not None and not (
        isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")
    ):
        raise ValueError(f"dataset {name!r}: column {text_column!r} holds {_feature_name(feature)}, not text")

    def tokenize(batch, indices):
        texts = batch[text_column]
        for i, text in zip(indices, texts):
            if not isinstance(text, str):
                raise ValueError(
                    f"dataset {name!r}: row {i} of column {text_column!r} is {type(text).__name__}, not text"
                )
            if not text.strip():
                raise ValueError(f"dataset {name!r}: row {i} of column {text_column!r} is empty; filter empty rows out")
        return {"input_ids": tokenizer(texts, add_special_tokens=False)["input_ids"]}

    options = {} if isinstance(dataset, datasets.IterableDataset) else {"desc": f"tokenizing {text_column!r}"}
    return dataset.map(tokenize, batched=True, with_indices=True, remove_columns=columns, **options)


def open_rows(
    name: str,
    length: int,
    tokenizer,
    text_column: str = "text",
    split: str = "train",
    max_rows: int | None = None,
    streaming: bool = False,
    dp_rank: int = 0,
    dp_size: int = 1,
):
    """Rows of `length` tokens from a dataset: its `input_ids` column if it has one (rows
    truncated to `length`), otherwise `text_column` tokenized with `tokenizer` and packed.
    With streaming, a StreamedRows holding this data-parallel group's part of the stream."""
    dataset = load_any_dataset(name, split, streaming=streaming)
    columns = _columns(dataset, name)
    packed = "input_ids" not in columns
    eos_id = tokenizer.eos_token_id
    if packed and eos_id is None:
        raise ValueError("packing text needs a tokenizer with an EOS token (it separates the documents)")
    if not streaming:
        if not packed:
            return TokenRows(dataset, length, name, max_rows)
        return PackedRows(tokenize_documents(dataset, tokenizer, text_column, name), length, eos_id, name, max_rows)
    from datasets.distributed import split_dataset_by_node

    dataset = split_dataset_by_node(dataset, rank=dp_rank, world_size=dp_size)  # each DP group its own part
    if packed:
        documents = tokenize_documents(dataset, tokenizer, text_column, name)
    elif dataset.features is not None:
        _check_token_column_type(dataset, "input_ids", name)

    def make_stream():
        import itertools

        rows = (
            _stream_packed_rows(documents, "input_ids", length, eos_id)
            if packed
            else _stream_token_rows(dataset, "input_ids", length, name)
        )
        return itertools.islice(rows, max_rows)

    return StreamedRows(make_stream, name)


def _columns(dataset, name: str) -> list[str]:
    """The dataset's columns; a stream without feature metadata is asked for its first row
    (which also surfaces a file that cannot be parsed, as a ValueError)."""
    if dataset.column_names is not None:
        return list(dataset.column_names)
    try:
        first = next(iter(dataset), None)
    except Exception as error:  # datasets / pyarrow parse errors of many kinds
        raise ValueError(f"dataset {name!r} cannot be read: {' '.join(str(error).split())[:300]}") from error
    if first is None:
        raise ValueError(f"dataset {name!r} is empty")
    return list(first)
