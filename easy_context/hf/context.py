"""One sequence-parallel context: the mode, its options, topology and groups, resolved once.

    sp = easy_context.setup("zigzag_ring_attn", model)      # resolves and installs the patch
    local = sp.shard(input_ids, position_ids, target_ids)    # this rank's share of a batch
    logits = sp.gather(model(...).logits)                    # whole rows again
    loader = sp.dataloader(loader, accelerator)              # one data stream per SP group
    trainer = sp.trainer(trainer)                            # HF Trainer / TRL, in one line
    output = sp.generate(model, input_ids, max_new_tokens=8)  # KV cache sharded over the group

The patch's dispatchers read the one installed context (`active()`); the EasyContext
functions (hf/api.py) find the context of a call with `context_for` and delegate to it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings

import torch

from easy_context.core import collectives
from easy_context.core.data_groups import DataParallelShard, seed_shuffling
from easy_context.core.global_mask import check_padding
from easy_context.core.groups import SeqParallelGroups, Topology, get_groups
from easy_context.core.layout import RowLayout, check_document_split_value
from easy_context.hf import architectures, mask_check, patch, replicas
from easy_context.hf.generation import generate_in
from easy_context.hf.heads import check_layer_heads, model_heads, placement_of
from easy_context.hf.model_types import MASKS_NOT_PROBED
from easy_context.hf.trainer import prepare
from easy_context.mixers import STRATEGIES
from easy_context.modes import SeqParallelMode, get_mode, modes_with

__all__ = [
    "OPTIONS",
    "SequenceParallel",
    "setup",
    "teardown",
    "active",
    "context_for",
    "DataParallelShard",
    "placement_of",
]

OPTIONS = ("sp_size", "ring_degree", "document_split", "mixer_strategy")
SHARD_KEYS = ("local_input_ids", "local_position_ids", "local_target_ids", "local_attention_mask")


def check_option_names(where: str, options: dict) -> None:
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise TypeError(f"{where}: unknown option(s) {sorted(unknown)}; supported: {list(OPTIONS)}")


class SequenceParallel:
    """A mode with its options (sp_size, ring_degree, document_split, mixer_strategy; None: the default) and the
    model types it patches. The topology follows the world size of the call (the world may be
    initialised after the patch is applied), the launcher's ranks per node and the model's heads
    (`heads`: (query heads, key/value heads), None where unknown), which a mode's default split
    may follow; groups are created once per topology."""

    def __init__(
        self,
        mode,
        model_types=frozenset(),
        sp_size=None,
        ring_degree=None,
        document_split=None,
        mixer_strategy=None,
        *,
        heads=(None, None),
    ):
        self.mode: SeqParallelMode = mode if isinstance(mode, SeqParallelMode) else get_mode(mode)
        self.model_types = frozenset(model_types)
        check_document_split_value(document_split)
        self.sp_size, self.ring_degree, self.document_split = sp_size, ring_degree, document_split
        # hybrid layers' strategy (mixers/): None or "auto", "state_passing", "head_exchange"
        if mixer_strategy not in (None, "auto", *STRATEGIES):
            raise ValueError(f"mixer_strategy={mixer_strategy!r} is not one of {['auto', *STRATEGIES]}")
        self.mixer_strategy = mixer_strategy
        self.heads = tuple(heads)
        self.decoding = None  # generation's ShardedKVCache while it decodes: attention goes to the cache
        # while generation prefills S - 1 prompt tokens: the prompt's last position (a tensor),
        # the length the one-process prefill's RoPE sees (hf/rope.py), and the index of the last
        # prefilled token, after which hybrid layers keep their states in the cache (hf/mixers.py)
        self.prefill_last_position = None
        self.prefill_end = None

    # ------------------------------------------------------------ what it is
    @property
    def options(self) -> dict:
        return {name: getattr(self, name) for name in OPTIONS}

    @property
    def sequence_parallel(self) -> bool:
        return self.mode.attention is not None

    def same_setup(self, other: SequenceParallel | None) -> bool:
        return other is not None and (self.mode, *self.options.values()) == (other.mode, *other.options.values())

    def topology(self, world_size: int | None = None) -> Topology:
        world = collectives.world_size() if world_size is None else world_size
        return self.mode.topology(world, self.sp_size, self.ring_degree, placement_of(self.heads, world))

    def groups(self) -> SeqParallelGroups:
        """This rank's process groups; created at the first call, then cached."""
        return get_groups(self.topology())

    def layout(self, world_size: int | None = None):
        return self.mode.layout(self.topology(world_size))

    def installed_for(self, model_or_type) -> SequenceParallel:
        """setup() of this mode with these options for another model (or type, or config): the
        installed context that also patches its type."""
        return setup(self.mode, model_or_type, **self.options)

    def with_options(self, where: str, options: dict) -> SequenceParallel:
        """This context with a call's options, which default to (and may not contradict) its own."""
        check_option_names(where, options)
        merged = {}
        for name in OPTIONS:
            given, mine = options.get(name), getattr(self, name)
            if given is not None and mine is not None and given != mine:
                raise ValueError(
                    f"{where}: {name}={given} differs from {name}={mine} given to apply_seq_parallel_monkey_patch"
                )
            merged[name] = given if given is not None else mine
        if merged == self.options:
            return self
        return SequenceParallel(self.mode, self.model_types, **merged, heads=self.heads)

    def check_document_split(self) -> None:
        if not self.mode.document_split:
            raise ValueError(
                f"document_split={self.document_split!r} works with {list(modes_with('document_split'))}, "
                f"not {self.mode.name!r} "
                "(ulysses_attn is balanced already: every rank attends the whole sequence for its heads)"
            )

    # ------------------------------------------------------------ batches
    def shard(
        self,
        input_ids,
        position_ids=None,
        target_ids=None,
        attention_mask=None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        device=None,
    ) -> dict:
        """This rank's share of a batch of full sequences (prepare_seq_parallel_inputs documents
        the arguments and the result); rank and world_size default to torch.distributed's."""
        rank = collectives.rank() if rank is None else rank
        world_size = collectives.world_size() if world_size is None else world_size
        topology = self.topology(world_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        device = input_ids.device if device is None else device

        def to_device(x):
            return None if x is None else x.to(device)

        if not self.sequence_parallel:
            return dict(zip(SHARD_KEYS, map(to_device, (input_ids, position_ids, target_ids, attention_mask))))
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must have shape (batch, seq_len), got {tuple(input_ids.shape)}")
        batch, seq_len = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=input_ids.device)
        position_ids = _as_batch("position_ids", position_ids, batch, seq_len)
        target_ids = _as_batch("target_ids", target_ids, batch, seq_len)
        attention_mask = _as_batch("attention_mask", attention_mask, batch, seq_len)
        if attention_mask is not None:
            check_padding(attention_mask.cpu())
        layout, sp_rank = self.mode.layout(topology), topology.sp_rank(rank)
        rows = (input_ids, position_ids, target_ids, attention_mask)
        if self.document_split:
            self.check_document_split()
            index = _split_index(self.mode, topology, position_ids, attention_mask, sp_rank, self.document_split)
            result = {name: None if x is None else to_device(x.gather(1, index)) for name, x in zip(SHARD_KEYS, rows)}
            result["local_token_index"] = to_device(index)
            return result
        return {
            name: None if x is None else to_device(layout.shard(x, sp_rank, dim=1)) for name, x in zip(SHARD_KEYS, rows)
        }

    def gather(self, local: torch.Tensor, dim: int = 1, token_index=None) -> torch.Tensor:
        """All-gather the SP group's local tensors back into sequence order (not differentiable)."""
        topology = self.topology()
        if self.document_split and token_index is None:
            raise ValueError(
                f"document_split={self.document_split!r}: pass token_index=local['local_token_index'] "
                "to gather_seq_parallel_outputs"
            )
        group = get_groups(topology).sp
        if group is None:
            return local
        pieces = collectives.all_gather(local, group)
        if token_index is None:
            return self.mode.layout(topology).unshard(pieces, dim=dim)
        if dim != 1:
            raise ValueError(f"token_index orders dim 1 (the sequence), got dim={dim}")
        index = torch.cat(collectives.all_gather(token_index.to(local.device), group), dim=1)
        index = index.reshape(*index.shape, *([1] * (local.dim() - 2))).expand(*index.shape, *local.shape[2:])
        whole = torch.cat(pieces, dim=1)
        return torch.empty_like(whole).scatter_(1, index, whole)

    def check_same(self, tensors, error) -> None:
        """Every rank of the SP group must hold the same `tensors`; else ValueError(error(shapes))
        on every rank (shapes: the first tensor's (rows, columns) by SP rank)."""
        collectives.check_same(self.groups().sp, tensors, error)

    def dataloader(self, dataloader, accelerator):
        """data_parallel: the accelerator shards batches over all ranks. Sequence-parallel modes:
        batches are split over the data-parallel groups only (every rank of an SP group reads the
        same full sequences and keeps its share through shard), by core/data_groups.py's rule; a
        shuffling sampler without a generator gets one seeded alike on every rank (the
        accelerator's data_seed, else the process's initial seed)."""
        if not self.sequence_parallel:
            return accelerator.prepare(dataloader)
        seed_shuffling(dataloader, getattr(getattr(accelerator, "dataloader_config", None), "data_seed", None))
        world = getattr(accelerator, "num_processes", collectives.world_size())
        topology = self.topology(world)
        if topology.dp_size == 1:
            return dataloader
        return DataParallelShard(
            dataloader, topology.dp_rank(getattr(accelerator, "process_index", 0)), topology.dp_size
        )

    # ------------------------------------------------------------ what runs on it
    def trainer(self, trainer, balance_work=False):
        """The HF Trainer (or TRL SFTTrainer) trains in this context; returns the same trainer.
        balance_work: True, or one number per train row: the data-parallel groups of a step get
        rows of equal attention work (core/work_order.py; True reads it from the dataset)."""
        return prepare(self, trainer, balance_work)

    def generate(self, model, input_ids, attention_mask=None, **generate_kwargs):
        """model.generate with the prompt's KV cache sharded over the SP group."""
        return generate_in(self, model, input_ids, attention_mask, **generate_kwargs)

    @contextlib.contextmanager
    def decoding_with(self, cache):
        """While generation decodes: a layer's attention is one step's queries against `cache`."""
        previous, self.decoding = self.decoding, cache
        try:
            yield cache
        finally:
            self.decoding = previous

    @contextlib.contextmanager
    def prefilling(self, last_position: torch.Tensor, end: int):
        """While generation prefills part of a prompt whose largest position is `last_position`
        and whose last prefilled token is the sequence's `end`-th (0-based)."""
        previous = self.prefill_last_position, self.prefill_end
        self.prefill_last_position, self.prefill_end = last_position, end
        try:
            yield
        finally:
            self.prefill_last_position, self.prefill_end = previous

    def summary(self, masks: str = "", world_size: int | None = None) -> str:
        """What runs, in one line: the mode, the SP and DP sizes, the ring and Ulysses degrees,
        what each rank holds of a row (the length is the batch's: S), and `masks` (the mask check's
        result). setup logs it once, on rank 0."""
        topology = self.topology(world_size)
        head = f"{self.mode.name} on {topology.world_size} rank{'s' * (topology.world_size > 1)}"
        if not self.sequence_parallel:
            return f"{head}: data parallel {topology.world_size}, no sequence parallelism (every rank holds whole rows)"
        layout = self.mode.layout(topology)
        if self.document_split:
            shard = f"shard length: set per row by its documents (document_split={self.document_split!r})"
        else:
            shard = f"shard length: S/{topology.sp_size} of each S-token row (S a multiple of {layout.multiple})"
        return (
            f"{head}: sequence parallel {topology.sp_size} x data parallel {topology.dp_size}, ring degree "
            f"{topology.ring_degree}, Ulysses degree {topology.ulysses_degree} ({layout.name}); {shard}; {masks}"
        )

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v}" for k, v in self.options.items() if v is not None)
        return (
            f"SequenceParallel({self.mode.name!r}, types={sorted(self.model_types)}{', ' if options else ''}{options})"
        )


