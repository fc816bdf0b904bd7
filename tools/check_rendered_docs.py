"""The documentation site as readers see it: build it with mkdocs and read the built HTML.

    python -m tools.check_rendered_docs     build (--strict) into a temporary folder; print each problem

`mkdocs build --strict` checks links, anchors and pages, but passes a page that renders wrongly.
This reads each page's article (the built HTML, no browser) and finds:

- a snippet include (`--8<-- "FILE"`) left as text, or its file's code absent from the page: the
  formatter rewrites a marker inside a ```python fence to `--8 < --"FILE"` unless the fence sits
  between `<!-- fmt: off -->` and `<!-- fmt: on -->`;
- a list rendered as running text (a markdown list needs a blank line before it), or a nested
  list flattened into its parent (Python-Markdown nests a list indented by 4 spaces, not 2 or 3:
  found in the page's source, since the HTML no longer shows the nesting);
- markdown left as text: a fence's backticks (in prose, or in a code block: a fence indented
  4 spaces too far), a table's `|---|` row;
- a blockquote (the docs use none: a line that starts with `>` or `>=` makes one);
- an image made small: inside a table cell (which shares the page's width among its columns), or
  given a width or height below MIN_IMAGE_PX.

tests/unit/test_rendered_docs.py runs the same check on the built site.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MIN_IMAGE_PX = 400
# The marker as written and as the formatter leaves it: `--8<--`, `--8 < --`.
SNIPPET_MARKER = re.compile(r"-{2,}\s*8\s*<\s*-{2,}")
SNIPPET_INCLUDE = re.compile(r"""^\s*-{2,}8<-{2,}\s*["']([^"']+)["']\s*$""", re.M)
LIST_ITEM_LINE = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+\S")
FENCE = re.compile(r"^\s*(```|~~~)")
# Markdown that a renderer turns into markup: seen as text, it was not rendered.
LEFT_MARKDOWN = {"a code fence": re.compile(r"```"), "a table's separator row": re.compile(r"\|\s*:?-{3,}:?\s*\|")}
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}
SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(px)?\s*$")


@dataclass
class Page:
    """What the checks need of one page's article: the own text of each text block (a paragraph,
    list item or table cell, without the blocks inside it), every text run outside code, the text
    of each code block, its blockquotes, and its images with the elements around them."""

    blocks: list[str] = field(default_factory=list)
    prose: list[str] = field(default_factory=list)  # every text run outside <code>/<pre>
    code: list[str] = field(default_factory=list)  # the text of each <pre> block
    blockquotes: list[str] = field(default_factory=list)
    images: list[tuple[dict[str, str], list[str]]] = field(default_factory=list)  # (attributes, ancestors)


TEXT_BLOCKS = {"p", "li", "td", "th", "dd", "dt"}


class ArticleParser(HTMLParser):
    """Collects a Page from the <article> of a Material for MkDocs page (the page's own content,
    without the navigation, header and footer)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.page = Page()
        self.stack: list[str] = []  # open elements inside the article, the article first
        self.texts: list[list[str]] = []  # the text of each open text block, innermost last
        self.pre: list[str] | None = None
        self.quote: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if not self.stack:
            if tag == "article":
                self.stack.append(tag)
            return
        if tag == "img":
            self.page.images.append(({k: v or "" for k, v in attrs}, list(self.stack)))
        if tag in VOID:
            return
        self.stack.append(tag)
        if tag in TEXT_BLOCKS:
            self.texts.append([])
        elif tag == "pre" and self.pre is None:
            self.pre = []
        elif tag == "blockquote" and self.quote is None:
            self.quote = []

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag not in VOID:
            self.handle_endtag(tag)

    def handle_endtag(self, tag):
        if tag in VOID or tag not in self.stack:
            return
        while self.stack:
            closed = self.stack.pop()
            self.finish(closed)
            if closed == tag:
                break

    def finish(self, tag: str) -> None:
        if tag in TEXT_BLOCKS:
            self.page.blocks.append("".join(self.texts.pop()))
        elif tag == "pre" and "pre" not in self.stack:
            self.page.code.append("".join(self.pre))
            self.pre = None
        elif tag == "blockquote" and "blockquote" not in self.stack:
            self.page.blockquotes.append("".join(self.quote).strip())
            self.quote = None

    def handle_data(self, data):
        if not self.stack:
            return
        if self.pre is not None:
            self.pre.append(data)
            return
        if self.texts:
            self.texts[-1].append(data)
        if self.quote is not None:
            self.quote.append(data)
        if "code" not in self.stack:
            self.page.prose.append(data)


def parse(html: str) -> Page:
    parser = ArticleParser()
    parser.feed(html)
    parser.close()
    return parser.page


