"""A recipe's settings as dataclasses, and the command line generated from them.

Each setting is a dataclass field made by `option`: its default, its doc (the `--help` line and
the docs' flag table) and its check, a function of (the flag, its value, every setting by name)
returning a refusal or None. A job's configuration is a dataclass of sections, one per concern
(training/config.py: TrainConfig); `add_flags` turns sections into argparse groups (one flag per
field: --seq-length for seq_length; a bool is a switch), `parse` reads a command line into the
sections and runs every check, joining the failures into one `<script>: error:` line (exit 2).
Old spellings stay as aliases that warn (`option(..., aliases=("--parallel_mode",))`) until
ALIASES_REMOVED. A field another job shares is declared once and reused (`same_as`); the eval
scripts' configurations: evaluation_config.py.

Why not transformers' HfArgumentParser: it adds `--seq_length` beside `--seq-length`, gives each
switch an optional value, and has no flag whose value is optional (`--balance-documents
[cut|workload]`), so the command line would change; the dataclasses are the same idea.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

from easy_context.mixers import STRATEGIES as MIXER_STRATEGIES
from easy_context.modes import MODE_NAMES
from recipes import fsdp
from recipes.launch import DEFAULT_DIST_TIMEOUT, dist_timeout_seconds, ring_degree_error

__all__ = [
    "ALIASES_REMOVED",
    "Check",
    "option",
    "same_as",
    "flag_of",
    "dest_of",
    "at_least",
    "optional_at_least",
    "needs",
    "writable_folder",
    "add_flags",
    "sections_of",
    "values_of",
    "parse",
    "checks_failed",
    "flag_table",
    "ParallelismConfig",
    "SHARED_BY_SCRIPTS",
]

ALIASES_REMOVED = "2027-06-01"
Check = Callable[[str, object, SimpleNamespace], "str | None"]  # (flag, its value, every setting) -> refusal


def option(
    default,
    doc: str = "",
    check: Check | None = None,
    aliases: tuple[str, ...] = (),
    short: str | None = None,
    **argparse_options,
):
    """A setting: its default, its doc, its check; `short` a one-letter spelling beside the flag
    (-m for --model); `argparse_options` (choices, metavar, nargs, const, type, action) only where
    the field's type does not say it."""
    metadata = {"doc": doc, "check": check, "aliases": aliases, "short": short, "argparse": argparse_options}
    return dataclasses.field(default=default, metadata=metadata)


def same_as(section: type, name: str):
    """Another section's field as it is (default, doc, check, spellings): one declaration for a
    setting several jobs share."""
    field = next(f for f in dataclasses.fields(section) if f.name == name)
    return dataclasses.field(default=field.default, metadata=field.metadata)


def flag_of(name: str) -> str:
    """The flag of a field: seq_length -> --seq-length."""
    return "--" + name.replace("_", "-")


def dest_of(flag: str) -> str:
    """The field of a flag: --seq-length -> seq_length."""
    return flag.removeprefix("--").replace("-", "_")


# ------------------------------------------------------------------------ checks any field may use
def at_least(bound: int) -> Check:
    return lambda name, value, settings: f"{name} must be >= {bound}, got {value}" if value < bound else None


def optional_at_least(bound: int) -> Check:
    return lambda name, value, settings: None if value is None else at_least(bound)(name, value, settings)


def needs(other: str, why: str = "") -> Check:
    """A flag that means something only with `other` (a switch, or a flag with a value)."""
    dest = dest_of(other)
    return lambda name, value, settings: f"{name} needs {other}{why}" if value and not getattr(settings, dest) else None


# ------------------------------------------------------------------------ the command line
def writable_folder(name, value, settings) -> str | None:
    """A folder the run writes into, checked before anything loads: it, or the nearest folder
    above it that exists (where it will be created), must be a folder this process can write."""
    path = Path(value).expanduser().absolute()
    existing = path
    while True:
        try:
            existing.stat()
            break
        except (FileNotFoundError, NotADirectoryError):
            existing = existing.parent
        except OSError as error:
            return f"{name} {value}: cannot look at {existing} ({error.strerror}); choose another {name}"
    if not existing.is_dir():
        return f"{name} {value}: {existing} is a file, not a folder; choose another {name}"
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "write in" if existing == path else f"create it: {existing} is not writable"
        return f"{name} {value}: cannot {where} (permission denied or read-only); choose another {name}"
    return None


def _argparse_options(cls, field: dataclasses.Field) -> dict:
    options = dict(field.metadata.get("argparse", {}))
    kind = typing.get_type_hints(cls)[field.name]
    if kind is bool:
        options.setdefault("action", "store_true")
    else:
        options.setdefault("default", field.default)
        scalar = [t for t in typing.get_args(kind) if t is not type(None)] or [kind]
        if scalar[0] in (int, float) and "choices" not in options:
            options.setdefault("type", scalar[0])
    if field.metadata.get("doc"):
        options["help"] = field.metadata["doc"].replace("%", "%%")
    return options


def _warn_if_old(action: argparse.Action, parser, option_string) -> None:
    if option_string in action.old_spellings:
        new = next(s for s in action.option_strings if s.startswith("--") and s not in action.old_spellings)
        print(
            f"{parser.prog}: warning: {option_string} is now {new} (the old spelling goes on {ALIASES_REMOVED})",
            file=sys.stderr,
        )


class _OldSpellingWarns(argparse._StoreAction):
    """A valued flag whose old spelling still works, with a warning on stderr."""

    old_spellings: tuple[str, ...] = ()

    def __call__(self, parser, namespace, values, option_string=None):
        _warn_if_old(self, parser, option_string)
        super().__call__(parser, namespace, values, option_string)


