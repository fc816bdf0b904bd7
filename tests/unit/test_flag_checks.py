"""train.py's setting checks (recipes/configuration.py, declared in recipes/training/config.py):
at_least, optional_at_least and needs, each at its edges, and every field that uses one of them
wired into train.py's parser. The wired flags are read from the fields themselves (the factory
that made each check, and its bound or the flag it needs), so a check declared later is covered
without touching this file. Also: --help and the docs' table come from the same fields, and an
old spelling works with a warning. One process, no script: train.parse_args is called directly."""

import argparse
import dataclasses
import inspect
import re
import sys
import types

import pytest

import train
from recipes import configuration as flag_declaration
from recipes.training import config as flags

FACTORIES = ("at_least", "optional_at_least", "needs")


def _checked_flags():
    """(declaration, factory name, the factory's arguments) of each flag whose check one of FACTORIES made."""
    found = []
    for section in flags.SECTIONS.values():
        for field in dataclasses.fields(section):
            check = field.metadata["check"]
            factory = getattr(check, "__qualname__", "").split(".<locals>")[0]
            if factory in FACTORIES:
                declared = types.SimpleNamespace(name=flag_declaration.flag_of(field.name))
                found.append((declared, factory, inspect.getclosurevars(check).nonlocals))
    return found


CHECKED = _checked_flags()


# ------------------------------------------------------------------------------- the factories
@pytest.mark.parametrize("bound", [0, 1, 7])
def test_at_least_accepts_the_bound_and_refuses_one_below_naming_flag_and_value(bound):
    check = flag_declaration.at_least(bound)
    for value in (bound, bound + 1, bound + 1000):
        assert check("--some-flag", value, argparse.Namespace()) is None, (bound, value)
    for value in (bound - 1, bound - 5):
        assert check("--some-flag", value, argparse.Namespace()) == f"--some-flag must be >= {bound}, got {value}"


def test_optional_at_least_accepts_none_and_checks_any_value():
    check = flag_declaration.optional_at_least(3)
    assert check("--some-flag", None, argparse.Namespace()) is None
    assert check("--some-flag", 3, argparse.Namespace()) is None
    assert check("--some-flag", 2, argparse.Namespace()) == "--some-flag must be >= 3, got 2"
    assert check("--some-flag", 0, argparse.Namespace()) == "--some-flag must be >= 3, got 0"


def test_needs_refuses_the_flag_without_the_other_and_accepts_it_with():
    plain, why = flag_declaration.needs("--other-flag"), flag_declaration.needs("--other-flag", " (it says why)")
    for unset in (False, None):  # a switch left off; a valued flag left at its default
        without = argparse.Namespace(other_flag=unset)
        for value in (True, "cut"):  # a switch given; a flag with a value (--balance-documents' const)
            assert plain("--flag", value, without) == "--flag needs --other-flag", (unset, value)
            assert why("--flag", value, without) == "--flag needs --other-flag (it says why)", (unset, value)
        for value in (False, None):  # the flag itself not given: nothing to refuse
            assert plain("--flag", value, without) is None, (unset, value)
    for given in (True, "data.jsonl"):
        assert plain("--flag", True, argparse.Namespace(other_flag=given)) is None, given
        assert why("--flag", "cut", argparse.Namespace(other_flag=given)) is None, given


# ------------------------------------------------------------------- wired into train.py's parser
def _argv(name: str) -> list[str]:
    """The flag given, on train.py's command line: a switch bare, else with a value."""
    action = next(a for a in flags.parser("")._actions if name in a.option_strings)
    if action.nargs in (0, "?"):
        return [name]
    value = action.choices[0] if action.choices else "1" if action.type in (int, float) else "x"
    return [f"{name}={value}"]


def _error(argv, capsys) -> str | None:
    """train.py's refusal of argv: its one `train.py: error:` line (exit 2), or None if it parses."""
    try:
        train.parse_args(argv)
    except SystemExit as refused:
        lines = capsys.readouterr().err.strip().splitlines()
        assert refused.code == 2 and lines, (argv, refused.code, lines)
        assert [line for line in lines if "error:" in line] == lines[-1:], (argv, lines)  # one line, the last
        assert lines[-1].startswith("train.py: error: "), (argv, lines)
        return lines[-1]
    return None


def test_the_declarations_use_every_factory_and_the_defaults_pass():
    assert {factory for _, factory, _ in CHECKED} == set(FACTORIES), CHECKED
    assert train.parse_args([]).data.seq_length == 2048  # nothing given: every check passes


@pytest.mark.parametrize("declared, factory, arguments", CHECKED, ids=[declared.name for declared, _, _ in CHECKED])
def test_each_declared_check_refuses_its_flag_in_train_py(declared, factory, arguments, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py"])  # argparse names the program from it
    name = declared.name
    if factory == "needs":
        assert "other" in arguments, f"{name}: its needs(...) check no longer holds the flag it needs"
        other = arguments["other"]
        error = _error(_argv(name), capsys)
        assert error is not None and f"{name} needs {other}" in error, (name, other, error)
        error = _error(_argv(name) + _argv(other), capsys)
        assert error is None or f"{name} needs" not in error, (name, other, error)
    else:
        assert "bound" in arguments, f"{name}: its {factory}(...) check no longer holds its bound"
        bound = arguments["bound"]
        error = _error([f"{name}={bound - 1}"], capsys)
        assert error is not None and f"{name} must be >= {bound}, got {bound - 1}" in error, (name, bound, error)
        error = _error([f"{name}={bound}"], capsys)
        assert error is None or f"{name} must be" not in error, (name, bound, error)


# ------------------------------------------------------------------- one source for flags and docs
def test_help_lists_every_field_once_grouped_by_section(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py"])
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    text = capsys.readouterr().out
    for title, section in flags.SECTIONS.items():
        block = text.split(f"\n{section.title}:\n", 1)[1].split("\n\n", 1)[0]
        for field in dataclasses.fields(section):
            flag = flag_declaration.flag_of(field.name)
            assert len(re.findall(rf"^  {flag}[ ,\n]", block + "\n", flags=re.M)) == 1, (title, field.name)


def test_the_docs_flag_table_is_generated_from_the_fields():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "guides" / "train-py.md").read_text()
    block = page.split("<!-- flags:begin -->\n", 1)[1].split("\n<!-- flags:end -->", 1)[0]
    assert block == flag_declaration.flag_table(flags.SECTIONS), "run: python -m recipes.training.config --table"


def test_an_old_spelling_works_and_warns(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py"])
    config = train.parse_args(["--parallel_mode", "ulysses_attn"])
    assert config.parallelism.parallel_mode == "ulysses_attn"
    err = capsys.readouterr().err
    assert "warning: --parallel_mode is now --parallel-mode" in err and flag_declaration.ALIASES_REMOVED in err
    assert train.parse_args(["--parallel-mode", "ulysses_attn"]).parallelism.parallel_mode == "ulysses_attn"
    assert "warning" not in capsys.readouterr().err
