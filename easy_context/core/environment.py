"""Every environment variable easy-context reads, in one list: name -> (who reads it, what it
does, its default). The readers read them where they act (os.environ); this list is what the
docs show (docs/reference/environment.md) and what a test holds every EASY_CONTEXT_* name in
the repository to. `TEST_HOOKS` are for the tests of failure paths and measurements only."""

from __future__ import annotations

__all__ = ["VARIABLES", "TEST_HOOKS"]

VARIABLES = {
    "EASY_CONTEXT_KERNEL": (
        "core/kernels.py",
        "force one attention backend (math_tiles, cpu_flash, cuda_flash, cuda_efficient, flash_attn, flex) "
        "instead of the automatic choice; a backend that cannot run the call is refused",
        "unset: the fastest backend that can run each call",
    ),
    "EASY_CONTEXT_FLEX_COMPILE": (
        "core/backends/flex.py",
        "run flex attention compiled with this torch.compile backend on any device (e.g. eager: "
        "Dynamo's graphs without Triton)",
        "unset: compiled on CUDA (inductor), eager elsewhere",
    ),
    "EASY_CONTEXT_REPLICA_CHECK_EVERY": (
        "hf/replicas.py",
        "check that the ranks of an SP group hold the same weights every N forwards (0: never)",
        "16",
    ),
    "EASY_CONTEXT_ALLOW_UNSUPPORTED": (
        "versions.py",
        "1: run with torch / transformers versions outside pyproject.toml's ranges (warns instead of refusing)",
        "unset: refused",
    ),
    "EASY_CONTEXT_LOG_GROUPS": ("core/groups.py", "1: print the process groups as they are created", "0"),
    "EASY_CONTEXT_EXIT_TEARDOWN": (
        "core/groups.py",
        "0: do not register the clean process-group teardown at exit",
        "1",
    ),
    "EASY_CONTEXT_PLAN_ONLINE": (
        "recipes/plan/catalogue.py",
        "1: the planner may look a model's config up on the hub (else the local cache only)",
        "unset: offline",
    ),
    "EASY_CONTEXT_FAULT": (
        "recipes/faults.py (injected_fault)",
        'test hook: "point@step:rank[:value]" fires a failure at that point of train.py (hang, die_in_save, '
        "pause_in_save, disk_full_in_save, nonfinite_loss)",
        "unset: none",
    ),
    "EASY_CONTEXT_FAULT_ATTEMPT": (
        "recipes/faults.py (injected_fault)",
        "test hook: fire EASY_CONTEXT_FAULT only in torchrun's attempt N (0: the first)",
        "unset: every attempt",
    ),
    "EASY_CONTEXT_TRACE_OPS": (
        "benchmarks/dispatch_counts.py",
        "measurement hook: comma-separated aten ops whose call stacks the op counter prints",
        "unset: none",
    ),
    "EASY_CONTEXT_REQUIRE_DEEPSPEED": (
        "tests/ranks.py, tests/recipes/test_scripts_smoke.py",
        "test hook: 1 makes the tests that need DeepSpeed fail where it is missing, not skip (CI sets it)",
        "unset: skipped without DeepSpeed",
    ),
    "EASY_CONTEXT_REQUIRE_PYTHON_DOCS": (
        "tests/unit/test_long_text.py",
        "test hook: 1 makes the long-text tests fail where Debian's python3.X-doc is missing, not skip (CI sets it)",
        "unset: skipped without the Python docs",
    ),
}
TEST_HOOKS = frozenset(
    {
        "EASY_CONTEXT_FAULT",
        "EASY_CONTEXT_FAULT_ATTEMPT",
        "EASY_CONTEXT_TRACE_OPS",
        "EASY_CONTEXT_REQUIRE_DEEPSPEED",
        "EASY_CONTEXT_REQUIRE_PYTHON_DOCS",
    }
)
