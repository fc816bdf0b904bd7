"""The README and the documentation site cannot rot silently: the README's numbers are printed
from the record and the benchmarks' CSV files, its code is cut from the examples that tests run,
its links resolve, and every Python block of the docs compiles. (`mkdocs build --strict`, run by
.ci/run, checks the site's own links, anchors and pages.)"""

import re
from pathlib import Path

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
