"""The planner: the layouts the modes accept, every memory option on each, a row per
combination (peak memory, tokens/s) and the recommendation."""

from __future__ import annotations

from dataclasses import asdict

from easy_context.core.exchange import ulysses_head_splits
from easy_context.modes import BUILT_MODES, get_mode
from recipes.plan.catalogue import (
    GIB,
    ZERO_CHOICES,
    Device,
    ModelShape,
    Options,
    PlanError,
)
from recipes.plan.memory import default_chunk, default_tile, estimate, host_memory
from recipes.plan.packed import LAYOUT_FLAGS
from recipes.plan.sharding import SHARDINGS
from recipes.plan.speed import throughput

__all__ = [
    "candidate_options",
    "check_layout",
    "complexity",
    "flags_of",
    "host_verdict",
    "layout_multiple",
    "layouts",
    "plan",
    "row_of",
    "smallest_fit",
]


def _topology_and_layout(mode: str, sp: int, ring: int):
    """The mode's own topology and layout for one SP group of `sp` ranks (raises ValueError
    where the mode refuses the split): the planner asks the code that runs, not a copy of
    its rules."""
    spec = get_mode(mode)
    topology = spec.topology(sp, sp, ring)
    return topology, spec.layout(topology)


def layout_multiple(mode: str, sp: int, ring: int) -> int:
    """What the sequence length must divide by (the mode's layout.multiple)."""
    return _topology_and_layout(mode, sp, ring)[1].multiple


def check_layout(model: ModelShape, seq: int, mode: str, sp: int, ring: int) -> str | None:
    """None when the mode runs this layout, else why not: the mode's own topology and length
    checks, and the head split models.check_config makes before the first forward."""
    try:
        topology, layout = _topology_and_layout(mode, sp, ring)
        layout.check_length(seq)
    except ValueError as error:
        return str(error)
    if topology.ulysses_degree > 1:
        try:
            ulysses_head_splits(model.heads, model.kv_heads, topology.ulysses_degree)
        except ValueError as error:
            return str(error)
    return None


def layouts(model: ModelShape, seq: int, gpus: int, sp_sizes=None, modes=None):
    """(mode, sp, ring) that run on `gpus` ranks, and the ones refused with the reason."""
    ok, refused = [], []
    for sp in [d for d in range(1, gpus + 1) if gpus % d == 0]:
        if sp_sizes and sp not in sp_sizes:
            continue
        for mode in BUILT_MODES:
            if modes and mode not in modes:
                continue
            for r in get_mode(mode).ring_degrees_to_plan(sp):
                why = check_layout(model, seq, mode, sp, r)
                (refused if why else ok).append((mode, sp, r, why) if why else (mode, sp, r))
    return ok, refused


def candidate_options(model: ModelShape, seq: int, layout, zero_choices, tile: int, chunk: int, gpus: int):
    """Every memory option on a layout of a `gpus`-rank job; settings that need more ranks
    (FSDP2: two) are left out."""
    mode, sp, ring = layout
    local = seq // sp  # a tile or chunk at least this long changes nothing: not a separate row
    zero_choices = [z for z in zero_choices if SHARDINGS[z].min_world <= gpus]
    for ckpt, off in ((False, False), (True, False), (True, True)):
        for t in (0, tile) if tile < local else (0,):
            for c in (0, chunk) if chunk < local else (0,):
                for z in zero_choices:
                    yield Options(mode, sp, ring, ckpt, off, t, c, z)


def host_verdict(need_bytes: float, host_memory_gib: float | None, margin: float) -> str | None:
    """None when a node's host memory holds `need_bytes` within the margin (or no host memory
    is given), else the one-line reason, naming both numbers."""
    if host_memory_gib is None or need_bytes <= host_memory_gib * GIB * (1 - margin):
        return None
    return (
        f"needs {need_bytes / GIB:.1f} GiB of host memory per node, the host has {host_memory_gib:.1f} GiB "
        f"({host_memory_gib * (1 - margin):.1f} within the {margin:.0%} margin)"
    )


