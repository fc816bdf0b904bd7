#!/usr/bin/env python
"""Print the README's generated blocks: the model-type counts (from the record,
easy_context/hf/model_types.py) and the short table of measured results (from the CSV files the
benchmarks write into docs/). tests/unit/test_docs.py checks that the README holds them, so its
numbers change only with the record or a benchmark run.

python -m tools.readme_tables
"""

import csv
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
MIXER_LAYERS = ("Mamba-2 layers", "Gated DeltaNet layers", "short convolution layers")


def _rows(name: str) -> list[dict]:
    with open(DOCS / name, newline="") as f:
        return list(csv.DictReader(f))


def model_types_line() -> str:
    from easy_context.hf.model_types import REFUSED, SUPPORTED

    hybrids = sum(any(layer in features for layer in MIXER_LAYERS) for features in SUPPORTED.values())
    return (
        f"{len(SUPPORTED)} model types exact ({hybrids} of them hybrids with Mamba-2, Gated DeltaNet or "
        f"short-convolution layers), {len(REFUSED)} refused with the reason"
    )


def results_table() -> str:
    lines = ["| what (CPU, gloo, 2 cores) | measured | benchmark |", "|---|---|---|"]

    fit = {row["config"]: row for row in _rows("bench_train_fit.csv")}
    plain, ours = fit["hf-plain"], fit["zigzag_ring_attn P=2 +mem"]
    ratio = float(plain["slope_kib_per_token"]) / float(ours["slope_kib_per_token"])
    lines.append(
        "| training memory per token of the sequence, per rank (tiny Llama, vocab 32000) | "
        f"plain HF {float(plain['slope_kib_per_token']):.1f} KiB; zigzag P=2 with checkpointing, tiled MLP "
        f"and chunked loss {float(ours['slope_kib_per_token']):.1f} KiB ({ratio:.0f}x less): "
        f"{int(ours['longest_tokens']) / 1e6:.2f}M tokens fit in 24 GiB instead of "
        f"{int(plain['longest_tokens']) // 1000}K | `benchmarks/bench_train.py` |"
    )

    attention = [row for row in _rows("bench_attention.csv") if row["S"] == "16384" and row["config"] != "baseline"]
    speed = ", ".join(f"{row['config']} {float(row['speedup']):.2f}" for row in attention)
    lines.append(
        f"| attention fwd+bwd, S=16K, P=2: one 2-thread process's time / ours (run-to-run noise 10-25%) | {speed} "
        "| `benchmarks/bench_attention.py` |"
    )

    generate = [row for row in _rows("bench_generate.csv") if row["seq"] == "32768"]
    hf = next(row for row in generate if row["config"] == "hf")
    zigzag = next(row for row in generate if row["config"].startswith("zigzag_ring_attn"))
    lines.append(
        "| generation with a 32K prompt, P=2 against one process | "
        f"K/V cache per rank {float(zigzag['kv_mib']) / float(hf['kv_mib']):.2f}x, "
        f"ms per new token {float(zigzag['ms_per_token']) / float(hf['ms_per_token']):.2f}x | "
        "`benchmarks/bench_generate.py` |"
    )

    mixers = {(row["family"], row["S"], row["setting"]): row for row in _rows("bench_mixers.csv")}
    cells = []
    for family, label in (("mamba2", "Mamba-2"), ("gdn", "Gated DeltaNet")):
        one = float(mixers[(family, "32768", "1 process")]["peak MiB/rank"])
        passing = float(mixers[(family, "32768", "state_passing")]["peak MiB/rank"])
        cells.append(f"{label} {passing:.0f} MiB vs {one:.0f} MiB")
    lines.append(
        "| hybrid layers fwd+bwd, S=32K, P=2 (state passing): peak per rank vs one process | "
        f"{'; '.join(cells)} | `benchmarks/bench_mixers.py` |"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    print(model_types_line())
    print()
    print(results_table())
