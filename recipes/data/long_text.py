"""Real long documents, offline: text this machine has without a hub, each document of at least
MIN_CHARS characters (over 32K tokens with SmolLM2's tokenizer: `python -m recipes.data.long_text`
prints the table), in a fixed order, with a held-out split that training never reads.

Two sources:
- `stdlib`: the Python standard library's sources, one document per package (Lib/asyncio/,
  Lib/email/, ...: its .py files concatenated in path order, each after a `# path` line; test
  folders left out). Not one long program but one package's modules read in a row, which is how
  a code model sees a repository. Left out: `encodings` (generated codec tables), `pydoc_data`
  (the language reference as one dict of strings: the needle haystack, embedded.embedded_prose)
  and the tests.
- `python-docs`: natural-language English, the Python documentation that Debian's python3.X-doc
  package ships as reStructuredText (/usr/share/doc/python3.X/html/_sources; install it with
  `apt-get install python3.11-doc`): one document per section (tutorial/, howto/, library/,
  whatsnew/, ...), its pages in the order of the section's tables of contents.

What is held out is named, not drawn (HELD_OUT): in each source, documents long enough for the
evaluations' longest windows (whatsnew: over 400K tokens, 14 windows of 32K), so perplexity by
length and the needle haystacks read text the extension recipe never trained on. The documents
depend on the Python version (the standard library and the docs change between releases), never
on the run: the same interpreter and docs package give the same documents in the same order.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "HELD_OUT",
    "MIN_CHARS",
    "SOURCES",
    "SPLITS",
    "LongDocument",
    "documents",
    "python_docs_dir",
    "stdlib_dir",
]

SOURCES = ("stdlib", "python-docs")
SPLITS = ("train", "held_out", "all")
# 150,000 characters: at the most characters per token measured among the candidates with
# SmolLM2's tokenizer (4.5, the docs' distributing/ section; the documents kept: 3.6-4.3) that is
# over 33K tokens.
MIN_CHARS = 150_000
HELD_OUT = {"stdlib": ("asyncio", "email"), "python-docs": ("faq", "whatsnew")}
STDLIB_LEFT_OUT = ("encodings", "pydoc_data", "test")
TEST_FOLDERS = {"test", "tests", "idle_test"}  # inside a package (idlelib/idle_test, lib2to3/tests)
DEBIAN_DOCS = Path("/usr/share/doc")


@dataclass(frozen=True)
class LongDocument:
    source: str  # one of SOURCES
    name: str  # the package (stdlib) or section (python-docs)
    text: str
    origin: str  # the folder it was read from
    held_out: bool  # never used for training


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def python_docs_dir() -> Path:
    """The _sources folder of the Python documentation Debian installed: the running Python's
    version where there, else the newest; FileNotFoundError saying what to install."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    preferred = DEBIAN_DOCS / version / "html" / "_sources"
    if preferred.is_dir():
        return preferred
    found = sorted(
        DEBIAN_DOCS.glob("python3.*/html/_sources"),
        key=lambda path: [int(number) for number in re.findall(r"\d+", path.parts[-3])],
    )
    if found:
        return found[-1]
    raise FileNotFoundError(
        f"the Python documentation's sources are not installed (no {preferred}): apt-get install {version}-doc "
        "(Debian's package; or pass docs_dir, the _sources folder of any Sphinx build of the Python docs)"
    )


def _stdlib_documents() -> Iterator[tuple[str, str, Path]]:
    root = stdlib_dir()
    for package in sorted(path.parent for path in root.glob("*/__init__.py")):
        if package.name in STDLIB_LEFT_OUT or "site-packages" in package.parts:
            continue
        files = sorted(
            path
            for path in package.rglob("*.py")
            if not TEST_FOLDERS & set(path.relative_to(root).parts[:-1]) and path.is_file()
        )
        parts = [f"# {path.relative_to(root).as_posix()}\n{path.read_text(encoding='utf-8')}" for path in files]
        yield package.name, "\n\n".join(parts), package


_TOCTREE = re.compile(r"^\.\. toctree::[^\n]*\n((?:[ \t]+[^\n]*\n|[ \t]*\n)*)", re.M)


def _toctree_pages(page: Path, section: Path) -> list[Path]:
    """The pages a page's toctree directives name, in order (options and globs skipped)."""
    pages = []
    for block in _TOCTREE.findall(page.read_text(encoding="utf-8")):
        for line in block.splitlines():
            entry = line.strip()
            if not entry or entry.startswith(":") or "*" in entry:
                continue
            entry = entry.rsplit("<", 1)[-1].rstrip(">").strip()  # "Title <target>" names target
            target = page.parent / f"{entry.removesuffix('.rst')}.rst.txt"  # not with_suffix: "3.11"
            if target.is_file() and section in target.resolve().parents:
                pages.append(target.resolve())
    return pages