class _OldSwitchSpellingWarns(argparse._StoreTrueAction):
    """A switch whose old spelling still works, with the same warning."""

    old_spellings: tuple[str, ...] = ()

    def __call__(self, parser, namespace, values, option_string=None):
        _warn_if_old(self, parser, option_string)
        super().__call__(parser, namespace, values, option_string)


def add_flags(parser: argparse.ArgumentParser, sections: Iterable[type], only: Iterable[str] | None = None) -> None:
    """One argparse group per section (its title: the section's `title`), one flag per field
    (`only`: these fields alone, for a script that shares a few)."""
    wanted = None if only is None else set(only)
    for cls in sections:
        group = parser.add_argument_group(cls.title)
        for field in dataclasses.fields(cls):
            if wanted is None or field.name in wanted:
                aliases, short = field.metadata.get("aliases", ()), field.metadata.get("short")
                options = _argparse_options(cls, field)
                if aliases:
                    switch = options.get("action") == "store_true"
                    options["action"] = _OldSwitchSpellingWarns if switch else _OldSpellingWarns
                spellings = ([short] if short else []) + [flag_of(field.name), *aliases]
                action = group.add_argument(*spellings, dest=field.name, **options)
                action.old_spellings = aliases


def sections_of(config_class: type) -> dict[str, type]:
    """A job's sections: its fields' names -> their dataclasses."""
    hints = typing.get_type_hints(config_class)
    return {field.name: hints[field.name] for field in dataclasses.fields(config_class)}


def values_of(config) -> SimpleNamespace:
    """Every setting of a job by name (the sections' fields share one namespace): what checks read."""
    values = {}
    for section in dataclasses.fields(config):
        values.update(dataclasses.asdict(getattr(config, section.name)))
    return SimpleNamespace(**values)


def checks_failed(config) -> list[str]:
    """Every field's check on `config`, in declaration order: the refusals."""
    settings, errors = values_of(config), []
    for section in dataclasses.fields(config):
        for field in dataclasses.fields(type(getattr(config, section.name))):
            check = field.metadata.get("check")
            if check and (error := check(flag_of(field.name), getattr(settings, field.name), settings)):
                errors.append(error)
    return errors


def parse(config_class: type, parser: argparse.ArgumentParser, argv: list[str] | None = None, fill=None):
    """argv into `config_class` (a dataclass of sections); `fill(config)` sets the defaults that
    depend on other settings before the checks run. Every refusal joins one error line (exit 2)."""
    namespace = parser.parse_args(argv)
    sections = sections_of(config_class)
    config = config_class(
        **{
            name: cls(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)})
            for name, cls in sections.items()
        }
    )
    if fill is not None:
        fill(config)
    if errors := checks_failed(config):
        parser.error("; ".join(errors))
    return config


def flag_table(sections: Mapping[str, type] | Iterable[type]) -> str:
    """The docs' table of flags, by section, from the same fields as --help."""
    classes = sections.values() if isinstance(sections, Mapping) else sections
    lines = ["| flag | default | what it does |", "|---|---|---|"]
    for cls in classes:
        lines.append(f"| **{cls.title}** | | |")
        for field in dataclasses.fields(cls):
            options = field.metadata.get("argparse", {})
            shown = flag_of(field.name)
            if field.metadata.get("short"):
                shown = f"{field.metadata['short']}, {shown}"
            if "choices" in options:
                shown += " {" + ",".join(map(str, options["choices"])) + "}"
            elif options.get("metavar"):
                shown += f" {options['metavar']}"
            default = "" if field.default is None or field.default is False else f"`{field.default}`"
            doc = field.metadata.get("doc", "").replace("|", "\\|")
            lines.append(f"| `{shown}` | {default} | {doc} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------ the section every script shares
def _ring_degree(name, value, settings):
    return ring_degree_error(settings)


def _fsdp(name, value, settings):
    return "; ".join(fsdp.flag_errors(settings)) or None


@dataclasses.dataclass
class ParallelismConfig:
    title: ClassVar[str] = "parallelism"
    parallel_mode: str = option(
        "zigzag_ring_attn", "how the sequence is split over ranks", aliases=("--parallel_mode",), choices=MODE_NAMES
    )
    ring_degree: int | None = option(
        None, "usp_attn: ring part of the SP group", _ring_degree, aliases=("--ring_degree",)
    )
    sp_size: int | None = option(None, "ranks sharing one sequence (default: all); world = dp x sp")
    mixer_strategy: str = option(
        "auto",
        "hybrid models' recurrent layers: state passing, head exchange, or auto (head exchange where the heads "
        "split over the sequence-parallel group)",
        choices=["auto", *MIXER_STRATEGIES],
    )
    fsdp: bool = option(
        False,
        "shard weights, gradients and optimizer state over every rank with PyTorch FSDP2 (fully_shard per decoder "
        "layer, then the root); launch with torchrun",
    )
    fsdp_offload: bool = option(False, "with --fsdp: keep the sharded state in host memory", _fsdp)
    dist_timeout: float = option(
        DEFAULT_DIST_TIMEOUT,
        "longest wait for a peer in any collective before every rank stops with a message "
        f"(default {DEFAULT_DIST_TIMEOUT:g} s)",
        type=dist_timeout_seconds,
        metavar="SECONDS",
    )


# the fields of ParallelismConfig other scripts take as they are: add_flags(..., only=), or in a section
# of their own with same_as (recipes/evaluation_config.py: EvalParallelismConfig)
SHARED_BY_SCRIPTS = ("parallel_mode", "ring_degree", "dist_timeout")