def row_of(model, seq, gpus, o: Options, device, dtype, margin, persistent_grads=True, host_memory_gib=None) -> dict:
    """One combination: its predicted peak per rank, host memory per node (host_memory), speed,
    and whether it fits: the peak within the device's memory less the margin and, where
    `host_memory_gib` is given, the host memory within the host's less the margin."""
    mem = estimate(model, seq, gpus, o, device, dtype, persistent_grads)
    host = host_memory(model, seq, gpus, o, device, dtype)
    tp = throughput(model, seq, gpus, o, device, dtype)
    budget = device.memory_gib * GIB * (1 - margin)
    host_why = host_verdict(host["per_node"], host_memory_gib, margin)
    return {
        "mode": o.mode,
        "sp_size": o.sp,
        "ring_degree": o.ring_degree,
        "ulysses_degree": o.ulysses_degree,
        "dp_size": gpus // o.sp,
        "activation_checkpointing": o.checkpointing,
        "offload_checkpoints": o.offload_checkpoints,
        "tiled_mlp": o.tiled_mlp,
        "loss_chunk_size": o.loss_chunk,
        "zero": o.zero,
        "peak_gib": round(mem["peak_bytes"] / GIB, 3),
        "host_gib": round(host["per_node"] / GIB, 3),
        "fits": mem["peak_bytes"] <= budget and host_why is None,
        "fits_device": mem["peak_bytes"] <= budget,
        "host_why": host_why,
        "tokens_per_s": round(tp["tokens_per_s"], 1),
        "step_s": round(tp["step_s"], 3),
        "limiter": tp["limiter"],
        "peak_phase": mem["peak_phase"],
        "terms_gib": {k: round(v / GIB, 3) for k, v in mem["terms"].items()},
        "host_terms_gib": {k: round(v / GIB, 3) for k, v in host["terms"].items()},  # per rank
        "host_ranks_per_node": host["ranks_per_node"],
    }


def flags_of(row: dict, seq: int, packed: bool = False, layout: str = "workload") -> str:
    """train.py / accelerate flags for a row (`seq`: the sequence length planned for). `packed`:
    the rows are packed documents: document masking, and in modes that take a layout per row
    `layout` (packed.LAYOUT_FLAGS; the CLI passes packed.packed_layout's choice)."""
    parts = [f"--parallel-mode {row['mode']}"]
    mode = get_mode(row["mode"])
    if packed:
        parts.append("--document-masking")
        if mode.document_split and row["sp_size"] > 1 and LAYOUT_FLAGS[layout]:
            parts.append(LAYOUT_FLAGS[layout])
    if mode.sequence_parallel and row["dp_size"] > 1:
        parts.append(f"--sp-size {row['sp_size']}")
    if mode.takes_ring_degree:
        parts.append(f"--ring-degree {row['ring_degree']}")
    if row["activation_checkpointing"]:
        parts.append("--activation-checkpointing")
    if row["offload_checkpoints"]:
        parts.append("--offload-checkpoints")
    if row["tiled_mlp"]:
        parts.append(f"--tiled-mlp {row['tiled_mlp']}")
    # no chunking: one chunk as long as the rank's shard of the sequence
    parts.append(f"--seq-length {seq} --loss-chunk-size {row['loss_chunk_size'] or seq // row['sp_size']}")
    setting = SHARDINGS[row["zero"]]
    if setting.train_flags:
        parts.append(setting.train_flags)
    return " ".join(parts) + f"   [{setting.launch}]"


def complexity(row: dict) -> int:
    """How many memory options a row turns on (sharding and each offload count one each)."""
    return (
        row["activation_checkpointing"]
        + row["offload_checkpoints"]
        + bool(row["tiled_mlp"])
        + bool(row["loss_chunk_size"])
        + SHARDINGS[row["zero"]].options
    )


