"""The documentation site renders as written: tools/check_rendered_docs.py reads the built HTML
(snippets included as code, lists as lists, no stray blockquote, markdown left as text or images
shrunk) and the site built from docs/ has none of those problems. Each check is shown to find
what Python-Markdown makes of a page written wrongly. (Skipped without mkdocs, as on the floor
versions' fast tier; .ci/run also runs `python -m tools.check_rendered_docs` where mkdocs is.)"""

from pathlib import Path

import pytest

pytest.importorskip("mkdocs")
import markdown  # noqa: E402  (installed with mkdocs)

from tools import check_rendered_docs as check  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def rendered(source: str) -> check.Page:
    """`source` through Python-Markdown with the site's extensions, inside an <article>."""
    html = markdown.markdown(
        source,
        extensions=["tables", "attr_list", "admonition", "pymdownx.superfences", "pymdownx.snippets"],
        extension_configs={"pymdownx.snippets": {"base_path": [str(ROOT)], "check_paths": True}},
    )
    return check.parse(f"<nav><p>menu\n- not the page</p></nav><article>{html}</article><footer>x</footer>")


def problems(source: str) -> list[str]:
    return check.source_problems(source) + check.page_problems(rendered(source), check.SNIPPET_INCLUDE.findall(source))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("site")
    check.build(path)
    return path


@pytest.mark.timeout(120)
def test_every_page_of_the_built_site_renders_as_written(site):
    found = check.site_problems(site)
    assert not found, check.report(found)


@pytest.mark.timeout(120)
def test_the_site_is_read_from_its_articles(site):
    """The check reads real pages: every docs/ page's article, with its code, lists and images."""
    pages = {source: check.parse(check.page_of(source, site).read_text()) for source in check.DOCS.rglob("*.md")}
    assert len(pages) > 20 and all(page.blocks for page in pages.values())
    loop = pages[check.DOCS / "guides" / "training-loop.md"]
    assert any("def main" in code for code in loop.code)  # examples/training_loop.py, included
    evaluation = pages[check.DOCS / "guides" / "evaluation.md"]
    assert len(evaluation.images) >= 6


WRITTEN_RIGHT = """# A page

Text before a list:

- one
- two, with a nested list:

    - nested

1. first
2. second

<!-- fmt: off -->
```python
--8<-- "examples/training_loop.py"
```
<!-- fmt: on -->

| a | b |
|---|---|
| 1 | 2 |

Supported: datasets >= 5.0, `a > b`.

![heatmap](x.png)
"""


def test_a_page_written_right_has_no_problem():
    assert problems(WRITTEN_RIGHT) == []


@pytest.mark.parametrize(
    "source, found",
    [
        # what ruff format (0.16+) makes of a snippet marker inside a ```python fence
        ('```python\n--8 < --"examples/training_loop.py"\n```\n', "a snippet marker shown as text"),
        ('Text --8<-- "examples/training_loop.py" inline\n', "a snippet marker shown as text"),
        ('```python\n--8<-- "examples/no_such_file.py"\n```\n', None),  # check_paths: the build fails
        ("How it works:\n1. first\n2. second\n", "a list rendered as running text"),
        ("Refused:\n- this;\n- that.\n", "a list rendered as running text"),
        ("- item\n\n  its second paragraph\n- the next item\n", "a list rendered as running text"),
        ("- parent:\n  - nested by 2 spaces\n", "a nested list item not indented by 4 spaces"),
        ("1. parent\n   - nested by 3 spaces\n", "a nested list item not indented by 4 spaces"),
        ("Versions: torch >= 2.11, datasets\n>= 5.0; CI runs\n", "a blockquote"),
        ("Columns:\n| a | b |\n|---|---|\n| 1 | 2 |\n", "a table's separator row shown as text"),
        ("Text:\n\n    ```python\n    x = 1\n    ```\n", "a code fence shown as text"),
        ("| a |\n|---|\n| ```python |\n", "a code fence shown as text"),
        ("| a | b |\n|---|---|\n| ![x](x.png) | ![y](y.png) |\n", "is in a table cell"),
        ("![x](x.png){ width=200 }\n", "is given width=200"),
        ('![x](x.png){ style="width: 30%" }\n', "is given width=30%"),
    ],
)
def test_each_problem_is_found_where_markdown_renders_it(source, found):
    if found is None:  # a missing file is the build's error, before any page is read
        with pytest.raises(Exception, match="no_such_file"):
            rendered(source)
        return
    got = problems(source)
    assert any(found in problem for problem in got), got


def test_an_include_whose_code_is_not_on_the_page_is_found():
    page = rendered("```python\nprint('something else')\n```\n")
    assert check.page_problems(page, ["examples/training_loop.py"]) == [
        "the code of examples/training_loop.py (included with --8<--) is not on the page"
    ]


def test_text_outside_the_article_is_not_read():
    page = check.parse("<nav><p>a\n- b</p><blockquote>q</blockquote></nav><article><p>ok</p></article>")
    assert page.blocks == ["ok"] and page.blockquotes == [] and check.page_problems(page) == []
