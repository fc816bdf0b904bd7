"""recipes/data/long_text.py: the real long documents are the same on every call, long enough,
and split in two that never share a document; what is missing is named in one line. Their token
counts with the real tokenizer: tests/recipes/test_real_model.py."""

from __future__ import annotations

import os

import pytest

from recipes.data import long_text


def python_docs_or_skip():
    """The Python docs (Debian's python3.X-doc): CI's machine has them and sets
    EASY_CONTEXT_REQUIRE_PYTHON_DOCS=1 (.ci/run), so there their absence fails; elsewhere it skips,
    naming the package."""
    try:
        return long_text.python_docs_dir()
    except FileNotFoundError as missing:
        if os.environ.get("EASY_CONTEXT_REQUIRE_PYTHON_DOCS") == "1":
            raise
        pytest.skip(str(missing))


def test_the_documents_are_fixed_long_and_split_in_two_disjoint_parts():
    python_docs_or_skip()
    everything = list(long_text.documents())
    names = [(doc.source, doc.name) for doc in everything]
    assert names == [(doc.source, doc.name) for doc in long_text.documents()]  # the same, in the same order
    assert names == sorted(names, key=lambda key: (long_text.SOURCES.index(key[0]), key[1]))
    assert all(len(doc.text) >= long_text.MIN_CHARS for doc in everything)
    train = {(doc.source, doc.name) for doc in long_text.documents("train")}
    held_out = {(doc.source, doc.name) for doc in long_text.documents("held_out")}
    assert not train & held_out and train | held_out == set(names)
    # every held-out name is there (a rename in a later Python would otherwise empty the split),
    # and each source keeps documents to train on
    assert held_out == {(source, name) for source, held in long_text.HELD_OUT.items() for name in held}
    assert {source for source, _ in train} == set(long_text.SOURCES)
    # natural language from the docs package, code from the standard library
    docs = {doc.name: doc for doc in everything if doc.source == "python-docs"}
    assert docs["tutorial"].text.lstrip().startswith(".. _tutorial-index:")  # its index first, then its chapters
    assert docs["tutorial"].text.index("Whetting Your Appetite") < docs["tutorial"].text.index("Classes\n*******")
    stdlib = {doc.name: doc for doc in everything if doc.source == "stdlib"}
    assert stdlib["asyncio"].text.startswith("# asyncio/__init__.py\n")
    assert "encodings" not in stdlib and "test" not in stdlib
    assert "\n# unittest/test/" not in stdlib["unittest"].text and "\n# unittest/main.py\n" in stdlib["unittest"].text


def test_missing_docs_and_bad_arguments_are_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(long_text, "DEBIAN_DOCS", tmp_path)
    with pytest.raises(FileNotFoundError) as missing:
        list(long_text.documents(sources=("python-docs",)))
    assert "\n" not in str(missing.value) and "apt-get install python3." in str(missing.value), missing.value
    assert long_text.main(["--no-tokens"]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "apt-get install python3." in error, error
    with pytest.raises(ValueError, match="split 'test': use one of train, held_out, all"):
        list(long_text.documents("test"))
    with pytest.raises(ValueError, match="unknown long-text source.s. books; the sources are stdlib, python-docs"):
        list(long_text.documents(sources=("books",)))


def test_the_table_lists_each_document_with_its_split(capsys):
    assert long_text.main(["--sources", "stdlib", "--no-tokens"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0] == "| split | source | document | characters | tokens |"
    assert "| held out | stdlib | asyncio |" in "\n".join(rows)
    assert rows[-2].startswith("| **train** | | **") and rows[-1].startswith("| **held out** | | **2 documents**")
