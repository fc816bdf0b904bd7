"""Hybrid models' sequence mixers under the patch: transformers' mixer seams, sequence parallel.

transformers 5.25's hybrid layers call their convolution and scan through module-level
functions it keeps replaceable (the seams its `kernelize` swaps): `causal_conv1d_forward`
(every convolution), `mamba2_scan_forward` (Mamba-2's SSD; `mamba2_split_conv1d_scan_combined`
is its fused training path, used only where mamba_ssm is installed) and
`torch_chunk_gated_delta_rule` (Gated DeltaNet). While the patch is installed, for the model
types it runs, those module globals are replaced by functions that, on a sharded forward, run
mixers/families.py over this rank's runs, and otherwise call transformers' own. The fused path
answers None under sequence parallelism, so the layer takes the seams.

Packed rows (position_ids restarting at each document) restart every mixer's state at each
document: the forward's position_ids are read where the model builds its recurrent layers' mask
(`create_recurrent_attention_mask`, another module global), gathered over the SP group once per
forward, and handed to mixers/ as the documents' starts.

Generation (easy_context.generate): the sharded prefill keeps, in transformers' own layer
caches, the states after the prompt's last prefilled token (computed by the rank that holds it,
by state passing, and broadcast); decoding steps run the layers as one process does, on every
rank (hf/sharded_cache.py says why). Which hybrids this covers is what `unsupported_mixers` says
(the sweep runs the rest to prove them); document_split is refused for them.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from easy_context.core.collectives import all_gather
from easy_context.core.global_mask import check_positions
from easy_context.core.masking import document_starts
from easy_context.hf.forward_positions import or_latest
from easy_context.hf.modeling import modeling_module
from easy_context.mixers import Sharding, choose_strategy, families
from easy_context.mixers.costs import MixerShape

__all__ = [
    "SEAMS",
    "covers",
    "forward_positions",
    "has_scans",
    "install",
    "mixer_layers",
    "mixer_shapes",
    "uninstall",
    "unsupported_mixers",
]

# seam name -> the function that replaces it (built from the module's own)
SEAMS = (
    "causal_conv1d_forward",
    "mamba2_scan_forward",
    "mamba2_split_conv1d_scan_combined",
    "torch_chunk_gated_delta_rule",
)
# seams of mixers no strategy here implements: a module that has one is refused
UNSUPPORTED_SEAMS = {
    "mamba_scan_forward": "Mamba (selective scan, Mamba-1)",
    "mamba_selective_scan": "Mamba (selective scan, Mamba-1)",
    "chunk_kimi_delta_attention": "Kimi Delta Attention",
}

# where a forward's position_ids are seen: the mask builder of the recurrent layers
POSITIONS_SEAM = "create_recurrent_attention_mask"

_saved: dict[tuple, object] = {}  # (module, name) -> transformers' function
_active = None  # callable returning the installed SequenceParallel
_positions: tuple = (None, None)  # (modeling module, local position_ids) of the latest sharded forward
_gathered: tuple = (None, -1, None)  # (weakref to those position_ids, their version, the starts)


def unsupported_mixers(module) -> list[str]:
    """The mixers of a modeling module that no seam here covers."""
    return sorted(what for name, what in UNSUPPORTED_SEAMS.items() if hasattr(module, name))


def covers(module) -> bool:
    """Whether the mixers of a modeling module run sequence parallel here: it calls them through
    the seams, and has none that no strategy implements."""
    return module is not None and any(hasattr(module, name) for name in SEAMS) and not unsupported_mixers(module)


def has_scans(module) -> bool:
    """Whether a modeling module has recurrent scans (which the two strategies run differently);
    a convolution alone runs the same under both."""
    return any(hasattr(module, name) for name in ("mamba2_scan_forward", "torch_chunk_gated_delta_rule"))


def install(model_types, active) -> None:
    global _active
    _active = active
    for model_type in model_types:
        module = modeling_module(model_type)
        if not covers(module):
            continue
        for name in (*SEAMS, POSITIONS_SEAM):
            if hasattr(module, name) and (module, name) not in _saved:
                _saved[(module, name)] = getattr(module, name)
                setattr(module, name, _REPLACEMENTS[name](module, getattr(module, name)))


def uninstall() -> None:
    global _positions, _gathered
    for (module, name), original in _saved.items():
        setattr(module, name, original)
    _saved.clear()
    _positions, _gathered = (None, None), (None, -1, None)


def _sharding():
    """This forward's Sharding and the installed context, or (None, None) where the forward is
    not sharded (no patch, data_parallel, one rank)."""
    context = _active() if _active is not None else None
    if context is None or not context.sequence_parallel:
        return None, None
    groups = context.groups()
    if groups.sp is None:
        return None, None
    if context.decoding is not None:  # every rank runs the step's tokens whole, with the whole states
        return None, None
    if context.document_split:
        raise ValueError("document_split is not implemented for hybrid layers; apply the patch without it")
    return groups, context


def _sharded(module, groups, context, batch: int, local_len: int) -> Sharding:
    layout = context.layout()
    starts = _document_starts(module, groups.sp, layout, local_len)
    starts = None if starts is None else starts.expand(batch, -1)
    return Sharding(groups.sp, groups.sp_rank, layout, local_len * layout.size, starts)


def _document_starts(module, group, layout, local_len: int):
    """(rows, S) bool: where documents start in this forward's rows, from every rank's position_ids
    (one all-gather of small integers per forward, the first mixer's); None for one document per
    row, or where the model passed no position_ids (the default positions)."""
    global _gathered
    recorded_by, positions = _positions
    if recorded_by is not module or positions is None or positions.shape[-1] != local_len:
        return None
    ref, version, starts = _gathered
    if ref is not None and ref() is positions and version == positions._version:
        return starts
    local = positions.reshape(-1, local_len).long()
    pieces = all_gather(local, group)
    # the model's default positions (arange on every shard) would read as a document per shard
    check_positions([piece[None] for piece in pieces], layout.size, dist.get_rank(group), layout)
    whole = layout.unshard(pieces, dim=1).cpu()  # on the host: the runs are cut there
    starts = document_starts(whole)
    starts = starts if bool(starts[:, 1:].any()) else None
    _gathered = (weakref.ref(positions), positions._version, starts)
    return starts


def forward_positions(module):
    """The local position_ids the latest sharded forward of a model of modeling `module` showed
    its recurrent layers' mask (None: none, or another model's)."""
    recorded_by, positions = _positions
    return positions if recorded_by is module else None


def _recurrent_mask(module, original):
    def create_recurrent_attention_mask(*args, **kwargs):
        global _positions
        context = _active() if _active is not None else None
        if context is not None and context.sequence_parallel:
            # a model that builds this mask without them: its forward's (forward_positions.py)
            _positions = (module, or_latest(kwargs.get("position_ids"), module.__name__))
        return original(*args, **kwargs)

    return create_recurrent_attention_mask


def _conv_forward(module, original):
    def causal_conv1d_forward(conv1d, hidden_states, cache, layer_idx, activation=None, state_idx=0, **kwargs):
        groups, context = _sharding()
        if groups is None:
            return original(conv1d, hidden_states, cache, layer_idx, activation, state_idx, **kwargs)
        keep = _kept(cache, context)
        sharding = _sharded(module, groups, context, hidden_states.shape[0], hidden_states.shape[-1])
        weight = conv1d.weight.squeeze(1)
        conv = module.causal_conv1d_fn
        result = families.causal_conv(
            conv, hidden_states, weight, sharding, keep, bias=conv1d.bias, activation=activation
        )
        if keep is None:
            return result
        out, state = result
        cache.update_conv_state(state, layer_idx, state_idx=state_idx, conv_kernel_size=conv1d.kernel_size[0])
        return out

    return causal_conv1d_forward


def _mamba2_scan_forward(module, original):
    def mamba2_scan_forward(mixer, hidden_states, B, C, dt, cache, **kwargs):
        groups, context = _sharding()
        if groups is None:
            return original(mixer, hidden_states, B, C, dt, cache, **kwargs)
        keep = _kept(cache, context)
        batch, local_len, _ = hidden_states.shape
        sharding = _sharded(module, groups, context, batch, local_len)
        strategy = _strategy(context, mixer.num_heads, mixer.n_groups, sharding.size)
        result = families.mamba2_scan(
            module.mamba2_chunk_scan,
            hidden_states.view(batch, local_len, mixer.num_heads, mixer.head_dim),
            dt,
            -torch.exp(mixer.A_log.float()),
            B.view(batch, local_len, mixer.n_groups, mixer.ssm_state_size),
            C.view(batch, local_len, mixer.n_groups, mixer.ssm_state_size),
            sharding,
            strategy,
            chunk_size=mixer.chunk_size,
            D=mixer.D,
            dt_bias=mixer.dt_bias,
            dt_limit=mixer.time_step_limit,
            keep=keep,
        )
        if keep is None:
            return result.reshape(batch, local_len, -1)
        y, state = result
        cache.update_recurrent_state(state, mixer.layer_idx)
        return y.reshape(batch, local_len, -1)

    return mamba2_scan_forward


def _fused_mamba2(module, original):
    def mamba2_split_conv1d_scan_combined(*args, **kwargs):
        groups, _ = _sharding()
        # None: the layer takes its unfused path, through the seams above
        return original(*args, **kwargs) if groups is None else None

    return mamba2_split_conv1d_scan_combined


def _gated_delta_rule(module, original):
    def torch_chunk_gated_delta_rule(query, key, value, g, beta, *args, initial_state=None, **kwargs):
        groups, context = _sharding()
        if groups is None:
            return original(query, key, value, g, beta, *args, initial_state=initial_state, **kwargs)
        if initial_state is not None:  # a sharded forward continuing a cache's state
            raise ValueError(
                "a sharded forward of a gated delta rule layer cannot continue from a cached state; generate with "
                "easy_context.generate"
            )
        if args:
            raise TypeError(f"torch_chunk_gated_delta_rule: unexpected positional arguments {len(args)}")
        options = {k: kwargs[k] for k in ("chunk_size", "use_qk_l2norm_in_kernel") if k in kwargs}
        sharding = _sharded(module, groups, context, query.shape[0], query.shape[1])
        # the layer asks for the final state when it has a cache (the prefill's), and stores it itself
        keep = context.prefill_end if kwargs.get("output_final_state") else None
        # heads: the value heads; "groups": the query/key heads each serves several of
        strategy = _strategy(context, value.shape[2], key.shape[2], sharding.size)
        return families.gated_delta_rule(original, query, key, value, g, beta, sharding, strategy, keep, **options)

    return torch_chunk_gated_delta_rule


def _kept(cache, context) -> int | None:
    """The position after which a sharded forward keeps the states in `cache`: generation's
    prefill (easy_context.generate) keeps them after its last token; another cache is refused."""
    if cache is None:
        return None
    if context.prefill_end is None:
        raise ValueError(
            "a cache in a sharded forward of a hybrid layer is for easy_context.generate's prefill; call the model "
            "with use_cache=False, or generate with easy_context.generate"
        )
    return context.prefill_end


def _strategy(context, heads: int, groups: int, size: int) -> str:
    # generation's prefill keeps a state that one rank's run ends in: state passing has it there
    if context.prefill_end is not None:
        return "state_passing"
    return choose_strategy(context.mixer_strategy, heads, groups, size)


_REPLACEMENTS = {
    "causal_conv1d_forward": _conv_forward,
    "mamba2_scan_forward": _mamba2_scan_forward,
    "mamba2_split_conv1d_scan_combined": _fused_mamba2,
    "torch_chunk_gated_delta_rule": _gated_delta_rule,
    POSITIONS_SEAM: _recurrent_mask,
}


def mixer_layers(model) -> list[tuple[torch.nn.Module, torch.nn.Conv1d]]:
    """The recurrent and convolution mixer layers of a model, each with its depthwise causal
    convolution (every family here has one: Mamba-2's conv1d, Gated DeltaNet's conv1d, the short
    convolution's conv)."""
    found = []
    for layer in model.modules():
        conv = getattr(layer, "conv1d", None) or getattr(layer, "conv", None)
        if isinstance(conv, torch.nn.Conv1d) and conv.groups == conv.in_channels:
            found.append((layer, conv))
    return found


def mixer_shapes(model, batch: int, seq_len: int, sp_size: int, max_runs: int) -> list[MixerShape]:
    """The MixerShape of each mixer layer of a model (mixers/costs.py declares their traffic),
    read from the layers' own attributes: a Mamba-2 mixer, a gated delta rule layer, a short
    convolution."""
    shapes = []
    dtype_bytes = next(model.parameters()).element_size()
    common = dict(batch=batch, seq_len=seq_len, sp_size=sp_size, max_runs=max_runs, dtype_bytes=dtype_bytes)
    for layer, conv in mixer_layers(model):
        convolution = dict(conv_channels=conv.in_channels, conv_width=conv.kernel_size[0] - 1)
        if hasattr(layer, "ssm_state_size"):
            scan = dict(scan="mamba2", heads=layer.num_heads, head_dim=layer.head_dim, state_dim=layer.ssm_state_size)
            shapes.append(MixerShape(**common, **convolution, **scan, groups=layer.n_groups))
        elif hasattr(layer, "head_k_dim"):
            scan = dict(scan="gated_delta_rule", heads=layer.num_v_heads, head_dim=layer.head_v_dim)
            shapes.append(
                MixerShape(**common, **convolution, **scan, state_dim=layer.head_k_dim, groups=layer.num_k_heads)
            )
        else:
            shapes.append(MixerShape(**common, **convolution))
    return shapes