def small_size(attributes: dict[str, str]) -> str | None:
    """The width or height an image is given below MIN_IMAGE_PX (as an attribute or a style), or None."""
    sizes = {name: attributes[name] for name in ("width", "height") if name in attributes}
    for declaration in attributes.get("style", "").split(";"):
        name, _, value = declaration.partition(":")
        if name.strip() in ("width", "height", "max-width", "max-height"):
            sizes[name.strip()] = value
    for name, value in sizes.items():
        match = SIZE.match(value)
        if match is None or float(match.group(1)) < MIN_IMAGE_PX:  # a % or em is relative: small on a phone
            return f"{name}={value.strip()}"
    return None


def page_problems(page: Page, includes: list[str] = ()) -> list[str]:
    """Each way this page renders other than as written; `includes` are the files its source
    includes with `--8<--` (their code must be on the page)."""
    problems = []
    for text in page.prose + page.code:
        if SNIPPET_MARKER.search(text):
            line = next(line for line in text.splitlines() if SNIPPET_MARKER.search(line))
            problems.append(
                f"a snippet marker shown as text: {line.strip()!r} (the formatter rewrote it? put the fence"
                " between <!-- fmt: off --> and <!-- fmt: on -->)"
            )
    code = "\n".join(page.code)
    for include in includes:
        source = (ROOT / include).read_text() if (ROOT / include).is_file() else ""
        first = next((line for line in source.splitlines() if line.strip()), None)
        if first is None or first not in code:
            problems.append(f"the code of {include} (included with --8<--) is not on the page")
    for block in page.blocks:
        items = [line for line in block.splitlines()[1:] if LIST_ITEM_LINE.match(line)]
        if items:
            problems.append(f"a list rendered as running text (no blank line before it?): {items[0].strip()!r}")
    for text in page.prose + page.code:  # an over-indented fence is a code block showing its backticks
        for what, pattern in LEFT_MARKDOWN.items():
            match = pattern.search(text)
            if match:
                around = text[max(0, match.start() - 30) : match.end() + 30].replace("\n", " ")
                problems.append(f"{what} shown as text: {around.strip()!r}")
    for quote in page.blockquotes:
        problems.append(f"a blockquote (a line starting with '>'?): {quote[:60]!r}")
    for attributes, ancestors in page.images:
        name = attributes.get("src", "?")
        if "td" in ancestors or "th" in ancestors:
            problems.append(f"the image {name} is in a table cell, which shrinks it to the column's width")
        size = small_size(attributes)
        if size:
            problems.append(f"the image {name} is given {size} (under {MIN_IMAGE_PX} px)")
    return problems


def source_problems(markdown: str) -> list[str]:
    """What the built HTML cannot show: a list item indented by other than a multiple of 4
    spaces, which Python-Markdown puts at the level of the list around it."""
    problems = []
    fenced = False
    for number, line in enumerate(markdown.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and LIST_ITEM_LINE.match(line) and (len(line) - len(line.lstrip(" "))) % 4:
            problems.append(
                f"line {number}: a nested list item not indented by 4 spaces is flattened: {line.strip()!r}"
            )
    return problems


def page_of(source: Path, site: Path) -> Path:
    """The built HTML of a docs/ page under mkdocs' directory URLs (docs/a/b.md -> site/a/b/index.html)."""
    relative = source.relative_to(DOCS).with_suffix("")
    if relative.name == "index":
        return site / relative.parent / "index.html"
    return site / relative / "index.html"


def site_problems(site: Path) -> dict[str, list[str]]:
    """docs/ page (relative path) -> its problems, for every page of the built site."""
    problems = {}
    for source in sorted(DOCS.rglob("*.md")):
        built = page_of(source, site)
        name = str(source.relative_to(DOCS))
        if not built.is_file():
            problems[name] = [f"not built: no {built.relative_to(site)}"]
            continue
        markdown = source.read_text()
        found = source_problems(markdown) + page_problems(parse(built.read_text()), SNIPPET_INCLUDE.findall(markdown))
        if found:
            problems[name] = found
    return problems


def build(site: Path) -> None:
    """mkdocs build --strict of mkdocs.yml into `site`, in this process (the snippets' base path
    is the repository root, so the build runs from there); raises naming mkdocs' warnings."""
    from mkdocs.commands.build import build as mkdocs_build
    from mkdocs.config import load_config
    from mkdocs.exceptions import Abort

    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    mkdocs_log = logging.getLogger("mkdocs")
    mkdocs_log.addHandler(handler)
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        mkdocs_build(load_config(str(ROOT / "mkdocs.yml"), site_dir=str(site), strict=True))
    except Abort as error:
        raise RuntimeError("mkdocs build --strict failed: " + "; ".join(warnings or [str(error)])) from None
    finally:
        os.chdir(cwd)
        mkdocs_log.removeHandler(handler)


def report(problems: dict[str, list[str]]) -> str:
    lines = [f"docs/{page}: {problem}" for page, found in problems.items() for problem in found]
    count = len(lines)
    return "\n".join([*lines, f"{count} problem{'s' if count != 1 else ''} in the rendered site"])


def main() -> int:
    with tempfile.TemporaryDirectory() as site:
        try:
            build(Path(site))
        except RuntimeError as error:
            print(error)
            return 1
        problems = site_problems(Path(site))
    print(report(problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
