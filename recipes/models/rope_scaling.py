"""A model folder's training-free RoPE scalings as folders of their own: the same weights and
tokenizer (linked, not copied), a config.json whose rope_parameters ask transformers for linear
interpolation, dynamic NTK or YaRN by a factor. Every script that takes --model then evaluates
the scaled model as it would any other (eval_ppl.py -m BASE -m SCALED ...), with transformers'
own rotary code: nothing here computes frequencies.

    python -m recipes.models scale smollm2-135m-instruct --rope yarn:4     (-> models/smollm2-135m-instruct-yarn4)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from recipes.models.downloads import SOURCE_FILE

__all__ = ["SCALINGS", "parse_scaling", "scaled_copy"]

# The rope types easy_context proves (hf/architectures.PROVEN_ROPE_TYPES) that need only a factor.
SCALINGS = ("linear", "dynamic", "yarn")


def parse_scaling(text: str) -> tuple[str, float]:
    """'yarn:4' -> ('yarn', 4.0); a ValueError naming the value and the accepted form."""
    kind, _, factor = text.partition(":")
    try:
        value = float(factor)
    except ValueError:
        value = 0.0
    if kind not in SCALINGS or value <= 1:
        raise ValueError(f"--rope {text!r}: use TYPE:FACTOR with TYPE one of {', '.join(SCALINGS)} and FACTOR > 1")
    return kind, value


def scaled_parameters(config: dict, kind: str, factor: float) -> dict:
    """config.json's fields for `kind` at `factor`, from a config trained at its
    max_position_embeddings (the original length every scaling is relative to).

    linear and yarn are fixed stretches, so the positions the config declares grow by the
    factor; dynamic NTK rescales from the length it sees, relative to max_position_embeddings,
    which therefore stays the original."""
    original = config["max_position_embeddings"]
    base = dict(config.get("rope_parameters") or {"rope_theta": config["rope_theta"]})
    if base.get("rope_type", "default") != "default":
        raise ValueError(f"the model already has rope_type {base['rope_type']!r}: scale a model with default RoPE")
    rope = {"rope_type": kind, "rope_theta": base["rope_theta"], "factor": factor}
    if kind == "yarn":
        rope["original_max_position_embeddings"] = original
    positions = original if kind == "dynamic" else int(original * factor)
    return {"rope_parameters": rope, "max_position_embeddings": positions}


def scaled_copy(source: Path | str, kind: str, factor: float, out: Path | str) -> Path:
    """`out`: `source`'s files linked (weights, tokenizer, ...) and its config.json with the
    scaling; an existing `out` is replaced."""
    source, out = Path(source).resolve(), Path(out)
    config = json.loads((source / "config.json").read_text())
    config.update(scaled_parameters(config, kind, factor))
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.iterdir()):
        if path.name in ("config.json", SOURCE_FILE) or not path.is_file():  # source.json: the download's record
            continue
        link = out / path.name
        link.unlink(missing_ok=True)
        # a relative link keeps the pair movable together (models/NAME and models/NAME-yarn4)
        link.symlink_to(os.path.relpath(path, out.resolve()))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
