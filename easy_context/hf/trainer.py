"""HF Trainer, TRL SFT / DPO / GRPO / RLOO trainers in one line: prepare_trainer(mode, trainer, **options)
(hf/api.py), which runs `prepare` here in the call's context. Only these classes (and subclasses
that leave their loss and inputs alone) are accepted: a trainer that computes its own loss from
its own inputs would get shards that nothing proved it handles (hf/trainer_admission.py).

The trainer keeps doing everything it does (DDP or DeepSpeed, gradient accumulation,
evaluation, checkpoints, resume); four things change, each for a reason:

  data     Every rank of an SP group must read the same batches, and the data-parallel
           groups different ones (core/data_groups.py's rule). The trainer's dataloaders are
           prepared by accelerate as for dp_size processes, with this rank's dp_rank, their
           shuffling seeded alike on every rank.
  batches  compute_loss keeps this rank's share of each batch (prepare_seq_parallel_inputs).
           The labels are shifted first: shifting a shard would pair tokens across shard
           boundaries. Rows are padded internally (masked, label -100) to a length the
           layout can split.
  loss     The Trainer counts num_items_in_batch over whole rows, on each of the sp_size
           ranks that hold them, so it is divided by sp_size: each rank's loss is then its
           share of the token-weighted mean over the SP group, and gradient averaging over
           the ranks (DDP, DeepSpeed) gives the single process's gradient. With
           average_tokens_across_devices the count covers every group, as in plain DDP.
  eval     A batch's loss is its SP group's token-weighted mean; logits are gathered back
           to whole rows when predict() or compute_metrics keeps them, and results are
           gathered once per SP group.
Every batch is also checked to be the same on every rank of the SP group (one all-gather
of four numbers): a sampler or dataset that hands ranks different rows would otherwise
stitch unrelated shards into one sequence.

DPOTrainer keeps its own loss (every loss type, ld_alpha, WPO weighting, its metrics): only
the forwards it makes through TRL's fused LM head (policy and reference, and the precompute
of reference log-probs) are sharded, in hf/preference.py. GRPOTrainer and RLOOTrainer likewise
keep their loss: their rollout runs easy_context's sharded generation with sampling identical
over the SP group, their log-prob forwards are sharded as DPO's, and their collectives count one
process per SP group (hf/rl.py).

With balance_work, the train sampler is core/work_order.py's: the data-parallel groups of a
step get rows of equal attention work (the Trainer's own hook, _get_train_sampler, as a
subclass would override it; in every mode, data_parallel included).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

from easy_context.core import collectives
from easy_context.core.data_groups import seed_shuffling
from easy_context.core.groups import get_groups
from easy_context.core.work_order import WorkBalancedSampler, document_products
from easy_context.hf import replicas
from easy_context.hf.accelerate_parallelism import check_accelerate_parallelism
from easy_context.hf.preference import DPOSeqParallelMixin, is_dpo_trainer, prepare_dpo
from easy_context.hf.rl import RLSeqParallelMixin, prepare_rl, rl_trainer_base
from easy_context.hf.trainer_admission import check_trainer
from easy_context.versions import check_supported

__all__ = ["prepare", "row_work"]

IGNORE_INDEX = -100
# Keys with one value per token that are sharded; the keys below restate the documents that
# position_ids already describe (flash-attention varlen metadata of padding-free collators).
PER_TOKEN_KEYS = ("input_ids", "labels", "shift_labels", "position_ids", "attention_mask")
RESTATED_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def prepare(context, trainer, balance_work=False):
    """easy_context.prepare_trainer in a SequenceParallel context (SequenceParallel.trainer)."""
    check_supported("accelerate")
    if isinstance(trainer, (GatherOncePerSPGroup, WorkBalancedTrainerMixin)):
        raise ValueError("prepare_trainer was already called on this trainer")
    config = getattr(trainer.model, "config", None)
    if getattr(config, "model_type", None) is None:
        raise ValueError("prepare_trainer: the trainer's model has no config.model_type")
    if context.sequence_parallel:
        check_trainer(trainer)
        check_accelerate_parallelism(trainer.accelerator, context.mode.name)
        if collectives.world_size() > 1 and trainer.accelerator.distributed_type.name == "NO":
            raise ValueError(
                f"the trainer's accelerator runs each of the {collectives.world_size()} processes on its own "
                "(DistributedType.NO: no DDP, gradients never averaged); on a machine without CUDA "
                "create the trainer with TrainingArguments(use_cpu=True)"
            )
    context = context.installed_for(config)  # the config: its text decoder's type
    replicas.watch(trainer.model)
    topology = context.topology(trainer.accelerator.num_processes)
    if balance_work is not False and balance_work is not None:
        _balance_work(trainer, balance_work, topology.dp_size)
    if not context.sequence_parallel:  # data_parallel: the Trainer already is one
        return trainer
    dpo, rl = is_dpo_trainer(type(trainer)), rl_trainer_base(type(trainer)) is not None
    mixin = DPOSeqParallelMixin if dpo else RLSeqParallelMixin if rl else SeqParallelTrainerMixin
    trainer.__class__ = _seq_parallel_class(type(trainer), mixin)
    trainer._seq_parallel = _Batches(context, topology)
    if dpo:
        prepare_dpo(trainer, trainer._seq_parallel)
    if rl:  # GRPOTrainer, RLOOTrainer
        prepare_rl(trainer, trainer._seq_parallel)
    if topology.sp_size > 1:
        _read_by_sp_group(trainer, topology)
    return trainer


class GatherOncePerSPGroup:
    """In every class prepare_trainer makes (behind the trainer's own mixin): what the
    evaluation loop and TRL gather results with. Every rank of an SP group holds the same
    losses, labels and (gathered) logits, so keep each group's once."""

    @property
    def gather_function(self):
        return self._seq_parallel.gather_once_per_sp_group

    @gather_function.setter
    def gather_function(self, value):
        pass  # the Trainer sets accelerate's gather_for_metrics again after each evaluation loop


class SeqParallelTrainerMixin:
    """Put in front of the trainer's class by prepare_trainer."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        batches: _Batches = self._seq_parallel
        local, row_length = batches.shard(inputs)
        if not model.training:  # evaluation: each rank's loss is the mean over its own tokens
            result = super().compute_loss(model, local, return_outputs, None)
            loss, outputs = result if return_outputs else (result, None)
            loss_sum, count = batches.group_sum(loss, local.get("shift_labels"))
            if num_items_in_batch is not None and self.args.average_tokens_across_devices:
                # As the Trainer weighs data-parallel batches: by their share of every group's tokens.
                every_group = torch.as_tensor(num_items_in_batch / batches.topology.sp_size).clamp(min=1)
                loss = loss_sum * batches.topology.dp_size / every_group
            else:
                loss = loss_sum / count.clamp(min=1)
            if return_outputs and batches.keep_logits:
                outputs = batches.gather_logits(outputs, local, row_length)
            return (loss, outputs) if return_outputs else loss
        if num_items_in_batch is None:
            raise ValueError(
                "prepare_trainer: training needs num_items_in_batch (the batch has no labels, or the "
                "model's loss takes no num_items_in_batch)"
            )
        # Counted over whole rows on each of the SP group's ranks.
        return super().compute_loss(model, local, return_outputs, num_items_in_batch / batches.topology.sp_size)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        # Logits are gathered back to whole rows only when the caller keeps them (predict(),
        # evaluate() with compute_metrics): the gather costs sp_size x the local logits.
        self._seq_parallel.keep_logits = not prediction_loss_only
        if not any(inputs.get(name) is not None for name in (*self.label_names, "shift_labels")):
            # The Trainer would call the model on whole rows, bypassing compute_loss (and the sharding).
            raise ValueError(
                "prepare_trainer: evaluate()/predict() batches need labels (the Trainer runs label-less "
                "batches outside compute_loss, unsharded)"
            )
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)


class WorkBalancedTrainerMixin:
    """Put in front of the trainer's class by prepare_trainer(..., balance_work=...)."""

    def _get_train_sampler(self, train_dataset=None):
        work, dp_size, seed = self._work_balance
        dataset = self.train_dataset if train_dataset is None else train_dataset
        if len(dataset) != len(work):
            raise ValueError(
                f"prepare_trainer: balance_work was given for {len(work)} train rows, "
                f"the trainer now reads {len(dataset)}"
            )
        # The batch size read here, not at prepare: auto_find_batch_size may have lowered it.
        return WorkBalancedSampler(work, dp_size, self._train_batch_size, seed)


@functools.cache
def _seq_parallel_class(base: type, mixin: type) -> type:
    return type(f"SeqParallel{base.__name__}", (mixin, GatherOncePerSPGroup, base), {"__module__": base.__module__})


@functools.cache
def _work_balanced_class(base: type) -> type:
    return type(f"WorkBalanced{base.__name__}", (WorkBalancedTrainerMixin, base), {"__module__": base.__module__})


def _balance_work(trainer, balance_work, dp_size: int) -> None:
    """balance_work: True (each row's work from the train dataset) or one number per row."""
    args, dataset = trainer.args, trainer.train_dataset
    if getattr(args, "train_sampling_strategy", "random") != "random":
        raise ValueError(
            f"prepare_trainer: balance_work orders the rows itself; it cannot be combined with "
            f"train_sampling_strategy={args.train_sampling_strategy!r} (use 'random', the default)"
        )
    if dataset is None or not hasattr(dataset, "__len__"):
        raise ValueError("prepare_trainer: balance_work needs a train dataset with a length (map-style, not streaming)")
    work = row_work(dataset) if balance_work is True else balance_work
    if len(work) != len(dataset):
        raise ValueError(f"prepare_trainer: balance_work has {len(work)} values for {len(dataset)} train rows")
    seed = args.data_seed if args.data_seed is not None else args.seed
    WorkBalancedSampler(work, dp_size, 1, seed)  # refuses bad work values now, not at train()
    trainer._work_balance = (work, dp_size, seed)
    trainer.__class__ = _work_balanced_class(type(trainer))


def row_work(dataset) -> list[float]:
    """Each row's attention query x key products: per document when the rows say where their
    documents are (TRL's packing: seq_lengths; padding-free packing: position_ids restarting at
    0), else one document per row (input_ids)."""
    columns = getattr(dataset, "column_names", None) or list(dataset[0])
    if "seq_lengths" in columns:
        return [document_products(lengths) for lengths in _column(dataset, "seq_lengths")]
    if "position_ids" in columns:
        return [document_products(_documents(positions)) for positions in _column(dataset, "position_ids")]
    if "input_ids" in columns:
        return [document_products([len(ids)]) for ids in _column(dataset, "input_ids")]
    raise ValueError(
        f"prepare_trainer: balance_work=True reads each row's work from its seq_lengths, position_ids or "
        f"input_ids, and the train dataset has {sorted(columns)}; pass balance_work=[one number per row]"
    )


def _column(dataset, name: str):
    if hasattr(dataset, "column_names"):  # datasets.Dataset: the column, without reading the others
        return dataset[name]
    return (dataset[i][name] for i in range(len(dataset)))


def _documents(positions) -> list[int]:
    """Document lengths of a row whose position ids restart at 0 for each document."""
    positions = torch.as_tensor(positions).reshape(-1)
    starts = torch.nonzero(positions == 0).flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    return [end - start for start, end in zip(starts, [*starts[1:], positions.numel()])]


class _Batches:
    """Shards batches for one mode and topology, and recombines what the SP group computed."""

    def __init__(self, context, topology):
        self.context, self.topology = context, topology
        self.layout = context.mode.layout(topology)
        self.keep_logits = False

    def shard(self, inputs: dict) -> tuple[dict, int]:
        """(this rank's model inputs, the row length before internal padding)."""
        if "input_ids" not in inputs:
            raise ValueError(f"prepare_trainer: batches need input_ids (got keys {sorted(inputs)})")
        input_ids = inputs["input_ids"]
        batch, length = input_ids.shape
        for key, value in inputs.items():
            if (
                key not in PER_TOKEN_KEYS + RESTATED_KEYS
                and torch.is_tensor(value)
                and value.dim() >= 2
                and tuple(value.shape[:2]) == (batch, length)
            ):
                raise ValueError(
                    f"prepare_trainer: batch key {key!r} has a value per token and cannot be sharded; "
                    f"supported per-token keys: {list(PER_TOKEN_KEYS)}"
                )
        if any(key in inputs for key in RESTATED_KEYS) and inputs.get("position_ids") is None:
            raise ValueError(
                f"prepare_trainer: {[k for k in RESTATED_KEYS if k in inputs]} without position_ids; "
                "packed batches must carry position_ids restarting at each document"
            )
        self._check_same_batch(input_ids)
        targets = inputs.get("shift_labels")
        if targets is None and inputs.get("labels") is not None:
            targets = F.pad(inputs["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
        positions, padding = inputs.get("position_ids"), inputs.get("attention_mask")
        extra = self.layout.padding(length)
        if extra:  # pad to a length the layout splits; the pads are masked and have no target
            if positions is None:
                positions = torch.arange(length, device=input_ids.device).expand(batch, length)
            if padding is None:
                padding = torch.ones_like(input_ids)
            input_ids, positions, padding = (F.pad(x, (0, extra), value=0) for x in (input_ids, positions, padding))
            targets = None if targets is None else F.pad(targets, (0, extra), value=IGNORE_INDEX)
        local = self.context.shard(input_ids, positions, targets, padding)
        result = {k: v for k, v in inputs.items() if k not in PER_TOKEN_KEYS + RESTATED_KEYS}
        result["input_ids"] = local["local_input_ids"]
        result["position_ids"] = local["local_position_ids"]
        if local["local_attention_mask"] is not None:
            result["attention_mask"] = local["local_attention_mask"]
        if targets is not None:  # already shifted: the loss must not shift again
            result["labels"] = result["shift_labels"] = local["local_target_ids"]
        if "local_token_index" in local:
            result["seq_parallel_index"] = local["local_token_index"]
        return result, length

    def _check_same_batch(self, input_ids: torch.Tensor) -> None:
        """Every rank of the SP group must hold the same rows (one all-gather of 4 numbers)."""
        self.context.check_same(
            [input_ids.long()],
            lambda shapes: (
                f"the ranks of a sequence-parallel group got different batches (rows x length by SP rank: {shapes}); "
                "every rank of a group must read the same rows. A sampler or dataset that depends on the process rank "
                "(or draws from each process's own random state) causes this."
            ),
        )

    def gather_sp_rank_0(self, data):
        """Gathered from every rank, each data-parallel group's SP rank 0's part kept (the group's
        ranks hold the same values), in data-parallel order."""
        from accelerate.utils import gather, recursively_apply

        dp, sp = self.topology.dp_size, self.topology.sp_size
        return recursively_apply(lambda x: x.reshape(dp, sp, -1, *x.shape[1:])[:, 0].flatten(0, 1), gather(data))

    def gather_once_per_sp_group(self, data, use_gather_object=False):
        """accelerate's gather_for_metrics over the data-parallel groups: SP rank 0's results
        of each group, with the tail that evened out the groups' batches dropped."""
        from accelerate.state import GradientState
        from accelerate.utils import recursively_apply

        if use_gather_object:
            raise ValueError(
                "prepare_trainer: eval_use_gather_object=True is not supported; evaluation results must be tensors"
            )
        kept, state = self.gather_sp_rank_0(data), GradientState()
        if state.end_of_dataloader and state.remainder > 0:
            kept = recursively_apply(lambda x: x[: state.remainder], kept)
        return kept

    @property
    def sp_group(self):
        """This rank's SP process group (None in one process)."""
        return get_groups(self.topology).sp

    def group_sum(self, loss: torch.Tensor, targets) -> tuple[torch.Tensor, torch.Tensor]:
        """Evaluation: (sum of the SP group's token losses, its token count) from each rank's
        mean over its own tokens."""
        if targets is None:
            raise ValueError("prepare_trainer: evaluation batches need labels")
        count = (targets != IGNORE_INDEX).sum().to(loss.dtype)
        stats = torch.stack([torch.where(count > 0, loss.detach() * count, torch.zeros_like(count)), count])
        if self.sp_group is not None:
            dist.all_reduce(stats, group=self.sp_group)
        return stats[0], stats[1]

    def gather_logits(self, outputs, local: dict, row_length: int):
        others = [key for key, value in outputs.items() if key not in ("loss", "logits") and value is not None]
        if others:
            raise ValueError(
                f"prepare_trainer: predict()/compute_metrics would get {others} of this rank's shard only; "
                "only logits are gathered back to whole rows"
            )
        logits = getattr(outputs, "logits", None)
        if logits is not None:
            whole = self.context.gather(logits.detach(), dim=1, token_index=local.get("seq_parallel_index"))
            outputs["logits"] = whole[:, :row_length]
        return outputs


def _read_by_sp_group(trainer, topology) -> None:
    """The trainer's dataloaders, prepared by accelerate as if there were dp_size processes:
    batch i goes to data-parallel group i % dp_size, read by every rank of the group
    (core/data_groups.py's rule, which accelerate deals by). Shuffling is seeded as accelerate
    seeds it (data_seed, else the process seed): accelerate synchronises a sampler's random
    state only across the processes it shards over (or replaces a RandomSampler by its seeded
    one), so the ranks of an SP group would otherwise draw their own orders."""
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import IterableDataset

    accelerator = trainer.accelerator
    register = accelerator.prepare_data_loader  # for an already prepared loader it only records it
    dp_rank = topology.dp_rank(accelerator.process_index)

    def prepare_for_sp_groups(data_loader, device_placement=None, slice_fn_for_dispatch=None):
        if not getattr(data_loader, "_is_accelerate_prepared", False):
            if topology.dp_size > 1 and isinstance(data_loader.dataset, IterableDataset):
                # accelerate evens out iterable shards by repeating samples, and only its
                # dispatcher (which slices over every process) knows how many to drop.
                raise ValueError(
                    "prepare_trainer: an IterableDataset (streaming) with several data-parallel groups "
                    f"(dp_size={topology.dp_size}) is not supported; use a map-style dataset or sp_size = world size"
                )
            seed_shuffling(data_loader, accelerator.dataloader_config.data_seed)
            _seed_workers_by_group(data_loader, dp_rank)
            data_loader = prepare_data_loader(
                data_loader,
                accelerator.device,
                num_processes=topology.dp_size,
                process_index=dp_rank,
                split_batches=accelerator.split_batches,
                put_on_device=accelerator.device_placement if device_placement is None else device_placement,
                rng_types=accelerator.rng_types.copy(),
                dispatch_batches=False,  # the dispatcher would slice batches over every process
                even_batches=accelerator.even_batches,
                use_seedable_sampler=accelerator.use_seedable_sampler,
                data_seed=accelerator.dataloader_config.data_seed,
                non_blocking=accelerator.non_blocking,
                use_stateful_dataloader=accelerator.use_stateful_dataloader,
            )
            data_loader._is_accelerate_prepared = True  # what accelerator.prepare marks; register only records it
        return register(data_loader)

    accelerator.prepare_data_loader = prepare_for_sp_groups


def _seed_workers_by_group(data_loader, dp_rank: int) -> None:
    """The Trainer seeds dataloader workers by process rank; ranks of one SP group must apply
    the same random transforms, so seed them by data-parallel group."""
    init = data_loader.worker_init_fn
    if isinstance(init, functools.partial) and "rank" in init.keywords:
        data_loader.worker_init_fn = functools.partial(init.func, *init.args, **{**init.keywords, "rank": dp_rank})
