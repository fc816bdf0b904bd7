"""docs/architecture.md's rooms, held: each package room imports only the rooms below it
(core: none; modes and mixers: core; hf: core, modes, mixers; programs: any), and core, modes
and mixers never import transformers. Read from the sources' import statements (lazy imports
inside functions included)."""

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
