"""A model's attention heads as sequence parallelism sees them: the decoder's query and K/V head
counts, each layer's own where its module keeps them (checked against the Ulysses degree at
setup), and the Placement a topology is built from (ranks per node and heads)."""

from __future__ import annotations

import torch

from easy_context.core import collectives
from easy_context.core.exchange import ulysses_head_splits
from easy_context.core.groups import Placement, ranks_per_node
from easy_context.hf import architectures

__all__ = ["model_heads", "layer_heads", "check_layer_heads", "placement_of"]


def model_heads(model_or_config) -> tuple:
    """(query heads, key/value heads) of a model's (or config's) decoder; (None, None) for a
    model type, which says nothing about them."""
    if isinstance(model_or_config, str):
        return None, None
    text = architectures.text_config_of(model_or_config)
    heads = getattr(text, "num_attention_heads", None)
    return heads, getattr(text, "num_key_value_heads", None) or heads


def layer_heads(model_or_config) -> list[tuple[str, int, int]]:
    """(where, query heads, key/value heads) of each attention layer of a model's decoder: a
    layer's own counts where its module keeps them (num_heads: Laguna's and Step3p7's layers each
    have theirs), else the config's; a config, or a model none of whose modules is named as an
    attention layer (XxxAttention), gives the config's once; a model type, nothing."""
    heads, kv_heads = model_heads(model_or_config)
    if not isinstance(model_or_config, torch.nn.Module):
        return [] if heads is None else [("the config", heads, kv_heads)]
    get_decoder = getattr(model_or_config, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else model_or_config
    inside = {id(module) for module in decoder.modules()} if isinstance(decoder, torch.nn.Module) else None
    found = []
    for name, module in model_or_config.named_modules():
        if not type(module).__name__.endswith("Attention") or (inside is not None and id(module) not in inside):
            continue
        own = getattr(module, "num_heads", None) or getattr(module, "num_attention_heads", None)
        own_kv = getattr(module, "num_key_value_heads", None)
        if isinstance(own, int) or heads is not None:
            query = own if isinstance(own, int) else heads
            kv = own_kv if isinstance(own_kv, int) else min(kv_heads or query, query)
            found.append((f"layer {name} ({type(module).__name__})", query, kv))
    return found or ([] if heads is None else [("the config", heads, kv_heads)])


def check_layer_heads(model_or_config, ulysses_degree: int) -> None:
    """Every attention layer needs a query head on each of `ulysses_degree` ranks (uneven splits
    are served: 9 over 2 as 5 + 4); the layer with the fewest heads is refused, by name, at setup
    rather than at its first forward."""
    if ulysses_degree < 2:
        return
    layers = layer_heads(model_or_config)
    if not layers:
        return
    where, heads, kv_heads = min(layers, key=lambda layer: layer[1])
    try:
        ulysses_head_splits(heads, kv_heads, ulysses_degree)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None


def placement_of(model_or_heads, world_size: int | None = None) -> Placement:
    """Where `world_size` ranks (default: this world) run a model (a model, a config, or its
    (heads, kv_heads)): the launcher's ranks per node, when the world is this process's (a
    topology asked about for another world size knows no nodes), and the model's heads."""
    heads = model_or_heads if isinstance(model_or_heads, tuple) else model_heads(model_or_heads)
    actual = collectives.world_size()
    node = ranks_per_node() if world_size in (None, actual) else None
    return Placement(node, *heads)
