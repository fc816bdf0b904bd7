"""The long-context headline on one device: an 8B-shaped model from a config, trained at full
depth at a few lengths, the longest sequence a probe trains at, and the host memory full depth
would need, each beside the planner's prediction.

    # one H100 / H200: the Llama-3.1-8B shape (configs/llama-3.1-8b), bf16 weights, plain SGD
    python -m benchmarks.bench_long_context --budget-s 420 --json long_context.json
    # the CPU dry run CI runs: configs/tiny-llama, fp32, small lengths, the same table
    python -m benchmarks.bench_long_context --dry-run

Each step is train.py's step on one device: the model built from the config on the device in
--param-dtype with random weights, every decoder layer checkpointed (its input offloaded to
pinned host memory on a GPU), MLPs in tiles, the loss in chunks (easy_context/hf/loss.py), SGD (no
optimizer state). One sequence per step, no sequence parallelism (one device).

Sections, in this order, each inside what is left of --budget-s:
  full depth  every layer, at --lengths: synchronized step time (the mean of --timed-steps steps
              after one warm-up), tokens/s, MFU (model FLOPs / step time / the device's peak:
              6 x the weights a token multiplies + 3 x causal attention's forward) and HFU (the
              FLOPs executed: + the recompute of checkpointing, tiles and loss chunks, as the
              planner counts them), per-step peak device memory, pinned host memory; the planner's
              peak, host memory and step time beside each. A length that runs out of memory is a
              row saying so, and the run goes on.
  ceiling     the longest S that trains, probed on the first --probe-layers layers with the
              weights and gradients of the others allocated on the device as ballast (so the
              memory the probe has is what full depth would leave it): S doubles from the last
              full-depth length that ran, but never past the first length the planner rules out
              (its peak over the device's memory: that length is probed instead), until a step
              runs out of memory; then the gap between the last length that trained and the first
              that did not is bisected to --resolution. A probe's per-layer activation memory is
              that of full depth; its checkpointed inputs are --probe-layers' instead of all
              layers' (on the host when offloaded), stated in the table. The device memory in use
              before the ballast, and before each probe, is recorded beside it: what an earlier
              model left behind would show there.
  host        the pinned host memory full depth would need at the ceiling (one layer input per
              layer: the planner's host_memory), against this machine's RAM.

What keeps the ceiling honest: a probe's model is freed when it is deleted (no reference
cycle holds it: recipes/tiled_mlp.py), a step that ran out of memory is let go of after its
`except` block (inside it the traceback still holds the step's activations), and the caching
allocator uses expandable segments (PYTORCH_CUDA_ALLOC_CONF, set before the first CUDA
allocation), so a long step is not refused for fragmentation. The pinned host column is the
host allocator's active bytes (its allocated bytes count cached blocks, rounded to powers of
two). MFU divides by the peak of the card's own model (recipes/plan/catalogue.py: SXM, PCIe,
NVL, H200), found from its name.

Writes --jsonl (one JSON line per row as it finishes: a run stopped part-way keeps every row
before the stop), --json (every row, the device, the planner's inputs, at the end) and prints
the tables for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from recipes.plan import catalogue, memory, speed
from recipes.training.sources import config_path

GIB = 1 << 30
ALLOCATOR_VARIABLE = "PYTORCH_CUDA_ALLOC_CONF"
# Segments that grow in place: a long step's large, changing allocations reuse freed memory
# instead of failing for want of one contiguous block (a ceiling found under fragmentation is
# the allocator's, not the model's).
EXPANDABLE_SEGMENTS = "expandable_segments:True"


@dataclass
class Setup:
    config: object  # the transformers config
    shape: catalogue.ModelShape
    device: torch.device
    dtype: torch.dtype
    tile: int
    chunk: int
    offload: bool

    def options(self) -> catalogue.Options:
        return catalogue.Options(
            "data_parallel",
            1,
            1,
            checkpointing=True,
            offload_checkpoints=self.offload,
            tiled_mlp=self.tile,
            loss_chunk=self.chunk,
            zero="bf16-sgd" if self.dtype == torch.bfloat16 else "noopt",
        )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None, help="a preset of configs/ or a config.json (default: llama-3.1-8b)")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="full-depth lengths (default: 32K 64K)")
    p.add_argument("--budget-s", type=float, default=420.0, help="seconds for all sections together")
    p.add_argument("--param-dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 (fp32 --dry-run)")
    p.add_argument("--timed-steps", type=int, default=2)
    p.add_argument("--probe-layers", type=int, default=2)
    p.add_argument("--resolution", type=int, default=None, help="ceiling search step (default: 16K; dry run 256)")
    p.add_argument("--max-length", type=int, default=None, help="the ceiling search's cap (default: 4M; 4096)")
    p.add_argument("--gpu", default=None, help="the planner's device (default: found from the GPU's name)")
    p.add_argument("--dry-run", action="store_true", help="CPU, configs/tiny-llama, small lengths")
    p.add_argument("--json", default=None)
    p.add_argument("--jsonl", default=None, help="append one JSON line per row as it finishes")
    args = p.parse_args(argv)
    dry = args.dry_run
    args.config = args.config or ("tiny-llama" if dry else "llama-3.1-8b")
    args.lengths = args.lengths or ([256, 512] if dry else [32768, 65536])
    args.param_dtype = args.param_dtype or ("fp32" if dry else "bf16")
    args.resolution = args.resolution or (256 if dry else 16384)
    args.max_length = args.max_length or (2048 if dry else 1 << 22)
    if config_path(args.config) is None:
        p.error(f"--config {args.config}: no such config.json, folder or preset under configs/")
    if not dry and not torch.cuda.is_available():
        p.error("no GPU here: run with --dry-run (CPU, tiny config) or on a CUDA machine")
    if args.probe_layers < 1 or args.timed_steps < 1:
        p.error("--probe-layers and --timed-steps must be >= 1")
    if args.gpu is not None and args.gpu.lower() not in catalogue.DEVICES:
        p.error(f"--gpu {args.gpu}: not a device of the planner's catalogue ({', '.join(sorted(catalogue.DEVICES))})")
    return args


def use_expandable_segments() -> str:
    """Ask the CUDA caching allocator for expandable segments (unless the environment already
    says either way); returns the setting in effect. It is read at the first CUDA allocation,
    so this runs before anything touches the device."""
    current = os.environ.get(ALLOCATOR_VARIABLE, "")
    if "expandable_segments" not in current:
        os.environ[ALLOCATOR_VARIABLE] = ",".join(filter(None, [current, EXPANDABLE_SEGMENTS]))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return f"{os.environ[ALLOCATOR_VARIABLE]} (not applied: CUDA was initialised before)"
    return os.environ[ALLOCATOR_VARIABLE]


class Rows:
    """Where rows go as they finish: printed, and appended to --jsonl (flushed per line, so a
    run stopped part-way keeps every row before the stop)."""

    def __init__(self, path: str | None):
        self.file = open(path, "a") if path else None  # noqa: SIM115 - open for the run

    def add(self, section: str, row: dict, text: str | None = None) -> None:
        if text is not None:
            print(text, flush=True)
        if self.file is not None:
            self.file.write(json.dumps({"section": section, **row}) + "\n")
            self.file.flush()


# ------------------------------------------------------------------------ the model
def build_setup(args) -> Setup:
    from transformers import AutoConfig

    path = config_path(args.config)
    config = AutoConfig.from_pretrained(str(path))
    config.use_cache = False
    device = torch.device("cpu" if args.dry_run else "cuda")
    shape = catalogue.shape_from_config(config, args.config)
    return Setup(
        config,
        shape,
        device,
        torch.bfloat16 if args.param_dtype == "bf16" else torch.float32,
        memory.default_tile(shape),
        memory.default_chunk(shape),
        offload=device.type == "cuda",
    )


def build_model(setup: Setup, layers: int | None = None):
    """The config's model (its first `layers` layers) with random weights, built on the device in
    its dtype, with train.py's memory options; returns (trainable, optimizer)."""
    from transformers import AutoModelForCausalLM

    from easy_context.hf.architectures import attn_implementation
    from easy_context.hf.loss import CausalLMLoss
    from easy_context.versions import enable_activation_checkpointing
    from recipes.tiled_mlp import tile_mlps

    config = setup.config.__class__.from_dict(setup.config.to_dict())
    if layers is not None:
        config.num_hidden_layers = layers
    torch.manual_seed(0)
    with torch.device(setup.device):
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=attn_implementation(config), dtype=setup.dtype
        )
    enable_activation_checkpointing(model, offload=setup.offload)
    tile_mlps(model, setup.tile)
    model.train()
    trainable = CausalLMLoss(model, setup.chunk)
    return trainable, torch.optim.SGD(trainable.parameters(), lr=1e-6)


