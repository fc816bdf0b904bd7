"""train.py's checkpoints in one process: which one `latest` and `auto` pick (step numbers of
different digit counts), what --save-total-limit prunes, and the manifest that proves a
checkpoint whole: a byte flipped, a file truncated, a file missing, the manifest missing."""

import json
from pathlib import Path

import pytest

from recipes import manifest
from recipes.checkpointing import (
    CheckpointError,
    checkpoint_dirs,
    checkpoints_to_prune,
    resolve_resume,
)


def make_checkpoint(output_dir: Path, step: int, whole: bool = True) -> Path:
    """A folder as save_checkpoint leaves it: files, trainer_state.json, then manifest.json."""
    folder = output_dir / f"checkpoint-{step}"
    (folder / "fsdp").mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 8 + step.to_bytes(4, "little"))
    (folder / "fsdp" / "__0_0.distcp").write_bytes(b"shard" * 100)
    (folder / "trainer_state.json").write_text(json.dumps({"step": step, "skipped_steps": 0, "args": {}}))
    if whole:
        manifest.write_manifest(folder, manifest.digests(folder, manifest.files_of(folder)))
    return folder


def resolved(output_dir, resume_from="auto"):
    lines = []
    found = resolve_resume(resume_from, str(output_dir), echo=lines.append)
    return found, lines


@pytest.fixture
def steps(tmp_path):
    """checkpoint-9, -10 and -100: by name, 9 would be the newest."""
    for step in (100, 9, 10):
        make_checkpoint(tmp_path, step)
    return tmp_path


def test_latest_auto_and_pruning_order_checkpoints_by_step_not_by_name(steps):
    assert [p.name for p in checkpoint_dirs(str(steps))] == ["checkpoint-9", "checkpoint-10", "checkpoint-100"]
    assert resolve_resume("latest", str(steps)).name == "checkpoint-100"
    assert resolved(steps)[0].name == "checkpoint-100"
    assert [p.name for p in checkpoints_to_prune(str(steps), 2, 100)] == ["checkpoint-9"]
    assert [p.name for p in checkpoints_to_prune(str(steps), 1, 100)] == ["checkpoint-9", "checkpoint-10"]
    # the checkpoint just saved is never pruned, nor one after it (left by a run resumed earlier)
    assert [p.name for p in checkpoints_to_prune(str(steps), 1, 10)] == ["checkpoint-9"]


CORRUPTIONS = {
    "a byte flipped": (
        lambda f: f.write_bytes(bytes([f.read_bytes()[0] ^ 1]) + f.read_bytes()[1:]),
        "model.safetensors does not match its SHA-256 in manifest.json",
    ),
    "a file truncated": (
        lambda f: f.write_bytes(f.read_bytes()[:-100]),
        "model.safetensors has 1952 bytes, the manifest says 2052",
    ),
    "a file missing": (lambda f: f.unlink(), "model.safetensors is missing"),
    "the manifest missing": (
        lambda f: (f.parent / "manifest.json").unlink(),
        "no manifest.json (its save did not finish",
    ),
}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_a_broken_newest_checkpoint_is_skipped_by_auto_and_refused_by_name(steps, corruption):
    damage, problem = CORRUPTIONS[corruption]
    newest = steps / "checkpoint-100"
    damage(newest / "model.safetensors")
    found, lines = resolved(steps)
    assert found.name == "checkpoint-10"
    assert lines == [f"--resume-from-checkpoint auto: skipping {newest}: {lines[0].split(': ', 2)[2]}"]
    assert problem in lines[0]
    for name in (str(newest), "latest"):  # named explicitly: refused with the same problem
        with pytest.raises(CheckpointError, match=problem.replace("(", r"\(")):
            resolve_resume(name, str(steps))


def test_auto_starts_fresh_without_a_whole_checkpoint_and_latest_says_so(tmp_path):
    assert resolved(tmp_path) == (
        None,
        [f"--resume-from-checkpoint auto: no whole checkpoint in {tmp_path}; starting at step 0"],
    )
    make_checkpoint(tmp_path, 3, whole=False)  # a save killed before its manifest (older releases: no manifest)
    found, lines = resolved(tmp_path)
    assert found is None and "skipping" in lines[0] and "no manifest.json" in lines[0]
    with pytest.raises(CheckpointError, match="latest: no checkpoint in .* \\(auto starts a fresh run instead\\)"):
        resolve_resume("latest", str(tmp_path / "empty"))


def test_the_ranks_share_the_hashing_and_agree(tmp_path):
    """Each rank hashes every world-th file; the gathered problems are the same on every rank."""
    folder = make_checkpoint(tmp_path, 7)
    files = manifest.read_manifest(folder)[0]
    assert [manifest.problems(folder, files, rank, 2) for rank in range(2)] == [[], []]
    size = (folder / "trainer_state.json").stat().st_size
    (folder / "trainer_state.json").write_text("{}")
    shares = [manifest.problems(folder, files, rank, 2) for rank in range(2)]
    problem = f"trainer_state.json has 2 bytes, the manifest says {size}"
    assert sum(shares, []) == [problem]
    assert [manifest.first_problem(folder, lambda mine: shares, rank, 2) for rank in range(2)] == [problem, problem]
