"""The test tree's layout: no module under tests/ imports a test module (tests/**/test_*.py).
What tests share lives in helper modules beside them (tests/tiny_models.py, exactness.py,
kernel_cases.py, script_runs.py, generation_runs.py, trainer_runs.py, ranks.py, ...): a test
module imported by another is collected twice over, runs its import-time setup in the other's
session, and ties the two files' fates together (issue 58)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _is_test_module(dotted: str) -> bool:
    return any(part.startswith("test_") for part in dotted.split("."))


def test_module_imports(source: str) -> list[str]:
    """The test modules that `source` imports, wherever the import sits (module level, in a
    function, `import x`, `from x import y`, `from package import test_x`, relative imports,
    importlib.import_module("x") and __import__("x") with a literal name)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if _is_test_module(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if _is_test_module(module):
                found.append(module)
            else:  # `from tests.recipes import test_train`
                found += [f"{module}.{alias.name}" for alias in node.names if alias.name.startswith("test_")]
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and _is_test_module(node.args[0].value)
        ):
            found.append(node.args[0].value)
    return found


test_module_imports.__test__ = False  # a helper, not a test (its name starts with test_)


def test_the_check_sees_every_form_of_import():
    sources = {
        "from test_train import ROOT, SMALL, train": ["test_train"],
        "def f():\n    from test_eval import ok\n": ["test_eval"],
        "import test_kernels": ["test_kernels"],
        "import test_kernels as k": ["test_kernels"],
        "from tests.recipes.test_train import train": ["tests.recipes.test_train"],
        "from tests.recipes import test_train": ["tests.recipes.test_train"],
        "from .test_models import errors": [".test_models"],
        "import importlib\nimportlib.import_module('test_generation')": ["test_generation"],
        "__import__('test_generation')": ["test_generation"],
        # helpers and libraries are fine, whatever else their names say
        "from script_runs import train\nimport tiny_models\nfrom kernel_cases import reference": [],
        "from easy_context.hf import testing_tools\nimport pytest": [],
    }
    for source, want in sources.items():
        assert test_module_imports(source) == want, source


def test_no_module_under_tests_imports_a_test_module():
    modules = sorted(TESTS.rglob("*.py"))
    assert len([m for m in modules if m.name.startswith("test_")]) > 50  # the tree was found
    offenders = {
        str(path.relative_to(TESTS.parent)): imported
        for path in modules
        if (imported := test_module_imports(path.read_text()))
    }
    assert not offenders, (
        f"modules importing test modules: {offenders}; move what they share into a helper module "
        "under tests/ (not named test_*.py) and import it from both"
    )
