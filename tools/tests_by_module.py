"""Which tests exercise a module, found from its name: every module of the library and the
recipes, with the test files that import it (lazy imports inside functions included).

    python -m tools.tests_by_module         the table of docs/reference/tests.md

A module no test imports by name is run through another one (the public API, a script); the
table says so, and tests/unit/test_tests_by_module.py keeps the page equal to this output.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("easy_context", "recipes")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> list[str]:
    return sorted(module_name(p) for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The known modules a file imports: `import a.b`, `from a import b` (b a module, else a)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names} & known
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            children = {f"{node.module}.{alias.name}" for alias in node.names} & known
            found |= children or ({node.module} & known)
    return found


def index() -> dict[str, list[str]]:
    """module -> the test files (paths under tests/) that import it."""
    known = set(modules())
    tests = {module: [] for module in sorted(known)}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for module in imported_modules(path, known):
            tests[module].append(str(path.relative_to(ROOT / "tests")))
    return tests


def table() -> str:
    lines = ["| module | tests that import it |", "|---|---|"]
    for module, files in index().items():
        shown = ", ".join(f"`{f}`" for f in files) if files else "(run through the modules that use it)"
        lines.append(f"| `{module}` | {shown} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
