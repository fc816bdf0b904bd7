"""The README and the documentation site cannot rot silently: the README's numbers are printed
from the record and the benchmarks' CSV files, its code is cut from the examples that tests run,
its links resolve, every Python block of the docs compiles, and the troubleshooting page quotes
the messages the code raises. (The site's links, anchors and pages, and its pages as rendered:
tests/unit/test_rendered_docs.py.)"""

import re
from pathlib import Path

import pytest

from easy_context import apply_seq_parallel_monkey_patch
from tools.readme_tables import model_types_line, results_table

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
PAGES = sorted((ROOT / "docs").rglob("*.md"))
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def block(text: str, name: str) -> str:
    return text.split(f"<!-- {name}:begin -->\n", 1)[1].split(f"\n<!-- {name}:end -->", 1)[0]


def test_the_readme_numbers_are_the_generated_ones():
    message = "README out of date: paste the output of python -m tools.readme_tables"
    assert block(README, "model-types") == model_types_line(), message
    assert block(README, "results") == results_table(), message


def test_the_readmes_code_is_cut_from_examples_that_tests_run():
    """Each Python block of the README names its source on its first line; every line of it is
    a line of that file, which tests/recipes/test_scripts_smoke.py runs."""
    blocks = PYTHON_BLOCK.findall(README)
    assert blocks
    for code in blocks:
        first, *lines = code.splitlines()
        assert first.startswith("# examples/"), f"a README code block without its source file: {first!r}"
        source = {line.strip() for line in (ROOT / first[2:]).read_text().splitlines()}
        missing = [line for line in lines if line.strip() and line.strip() not in source]
        assert not missing, f"{first[2:]} has no line {missing[0]!r}"


def test_the_readmes_links_resolve():
    targets = re.findall(r"\]\(([^)\s]+)\)", README)
    local = [target.split("#", 1)[0] for target in targets if "://" not in target and not target.startswith("#")]
    assert local
    missing = [target for target in local if not (ROOT / target).exists()]
    assert not missing, missing


def test_every_python_block_of_the_docs_compiles():
    for path in [ROOT / "README.md", *PAGES]:
        for index, code in enumerate(PYTHON_BLOCK.findall(path.read_text())):
            if code.lstrip().startswith("--8<--"):  # a file included whole: tests run it
                continue
            compile(code, f"{path.relative_to(ROOT)} block {index}", "exec")


def troubleshooting_messages(number: int) -> list[str]:
    """The messages quoted in row `number` of docs/bad_inputs.md's tables (its third column)."""
    rows = [line for line in (ROOT / "docs" / "bad_inputs.md").read_text().splitlines() if line.startswith("| ")]
    row = next(line for line in rows if line.split("|")[1].strip() == str(number))
    return re.findall(r"`([^`]+)`", row.split(" | ")[2])


@pytest.mark.parametrize(
    "number, calls",
    [
        (5, [dict(ring_dgree=2)]),
        (6, [dict(model_type="t5"), dict(model_type="bloom")]),
    ],
)
def test_the_troubleshooting_page_quotes_what_the_code_raises_now(number, calls):
    """The counts and lists in these messages come from the code (the supported types, the
    options): the page's quote, `…` for what it leaves out, is the message raised today."""
    quoted = troubleshooting_messages(number)
    assert len(quoted) == len(calls)
    for message, call in zip(quoted, calls):
        options = dict(call)
        model_type = options.pop("model_type", "llama")
        with pytest.raises((ValueError, TypeError)) as raised:
            apply_seq_parallel_monkey_patch("zigzag_ring_attn", model_type, **options)
        missing = [piece for piece in message.split("…") if piece not in str(raised.value)]
        assert not missing, f"docs/bad_inputs.md row {number} quotes {message!r}; the code raises {raised.value}"
