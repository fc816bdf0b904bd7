"""train.py's per-rank peak memory under DDP, FSDP2 and DeepSpeed ZeRO-3, on the same model,
next to the planner's prediction for each row (issue 30).

    python -m benchmarks.bench_sharding --seq-lengths 16384,32768 --exact-memory --csv docs/bench_sharding.csv
    python -m benchmarks.bench_sharding --smoke                    # tiny sizes, seconds a row

Every row is a fresh train.py launch of 2 processes (CPU, gloo, fp32, one thread each) on the
same random-weight Llama (vocab 32000, hidden 768, intermediate 2048, 2 layers, 12 query / 4 KV
heads: 62M parameters, 80% of them embeddings and output layer, so that the weights, not the
activations, set the peak), written once as a model folder with the byte tokenizer, so
train.py trains on its embedded corpus:
zigzag_ring_attn over both ranks, --activation-checkpointing --tiled-mlp 1024
--loss-chunk-size 1024 (activations stay small: the model states show), 2 AdamW steps (Adam's
moments exist from the first step on), --max-rows 4.

  ddp            torchrun train.py (accelerate wraps the model in DDP)
  fsdp2          torchrun train.py --fsdp
  fsdp2-offload  torchrun train.py --fsdp --fsdp-offload
  zero3          accelerate launch, DeepSpeed ZeRO-3 without offload: accelerate_configs/zero3_offload.json
                 without offload_optimizer / offload_param, torch's AdamW (DeepSpeed's FusedAdam is CUDA's)
  zero3-offload  accelerate launch --config_file accelerate_configs/cpu_zero3_offload.yaml (as shipped)

Columns: the last step's seconds (train_log.jsonl); the largest per-rank peak RSS
(train_summary.json's peak_rss_mib_per_rank: each rank's high-water mark from its start to
the end of training, model loading included, the final save not); the planner's peak for the
row (plan.estimate: device cpu, fp32, the row's setting, the same options) and its phase;
measured / predicted. --exact-memory runs the ranks with MALLOC_MMAP_THRESHOLD_=65536 (freed
tensors go back to the OS at once), so RSS follows live memory rather than glibc's cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import int_list, table_header, table_row, use_exact_memory, write_csv

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "train.py"
WORLD = 2


@dataclass(frozen=True)
class Sizes:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    tile: int  # --tiled-mlp and --loss-chunk-size


FULL = Sizes(vocab=32000, hidden=768, intermediate=2048, layers=2, heads=12, kv_heads=4, tile=1024)
SMOKE = Sizes(vocab=1000, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, tile=128)


# ----------------------------------------------------------------------------- the model
def write_model(folder: Path, sizes: Sizes) -> None:
    """A random-weight Llama and the byte tokenizer, as train.py --model reads them."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from recipes.data import BYTE_EOS_ID, byte_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=sizes.vocab,
        hidden_size=sizes.hidden,
        intermediate_size=sizes.intermediate,
        num_hidden_layers=sizes.layers,
        num_attention_heads=sizes.heads,
        num_key_value_heads=sizes.kv_heads,
        max_position_embeddings=1 << 20,
        bos_token_id=BYTE_EOS_ID,
        eos_token_id=BYTE_EOS_ID,
        tie_word_embeddings=False,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)


# ---------------------------------------------------------------------------- launching
def zero3_without_offload(workdir: Path) -> Path:
    """An accelerate config for ZeRO-3 on CPU with nothing offloaded: the shipped one pointing at
    zero3_offload.json less its offload sections, with torch's AdamW."""
    import yaml  # accelerate's dependency

    ds_config = json.loads((ROOT / "accelerate_configs" / "zero3_offload.json").read_text())
    for section in ("offload_optimizer", "offload_param"):
        ds_config["zero_optimization"].pop(section)
    ds_config["optimizer"]["params"]["torch_adam"] = True
    ds_path = workdir / "zero3.json"
    ds_path.write_text(json.dumps(ds_config, indent=1))
    launch = yaml.safe_load((ROOT / "accelerate_configs" / "cpu_zero3_offload.yaml").read_text())
    launch["deepspeed_config"]["deepspeed_config_file"] = str(ds_path)
    launch_path = workdir / "zero3.yaml"
    launch_path.write_text(yaml.safe_dump(launch))
    return launch_path


def shipped_cpu_zero3_offload(workdir: Path) -> Path:
    return ROOT / "accelerate_configs" / "cpu_zero3_offload.yaml"


@dataclass(frozen=True)
class Config:
    setting: str  # the planner's name for it (sharding.SHARDINGS)
    flags: tuple[str, ...] = ()  # train.py's
    # accelerate launch with the config this writes or names (given a scratch folder); None: torchrun
    accelerate_config: Callable[[Path], Path] | None = None


CONFIGS = {
    "ddp": Config("none"),
    "fsdp2": Config("fsdp2", ("--fsdp",)),
    "fsdp2-offload": Config("fsdp2-offload", ("--fsdp", "--fsdp-offload")),
    "zero3": Config("zero3", accelerate_config=zero3_without_offload),
    "zero3-offload": Config("zero3-offload", accelerate_config=shipped_cpu_zero3_offload),
}


def launch_command(name: str, workdir: Path) -> list[str]:
    make_config = CONFIGS[name].accelerate_config
    if make_config is None:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(WORLD)]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(make_config(workdir))]


def train_flags(name: str, model: Path, out: Path, seq: int, mode: str, tile: int) -> list[str]:
    return [
        str(TRAIN),
        "--model",
        str(model),
        "--parallel-mode",
        mode,
        "--seq-length",
        str(seq),
        "--max-train-steps",
        "2",
        "--max-rows",
        "4",
        "--activation-checkpointing",
        "--tiled-mlp",
        str(tile),
        "--loss-chunk-size",
        str(tile),
        "--log-with",
        "none",
        "--output-dir",
        str(out),
        *CONFIGS[name].flags,
    ]


