"""The evaluation pictures: needle accuracy and task score heatmaps, perplexity-vs-context curves.

matplotlib is imported when a picture is drawn (it is not needed to import the package).
"""

from __future__ import annotations

import csv
import math

__all__ = ["needle_heatmap", "task_heatmap", "perplexity_curves", "read_perplexity_csv"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def _tokens_label(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def needle_heatmap(accuracy: dict, lengths: list[int], depths: list[float], path, title: str) -> None:
    """accuracy[(length, depth)] in [0, 1]; rows are depths (0% at the top), columns lengths."""
    grid = [[accuracy.get((length, depth), math.nan) for length in lengths] for depth in depths]
    _heatmap(grid, lengths, [f"{100 * d:.0f}%" for d in depths], "needle depth", "accuracy", path, title)


def task_heatmap(scores: dict, lengths: list[int], tasks: list[str], path, title: str) -> None:
    """scores[(task, length)] in [0, 1] (missing: a length too short for the task); rows tasks."""
    grid = [[scores.get((task, length), math.nan) for length in lengths] for task in tasks]
    _heatmap(grid, lengths, tasks, "task", "score", path, title)


def _heatmap(grid, lengths: list[int], row_labels: list[str], row_title: str, scale: str, path, title: str) -> None:
    plt = _pyplot()
    from matplotlib.colors import LinearSegmentedColormap

    colours = LinearSegmentedColormap.from_list("needle", ["#d7301f", "#fdbb84", "#1a9850"])
    width = max(5.0, 0.6 * len(lengths) + 2.5 + 0.05 * max(map(len, row_labels)))
    fig, ax = plt.subplots(figsize=(width, max(3.5, 0.45 * len(row_labels) + 1.5)))
    image = ax.imshow(grid, cmap=colours, vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(lengths)), [_tokens_label(n) for n in lengths], rotation=45 if len(lengths) > 8 else 0)
    ax.set_yticks(range(len(row_labels)), row_labels)
    if len(lengths) * len(row_labels) <= 400:
        for i, row in enumerate(grid):
            for j, value in enumerate(row):
                if not math.isnan(value):
                    ax.text(j, i, f"{value:.2f}".rstrip("0").rstrip("."), ha="center", va="center", fontsize=8)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(row_title)
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label=scale)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def read_perplexity_csv(path) -> tuple[list[int], dict[str, list[float]]]:
    """eval_ppl.py's CSV: header `model,<length>,...`, one row per model."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows or rows[0][0] != "model":
        raise ValueError(f"{path}: not an eval_ppl.py CSV (its header must start with 'model')")
    lengths = [int(x) for x in rows[0][1:]]
    return lengths, {row[0]: [float(x) if x else math.nan for x in row[1:]] for row in rows[1:]}


def perplexity_curves(lengths: list[int], curves: dict[str, list[float]], paths: list, title: str = "") -> None:
    """One line per model, perplexity against context length (log2 axis); saved to every path."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    for name, values in curves.items():
        ax.plot(lengths, values, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [_tokens_label(n) for n in lengths])
    ax.minorticks_off()
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("perplexity")
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    for path in paths:
        fig.savefig(path, dpi=130)
    plt.close(fig)