def _as_batch(name: str, x: torch.Tensor | None, batch: int, seq_len: int) -> torch.Tensor | None:
    if x is None:
        return None
    if x.dim() == 1:
        x = x.unsqueeze(0)
    if x.dim() != 2 or x.shape[-1] != seq_len or x.shape[0] not in (1, batch):
        raise ValueError(f"{name} must have shape (batch, seq_len) = ({batch}, {seq_len}), got {tuple(x.shape)}")
    return x.expand(batch, seq_len)


def _split_index(mode, topology, position_ids, attention_mask, sp_rank, split) -> torch.Tensor:
    """document_split: this SP rank's rows, (B, S_local) global positions: per row, its ring
    rank's share of the row as `split` places the documents, cut into Ulysses pieces
    (core.layout.RowLayout)."""
    layout = RowLayout.of_documents(position_ids, attention_mask, topology.ring_degree, topology.ulysses_degree, split)
    return layout.local_indices(sp_rank).to(position_ids.device)


# ---------------------------------------------------------------- the installed context
def active() -> SequenceParallel | None:
    return patch.active()


def setup(mode: str | SeqParallelMode, model_or_type, **options) -> SequenceParallel:
    """Resolve `mode` with its options for a model (or a model type, or a config) and install
    the patch; see apply_seq_parallel_monkey_patch for the rules. Returns the context.

    Rank 0 logs what runs, once (logger "easy_context", INFO; on stderr unless logging is
    configured): the mode, the SP and DP sizes, the ring and Ulysses degrees, the shard length
    (S/P of each S-token row, the row length being the batch's) and the mask check's result.
    prepare_trainer and apply_seq_parallel_monkey_patch come through here."""
    mode = mode if isinstance(mode, SeqParallelMode) else get_mode(mode)
    check_option_names("apply_seq_parallel_monkey_patch", options)
    model_types = architectures.model_types_of(model_or_type)
    for model_type in model_types:
        architectures.check_model_type(model_type)
    context = SequenceParallel(mode, model_types, **options, heads=model_heads(model_or_type))
    topology = context.topology()  # impossible combinations fail now
    check_layer_heads(model_or_type, topology.ulysses_degree)
    replicas.watch(model_or_type)  # a model (a PeftModel too): the guard finds its trainable weights
    if context.document_split:
        context.check_document_split()
    if not context.sequence_parallel:  # data_parallel: models keep their own attention
        teardown()
        _announce(context, "")
        return context
    current = active()
    if isinstance(model_or_type, str):
        masks = "masks: not checked (a model type names no config; setup with the model or its config checks them)"
    elif current and set(model_types) <= current.model_types:
        masks = "masks: checked when this model type was set up before"
    else:
        masks = _check_masks_at_setup(model_or_type)
    if context.same_setup(current):
        context.model_types |= current.model_types
    patch.install(context)
    if collectives.world_size() > 1:
        context.groups()  # collective: every rank calls setup, so create the groups now
    _announce(context, masks)
    return context