def plan(
    model: ModelShape,
    seq: int,
    gpus: int,
    device: Device,
    dtype: str | None = None,
    margin: float = 0.10,
    sp_sizes=None,
    modes=None,
    zero_choices=None,
    tile: int | None = None,
    chunk: int | None = None,
    host_memory_gib: float | None = None,
) -> dict:
    """Every combination as a row, best first, and the recommendation: the fastest that fits.
    host_memory_gib: the host RAM of a node; a row whose host memory (host_memory) exceeds it
    less the margin does not fit (None: not checked; the CLI always gives one)."""
    if seq < 1:
        raise PlanError(f"--seq-length must be positive, got {seq}")
    if gpus < 1:
        raise PlanError(f"--gpus must be positive, got {gpus}")
    if not 0 <= margin < 1:
        raise PlanError(f"--margin must be in [0, 1), got {margin}")
    if host_memory_gib is not None and host_memory_gib <= 0:
        raise PlanError(f"--host-memory must be positive, got {host_memory_gib}")
    dtype = dtype or ("fp32" if device.name == "cpu" else "bf16")
    zero_choices = tuple(zero_choices or ZERO_CHOICES)
    if all(SHARDINGS[z].min_world > gpus for z in zero_choices):
        need = min(SHARDINGS[z].min_world for z in zero_choices)
        raise PlanError(
            f"--zero {' / '.join(zero_choices)} needs at least {need} GPUs (it shards over them), got {gpus}"
        )
    tile = tile or default_tile(model)
    chunk = chunk or default_chunk(model)
    divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
    wrong = [sp for sp in (sp_sizes or ()) if sp not in divisors]
    if wrong:
        raise PlanError(f"--sp-size {wrong[0]} does not divide --gpus {gpus}; choose from {divisors}")
    ok, refused = layouts(model, seq, gpus, sp_sizes, modes)
    if not ok:
        multiples = sorted({layout_multiple(m, s, r) for m, s, r, _ in refused})
        reasons = "; ".join(
            sorted(
                {
                    f"{m} sp={s}" + (f" ring={r}" if get_mode(m).takes_ring_degree else "") + f": {why}"
                    for m, s, r, why in refused
                }
            )
        )
        hint = f" Sequence lengths must divide by one of {multiples}." if multiples else ""
        raise PlanError(f"no mode runs {seq} tokens on {gpus} GPUs with these settings ({reasons}).{hint}")
    rows = [
        row_of(model, seq, gpus, o, device, dtype, margin, host_memory_gib=host_memory_gib)
        for layout in ok
        for o in candidate_options(model, seq, layout, zero_choices, tile, chunk, gpus)
    ]
    rows.sort(
        key=lambda r: (not r["fits"], -r["tokens_per_s"] if r["fits"] else r["peak_gib"], complexity(r), r["peak_gib"])
    )
    best = None
    if rows[0]["fits"]:  # the fastest that fits; within 1% of it, the fewest options, then the least memory
        near = [r for r in rows if r["fits"] and r["tokens_per_s"] >= 0.99 * rows[0]["tokens_per_s"]]
        best = min(near, key=lambda r: (complexity(r), r["peak_gib"]))
        rows.remove(best)
        rows.insert(0, best)
    result = {
        "model": asdict(model),
        "params": model.params,
        "seq_length": seq,
        "gpus": gpus,
        # the host memory the plan used is host_memory_gib; the device's default for a node is not repeated
        "device": {k: v for k, v in asdict(device).items() if k != "default_host_memory_gib"},
        "dtype": dtype,
        "margin": margin,
        "tile": tile,
        "chunk": chunk,
        "host_memory_gib": host_memory_gib,
        "recommendation": best,
        "rows": rows,
        "refused": [{"mode": m, "sp_size": s, "ring_degree": r, "why": w} for m, s, r, w in refused],
    }
    if best is None:
        result["smallest"] = smallest_fit(
            model, seq, gpus, device, dtype, margin, rows, sp_sizes, modes, zero_choices, tile, chunk, host_memory_gib
        )
    return result


def smallest_fit(
    model, seq, gpus, device, dtype, margin, rows, sp_sizes, modes, zero_choices, tile, chunk, host_memory_gib=None
) -> dict:
    """The least memory per GPU that would fit at this GPU count; where some rows fit the GPUs
    and none the host, the least host memory per node of those (host_gib, with the reason of
    the one that needs least: host_why); and the fewest GPUs (doubling --gpus, sequence
    parallelism over all of them) that fit at this memory."""
    need_gib = min(r["peak_gib"] for r in rows) / (1 - margin)
    on_device = [r for r in rows if r["fits_device"]]
    least_host = min(on_device, key=lambda r: r["host_gib"]) if on_device else None
    more = None
    g = gpus
    while g < 1 << 16:
        g = g * 2
        ok, _ = layouts(model, seq, g, None, modes)
        fits = [
            row_of(model, seq, g, o, device, dtype, margin, host_memory_gib=host_memory_gib)
            for layout in ok
            if layout[1] == g
            for o in candidate_options(model, seq, layout, zero_choices, tile, chunk, g)
        ]
        if any(r["fits"] for r in fits):
            more = g
            break
    return {
        "memory_gib": round(need_gib, 1),
        "gpus": more,
        "host_gib": round(least_host["host_gib"] / (1 - margin), 1) if least_host else None,
        "host_why": least_host["host_why"] if least_host else None,
    }
