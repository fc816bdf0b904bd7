"""A test hook, not a feature: deterministic failures for the tests of the failure paths
(tests/distributed/test_reliability.py, tests/recipes/test_train_fsdp.py, tests/chaos.py, ...).

EASY_CONTEXT_FAULT unset (every real run), injected_fault returns None and nothing fires. It lives
apart from launch.py so that the scripts' start-and-stop path holds no test code; train.py and
recipes/checkpointing.py call it at the points it names.
"""

from __future__ import annotations

import os

__all__ = ["injected_fault"]


def injected_fault(point: str, step: int, rank: int) -> str | None:
    """For the tests of failure paths: EASY_CONTEXT_FAULT="point@step:rank[:value]" makes
    `point` fire at that step on that rank (returns value, or "" when none is given).
    Points in train.py: hang (sleep value seconds before the forward), refusal (a ValueError
    there, as a bad input only one rank sees would raise), die_in_save (the
    process dies after writing its part of the checkpoint), pause_in_save (sleeps value
    seconds there: a kill from outside lands inside the save), disk_full_in_save (ENOSPC
    there), nonfinite_loss (in micro-batch `value` of the step, or in all of them). With
    EASY_CONTEXT_FAULT_ATTEMPT=n the fault fires only in torchrun's attempt n (0: the first)."""
    spec = os.environ.get("EASY_CONTEXT_FAULT")
    if not spec or "@" not in spec:
        return None
    attempt = os.environ.get("EASY_CONTEXT_FAULT_ATTEMPT")
    if attempt is not None and attempt != os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"):
        return None
    name, _, where = spec.partition("@")
    fields = where.split(":")
    if name != point or len(fields) < 2 or (int(fields[0]), int(fields[1])) != (step, rank):
        return None
    return fields[2] if len(fields) > 2 else ""
