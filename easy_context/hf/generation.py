"""Generation at long context: the prompt's K/V sharded over the SP group, decoding exact.

    generate_in(context, model, input_ids, attention_mask=None, **generate_kwargs)
    (easy_context.generate(mode, ...) and SequenceParallel.generate call it)

Every rank of an SP group passes the same prompts (B, S) and gets the same output as one
process's `model.generate` would give. How:

1. Prefill (ours): the first S - 1 prompt tokens run through the model in the mode's layout,
   like a training forward (padded at the end to a length the layout splits, the padding
   masked). A `ShardedKVCache` (sharded_cache.py) keeps what each layer computed for this
   rank's tokens: the rank's shard of every layer's K/V, and nothing else.
2. Decoding (HF's): `model.generate` runs with that cache, so logits processors, stopping
   criteria, sampling, beam search and EOS handling are transformers' own. It sees a cache
   holding S - 1 tokens, feeds the last prompt token, then one token per step. Only attention
   differs from one process's: each rank attends to its own K/V shard and one all-gather per
   layer merges the partial results exactly (sharded_cache.py says how).
"""

from __future__ import annotations

import sys

import torch

from easy_context.core import collectives
from easy_context.core.global_mask import check_padding
from easy_context.hf import mixers as hf_mixers
from easy_context.hf.architectures import model_types_of, sequence_mixers
from easy_context.hf.patch import active
from easy_context.hf.sharded_cache import ShardedKVCache
from easy_context.versions import cache_keyword

__all__ = ["generate_in"]

# generate() options that would bypass or fight the sharded cache.
_REFUSED_KWARGS = {
    "cache": "generate makes its own sharded cache",
    "past_key_values": "generate makes its own sharded cache",
    "cache_implementation": "generate makes its own sharded cache",
    "assistant_model": "assisted decoding rolls the cache back, which a sharded cache does not do",
    "prompt_lookup_num_tokens": "prompt lookup rolls the cache back, which a sharded cache does not do",
    "inputs_embeds": "pass input_ids",
    "position_ids": "positions follow from attention_mask, as in model.generate",
}


# ------------------------------------------------------------------ generate
def generate_in(context, model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
    """easy_context.generate in a SequenceParallel context (SequenceParallel.generate)."""
    for name, why in _REFUSED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise ValueError(f"generate: {name} is not supported ({why})")
    if kwargs.get("use_cache") is False:
        raise ValueError("generate: use_cache=False is not supported; the sharded KV cache is the point")
    # use_cache=True: a model saved for training often has use_cache=False in its config, which
    # model.generate would follow and run the whole sequence again at every token.
    kwargs["use_cache"] = True
    if not context.sequence_parallel:  # data_parallel: each rank generates on its own
        return model.generate(input_ids, attention_mask=attention_mask, **kwargs)
    module = sys.modules[type(model).__module__]
    mixers = sequence_mixers(module, model.config.get_text_config())
    if mixers and not hf_mixers.covers(module):
        raise ValueError(
            f"generate: the model has layers besides attention ({', '.join(mixers)}); a sharded cache of their "
            "recurrent and convolution states is not implemented: generate with model.generate in one process, "
            "or with the data_parallel mode"
        )
    context = _installed_for(context, model)
    groups = context.groups()
    input_ids, attention_mask = _checked_prompt(input_ids, attention_mask, model)
    config = _generation_config(model, kwargs)
    for name in ("guidance_scale", "negative_prompt_ids"):
        if getattr(config, name, None) not in (None, 1, 1.0) or kwargs.get(name) is not None:
            raise ValueError(
                f"generate: {name} is not supported (classifier-free guidance runs a second forward "
                "with a cache of its own)"
            )
    _check_same_everywhere(context, input_ids, attention_mask, bool(getattr(config, "do_sample", False)))

    cache = ShardedKVCache(groups.sp, groups.sp_rank, groups.topology.sp_size, model.config if mixers else None)
    with torch.no_grad():
        _prefill(context, model, cache, input_ids, attention_mask)
    cache.finish_prefill(input_ids.shape[0], input_ids.device)
    with context.decoding_with(cache):
        # cache_implementation=None: a model's generation config may name one (Gemma 2: "hybrid"),
        # which transformers refuses next to a cache it is given; ours replaces it.
        output = model.generate(
            input_ids,
            attention_mask=attention_mask,
            cache_implementation=None,
            **{cache_keyword(model): cache},
            **kwargs,
        )
    cache.raise_if_diverged()  # the last step's verdict
    sequences = output if isinstance(output, torch.Tensor) else output.sequences
    _check_same_everywhere(context, sequences, None, False, what="generated tokens")
    return output


def _installed_for(context, model):
    """The installed context that generates with `model`: the patch's (sharded prefill and
    decoding must agree with it), extended to the model's type, or a new one for it."""
    installed = active()
    if installed is not None and installed.mode is not context.mode:
        raise ValueError(
            f"generate({context.mode.name!r}, ...): the patch runs {installed.mode.name!r} for "
            f"{sorted(installed.model_types)}; generate with that mode, or call "
            "remove_seq_parallel_monkey_patch() first"
        )
    if installed is not None:
        mine, patched = context.topology(), installed.topology()
        if mine != patched:
            raise ValueError(
                f"generate: sp_size={mine.sp_size}, ring_degree={mine.ring_degree} differ from the patch's "
                f"sp_size={patched.sp_size}, ring_degree={patched.ring_degree} (apply_seq_parallel_monkey_patch)"
            )
    if context.document_split:
        raise ValueError(
            "generate: document_split is for packed rows; a prompt is one document per row "
            "(apply the patch without document_split to generate)"
        )
    if installed is None or not set(model_types_of(model)) <= installed.model_types:
        installed = (installed or context).installed_for(model)
    if model.training:
        raise ValueError("generate: the model is in training mode; call model.eval() first")
    return installed


def _checked_prompt(input_ids, attention_mask, model):
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] == 0:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"generate: input_ids must be a (batch, seq_len) tensor with seq_len >= 1, got {shape}")
    device = model.device if model.device.type != "meta" else input_ids.device
    input_ids = input_ids.to(device)
    if attention_mask is None:  # transformers needs it to see that the cache holds the prompt
        return input_ids, torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"generate: attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
        )
    attention_mask = attention_mask.to(device).long()
    check_padding(attention_mask.cpu())
    if not bool(attention_mask[:, -1].all()):
        raise ValueError("generate: rows must be left-padded (the last token of every row real), as for model.generate")
    return input_ids, attention_mask


