"""train.py's resumable checkpoints: saved atomically with a manifest that proves them whole,
pruned to --save-total-limit, and resumed only by a run with the same flags, so that it
continues exactly.

A checkpoint is accelerate's save_state folder plus trainer_state.json (the step, the steps
skipped so far, and the flags in RESUME_KEYS) and manifest.json (every file's size and
SHA-256, written last: recipes/manifest.py). --resume-from-checkpoint takes a folder, `latest`
(the newest, which must be whole) or `auto` (the newest whole one, else a fresh start), so one
command serves the first attempt of a job and every restart torchrun makes.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from recipes import manifest
from recipes.faults import injected_fault

if TYPE_CHECKING:
    from recipes.training.config import CheckpointConfig

__all__ = [
    "CHECKPOINT_NAME",
    "RESUME_KEYS",
    "CheckpointError",
    "Checkpoints",
    "checkpoint_dirs",
    "checkpoints_to_prune",
    "legacy_resume_values",
    "read_trainer_state",
    "resolve_resume",
    "save_checkpoint",
    "resume_record",
]

CHECKPOINT_NAME = re.compile(r"checkpoint-(\d+)")

# These shape the data order, the schedule or the model: a resumed run must use the same
# values (and the same number of processes) to continue exactly.
RESUME_KEYS = (
    "seq_length",
    "batch_size",
    "gradient_accumulate_every",
    "parallel_mode",
    "sp_size",
    "ring_degree",
    "seed",
    "dataset",
    "text_column",
    "streaming",
    "retrieval_fraction",
    "model",
    "max_rows",
    "max_train_steps",
    "learning_rate",
    "warmup_steps",
    "weight_decay",
    "fsdp",
    "rope_theta",
    "world_size",
    "document_masking",
    "balance_documents",
    "data_order",
)


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed: the message names it and what is wrong."""


def checkpoint_dirs(output_dir: str) -> list[Path]:
    """Complete checkpoints, oldest first. A save in progress (or killed) lives in a
    `checkpoint-N.partial` folder, which never matches."""
    found = [
        p
        for p in Path(output_dir).glob("checkpoint-*")
        if CHECKPOINT_NAME.fullmatch(p.name) and (p / "trainer_state.json").exists()
    ]
    return sorted(found, key=lambda p: int(CHECKPOINT_NAME.fullmatch(p.name)[1]))


def resolve_resume(resume_from: str | None, output_dir: str, check=manifest.first_problem, echo=print) -> Path | None:
    """The checkpoint --resume-from-checkpoint names, proven whole by `check` (a folder -> the
    first problem or None): a folder, 'latest' (the newest one) or 'auto' (the newest whole one;
    each broken one is skipped with a line naming what is wrong; None when there is none)."""
    if resume_from is None:
        return None

    def problem_of(path: Path) -> str | None:  # a foreign checkpoint is named as such, unhashed
        return _trainer_state(path)[1] or check(path)

    if resume_from == "auto":
        for path in reversed(checkpoint_dirs(output_dir)):
            problem = problem_of(path)
            if problem is None:
                return path
            echo(f"--resume-from-checkpoint auto: skipping {path}: {problem}")
        echo(f"--resume-from-checkpoint auto: no whole checkpoint in {output_dir}; starting at step 0")
        return None
    if resume_from == "latest":
        found = checkpoint_dirs(output_dir)
        if not found:
            raise CheckpointError(
                f"--resume-from-checkpoint latest: no checkpoint in {output_dir} (auto starts a fresh run instead)"
            )
        path = found[-1]
    else:
        path = Path(resume_from)
        if not (path / "trainer_state.json").exists():
            raise CheckpointError(f"--resume-from-checkpoint {path}: not a checkpoint folder (no trainer_state.json)")
    problem = problem_of(path)
    if problem is not None:
        where = f"{resume_from}: {path}" if resume_from == "latest" else str(path)
        raise CheckpointError(f"--resume-from-checkpoint {where}: {problem}")
    return path


def read_trainer_state(path: Path) -> dict:
    state, problem = _trainer_state(path)
    if problem is not None:
        raise CheckpointError(f"--resume-from-checkpoint {path}: {problem}")
    return state


