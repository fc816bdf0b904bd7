"""The sharded KV cache that generate decodes with: this SP rank's shard of every layer's K/V.

Decoding runs the step's tokens on every rank (the same input, the same weights: the same
hidden states); only attention differs: each rank attends the step's queries to its own K/V
shard (kernels.attention_forward, which returns the log-sum-exp) and one all-gather of the
partial (out, lse) per layer merges them exactly (ring.merge_block, in rank order, so every
rank gets bitwise the same result). The token with sequence index i is kept by SP rank i % P,
so the cache stays balanced. With the first layer's (out, lse) of a step goes a checksum of
the queries; its verdict is read at the next step: one host sync per token, none per layer.

Hybrid models' recurrent and convolution layers (hf/mixers.py) keep transformers' own layer
caches (LinearAttentionLayer): the prefill writes the states after the prompt's last prefilled
token, which the rank holding it computed and broadcast, so each rank holds the whole state,
the same everywhere. A decoding step runs those layers as one process would, on every rank: the
step's tokens are the same everywhere, and the states are O(1) in the sequence's length (a
convolution's last kernel inputs, a scan's state), so one copy per rank costs no more memory
than one K/V slot per token does and no communication per step.

Where the hook sits: the patch's attention dispatcher hands a layer's call to the cache's `attend`
while a ShardedKVCache is decoding (`SequenceParallel.decoding_with(cache)`); the prefill goes through the
mode's own attention.

Masks (the rule of masking.py: valid, not after the query, within the window). A step feeds one
token, whose query may attend every slot up to it; what it may not attend is
- slots out of a sliding window: the oldest ones, skipped (and dropped from the next step on);
- the prompt's left padding: a few slots of the prefill, fixed when the prompt is. Only those
  slots (up to the last one that is padding in any row) go to the masked kernel; the rest of the
  cache, everything decoding appends, goes to the unmasked one (on CUDA flash, in bf16/fp16), and the
  two partial results merge exactly. So what a masked step makes per layer (a bias over the
  padded slots) is fixed by the prompt and does not grow with the cache.
"""

from __future__ import annotations

import bisect
import math

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from easy_context.core import collectives
from easy_context.core.blocks import fold_sinks, merge_block
from easy_context.core.kernels import accumulation_dtype, attention_forward

__all__ = ["ShardedKVCache", "kv_bytes", "GROWTH"]

GROWTH = 256  # cache slots added at once when a rank's shard of a layer is full (one copy per GROWTH tokens)


