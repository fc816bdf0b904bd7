"""Plan a long-context training run: per-rank peak memory and a throughput estimate for every
feasible mode x memory-option combination, and a recommendation (`python -m
recipes.plan`, cli.py; docs/planner.md).

catalogue.py: models, devices, options; sharding.py: the DDP / ZeRO-3 / FSDP2 settings, one table;
memory.py: the peak-memory model; speed.py: the roofline and the FLOP count;
planner.py: layouts, rows, the recommendation; packed.py: packed rows' layout (static, cut or
workload) from each one's schedule priced on a GPU ring; cli.py: the table and the command line. What a
mode costs (bytes sent, activation terms) the mode declares (easy_context/modes/costs.py).
"""

from recipes.plan.catalogue import (
    DEVICES,
    GIB,
    MIB,
    PRESETS,
    ZERO_CHOICES,
    Device,
    ModelShape,
    Options,
    PlanError,
    default_host_memory,
    get_device,
    load_model,
    machine_memory_gib,
    shape_from_config,
)
from recipes.plan.cli import (
    COLUMNS,
    main,
    parameter_count,
    parse_args,
    render,
    table_cells,
)
from recipes.plan.memory import (
    IN_FLIGHT,
    activation_terms,
    attention_shape,
    attention_transient,
    default_chunk,
    default_tile,
    estimate,
    host_memory,
    in_flight,
    loss_bytes_per_token,
    offloads_checkpoints,
)
from recipes.plan.packed import LAYOUTS, LinkModel, choose_layout, packed_layout, predict, round_costs
from recipes.plan.planner import (
    candidate_options,
    check_layout,
    complexity,
    flags_of,
    host_verdict,
    layout_multiple,
    layouts,
    plan,
    row_of,
    smallest_fit,
)
from recipes.plan.sharding import SHARDINGS, Sharding, StateTerm
from recipes.plan.speed import (
    ATTENTION_EFFICIENCY,
    EFFICIENCY,
    efficiency,
    sharding_seconds,
    throughput,
)

__all__ = [
    "ATTENTION_EFFICIENCY",
    "COLUMNS",
    "DEVICES",
    "EFFICIENCY",
    "GIB",
    "IN_FLIGHT",
    "LAYOUTS",
    "MIB",
    "PRESETS",
    "SHARDINGS",
    "ZERO_CHOICES",
    "Device",
    "LinkModel",
    "ModelShape",
    "Options",
    "PlanError",
    "Sharding",
    "StateTerm",
    "activation_terms",
    "attention_shape",
    "attention_transient",
    "candidate_options",
    "check_layout",
    "choose_layout",
    "complexity",
    "default_chunk",
    "default_host_memory",
    "default_tile",
    "efficiency",
    "estimate",
    "flags_of",
    "get_device",
    "host_memory",
    "host_verdict",
    "in_flight",
    "layout_multiple",
    "layouts",
    "load_model",
    "loss_bytes_per_token",
    "machine_memory_gib",
    "main",
    "offloads_checkpoints",
    "packed_layout",
    "parameter_count",
    "parse_args",
    "plan",
    "predict",
    "render",
    "round_costs",
    "row_of",
    "shape_from_config",
    "sharding_seconds",
    "smallest_fit",
    "table_cells",
    "throughput",
]
