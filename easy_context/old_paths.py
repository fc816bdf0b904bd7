"""Old import paths, kept working until REMOVAL (then this file goes).

The package was flat (`easy_context.hf`, `easy_context.zigzag_ring_attn`, `easy_context.plan`...);
its modules now live in rooms (core/, modes/, hf/), and what the scripts need lives outside the
library, in the `recipes` package (it was `easy_context.programs`). An import of an old name gets
the new module itself (the same object, so a monkeypatch through either name is seen by
both) and a DeprecationWarning naming the new path. `python -m easy_context.plan` and
`python -m easy_context.programs.plan` keep working too.

The library never imports the recipes: this file names them only as strings, resolved when a
user imports an old path (tests/unit/test_rooms.py holds the direction).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

REMOVAL = "2027-06-01"  # or release 0.3, whichever comes first
# old name (under easy_context) -> new module; names that stayed (easy_context.hf, easy_context.modes,
# versions) are absent. Every easy_context.programs.<name> is recipes.<name> (PROGRAMS).
MOVED = {
    "kernels": "easy_context.core.kernels",
    "ring": "easy_context.core.ring",
    "p2p": "easy_context.core.p2p",
    "masking": "easy_context.core.masking",
    "layout": "easy_context.core.layout",
    "balance": "easy_context.core.balance",
    "remat": "easy_context.core.remat",
    "process_groups": "easy_context.core.groups",
    "zigzag_ring_attn": "easy_context.modes.zigzag_ring_attn",
    "dist_flash_attn": "easy_context.modes.dist_flash_attn",
    "dist_flash_attn.schedule": "easy_context.modes.dist_flash_attn",
    "ulysses_attn": "easy_context.modes.ulysses_attn",
    "usp_attn": "easy_context.modes.usp_attn",
    "data_parallel": "easy_context.modes.data_parallel",
    "api": "easy_context.hf.api",
    "architectures": "easy_context.hf.architectures",
    "replicas": "easy_context.hf.replicas",
    "generation": "easy_context.hf.api",  # release 0.1's generate, ShardedKVCache and kv_bytes
    "trainer": "easy_context.hf.api",  # release 0.1's prepare_trainer
    "launch": "recipes.launch",
    "data": "recipes.data",
    "data.rows": "recipes.data.rows",
    "data.embedded": "recipes.data.embedded",
    "models": "recipes.models",
    "loss": "easy_context.hf.loss",
    "tiled_mlp": "recipes.tiled_mlp",
    "needle": "recipes.needle",
    "evaluation": "recipes.evaluation",
    "plots": "recipes.plots",
    "plan": "recipes.plan",
}
PACKAGE = "easy_context"
PROGRAMS = "programs"  # easy_context.programs[.<name>] -> recipes[.<name>]
# recipes modules renamed since easy_context.programs: old name -> new name, under recipes
RENAMED_RECIPES = {"harness": "lm_eval_model"}  # one word, one thing: lm-eval's model


def new_name(old: str) -> str | None:
    """The module an old name under easy_context now is, or None if `old` did not move."""
    if old == PROGRAMS or old.startswith(PROGRAMS + "."):
        head, _, rest = old[len(PROGRAMS) + 1 :].partition(".")
        head = RENAMED_RECIPES.get(head, head)
        return "recipes" + (f".{head}" if head else "") + (f".{rest}" if rest else "")
    return MOVED.get(old)


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        warnings.warn(
            f"{spec.name} moved to {self.new}; the old path goes on {REMOVAL}", DeprecationWarning, stacklevel=2
        )
        module = importlib.import_module(self.new)
        self.real_spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self.real_spec  # the import system set the alias's spec; the module keeps its own

    def get_code(self, name: str):  # python -m <old name>
        spec = importlib.util.find_spec(self.new)
        return spec.loader.get_code(self.new)


class OldPaths(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path=None, target=None):
        prefix = PACKAGE + "."
        old = fullname[len(prefix) :] if fullname.startswith(prefix) else None
        new = None if old is None else new_name(old)
        if new is None or importlib.util.find_spec(new) is None:
            return None
        # an old package whose submodules moved into one module (dist_flash_attn.schedule)
        has_children = old == PROGRAMS or any(name.startswith(old + ".") for name in MOVED)
        is_package = has_children or importlib.util.find_spec(new).submodule_search_locations is not None
        return importlib.util.spec_from_loader(fullname, _Alias(new), is_package=is_package)


def install() -> None:
    # First in line: under an aliased package (easy_context.data) the path finder would otherwise
    # load a second copy of a submodule (easy_context.data.rows) from the new folder.
    if not any(isinstance(finder, OldPaths) for finder in sys.meta_path):
        sys.meta_path.insert(0, OldPaths())
