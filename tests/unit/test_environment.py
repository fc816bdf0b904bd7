"""One list of the environment variables (easy_context/core/environment.py): every EASY_CONTEXT_*
name the repository reads or sets is in it, each entry is read somewhere, and
docs/reference/environment.md shows the list as it is."""

import re
from pathlib import Path

from easy_context.core.environment import TEST_HOOKS, VARIABLES

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"EASY_CONTEXT_[A-Z][A-Z_]*[A-Z]")
SOURCES = (
    "easy_context",
    "recipes",
    "tools",
    "benchmarks",
    "tests",
    "scripts",
    "train.py",
    "eval_needle.py",
    "eval_harness.py",
)


def table() -> str:
    lines = ["| variable | read by | what it does | default |", "|---|---|---|---|"]
    for name, (reader, what, default) in VARIABLES.items():
        hook = " (test hook)" if name in TEST_HOOKS else ""
        lines.append(f"| `{name}`{hook} | {reader} | {what} | {default} |")
    return "\n".join(lines)


def used_names() -> dict:
    found = {}
    for source in SOURCES:
        path = ROOT / source
        files = [path] if path.is_file() else [*path.rglob("*.py"), *path.rglob("*.sh")]
        for file in files:
            if file.name == "environment.py" or file.name == Path(__file__).name:
                continue
            for name in NAME.findall(file.read_text(errors="ignore")):
                found.setdefault(name, set()).add(str(file.relative_to(ROOT)))
    return found


def test_every_name_the_repository_uses_is_listed_and_every_listed_one_is_used():
    used = used_names()
    assert not sorted(set(used) - set(VARIABLES)), {n: used[n] for n in set(used) - set(VARIABLES)}
    assert not sorted(set(VARIABLES) - set(used)), sorted(set(VARIABLES) - set(used))
    assert set(VARIABLES) >= TEST_HOOKS


def test_the_docs_show_the_list():
    text = (ROOT / "docs" / "reference" / "environment.md").read_text()
    block = text.split("<!-- environment:begin -->\n", 1)[1].split("\n<!-- environment:end -->", 1)[0]
    assert block == table(), "docs/reference/environment.md is stale: paste tests/unit/test_environment.table()"
