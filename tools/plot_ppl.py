"""Perplexity-vs-context-length curves from one or more eval_ppl.py CSV files.

    python -m tools.plot_ppl outputs/eval/ppl.csv other.csv --output outputs/eval/ppl_all.png

Writes the PNG and a PDF next to it; models with the same name in several files are
labelled with their file's name.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from recipes.plots import perplexity_curves, read_perplexity_csv


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", nargs="+", help="eval_ppl.py output files")
    p.add_argument("--output", default=None, help="PNG path (default: the first CSV with .png)")
    p.add_argument("--title", default="perplexity vs context length")
    args = p.parse_args(argv)

    tables = []
    for path in args.csv:
        try:
            tables.append((Path(path), *read_perplexity_csv(path)))
        except (OSError, ValueError) as error:
            p.error(str(error))
    lengths = sorted({n for _, table_lengths, _ in tables for n in table_lengths})
    curves = {}
    for path, table_lengths, rows in tables:
        for model, values in rows.items():
            by_length = dict(zip(table_lengths, values))
            name = Path(model.rstrip("/")).name
            name = name if name not in curves else f"{name} ({path.stem})"
            curves[name] = [by_length.get(n, math.nan) for n in lengths]
    png = Path(args.output) if args.output else tables[0][0].with_suffix(".png")
    png.parent.mkdir(parents=True, exist_ok=True)
    perplexity_curves(lengths, curves, [png, png.with_suffix(".pdf")], title=args.title)
    print(f"wrote {png} and {png.with_suffix('.pdf')} ({len(curves)} curves, {len(lengths)} lengths)")


if __name__ == "__main__":
    main()
