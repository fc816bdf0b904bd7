"""docs/architecture.md's rooms, held: each package room imports only the rooms below it
(core: none; modes and mixers: core; hf: core, modes, mixers), core, modes and mixers never
import transformers, and the library never imports the recipes (nor tools, benchmarks, tests),
parses a command line or knows the repository's shipped files. Read from the sources' import
statements (lazy imports inside functions included)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "easy_context"
ALLOWED = {
    "core": {"core"},
    "modes": {"core", "modes"},
    "mixers": {"core", "mixers"},
    "hf": {"core", "modes", "mixers", "hf", "versions"},
}
WITHOUT_TRANSFORMERS = ("core", "modes", "mixers")


def imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_each_room_imports_only_the_rooms_below_it():
    wrong = []
    for room, allowed in ALLOWED.items():
        for path in (PACKAGE / room).rglob("*.py"):
            for name in imported(path):
                parts = name.split(".")
                if parts[0] == "easy_context" and len(parts) > 1 and parts[1] not in allowed:
                    wrong.append(f"{path.relative_to(PACKAGE)} imports {name}")
                if room in WITHOUT_TRANSFORMERS and parts[0] == "transformers":
                    wrong.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not wrong, wrong


# What only an application knows: the packages beside the library, command-line parsing, the
# repository's shipped models and configs.
APPLICATION_IMPORTS = ("recipes", "tools", "benchmarks", "tests", "argparse")
APPLICATION_FILES = ("demo-base", "demo_base", "configs/")


def test_the_library_knows_nothing_of_the_applications():
    wrong = []
    for path in PACKAGE.rglob("*.py"):
        where = path.relative_to(PACKAGE.parent)
        for name in imported(path):
            if name.split(".")[0] in APPLICATION_IMPORTS:
                wrong.append(f"{where} imports {name}")
        # old_paths.py names the recipes' modules as strings for old import paths, and that only
        code = "" if path.name == "old_paths.py" else path.read_text()
        wrong += [f"{where} mentions {word}" for word in APPLICATION_FILES if word in code]
    assert not wrong, wrong


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# The repository's importable packages: the library, and the recipes, tools and benchmarks beside it.
PACKAGES = ("easy_context", "recipes", "tools", "benchmarks")


def test_no_module_imports_itself_back():
    """No import circle between modules of the repository's packages (lazy imports inside
    functions included): the import of `a.b` or `from a import b` counts as an edge to the module
    b where b is one, else to a. (tools/hybrid_checks.py and tools/sweep_models.py imported each
    other; what both need is tools/exact_step.py.)"""
    modules = {module_name(path): path for package in PACKAGES for path in (PACKAGE.parent / package).rglob("*.py")}
    edges = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                submodules = {f"{node.module}.{alias.name}" for alias in node.names} & modules.keys()
                targets |= submodules or {node.module}
        # a package's own __init__ is not an import of its children
        edges[name] = {t for t in targets if t in modules and t != name and not name.startswith(t + ".")}

    def cycle_from(start):
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for nxt in edges[node]:
                if nxt == start:
                    return trail + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, trail + [nxt]))
        return None

    cycles = {tuple(sorted(set(c))): c for name in modules if (c := cycle_from(name))}
    assert not cycles, [" -> ".join(c) for c in cycles.values()]
