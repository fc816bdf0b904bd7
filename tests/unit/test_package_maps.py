"""The package maps (each package's docstring naming its modules) agree with the tree: every
module and subpackage is named, and every name a map gives exists (issue 58: the maps had named
a head_exchange.py that never was and a plan.py that is a package, and left out modules)."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = sorted(p.parent for room in ("easy_context", "recipes") for p in (ROOT / room).rglob("__init__.py"))
NAME = re.compile(r"(?<![\w./-])([a-z_][a-z0-9_]*)(\.py|/)(?![\w])")


def named(package: Path) -> set[str]:
    """The module and folder names a package's docstring gives, relative to the package (a path
    through another folder, like core/pieces.py, names that folder's module: not checked here)."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    found = set()
    for match in NAME.finditer(doc):
        start = match.start()
        if start > 0 and doc[start - 1] == "/":
            continue
        found.add(match.group(1) + match.group(2))
    return found


def present(package: Path) -> set[str]:
    modules = {p.name for p in package.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    folders = {p.name + "/" for p in package.iterdir() if (p / "__init__.py").exists() or _has_python(p)}
    return modules | folders


def _has_python(folder: Path) -> bool:
    return folder.is_dir() and folder.name != "__pycache__" and any(folder.glob("*.py"))


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_package_map_names_its_modules_and_only_those(package):
    names, files = named(package), present(package)
    if not names and len(files) <= 1:
        return  # a package of one module needs no map
    missing = sorted(files - names)
    # a name that is not the package's own may be a module elsewhere in the library (the top map
    # names subpackages' folders, a backend names core's kernels.py); it must exist somewhere
    elsewhere = {p.name for room in ("easy_context", "recipes") for p in (ROOT / room).rglob("*.py")}
    elsewhere |= {p.name + "/" for room in ("easy_context", "recipes") for p in (ROOT / room).rglob("*") if p.is_dir()}
    invented = sorted(n for n in names - files if n not in elsewhere and not (ROOT / n).exists())  # or a script
    assert not missing and not invented, f"{package.relative_to(ROOT)}: not named {missing}; named, absent {invented}"