_masks_checked: dict = {}  # config -> the check's result, as the setup line says it


def _check_masks_at_setup(model_or_config) -> str:
    """The model's own masks against the patch's, before the patch replaces them (mask_check.py);
    the result, as the setup line says it. A disagreement stops here; a skeleton that cannot run
    is told, not fatal: every call is still checked by admission.py."""
    config = architectures.text_config_of(model_or_config)
    key = (type(config), config.to_json_string(use_diff=False))
    if key in _masks_checked:  # tests and sweeps set up the same config over and over
        return _masks_checked[key]
    if config.model_type in MASKS_NOT_PROBED:
        mask_check.check_masks(model_or_config)  # warns why
        return f"masks: not probed ({MASKS_NOT_PROBED[config.model_type]}); checked at each call"
    try:
        layers = mask_check.check_masks(model_or_config)
    except mask_check.MaskDisagreement:
        raise
    except Exception as error:  # noqa: BLE001 - any failure of the probe itself
        warnings.warn(f"check_masks could not probe this model's masks ({type(error).__name__}: {error})", stacklevel=3)
        return f"masks: not probed (the probe failed: {type(error).__name__}); checked at each call"
    kinds = f"{len(layers)} kind{'s' * (len(layers) != 1)} of layer mask"
    _masks_checked[key] = f"masks: checked, the patch's agree with the model's ({kinds})"
    return _masks_checked[key]