class _ShardLayer(DynamicLayer):
    """One layer's K/V on this rank: the cache's slots [base, base + used) in a buffer, of which
    [first, base + used) are live. Slots before `first` fall out of a sliding window for every
    later query (slot indices increase: the layouts keep a rank's tokens in order, and new
    tokens come last); their memory is reclaimed at the next copy. The prefill's tensors are
    kept as they come; decoding appends into spare capacity (GROWTH slots at a time) instead of
    concatenating the whole shard at every token, as DynamicLayer does."""

    def __init__(self):
        super().__init__()
        self.base = self.first = self.used = 0
        self.updated_at = 0  # the cache's length after this layer's last update
        self.window = None  # the layer's sliding window, learnt at its first decoding step

    def store(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values, self.used, self.is_initialized = keys, values, keys.shape[-2], True

    def live(self):
        start = self.first - self.base
        return self.keys[..., start : self.used, :], self.values[..., start : self.used, :]

    def append(self, keys: torch.Tensor, values: torch.Tensor):
        if not self.is_initialized:
            self.store(keys[..., :0, :].clone(), values[..., :0, :].clone())
        added, dead = keys.shape[-2], self.first - self.base
        if self.used + added > self.keys.shape[-2] or dead >= max(GROWTH, self.used - dead):
            live = self.used - dead  # copy the live slots only, with GROWTH spare ones
            self.keys, self.values = (
                _copied(x, dead, self.used, live + added + GROWTH) for x in (self.keys, self.values)
            )
            self.base, self.used = self.first, live
        self.keys[..., self.used : self.used + added, :] = keys
        self.values[..., self.used : self.used + added, :] = values
        self.used += added
        return self.live()

    def select_batch(self, index: torch.Tensor) -> None:
        if self.is_initialized:
            self.keys, self.values = (x.index_select(0, index.to(x.device)) for x in (self.keys, self.values))


def _mixer_layers(config) -> list:
    """The cache layers of a hybrid model, from transformers' own reading of its config: a
    shard of K/V for attention, transformers' linear-attention layer (whole states) for a mixer,
    both for a layer that has both."""
    from transformers.cache_utils import (
        DYNAMIC_LAYER_TYPE_MAPPING,
        LinearAttentionCacheLayerMixin,
        LinearAttentionLayer,
        get_layer_types_and_kwargs,
    )

    class _MixerLayer(LinearAttentionLayer):
        def select_batch(self, index: torch.Tensor) -> None:
            self.reorder_cache(index)

    class _ShardAndMixerLayer(LinearAttentionLayer, _ShardLayer):
        def __init__(self, number_of_states: int = 1, **kwargs):
            _ShardLayer.__init__(self)
            LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

        def select_batch(self, index: torch.Tensor) -> None:
            self.reorder_cache(index)
            _ShardLayer.select_batch(self, index)

    layers = []
    for kind, kwargs in zip(*get_layer_types_and_kwargs(config.get_text_config(decoder=True))):
        found = DYNAMIC_LAYER_TYPE_MAPPING.get(kind)
        linear = found is not None and issubclass(found, LinearAttentionCacheLayerMixin)
        states = {"number_of_states": kwargs.get("number_of_states", 1)}
        if linear and issubclass(found, CacheLayerMixin):
            layers.append(_ShardAndMixerLayer(**states))
        elif linear:
            layers.append(_MixerLayer(**states))
        else:
            layers.append(_ShardLayer())
    return layers


def _copied(x: torch.Tensor, start: int, stop: int, capacity: int) -> torch.Tensor:
    copy = x.new_empty(*x.shape[:-2], capacity, x.shape[-1])
    copy[..., : stop - start, :] = x[..., start:stop, :]
    return copy


class ShardedKVCache(Cache):
    """This SP rank's shard of every layer's K/V, for transformers' generate.

    Every slot has a sequence index (`positions`, increasing: the layouts keep a rank's tokens
    in order and new tokens come last). The first `padded_slots` slots have, per batch row, a
    validity bit (`valid`; False: the prompt's left padding); every later slot is valid in every
    row. `length` is the length of the whole sequence so far, what transformers sees as the
    cache length.
    """

    def __init__(self, group, sp_rank: int, sp_size: int, config=None):
        """config: a hybrid model's, whose mixer layers get their states' caches up front (None:
        every layer attention, its shard made at its first update)."""
        if config is None:
            super().__init__(layer_class_to_replicate=_ShardLayer)
        else:
            super().__init__(layers=_mixer_layers(config))
        self.group, self.rank, self.size = group, sp_rank, sp_size
        self.length = 0
        self.positions: list[int] = []  # each slot's sequence index, on the host
        self.padded_slots = 0  # the slots up to the last one that is padding in some row
        self.valid: torch.Tensor | None = None  # (B, padded_slots) bool
        self.prefilled = False  # False: update stores the prefill's shard; True: update appends a step's tokens
        self._prefill = None  # (slots the prefill passes, the positions among them that are kept or None, length)
        self._step_kept = None  # positions among the step's new tokens that this rank keeps
        self._pending = None  # the layer updated last, whose attention comes next
        self._kept: dict = {}  # (kept positions among a step's tokens, device) -> their index tensor
        self._checked_at = -1  # the length at the last cross-rank query check
        self._diverged = None  # that check's verdict (a bool tensor), read one step later

    # ------------------------------------------------------------ filling
    def start_prefill(self, index: torch.Tensor, valid: torch.Tensor, length: int) -> None:
        """index (slots,): the sequence index of each token this rank prefills, -1 for the
        padding that made the prompt split; valid (B, slots); length: the prompt tokens the
        prefill holds. The padding is not kept: every later step would attend it through a
        mask, and a masked kernel is the slower one."""
        real = index >= 0
        self._prefill = (index.shape[0], None if bool(real.all()) else torch.nonzero(real).flatten(), length)
        valid = valid[:, real]
        padded = torch.nonzero(~valid.all(0)).flatten().tolist()  # host syncs once per prompt, as tolist()
        self.positions, self.padded_slots = index[real].tolist(), (padded[-1] + 1 if padded else 0)
        self.valid = valid[:, : self.padded_slots]

    def finish_prefill(self, batch: int, device) -> None:
        """From here on update appends decoding steps' tokens; the cache holds the prefill's."""
        if self.valid is None:  # a one-token prompt: nothing was prefilled
            self.valid = torch.empty(batch, 0, dtype=torch.bool, device=device)
        else:
            self.length = self._prefill[2]
        self.prefilled, self._prefill = True, None

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        while len(self.layers) <= layer_idx:
            self.layers.append(_ShardLayer())
        layer = self.layers[layer_idx]
        if not self.prefilled:
            slots, kept, length = self._prefill
            if key_states.shape[-2] != slots:
                raise RuntimeError(f"prefill: layer {layer_idx} has {key_states.shape[-2]} tokens, expected {slots}")
            layer.updated_at = length
            layer.store(*(x if kept is None else x[..., kept, :] for x in (key_states, value_states)))
            return key_states, value_states  # the prefill's attention runs on the shard as it came
        if key_states.shape[0] != self.valid.shape[0]:
            self._expand_batch(key_states.shape[0])
        if layer.updated_at == self.length:  # the first layer of this step: admit its tokens
            self._admit(key_states.shape[-2], key_states.device)
        layer.updated_at = self.length
        if layer.window is not None:  # slots no query from this step on can reach
            layer.first = max(layer.first, self._first_in_window(layer.window))
        self._pending = layer_idx
        return layer.append(key_states[..., self._step_kept, :], value_states[..., self._step_kept, :])

    def _expand_batch(self, batch: int) -> None:
        """model.generate repeats each prompt (num_beams, num_return_sequences) before the
        first step but leaves a cache it was given as it is: repeat the cache alike."""
        repeats, rest = divmod(batch, self.valid.shape[0])
        if rest or any(
            getattr(layer, "keys", None) is not None and layer.keys.shape[0] != self.valid.shape[0]
            for layer in self.layers
        ):
            raise RuntimeError(f"decoding a batch of {batch} rows with a cache of {self.valid.shape[0]} rows")
        self.batch_repeat_interleave(repeats)

    def _admit(self, new: int, device) -> None:
        if new != 1:  # model.generate feeds one token per step once the cache holds the prompt
            raise ValueError(
                f"generate: a decoding step of {new} tokens; the sharded cache decodes one token per step, as "
                "model.generate does"
            )
        kept = (0,) if self.length % self.size == self.rank else ()
        if (kept, device) not in self._kept:  # two patterns, kept or not: no host-to-device copy per step
            self._kept[kept, device] = torch.tensor(kept, dtype=torch.long, device=device)
        self._step_kept = self._kept[kept, device]
        if kept:
            self.positions.append(self.length)
        self.length += 1

    # -------------------------------------------------------- attention
    def _first_in_window(self, window: int) -> int:
        """The oldest slot the step's query reaches through a sliding window (masking.py's rule:
        query - position < window); the slots before it are out of reach for every later query."""
        return bisect.bisect_left(self.positions, self.length - window)

    def _local_attention(self, q, k, v, scale: float, first: int, window, softcap):
        """This rank's partial (out, lse) of the step's query over its live slots k, v (the
        cache's slots from `first` on): the slots out of the window skipped, the prompt's padded
        slots under their mask, the rest unmasked, the two parts merged (the module docstring)."""
        total = first + k.shape[-2]
        start = first if window is None else max(first, self._first_in_window(window))
        split = min(max(start, self.padded_slots), total)
        parts = []
        if split > start:
            mask = self.valid[:, None, None, start:split]  # a view: (B, 1, 1, slots)
            keys, values = (x[..., start - first : split - first, :] for x in (k, v))
            parts.append(attention_forward(q, keys, values, False, scale, mask=mask, softcap=softcap))
        if total > split:
            keys, values = (x if split == first else x[..., split - first :, :] for x in (k, v))
            parts.append(attention_forward(q, keys, values, False, scale, softcap=softcap))
        acc = accumulation_dtype(q.dtype)
        if not parts:  # nothing here yet (a one-token prompt on P ranks), or all out of the window
            return q.new_zeros(*q.shape[:-1], v.shape[-1], dtype=acc), q.new_full(q.shape[:-1], -math.inf, dtype=acc)
        out, lse = parts[0][0].to(acc), parts[0][1].to(acc)
        if len(parts) == 2:
            merge_block(out, lse, *parts[1])  # the padded part may have rows without a key: lse -inf
        return out, lse

    def attend(self, q, k, v, scale: float, layer_idx: int, window=None, softcap=None, sinks=None) -> torch.Tensor:
        """Exact attention of the step's query q (B, Hq, 1, D), the same on every rank, over
        the K/V of every rank (k, v: this rank's live slots of layer `layer_idx`, as update
        returned them): local partial, one all-gather, log-sum-exp merge."""
        if self._pending != layer_idx:
            # Every rank runs the same forwards, so every rank raises here (no peer left waiting).
            raise ValueError(
                "generate: a forward with another cache ran while decoding (guidance_scale or negative_prompt_ids, or "
                "Phi-3's cache reset when the length crosses original_max_position_embeddings); not supported"
            )
        self._pending = None
        layer = self.layers[layer_idx]
        if window is not None and window < self.length:
            layer.window = window  # from the next step on, update drops what falls out of it
        out, lse = self._local_attention(q, k, v, scale, layer.first, window, softcap)
        acc = out.dtype
        if self.group is not None:
            # With the step's first partial (out, lse) goes a checksum of the queries: ranks
            # whose tokens diverged would otherwise keep decoding different sequences until one
            # stops at EOS and its peers wait forever. The verdict stays on the device and is
            # read at the next step's check: one host sync per token, none per layer.
            check = self._checked_at != self.length
            columns = [out, lse.unsqueeze(-1)] + ([q.to(acc).sum(-1, keepdim=True)] if check else [])
            pieces = collectives.all_gather(torch.cat(columns, dim=-1), self.group)
            if check:
                self.raise_if_diverged()
                self._diverged, self._checked_at = _queries_differ([piece[..., -1] for piece in pieces]), self.length
            d = out.shape[-1]  # the gathered buffers are ours: merge into the first one in place
            out, lse = pieces[0][..., :d], pieces[0][..., d]
            for piece in pieces[1:]:  # rank order on every rank: bitwise equal results
                merge_block(out, lse, piece[..., :d], piece[..., d])
        out, _ = fold_sinks(out, lse, sinks)
        return out.to(q.dtype)

    @property
    def updated_layer(self) -> int | None:
        """The layer whose K/V the last update stored (its attention comes next)."""
        return self._pending

    # ------------------------------------------ what transformers asks
    def raise_if_diverged(self) -> None:
        differ = [] if self._diverged is None else self._diverged.tolist()  # the step's one host sync
        if any(differ):
            raise RuntimeError(
                f"generate: rank {differ.index(True) + 1} of the sequence-parallel group decodes other tokens than "
                "rank 0 (different inputs, weights or generate options on the ranks)"
            )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.length

    def get_max_length(self, layer_idx=None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a sharded KV cache cannot be rolled back (assisted decoding)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for layer in self.layers:
            layer.select_batch(indices)
        self.valid = self.valid.index_select(0, indices.to(self.valid.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.batch_select_indices(torch.arange(self.valid.shape[0]).repeat_interleave(repeats))


def _queries_differ(checksums: list) -> torch.Tensor:
    """(P - 1,) bool: whether rank r's query checksums differ from rank 0's (every rank sees
    every checksum, so every rank decides alike)."""
    reference = checksums[0]
    others = torch.stack(checksums[1:]).flatten(1)
    return ((others - reference.flatten()).abs() > 1e-4 + 1e-4 * reference.flatten().abs()).any(1)


def kv_bytes(cache) -> int:
    """Bytes of K/V a transformers cache holds on this rank (a ShardedKVCache: its shard, spare
    capacity included; a DynamicCache: everything)."""
    layers = getattr(cache, "layers", ())
    tensors = [x for layer in layers for x in (getattr(layer, "keys", None), getattr(layer, "values", None))]
    tensors = [x for x in tensors if x is not None]
    return sum(x.untyped_storage().nbytes() for x in tensors)