def _generation_config(model, kwargs):
    """The generation config model.generate(**kwargs) will use (transformers' own merge of the
    model's defaults and the call's options); None for a model without one."""
    prepare = getattr(model, "_prepare_generation_config", None)
    if prepare is None:  # not a transformers generation model: its generate will say so
        return None
    options = {name: value for name, value in kwargs.items() if name != "generation_config"}
    return prepare(kwargs.get("generation_config"), **options)[0]


def _check_same_everywhere(context, tokens, mask, sampling: bool, what: str = "prompts") -> None:
    """Every rank of the SP group must hold the same prompts (and, when sampling, the same
    random state): a difference would make the sharded cache a mix of two sequences. Every
    rank sends the same number of values, whatever it was given."""
    state = None
    if sampling:
        state = torch.cuda.get_rng_state(tokens.device) if tokens.device.type == "cuda" else torch.get_rng_state()
    hint = " and random states (seed every rank alike: torch.manual_seed)" if sampling else ""
    flag = torch.tensor([float(sampling)], device=tokens.device)
    context.check_same(
        [tokens, mask, state, flag],
        lambda shapes: f"generate: the {what}{hint} differ between the ranks of the sequence-parallel group",
    )


def _prefill(context, model, cache: ShardedKVCache, input_ids, attention_mask) -> None:
    """The first S - 1 prompt tokens through the model in the mode's layout, into the cache."""
    length = input_ids.shape[1] - 1
    if length == 0:
        return
    # Positions as model.generate makes them: left padding does not count.
    whole = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
    positions = whole[:, :length]
    topology = context.topology()
    layout = context.mode.layout(topology)
    padded = length + layout.padding(length)

    def extend(x):
        return torch.nn.functional.pad(x[:, :length], (0, padded - length), value=0)

    ids, mask, positions = extend(input_ids), extend(attention_mask), extend(positions)
    local = context.shard(ids, positions, None, None if bool(mask.all()) else mask)
    columns = layout.local_indices(padded, topology.sp_rank(collectives.rank())).to(ids.device)
    index = columns.masked_fill(columns >= length, -1)
    cache.start_prefill(index, mask[:, columns].bool(), length)
    # RoPE whose frequencies follow the length sees the whole prompt's, as in model.generate's prefill
    with context.prefilling(whole.max(), length - 1):
        model(
            input_ids=local["local_input_ids"],
            position_ids=local["local_position_ids"],
            attention_mask=local["local_attention_mask"],
            use_cache=True,
            logits_to_keep=1,
            **{cache_keyword(model): cache},
        )