def measure(name: str, model: Path, seq: int, mode: str, tile: int, workdir: Path, timeout: float) -> dict:
    """One train.py launch: its peaks and last step time, or {"error": the last line it wrote}."""
    out = workdir / f"{name}-{seq}"
    command = launch_command(name, workdir) + train_flags(name, model, out, seq, mode, tile)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("EASY_CONTEXT_FAULT", None)
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if "error" in line.lower()] or result.stderr.splitlines()
        return {"error": f"exit {result.returncode}: {(lines or ['(no output)'])[-1][:300]}"}
    summary = json.loads((out / "train_summary.json").read_text())
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    peaks = summary["peak_rss_mib_per_rank"]
    return {"step_s": seq / log[-1]["tokens_per_s"], "peak_mib": max(peaks), "peak_mib_per_rank": peaks}


# ------------------------------------------------------------------------------ planner
def ring_degree(mode: str) -> int:
    """train.py's default ring degree for `mode` over the benchmark's ranks."""
    from easy_context.modes import get_mode

    return get_mode(mode).topology(WORLD, None, None).ring_degree


def prediction(shape, name: str, seq: int, mode: str, tile: int) -> tuple[float, str]:
    """(the planner's per-rank peak MiB for this row, its phase)."""
    from recipes.plan import MIB, Options, estimate, get_device

    options = Options(mode, WORLD, ring_degree(mode), True, False, tile, tile, CONFIGS[name].setting)
    result = estimate(shape, seq, WORLD, options, get_device("cpu"), "fp32")
    return result["peak_bytes"] / MIB, result["peak_phase"]


def model_shape(folder: Path):
    from transformers import AutoConfig

    from recipes.plan import shape_from_config

    return shape_from_config(AutoConfig.from_pretrained(folder), "bench_sharding")


# --------------------------------------------------------------------------------- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lengths", default="16384,32768", help="comma separated (default 16384,32768)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma separated, of {list(CONFIGS)}")
    p.add_argument("--mode", default="zigzag_ring_attn", help="train.py's --parallel-mode (over both ranks)")
    p.add_argument("--exact-memory", action="store_true", help="MALLOC_MMAP_THRESHOLD_=65536 in the ranks (see above)")
    p.add_argument("--timeout", type=float, default=7200, help="seconds one launch may take (default 7200)")
    p.add_argument("--csv", default=None, help="also write the rows here")
    p.add_argument("--smoke", action="store_true", help=f"tiny sizes ({SMOKE}), S = 512: for CI")
    args = p.parse_args(argv)
    args.config_names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in args.config_names if c not in CONFIGS]
    if unknown or not args.config_names:
        p.error(f"--configs: {f'unknown {unknown}' if unknown else 'none given'}; choose from {list(CONFIGS)}")
    try:
        args.seqs = [512] if args.smoke else int_list(args.seq_lengths)
    except ValueError:
        p.error(f"--seq-lengths must be comma-separated integers, got {args.seq_lengths!r}")
    if not args.seqs or min(args.seqs) < 1:
        p.error(f"--seq-lengths must be positive, got {args.seq_lengths!r}")
    from easy_context.modes import MODE_NAMES, get_mode

    sequence_parallel = [m for m in MODE_NAMES if get_mode(m).sequence_parallel]
    if args.mode not in sequence_parallel:
        p.error(f"--mode {args.mode!r}: choose a sequence-parallel mode, one of {sequence_parallel}")
    from recipes.plan import layout_multiple

    multiple = layout_multiple(args.mode, WORLD, ring_degree(args.mode))
    if any(seq % multiple for seq in args.seqs):
        p.error(f"--seq-lengths {args.seq_lengths}: {args.mode} over {WORLD} ranks needs multiples of {multiple}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.exact_memory:
        use_exact_memory()
    sizes = SMOKE if args.smoke else FULL
    rows, failed = [], 0
    with tempfile.TemporaryDirectory(prefix="bench_sharding_") as tmp:
        workdir = Path(tmp)
        model = workdir / "model"
        write_model(model, sizes)
        shape = model_shape(model)
        print(
            f"model: {shape.params / 1e6:.1f}M parameters (vocab {shape.vocab}, hidden {shape.hidden}, "
            f"{shape.layers} layers); {WORLD} ranks, {args.mode}, tile / loss chunk {sizes.tile}, fp32, CPU\n",
            flush=True,
        )
        columns = ["config", "S", "step s", "peak MiB/rank (max)", "predicted MiB/rank", "measured / predicted"]
        print(table_header([*columns, "predicted peak phase"]), flush=True)
        for seq in args.seqs:
            for name in args.config_names:
                measured = measure(name, model, seq, args.mode, sizes.tile, workdir, args.timeout)
                predicted, phase = prediction(shape, name, seq, args.mode, sizes.tile)
                row = {"config": name, "setting": CONFIGS[name].setting, "seq": seq, **measured}
                row.update(predicted_mib=round(predicted, 1), predicted_phase=phase)
                rows.append(row)
                if "error" in measured:
                    failed += 1
                    print(table_row([name, str(seq), "failed", "", f"{predicted:.0f}", "", phase]), flush=True)
                    print(f"  {name} S={seq}: {measured['error']}", file=sys.stderr, flush=True)
                    continue
                ratio = measured["peak_mib"] / predicted
                cells = [f"{measured['step_s']:.2f}", f"{measured['peak_mib']:.0f}", f"{predicted:.0f}", f"{ratio:.2f}"]
                print(table_row([name, str(seq), *cells, phase]), flush=True)
    if args.csv:
        write_csv(args.csv, rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