def _trainer_state(path: Path) -> tuple[dict | None, str | None]:
    try:
        state = json.loads((path / "trainer_state.json").read_text())
    except ValueError as error:
        return None, f"trainer_state.json is not valid JSON ({error})"
    if not (isinstance(state, dict) and isinstance(state.get("step"), int) and isinstance(state.get("args"), dict)):
        return None, (
            "not a train.py checkpoint (its trainer_state.json has no 'step' and 'args'; an HF Trainer checkpoint "
            "cannot be resumed here)"
        )
    return state, None


def legacy_resume_values(saved: dict) -> dict:
    """The saved flags as today's flags name them: checkpoints written before a flag existed were
    trained with its old behaviour, and --balance-documents was a switch (True: every document
    cut, today's `cut`)."""
    defaults = {
        "text_column": "text",
        "streaming": False,
        "fsdp": False,
        "retrieval_fraction": 0.0 if saved.get("dataset") is None else None,
        "data_order": "random",
    }
    values = {**defaults, **saved}
    values["balance_documents"] = {True: "cut", False: None}.get(
        values.get("balance_documents"), values.get("balance_documents")
    )
    return values


def resume_record(settings, world_size: int) -> dict:
    """What a checkpoint records and a resume compares: the settings of RESUME_KEYS (`settings`:
    every setting by name, recipes.configuration.values_of) and the number of processes."""
    return {k: world_size if k == "world_size" else getattr(settings, k) for k in RESUME_KEYS}


def save_checkpoint(accelerator, where: CheckpointConfig, record: dict, step: int, skipped: int) -> Path:
    """Atomic and verified: every rank writes into checkpoint-N.partial; rank 0 adds
    trainer_state.json; the ranks hash the folder's files between them and rank 0 writes
    manifest.json last, then renames the folder to checkpoint-N (a rename within a folder is
    atomic on POSIX). A kill at any moment leaves the newest whole checkpoint as it was; a
    save that fails on any rank (a full disk) fails on every rank with one message, before
    anything is pruned. Folders to delete are renamed aside first (`.stale`, never matched)
    and deleted in the background, so the other ranks do not wait on rank 0's rmtree."""
    from accelerate.utils import gather_object

    final = Path(where.output_dir) / f"checkpoint-{step}"
    partial = final.with_name(final.name + ".partial")
    if accelerator.is_main_process and partial.exists():
        shutil.rmtree(partial)  # left by a save that was killed
    accelerator.wait_for_everyone()
    rank, world = accelerator.process_index, accelerator.num_processes
    failure = None
    try:
        accelerator.save_state(str(partial))
        _injected_save_faults(step, rank, partial)
        if accelerator.is_main_process:
            state = {"step": step, "skipped_steps": skipped, "args": record}
            (partial / "trainer_state.json").write_text(json.dumps(state, indent=1))
    except OSError as error:
        failure = f"rank {rank}: {error}"
    _raise_if_any_failed(gather_object([failure]), final, where.output_dir)
    try:
        names = manifest.files_of(partial) if failure is None else []
        share = manifest.digests(partial, names, rank, world)
    except OSError as error:
        share, failure = {}, f"rank {rank}: {error}"
    shares = gather_object([(share, failure)])
    _raise_if_any_failed([f for _, f in shares], final, where.output_dir)
    if accelerator.is_main_process:
        manifest.write_manifest(partial, {name: entry for s, _ in shares for name, entry in s.items()})
        doomed = []
        if final.exists():  # the same step saved by an earlier run of this output dir
            doomed.append(set_aside(final))
        os.replace(partial, final)
        doomed += [set_aside(old) for old in checkpoints_to_prune(where.output_dir, where.save_total_limit, step)]
        # left by killed saves, or by deletions a finished process did not complete
        doomed += [
            *Path(where.output_dir).glob("checkpoint-*.partial"),
            *Path(where.output_dir).glob("checkpoint-*.stale-*"),
        ]
        threading.Thread(target=lambda: [shutil.rmtree(d, ignore_errors=True) for d in doomed], daemon=True).start()
    accelerator.wait_for_everyone()
    return final