def _section_pages(section: Path) -> list[Path]:
    """A docs section's pages: depth first through the tables of contents from its index, then
    any page no table names, in path order."""
    ordered, seen = [], set()

    def visit(page: Path) -> None:
        if page in seen:
            return
        seen.add(page)
        ordered.append(page)
        for child in _toctree_pages(page, section):
            visit(child)

    index = section / "index.rst.txt"
    if index.is_file():
        visit(index.resolve())
    for page in sorted(section.rglob("*.rst.txt")):
        visit(page.resolve())
    return ordered


def _python_docs_documents(docs_dir: Path) -> Iterator[tuple[str, str, Path]]:
    for section in sorted(path for path in docs_dir.iterdir() if path.is_dir() and not path.name.startswith("_")):
        text = "\n\n".join(page.read_text(encoding="utf-8") for page in _section_pages(section.resolve()))
        yield section.name, text, section


def documents(
    split: str = "all", sources: tuple[str, ...] = SOURCES, docs_dir: Path | str | None = None
) -> Iterator[LongDocument]:
    """The long documents of `sources` in `split` ("train", "held_out" or "all"), source by
    source in SOURCES order, then by name; each of at least MIN_CHARS characters."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r}: use one of {', '.join(SPLITS)}")
    unknown = [source for source in sources if source not in SOURCES]
    if unknown:
        raise ValueError(f"unknown long-text source(s) {', '.join(unknown)}; the sources are {', '.join(SOURCES)}")
    for source in (s for s in SOURCES if s in sources):
        if source == "stdlib":
            found = _stdlib_documents()
        else:
            found = _python_docs_documents(Path(docs_dir) if docs_dir is not None else python_docs_dir())
        for name, text, origin in found:
            if len(text) < MIN_CHARS:
                continue
            held_out = name in HELD_OUT[source]
            if split == "all" or held_out == (split == "held_out"):
                yield LongDocument(source, name, text, str(origin), held_out)


def table(docs: list[LongDocument], tokenizer=None) -> str:
    """The documents as a markdown table: split, source, name, characters and (with a tokenizer)
    tokens, and the totals by split."""
    lines = ["| split | source | document | characters | tokens |", "|---|---|---|---:|---:|"]
    totals: dict[str, list[int]] = {}
    for doc in docs:
        tokens = len(tokenizer(doc.text, add_special_tokens=False, verbose=False)["input_ids"]) if tokenizer else None
        split = "held out" if doc.held_out else "train"
        total = totals.setdefault(split, [0, 0, 0])
        total[0] += 1
        total[1] += len(doc.text)
        total[2] += tokens or 0
        shown = f"{tokens:,}" if tokens is not None else "-"
        lines.append(f"| {split} | {doc.source} | {doc.name} | {len(doc.text):,} | {shown} |")
    for split in ("train", "held out"):
        if split not in totals:
            continue
        count, chars, tokens = totals[split]
        shown = f"{tokens:,}" if tokenizer else "-"
        lines.append(f"| **{split}** | | **{count} documents** | **{chars:,}** | **{shown}** |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m recipes.data.long_text", description=__doc__.split("\n\n")[0])
    p.add_argument("--split", default="all", choices=SPLITS)
    p.add_argument("--sources", nargs="+", default=list(SOURCES), choices=SOURCES)
    p.add_argument("--docs-dir", help="the Python docs' _sources folder (default: Debian's python3.X-doc)")
    p.add_argument(
        "--tokenizer",
        default="smollm2-135m-instruct",
        help="whose tokens to count: a downloadable model, a local folder or a hub name (default: %(default)s)",
    )
    p.add_argument("--no-tokens", action="store_true", help="characters only (no tokenizer needed)")
    p.add_argument(
        "--write",
        metavar="FILE.jsonl",
        help="also write the documents as JSON lines ({source, name, text}): what eval_ppl.py -d FILE reads",
    )
    args = p.parse_args(argv)
    try:
        docs = list(documents(args.split, tuple(args.sources), args.docs_dir))
        tokenizer = None
        if not args.no_tokens:
            from transformers import AutoTokenizer

            from recipes.models import model_source

            tokenizer = AutoTokenizer.from_pretrained(model_source(args.tokenizer))
    except (OSError, ValueError) as error:
        print(f"{p.prog}: error: {error}", file=sys.stderr)
        return 1
    print(table(docs, tokenizer))
    if args.write:
        Path(args.write).parent.mkdir(parents=True, exist_ok=True)
        with open(args.write, "w", encoding="utf-8") as out:
            for doc in docs:
                out.write(json.dumps({"source": doc.source, "name": doc.name, "text": doc.text}) + "\n")
        print(f"{len(docs)} documents written to {args.write}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
