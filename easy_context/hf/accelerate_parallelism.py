"""accelerate's own context / sequence parallelism next to ours: refused.

accelerate (1.10 on) can shard the sequence itself when its ParallelismConfig sets cp_size
(torch's context parallel) or sp_size (DeepSpeed's Ulysses) above 1, from
Accelerator(parallelism_config=...) or the PARALLELISM_CONFIG_* variables an accelerate
config file sets. With our patch active, both would shard the same batch: each rank would
attend over a shard of a shard and the loss would be wrong without any error. The check
reads the accelerator's config by attribute, so an accelerate without ParallelismConfig
(or without sp_size) passes.
"""

from __future__ import annotations

__all__ = ["check_accelerate_parallelism"]


def check_accelerate_parallelism(accelerator, mode: str) -> None:
    """Refuse an accelerator whose ParallelismConfig shards the sequence (cp_size or sp_size
    > 1) while easy-context's sequence-parallel `mode` shards it too."""
    config = getattr(accelerator, "parallelism_config", None)
    if config is None:
        return
    sharding = {name: getattr(config, name, None) or 1 for name in ("cp_size", "sp_size")}
    sharding = {name: size for name, size in sharding.items() if size > 1}
    if not sharding:
        return
    given = ", ".join(f"{name}={size}" for name, size in sharding.items())
    raise ValueError(
        f"accelerate's ParallelismConfig sets {given} (its own context/sequence parallelism) while easy-context "
        f"runs {mode!r}: two systems would shard the same batch. Set {' and '.join(sharding)} to 1 (in the "
        "accelerate config file, or unset PARALLELISM_CONFIG_CP_SIZE / PARALLELISM_CONFIG_SP_SIZE) and let "
        "sp_size (easy-context's option) size the sequence-parallel group; or run data_parallel to use accelerate's "
        "instead"
    )
