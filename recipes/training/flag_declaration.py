"""A flag of train.py declared once: its argparse settings and its check (a function of the flag's
name, its value and every flag, returning a refusal or None), in groups; the checks every flag
may use (at_least, optional_at_least, needs). training/flags.py declares train.py's flags with them."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Check", "Flag", "Group", "dest_of", "flag", "at_least", "optional_at_least", "needs"]

Check = Callable[[str, object, argparse.Namespace], "str | None"]  # (flag, its value, all flags) -> refusal


def dest_of(name: str) -> str:
    """argparse's attribute for a flag: --seq-length -> seq_length."""
    return name.removeprefix("--").replace("-", "_")


@dataclass(frozen=True)
class Flag:
    name: str
    options: dict  # argparse's add_argument keywords
    check: Check | None = None

    @property
    def dest(self) -> str:
        return dest_of(self.name)


def flag(name: str, check: Check | None = None, **options) -> Flag:
    return Flag(name, options, check)


def at_least(bound: int) -> Check:
    return lambda name, value, args: f"{name} must be >= {bound}, got {value}" if value < bound else None


def optional_at_least(bound: int) -> Check:
    return lambda name, value, args: None if value is None else at_least(bound)(name, value, args)


def needs(other: str, why: str = "") -> Check:
    """A flag that means something only with `other` (a switch)."""
    dest = dest_of(other)
    return lambda name, value, args: f"{name} needs {other}{why}" if value and not getattr(args, dest) else None


@dataclass(frozen=True)
class Group:
    title: str
    flags: list[Flag]
    # flags declared once for several scripts (recipes/launch.py), with their checks
    shared: list[Callable] = field(default_factory=list)
    shared_checks: list[Callable[[argparse.Namespace], str | None]] = field(default_factory=list)