# The setup line goes through logging, under "easy_context" at INFO: a script that configured
# logging gets it in its log (its handlers); one that did not, on stderr. It is said once per
# process, by rank 0. logging.getLogger("easy_context").setLevel(logging.WARNING) silences it.
logger = logging.getLogger("easy_context")
_announced: set = set()


def _announce(context: SequenceParallel, masks: str) -> None:
    """The setup line of `context`, unless this process said it already (a setup again, or
    prepare_trainer after setup: the masks are those the first one checked)."""
    said = (context.mode, *context.options.values(), context.topology())
    if collectives.rank() != 0 or said in _announced:
        return
    _announced.add(said)
    line = context.summary(masks)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not logger.hasHandlers():  # else logging's last resort would show warnings only
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        logger.addHandler(handler)
    logger.info(line)


def teardown() -> None:
    """Restore transformers' own attention and mask functions."""
    patch.uninstall()


def context_for(where: str, mode: str, options: dict) -> SequenceParallel:
    """The context of a call naming `mode` with `options`: the installed one when it runs that
    mode (the call's options default to its own and may not contradict them), else a context
    of its own, not installed."""
    resolved = get_mode(mode)
    current = active()
    if current is not None and current.mode is resolved:
        return current.with_options(where, options)
    check_option_names(where, options)
    return SequenceParallel(resolved, **options)