def step(setup: Setup, trainable, optimizer, seq: int) -> dict:
    """One synchronized training step at `seq` tokens: seconds, peak device bytes, peak pinned
    host bytes (0 where not measurable)."""
    vocab = setup.shape.vocab
    ids = torch.randint(0, vocab, (1, seq + 1), device=setup.device)
    positions = torch.arange(seq, device=setup.device)[None]
    _reset_peaks(setup.device)
    started = time.perf_counter()
    loss = trainable(ids[:, :-1], positions, ids[:, 1:])
    (loss / seq).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _synchronize(setup.device)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "peak_bytes": _peak_bytes(setup.device), "pinned_bytes": _pinned_bytes(setup.device)}


def _synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peaks(device):
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        reset = getattr(torch.cuda, "reset_peak_host_memory_stats", None)
        if reset is not None:
            reset()
    else:
        from benchmarks.common import reset_peak_rss

        reset_peak_rss()


def _peak_bytes(device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    from benchmarks.common import peak_rss_bytes

    return peak_rss_bytes()  # the process's peak: on a CPU the device's memory is the host's


def in_use(device) -> dict:
    """Device memory in use now: bytes held by live tensors, and (CUDA) what the caching
    allocator reserves and what the driver reports free on the whole device (other processes
    and the CUDA context included). On a CPU, the process's resident set."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return {
            "allocated_bytes": torch.cuda.memory_allocated(device),
            "reserved_bytes": torch.cuda.memory_reserved(device),
            "device_free_bytes": free,
            "device_total_bytes": total,
        }
    from benchmarks.common import rss_bytes

    return {"allocated_bytes": rss_bytes()}


def pinned_bytes(stats: dict) -> int:
    """Peak pinned host bytes in use from torch.cuda.host_memory_stats(): the active blocks. (Its
    allocated bytes also count the blocks the host allocator keeps cached, each rounded up to a
    power of two: about 24 GiB where 16 are in use.)"""
    for key in ("active_bytes.peak", "active_bytes.all.peak"):
        if key in stats:
            return int(stats[key])
    return 0


def _pinned_bytes(device) -> int:
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if device.type != "cuda" or stats is None:
        return 0
    return pinned_bytes(stats())


def is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def release(setup: Setup, optimizer) -> None:
    """After a step that ran out of memory, outside its `except` block (there the traceback
    still holds the step's frames and so its activations): the gradients it left, and the
    allocator's cached blocks."""
    optimizer.zero_grad(set_to_none=True)
    _empty_cache(setup.device)


# ------------------------------------------------------------------ the planner's side
def planner_device(args, setup: Setup) -> catalogue.Device:
    if setup.device.type == "cpu":
        return catalogue.get_device("cpu")
    name = args.gpu or catalogue.device_of_gpu(torch.cuda.get_device_name())
    total = torch.cuda.get_device_properties(0).total_memory / GIB
    return catalogue.get_device(name, memory_gib=total)


def flops_per_token(setup: Setup, seq: int) -> tuple[float, float]:
    """(model FLOPs, executed FLOPs) per token of a step at `seq` (the planner's speed.step_flops)."""
    counted = speed.step_flops(setup.shape, seq, setup.options())
    return counted["model"], counted["matmuls"] + counted["attention"]


def predicted(setup: Setup, seq: int, device: catalogue.Device) -> dict:
    o = setup.options()
    dtype = "bf16" if setup.dtype == torch.bfloat16 else "fp32"
    peak = memory.estimate(setup.shape, seq, 1, o, device, dtype, persistent_grads=False)
    return {
        "peak_bytes": peak["peak_bytes"],
        "host_bytes": memory.host_memory(setup.shape, seq, 1, o, device, dtype)["per_node"],
        "step_s": speed.throughput(setup.shape, seq, 1, o, device, dtype)["step_s"],
    }


def planner_limit(setup: Setup, device: catalogue.Device, start: int, resolution: int, cap: int) -> int | None:
    """The shortest length above `start`, on the `resolution` grid, whose predicted peak is over
    the device's memory (the planner rules it out), or None up to `cap`. The peak grows with S:
    doubled to a bracket, then bisected."""

    def over(seq: int) -> bool:
        return predicted(setup, seq, device)["peak_bytes"] > device.memory_gib * GIB

    low = max(start, resolution) // resolution * resolution
    high = low
    while not over(high):
        if high >= cap:
            return None
        low, high = high, min(2 * high, cap)
    while high - low > resolution:
        middle = (low + high) // 2 // resolution * resolution
        low, high = (middle, high) if not over(middle) else (low, middle)
    return high


# ------------------------------------------------------------------------ sections
def full_depth(args, setup: Setup, device: catalogue.Device, deadline: float, rows_out: Rows | None = None):
    rows = []

    def done(row):
        rows.append(row)
        if rows_out is not None:
            rows_out.add("full_depth", row, row_text(row, setup, device))

    trainable, optimizer = build_model(setup)
    for seq in args.lengths:
        plan = predicted(setup, seq, device)
        row = {"seq": seq, "layers": setup.shape.layers, **{f"planner_{k}": v for k, v in plan.items()}}
        needed = plan["step_s"] * (1 + args.timed_steps)
        if time.monotonic() + needed > deadline:
            done({**row, "result": f"skipped: the budget (the planner's {needed:.0f} s)"})
            continue
        out_of_memory = False
        try:
            step(setup, trainable, optimizer, seq)  # warm-up
            timed = [step(setup, trainable, optimizer, seq) for _ in range(args.timed_steps)]
        except Exception as error:  # noqa: BLE001 - an out-of-memory is a result; anything else is raised
            if not is_out_of_memory(error):
                raise
            out_of_memory = True
        if out_of_memory:
            release(setup, optimizer)
            done({**row, "result": "out of memory"})
            continue
        seconds = sum(t["seconds"] for t in timed) / len(timed)
        model_flops, executed = flops_per_token(setup, seq)
        row.update(
            result="trained",
            step_s=seconds,
            tokens_per_s=seq / seconds,
            mfu=model_flops * seq / seconds / (device.tflops * 1e12),
            hfu=executed * seq / seconds / (device.tflops * 1e12),
            peak_bytes=max(t["peak_bytes"] for t in timed),
            pinned_bytes=max(t["pinned_bytes"] for t in timed),
        )
        done(row)
    del trainable, optimizer
    _empty_cache(setup.device)
    return rows


def next_probe(seq: int, good: int, bad: int | None, limit: int | None, args) -> int | None:
    """The ceiling search's next length after a probe at `seq` (the last that trained: `good`;
    the first that did not: `bad`), or None when it is over. Before any out of memory S doubles,
    but not past `limit`, the first length the planner rules out, which is probed instead
    (a planner proved wrong there lets the doubling go on); after one, the gap is bisected."""
    if bad is None:
        if seq >= args.max_length:
            return None
        doubled = min(2 * seq, args.max_length)
        return limit if limit is not None and seq < limit < doubled else doubled
    if bad - good <= args.resolution:
        return None
    return good + (bad - good) // 2 // args.resolution * args.resolution or good + args.resolution


def ceiling(args, setup: Setup, start: int, deadline: float, device: catalogue.Device, rows_out: Rows | None = None):
    """The longest S a probe trains at (see the module docstring); a probe the planner says
    would not finish before the deadline is not started."""
    probe_layers = min(args.probe_layers, setup.shape.layers)
    before_ballast = in_use(setup.device)  # what the full-depth model left, if anything
    trainable, optimizer = build_model(setup, probe_layers)
    itemsize = torch.finfo(setup.dtype).bits // 8
    ballast_elements = 2 * (setup.shape.layers - probe_layers) * setup.shape.layer_params  # weights + gradients
    ballast = torch.empty(ballast_elements, dtype=setup.dtype, device=setup.device)
    limit = planner_limit(setup, device, start, args.resolution, args.max_length)
    good, bad, probes = 0, None, []
    seq = start
    while seq is not None:
        plan = predicted(setup, seq, device)
        expected = plan["step_s"] * probe_layers / setup.shape.layers
        probe = {"seq": seq, "planner_peak_bytes": plan["peak_bytes"], "in_use_before": in_use(setup.device)}
        if time.monotonic() + expected > deadline:
            probes.append({**probe, "result": f"not started: the budget (the planner's {expected:.0f} s)"})
            _report_probe(rows_out, probes[-1])
            break
        out_of_memory = False
        try:
            result = step(setup, trainable, optimizer, seq)
        except Exception as error:  # noqa: BLE001 - see full_depth
            if not is_out_of_memory(error):
                raise
            out_of_memory = True
        if out_of_memory:
            release(setup, optimizer)
            bad = seq
            probes.append({**probe, "result": "out of memory"})
        else:
            good = seq
            probes.append({**probe, "result": "trained", **result})
        _report_probe(rows_out, probes[-1])
        seq = next_probe(seq, good, bad, limit, args)
    del ballast, trainable, optimizer
    _empty_cache(setup.device)
    return {
        "longest_seq": good,
        "first_out_of_memory": bad,
        "planner_limit": limit,
        "probe_layers": probe_layers,
        "ballast_bytes": ballast_elements * itemsize,
        "in_use_before_ballast": before_ballast,
        "capped": bad is None,  # by --max-length or the budget: no out of memory seen
        "probes": probes,
    }


def _report_probe(rows_out: Rows | None, probe: dict) -> None:
    if rows_out is None:
        return
    used = probe["in_use_before"]["allocated_bytes"] / GIB
    rows_out.add("probe", probe, f"  probe S={probe['seq']}: {probe['result']} (in use before: {used:.1f} GiB)")


def _empty_cache(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()


def host_check(setup: Setup, seq: int, device: catalogue.Device) -> dict:
    """What full depth at `seq` pins on the host (on a CPU, what a GPU run would: nothing is
    offloaded there), against this machine's RAM."""
    dtype = "bf16" if setup.dtype == torch.bfloat16 else "fp32"
    gpu = device if not device.memory_is_host else catalogue.get_device("h100-80g")
    o = replace(setup.options(), offload_checkpoints=True)
    need = memory.host_memory(setup.shape, seq, 1, o, gpu, dtype)["per_node"]
    ram = catalogue.machine_memory_gib()
    return {"seq": seq, "host_bytes_needed": need, "machine_ram_gib": ram, "fits": ram is None or need / GIB <= ram}


# ------------------------------------------------------------------------ tables
COLUMNS = (
    "S | layers | result | step s | tokens/s | MFU | HFU | peak GiB | planner peak GiB | pinned host GiB | "
    "planner host GiB | planner step s"
)


def row_text(row: dict, setup: Setup, device: catalogue.Device) -> str:
    def gib(key):
        return f"{row[key] / GIB:.1f}" if key in row else "-"

    cells = [
        f"{row['seq']:,}",
        str(row["layers"]),
        row["result"],
        f"{row['step_s']:.2f}" if "step_s" in row else "-",
        f"{row['tokens_per_s']:,.0f}" if "tokens_per_s" in row else "-",
        f"{row['mfu']:.2f}" if "mfu" in row else "-",
        f"{row['hfu']:.2f}" if "hfu" in row else "-",
        gib("peak_bytes"),
        gib("planner_peak_bytes"),
        gib("pinned_bytes") if setup.offload else "- (cpu)",
        gib("planner_host_bytes"),
        f"{row['planner_step_s']:.2f}",
    ]
    return "| " + " | ".join(cells) + " |"


def report(args, setup: Setup, device: catalogue.Device, rows, top, host) -> str:
    lines = [
        f"{args.config} ({setup.shape.params / 1e9:.3g}B parameters), {args.param_dtype} weights, SGD, every layer "
        f"checkpointed{' (inputs offloaded to pinned host memory)' if setup.offload else ''}, MLP tiles of "
        f"{setup.tile:,} tokens, loss chunks of {setup.chunk:,}; {_device_name(setup.device)}, peak "
        f"{device.tflops:g} TFLOP/s",
        "",
        "| " + COLUMNS + " |",
        "|" + "---|" * len(COLUMNS.split(" | ")),
        *(row_text(r, setup, device) for r in rows),
        "",
        f"Ceiling: the longest S that trained is {top['longest_seq']:,} tokens"
        + (
            f" (no out of memory before --max-length {args.max_length:,} or the budget)"
            if top["capped"]
            else f" (first out of memory: {top['first_out_of_memory']:,})"
        )
        + f", probed on {top['probe_layers']} layers with the other layers' weights and gradients as "
        f"{top['ballast_bytes'] / GIB:.1f} GiB of ballast ({top['in_use_before_ballast']['allocated_bytes'] / GIB:.1f} "
        f"GiB in use before it{'' if setup.device.type == 'cuda' else ': the process'}); the planner rules out "
        + (f"{top['planner_limit']:,} tokens and up." if top["planner_limit"] else "no length up to --max-length."),
        f"Host: full depth at {host['seq']:,} tokens needs {host['host_bytes_needed'] / GIB:.1f} GiB of pinned host "
        f"memory; this machine has "
        + (f"{host['machine_ram_gib']:.0f} GiB" if host["machine_ram_gib"] else "an unknown amount")
        + (" (fits)" if host["fits"] else " (does not fit: full depth at this length is host-bound)")
        + ("" if setup.offload else " (CPU: nothing is offloaded; the figure is what a GPU run would pin)"),
    ]
    return "\n".join(lines)


def _device_name(device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def main(argv=None) -> int:
    allocator = use_expandable_segments()  # before parse_args asks CUDA anything
    args = parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    setup = build_setup(args)
    device = planner_device(args, setup)
    rows_out = Rows(args.jsonl)
    rows_out.add(
        "setup",
        {
            "config": args.config,
            "device": _device_name(setup.device),
            "planner_device": device.name,
            "peak_tflops": device.tflops,
            "allocator": allocator,
            "budget_s": args.budget_s,
        },
        f"{_device_name(setup.device)} as the planner's {device.name} ({device.tflops:g} TFLOP/s); "
        f"{ALLOCATOR_VARIABLE}={allocator}",
    )
    print(f"| {COLUMNS} |", flush=True)
    rows = full_depth(args, setup, device, deadline - args.budget_s / 3, rows_out)  # a third kept for the probes
    trained = [r["seq"] for r in rows if r["result"] == "trained"]
    top = ceiling(args, setup, max(trained or [args.lengths[0]]), deadline, device, rows_out)
    rows_out.add("ceiling", {k: v for k, v in top.items() if k != "probes"})
    host = host_check(setup, max(top["longest_seq"], 1), device)
    rows_out.add("host", host)
    text = report(args, setup, device, rows, top, host)
    print("\n" + text)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "config": args.config,
                    "device": _device_name(setup.device),
                    "allocator": allocator,
                    "rows": rows,
                    "ceiling": top,
                    "host": host,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
