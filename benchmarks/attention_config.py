"""Names and sizes bench_attention's driver and ranks share, and the light import of
easy_context's modes the ranks use. No torch here (see benchmarks.common)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

CPU_CORES = 2  # the machine this benchmark is written for (see docs/benchmarks.md)
BASELINE = "baseline"
DEEPSPEED = "deepspeed_ulysses"
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def import_easy_context_modes():
    """(easy_context.modes, easy_context.core.groups), loaded without running the package's
    __init__, which imports transformers (~8 s per process here; none of it is used by the
    attention paths measured). Falls back to the normal import if that does not work."""
    if "easy_context" not in sys.modules:
        spec = importlib.util.find_spec("easy_context")  # locates the package, runs nothing
        if spec is not None and spec.submodule_search_locations:
            stub = types.ModuleType("easy_context")
            stub.__path__ = list(spec.submodule_search_locations)
            stub.__spec__ = spec
            sys.modules["easy_context"] = stub
            try:
                modes = importlib.import_module("easy_context.modes")
                return modes, importlib.import_module("easy_context.core.groups")
            except Exception:
                for name in [n for n in sys.modules if n == "easy_context" or n.startswith("easy_context.")]:
                    del sys.modules[name]
    return importlib.import_module("easy_context.modes"), importlib.import_module("easy_context.core.groups")
