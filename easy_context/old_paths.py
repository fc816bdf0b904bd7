"""Import paths of release 0.1, kept working for one more release.

The package was flat (`easy_context.hf`, `easy_context.zigzag_ring_attn`, `easy_context.plan`...);
its modules now live in rooms (core/, modes/, hf/, programs/). An import of an old name gets
the new module itself (the same object, so a monkeypatch through either name is seen by
both) and a DeprecationWarning naming the new path. `python -m easy_context.plan` keeps
working too.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# old name -> new name; names that stayed (easy_context.hf, easy_context.modes, versions) are absent
MOVED = {
    "kernels": "core.kernels",
    "ring": "core.ring",
    "p2p": "core.p2p",
    "masking": "core.masking",
    "layout": "core.layout",
    "balance": "core.balance",
    "remat": "core.remat",
    "process_groups": "core.groups",
    "zigzag_ring_attn": "modes.zigzag_ring_attn",
    "dist_flash_attn": "modes.dist_flash_attn",
    "dist_flash_attn.schedule": "modes.dist_flash_attn",
    "ulysses_attn": "modes.ulysses_attn",
    "usp_attn": "modes.usp_attn",
    "data_parallel": "modes.data_parallel",
    "api": "hf.api",
    "architectures": "hf.architectures",
    "replicas": "hf.replicas",
    "generation": "hf.api",  # release 0.1's generate, ShardedKVCache and kv_bytes
    "trainer": "hf.api",  # release 0.1's prepare_trainer
    "launch": "programs.launch",
    "data": "programs.data",
    "data.rows": "programs.data.rows",
    "data.embedded": "programs.data.embedded",
    "models": "programs.models",
    "loss": "programs.loss",
    "tiled_mlp": "programs.tiled_mlp",
    "needle": "programs.needle",
    "evaluation": "programs.evaluation",
    "plots": "programs.plots",
    "plan": "programs.plan",
}
PACKAGE = "easy_context"


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        warnings.warn(
            f"{spec.name} moved to {self.new}; the old path goes in the next release", DeprecationWarning, stacklevel=2
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
        if not fullname.startswith(prefix) or fullname[len(prefix) :] not in MOVED:
            return None
        old = fullname[len(prefix) :]
        new = prefix + MOVED[old]
        # an old package whose submodules moved into one module (dist_flash_attn.schedule)
        has_children = any(name.startswith(old + ".") for name in MOVED)
        is_package = has_children or importlib.util.find_spec(new).submodule_search_locations is not None
        return importlib.util.spec_from_loader(fullname, _Alias(new), is_package=is_package)


def install() -> None:
    # First in line: under an aliased package (easy_context.data) the path finder would otherwise
    # load a second copy of a submodule (easy_context.data.rows) from the new folder.
    if not any(isinstance(finder, OldPaths) for finder in sys.meta_path):
        sys.meta_path.insert(0, OldPaths())
