"""A checkpoint folder's manifest: every file with its size and SHA-256, written last.

A checkpoint is whole when its manifest is there and every file it lists has that size and
digest. The work is shared: each rank hashes every `world`-th file (sorted by name), so
writing and checking a checkpoint of F bytes reads F / world bytes per rank (SHA-256 runs at
about 1-2 GB/s per core with the CPU's SHA instructions).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

__all__ = ["MANIFEST", "files_of", "digests", "write_manifest", "read_manifest", "problems", "first_problem"]

MANIFEST = "manifest.json"
_CHUNK = 8 * 2**20


def files_of(folder: Path) -> list[str]:
    """The files of a checkpoint folder (relative, sorted), the manifest itself excepted."""
    folder = Path(folder)
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


def digests(folder: Path, names: list[str], rank: int = 0, world: int = 1) -> dict:
    """{name: {"bytes", "sha256"}} of this rank's share of `names`."""
    folder = Path(folder)
    return {
        name: {"bytes": (folder / name).stat().st_size, "sha256": _digest(folder / name)} for name in names[rank::world]
    }


def write_manifest(folder: Path, entries: dict) -> None:
    """manifest.json, atomically (a reader sees the whole file or none)."""
    path = Path(folder) / MANIFEST
    temporary = path.with_name(MANIFEST + ".tmp")
    with open(temporary, "w") as f:
        json.dump({"files": dict(sorted(entries.items()))}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


def read_manifest(folder: Path) -> tuple[dict | None, str | None]:
    """(the manifest's files, None), or (None, why it cannot be read)."""
    path = Path(folder) / MANIFEST
    if not path.exists():
        return None, f"no {MANIFEST} (its save did not finish, or it was written before checkpoints were verified)"
    try:
        files = json.loads(path.read_text())["files"]
        if not isinstance(files, dict):
            raise ValueError("'files' is not a mapping")
    except (ValueError, KeyError, TypeError) as error:
        return None, f"{MANIFEST} is not a manifest ({error})"
    return files, None


def problems(folder: Path, files: dict, rank: int = 0, world: int = 1) -> list[str]:
    """What is wrong with this rank's share of the files the manifest lists (sorted by name)."""
    folder, found = Path(folder), []
    for name in sorted(files)[rank::world]:
        expected, path = files[name], folder / name
        if not path.is_file():
            found.append(f"{name} is missing")
        elif path.stat().st_size != expected["bytes"]:
            found.append(f"{name} has {path.stat().st_size} bytes, the manifest says {expected['bytes']}")
        elif _digest(path) != expected["sha256"]:
            found.append(f"{name} does not match its SHA-256 in {MANIFEST}")
    return found


def first_problem(folder: Path, gather=None, rank: int = 0, world: int = 1) -> str | None:
    """Why a checkpoint is not whole, or None. With `gather` (a list -> list of every rank's
    lists, a collective), the ranks share the hashing and all get the same answer."""
    files, error = read_manifest(folder)
    if error is not None:
        return error
    found = problems(folder, files, rank, world)
    if gather is not None:
        found = [problem for share in gather(found) for problem in share]
    return min(found) if found else None
