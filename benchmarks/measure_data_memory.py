"""Does train.py's memory grow with the dataset? Peak RSS per rank, small vs large dataset.

Writes two tokenized datasets (save_to_disk folders) with rows of --row-tokens tokens, one
of --small-mb and one of --large-gb on disk, trains a few steps on each (2 processes, the
tiny Llama, zigzag ring), and prints each rank's peak resident memory as train.py records
it (`peak_rss_mib_per_rank` in train_summary.json). Rows are read lazily from the memory-mapped Arrow
files, so the two runs should match.

    python -m benchmarks.measure_data_memory                      # 2 GB vs 100 MB, about 5 minutes
    python -m benchmarks.measure_data_memory --large-gb 0.5 --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_dataset(folder: Path, rows: int, row_tokens: int, seed: int) -> float:
    """A save_to_disk dataset of `rows` random byte-token rows (int32); returns its size in MB."""
    import datasets
    import numpy as np

    def generate():
        rng = np.random.default_rng(seed)
        for _ in range(rows):
            yield {"input_ids": rng.integers(0, 256, row_tokens, dtype=np.int32)}

    datasets.disable_progress_bars()
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))})
    with tempfile.TemporaryDirectory(dir=folder.parent) as cache:
        dataset = datasets.Dataset.from_generator(generate, features=features, cache_dir=cache)
        dataset.save_to_disk(str(folder), max_shard_size="500MB")
    return sum(f.stat().st_size for f in folder.rglob("*")) / 1e6


def train(dataset: Path, out: Path, args) -> dict:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(ROOT / "train.py"),
        "--from-scratch",  # the random tiny Llama: the datasets are byte tokens
        "--dataset",
        str(dataset),
        "--seq-length",
        str(args.seq_length),
        "--max-train-steps",
        str(args.steps),
        "--output-dir",
        str(out),
        "--log-with",
        "none",
    ]
    started = time.perf_counter()
    result = subprocess.run(
        command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True
    )
    if result.returncode:
        sys.exit(f"train.py failed on {dataset}:\n{result.stderr[-3000:]}")
    summary = json.loads((out / "train_summary.json").read_text())
    return {"seconds": time.perf_counter() - started, "peak_rss_mib": summary["peak_rss_mib_per_rank"]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--large-gb", type=float, default=2.0)
    p.add_argument("--small-mb", type=float, default=100.0)
    p.add_argument("--row-tokens", type=int, default=65536)
    p.add_argument("--seq-length", type=int, default=4096, help="train.py --seq-length (rows are truncated to it + 1)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--workdir", default="outputs/data_memory")
    args = p.parse_args()

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    row_mb = args.row_tokens * 4 / 1e6
    table = []
    for name, megabytes in (("small", args.small_mb), ("large", args.large_gb * 1000)):
        folder = work / f"{name}-dataset"
        rows = max(2, round(megabytes / row_mb))
        if folder.exists():
            shutil.rmtree(folder)
        size = write_dataset(folder, rows, args.row_tokens, seed=len(name))
        result = train(folder, work / f"{name}-run", args)
        table.append((name, rows, size, result))
        shutil.rmtree(folder)

    print(
        f"\ntrain.py, 2 processes, zigzag_ring_attn, --seq-length {args.seq_length}, {args.steps} steps, "
        f"rows of {args.row_tokens} tokens (int32)\n"
    )
    print("| dataset | rows | on disk (MB) | peak RSS rank 0 (MiB) | peak RSS rank 1 (MiB) | run (s) |")
    print("|---|---|---|---|---|---|")
    for name, rows, size, result in table:
        rss = result["peak_rss_mib"]
        print(f"| {name} | {rows} | {size:.0f} | {rss[0]:.0f} | {rss[1]:.0f} | {result['seconds']:.0f} |")
    small, large = table[0][3]["peak_rss_mib"], table[1][3]["peak_rss_mib"]
    growth = max(b / a - 1 for a, b in zip(small, large))
    print(f"\nlargest per-rank growth from the small to the large dataset: {100 * growth:+.1f}%")


if __name__ == "__main__":
    main()
