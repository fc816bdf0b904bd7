"""How a run keeps its model states (DDP, DeepSpeed ZeRO-3, PyTorch FSDP2), one table: what
each rank holds per parameter, where, and how the weights reach the layers. memory.py and
speed.py price a setting from its row here; planner.flags_of prints its launch; the CLI's
--zero takes its names. Nothing else names a setting."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SHARDINGS", "ZERO_CHOICES", "Sharding", "StateTerm"]


@dataclass(frozen=True)
class StateTerm:
    """One model state, in bytes per parameter of the model."""

    label: str  # its name in the memory breakdown
    kind: str  # "weights", "gradients" or "optimizer"
    dtype: str  # "fp32"; "train": the training dtype; "master": fp32 only where the training dtype is narrower
    copies: int = 1  # Adam: m and v
    host: bool = False  # offloaded: in host memory
    distributed_only: bool = False  # held only with more than one rank (DDP's buckets)
    # kept from one step to the next; False: a torch optimizer's gradients, which
    # zero_grad(set_to_none=True) frees and the next backward rebuilds (DeepSpeed's partitions
    # are flat buffers allocated once)
    between_steps: bool = True

    def bytes_per_param(self, a: int) -> int:
        """Bytes per parameter when activations (and the training dtype) take `a` bytes."""
        size = {"fp32": 4, "train": a, "master": 4 if a < 4 else 0}[self.dtype]
        return size * self.copies


@dataclass(frozen=True)
class Sharding:
    name: str
    launch: str  # what planner.flags_of prints in brackets: the launcher and its config
    train_flags: str  # what it adds to train.py's flags
    states: tuple[StateTerm, ...]
    sharded: bool  # the states divided over every rank (W)
    # How weights reach the layers (memory.py's in-flight terms): "replicated" (every rank
    # holds them), "zero3" (DeepSpeed gathers each module as it runs, prefetching the next),
    # "fsdp2" (train.py's units: each decoder layer gathered for its forward and backward
    # with the next prefetched; the root, embeddings to output layer, gathered for the step).
    gathers: str
    reduce_dtype: str  # the gradients' reduce-scatter: "train" or "fp32"
    # the activation-checkpointing recompute gathers the layer again (DeepSpeed's forward
    # hooks fire); FSDP2 skips it: its pre-backward unshard still holds the layer
    regathers_on_recompute: bool = False
    residual_fp32: bool = False  # fp32 weights under bf16 autocast keep the residual stream fp32
    min_world: int = 1  # ranks the launch needs (train.py refuses --fsdp on one process)
    options: int = 0  # how many memory options it counts as (planner.complexity)
    planned: bool = True  # offered by the planner (False: the validation's own setting)

    def state_bytes(self, a: int, world: int, host_counts: bool, persistent_grads: bool = True):
        """({label: per-rank bytes per parameter} of the states kept between steps, the same of the
        gradients rebuilt in each backward); host-memory terms only where `host_counts` (a
        device whose memory is the host's: cpu). persistent_grads=False: an unsharded
        setting's gradients are all rebuilt (the validation's one-step runs)."""
        share = world if self.sharded else 1
        kept, rebuilt = {}, {}
        for t in self.states:
            if (t.host and not host_counts) or (t.distributed_only and world == 1):
                continue
            freed = t.kind == "gradients" and (not t.between_steps or not (persistent_grads or self.sharded))
            (rebuilt if freed else kept)[t.label] = t.bytes_per_param(a) / share
        return kept, rebuilt

    def weights_on_host(self) -> bool:
        return any(t.kind == "weights" and t.host for t in self.states)

    def optimizer_on_host(self) -> bool:
        return any(t.kind == "optimizer" and t.host for t in self.states)


def _zero3_states(offload_optimizer: bool, offload_params: bool) -> tuple[StateTerm, ...]:
    """DeepSpeed ZeRO-3's partitions: parameters in the training dtype; with the optimizer on
    the host, its fp32 master copy, gradients and Adam moments there (cpu_adam); without, an
    fp32 master only where the parameters are narrower (fp32 partitions are updated in place)."""
    if not offload_optimizer:
        return (
            StateTerm("params (shard)", "weights", "train"),
            StateTerm("gradients (shard)", "gradients", "train"),
            StateTerm("optimizer (fp32 master, shard)", "optimizer", "master"),
            StateTerm("optimizer (Adam m, v, shard)", "optimizer", "fp32", copies=2),
        )
    return (
        StateTerm("params (shard)" + (", host" if offload_params else ""), "weights", "train", host=offload_params),
        StateTerm("gradients (fp32 shard, host)", "gradients", "fp32", host=True),
        StateTerm("optimizer (fp32 master, m, v shard, host)", "optimizer", "fp32", copies=3, host=True),
    )


def _fsdp2_states(offload: bool) -> tuple[StateTerm, ...]:
    """train.py --fsdp: fully_shard over weights loaded in fp32 (bf16 is a mixed-precision
    policy that casts the gathered copy), fp32 gradient shards, torch AdamW's moments on the
    shards; CPUOffloadPolicy keeps all three in host memory."""
    where = ", host" if offload else ""
    return (
        StateTerm(f"params (fp32 shard{where})", "weights", "fp32", host=offload),
        StateTerm(f"gradients (fp32 shard{where})", "gradients", "fp32", host=offload, between_steps=False),
        StateTerm(f"optimizer (Adam m, v, shard{where})", "optimizer", "fp32", copies=2, host=offload),
    )


_ZERO3 = dict(sharded=True, gathers="zero3", reduce_dtype="train", regathers_on_recompute=True)
_FSDP2 = dict(sharded=True, gathers="fsdp2", reduce_dtype="fp32", min_world=2)
_DEEPSPEED_JSON = "accelerate_configs/zero3_offload.json"

SHARDINGS = {
    s.name: s
    for s in (
        Sharding(
            "none",
            "DDP: no DeepSpeed config, no FSDP",
            "",
            (
                StateTerm("weights (fp32)", "weights", "fp32"),
                StateTerm("gradients (fp32)", "gradients", "fp32", between_steps=False),
                # DDP's all-reduce buckets: a second copy of the gradients unless
                # gradient_as_bucket_view (accelerate's default: off)
                StateTerm("DDP gradient buckets (fp32)", "gradients", "fp32", distributed_only=True),
                StateTerm("optimizer (Adam m, v)", "optimizer", "fp32", copies=2),
            ),
            sharded=False,
            gathers="replicated",
            reduce_dtype="fp32",
            residual_fp32=True,
        ),
        Sharding(
            "zero3",
            f"ZeRO-3: {_DEEPSPEED_JSON} without offload_optimizer and offload_param",
            "",
            _zero3_states(offload_optimizer=False, offload_params=False),
            options=1,
            **_ZERO3,
        ),
        Sharding(
            "zero3-opt-offload",
            f"ZeRO-3: {_DEEPSPEED_JSON} without offload_param",
            "",
            _zero3_states(offload_optimizer=True, offload_params=False),
            options=2,
            **_ZERO3,
        ),
        Sharding(
            "zero3-offload",
            f"ZeRO-3: accelerate_configs/single_node.yaml ({_DEEPSPEED_JSON} as shipped)",
            "",
            _zero3_states(offload_optimizer=True, offload_params=True),
            options=3,
            **_ZERO3,
        ),
        Sharding("fsdp2", "FSDP2: train.py --fsdp", "--fsdp", _fsdp2_states(offload=False), options=1, **_FSDP2),
        Sharding(
            "fsdp2-offload",
            "FSDP2: train.py --fsdp --fsdp-offload",
            "--fsdp --fsdp-offload",
            _fsdp2_states(offload=True),
            options=2,
            **_FSDP2,
        ),
        # The long-context headline (benchmarks/bench_long_context.py; train.py --param-dtype bf16
        # --optimizer sgd): weights and gradients in the training dtype, no optimizer state.
        Sharding(
            "bf16-sgd",
            "one device or DDP, train.py --param-dtype bf16 --optimizer sgd",
            "--param-dtype bf16 --optimizer sgd",
            (
                StateTerm("weights", "weights", "train"),
                StateTerm("gradients", "gradients", "train", between_steps=False),
                StateTerm("DDP gradient buckets", "gradients", "train", distributed_only=True),
            ),
            sharded=False,
            gathers="replicated",
            reduce_dtype="train",
            planned=False,
        ),
        # The validation's one-step runs (benchmarks/bench_train.py): weights, no optimizer;
        # gradients kept between steps or not (memory.estimate's persistent_grads).
        Sharding(
            "noopt",
            "no optimizer (validation)",
            "",
            (StateTerm("weights", "weights", "fp32"), StateTerm("gradients", "gradients", "fp32")),
            sharded=False,
            gathers="replicated",
            reduce_dtype="fp32",
            residual_fp32=True,
            planned=False,
        ),
    )
}

ZERO_CHOICES = tuple(name for name, s in SHARDINGS.items() if s.planned)
