"""Models for the scripts: loading a Hugging Face causal LM the way they need it.

loading.py     load or build a model for a supported type (config overrides, checks)
"""

from recipes.models.loading import check_config, load_config, load_pretrained

__all__ = ["load_config", "load_pretrained", "check_config"]