def _injected_save_faults(step: int, rank: int, partial: Path) -> None:
    """The tests' failures inside a save: the process dies, pauses (for a kill from outside)
    or finds the disk full after writing its part."""
    if injected_fault("die_in_save", step, rank) is not None:
        os._exit(1)
    pause = injected_fault("pause_in_save", step, rank)
    if pause is not None:
        time.sleep(float(pause or 5))
    if injected_fault("disk_full_in_save", step, rank) is not None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(partial / "model.safetensors"))


def _raise_if_any_failed(failures: list, final: Path, output_dir: str) -> None:
    failures = [f for f in failures if f is not None]
    if failures:
        whole = [p.name for p in checkpoint_dirs(output_dir) if p != final]
        kept = f"{whole[-1]} is as it was" if whole else "no earlier checkpoint exists"
        raise CheckpointError(
            f"{final.name} was not saved ({failures[0]}); {kept}. Free the space (or fix the path), then run "
            "the same command with --resume-from-checkpoint auto"
        )


def set_aside(path: Path) -> Path:
    aside = path.with_name(f"{path.name}.stale-{time.time_ns()}")
    os.replace(path, aside)
    return aside


def checkpoints_to_prune(output_dir: str, save_total_limit: int | None, step: int) -> list[Path]:
    """With --save-total-limit N: all but checkpoint-`step` and the N - 1 newest before it.
    Checkpoints after `step` (left by a run this one resumed before) are not ours to judge."""
    if save_total_limit is None:
        return []
    older = [p for p in checkpoint_dirs(output_dir) if int(CHECKPOINT_NAME.fullmatch(p.name)[1]) < step]
    return older[: max(0, len(older) - (save_total_limit - 1))]


class Checkpoints:
    """The checkpoints of one run in --output-dir, and the newest one it saved or resumed
    from: a run that stops on a non-finite loss keeps its last good step without saving twice.
    `record`: the run's resume_record, saved with each checkpoint and compared on resume."""

    def __init__(self, accelerator, where: CheckpointConfig, record: dict):
        self.accelerator, self.where, self.record = accelerator, where, record
        self.newest: tuple[int, Path] | None = None  # (step, folder)

    def find(self, resume_from: str | None) -> Path | None:
        """resolve_resume with the ranks sharing the hashing (every rank gets the same answer)."""
        from accelerate.utils import gather_object

        accelerator = self.accelerator
        rank, world = accelerator.process_index, accelerator.num_processes

        def check(path):
            return manifest.first_problem(path, lambda found: gather_object([found]), rank, world)

        return resolve_resume(resume_from, self.where.output_dir, check, accelerator.print)

    def resume(self, path: Path) -> tuple[int, int]:
        """Load `path` into the prepared model, optimizer and schedule; (step, skipped steps).
        Refused before anything is loaded when a flag in RESUME_KEYS differs."""
        state = read_trainer_state(path)
        saved = legacy_resume_values(state["args"])
        changed = {k: (saved.get(k), self.record[k]) for k in RESUME_KEYS if saved.get(k) != self.record[k]}
        if changed:
            raise CheckpointError(
                f"cannot resume {path}: these flags differ from the checkpoint (checkpoint, now): {changed}"
            )
        try:
            self.accelerator.load_state(str(path))
        except (OSError, RuntimeError, ValueError) as error:  # a folder with missing or truncated files
            raise CheckpointError(
                f"--resume-from-checkpoint {path}: cannot load it ({' '.join(str(error).split())[:300]})"
            ) from error
        self.newest = (state["step"], path)
        return state["step"], state.get("skipped_steps", 0)

    def save(self, step: int, skipped: int) -> Path:
        self.newest = (step, save_checkpoint(self.accelerator, self.where, self.record, step, skipped))
        return self.newest[1]

    def keep_last_good_step(self, step: int, skipped: int) -> Path | None:
        """The checkpoint of the weights after `step` good steps, saved now unless it exists
        already; None when nothing was trained yet."""
        if self.newest is not None and self.newest[0] == step:
            return self.newest[1]
        return self.save(step, skipped) if step > 0 else None
