"""The tests of a module are findable from its name: docs/reference/tests.md lists, for every
module of the library and the recipes, the test files that import it, and equals what
tools/tests_by_module.py prints from the tree now."""

from pathlib import Path

from tools import tests_by_module

ROOT = Path(__file__).resolve().parents[2]


def test_the_page_lists_every_module_with_its_tests_as_the_tree_has_them():
    page = (ROOT / "docs" / "reference" / "tests.md").read_text()
    block = page.split("<!-- tests:begin -->\n", 1)[1].split("\n<!-- tests:end -->", 1)[0]
    assert block == tests_by_module.table(), "run: python -m tools.tests_by_module (into docs/reference/tests.md)"


def test_the_index_reads_imports_of_modules_and_of_names_in_them():
    index = tests_by_module.index()
    assert "unit/test_tests_by_module.py" not in sum(index.values(), [])  # it imports tools only
    assert "unit/test_environment.py" in index["easy_context.core.environment"]  # from m import NAME
    assert "unit/test_ruler.py" in index["recipes.ruler"]  # from package import module
    assert set(index) >= {"easy_context", "recipes.training.config", "easy_context.hf.loss"}
