"""Pretrain the demo's base model, once, on CPU: a tiny Llama that retrieves needles at short context.

    python scripts/pretrain_demo_base.py --out outputs/demo-base            # 6500 steps, ~50 min on one core
    python scripts/pretrain_demo_base.py --out outputs/demo-base --resume   # continue an interrupted run

The recipe (issue 31's probes; data in recipes/demo_data.py): a byte-level BPE
tokenizer with every 1-3 digit group one token; a 2-layer x 128 Llama (0.6M parameters); a
curriculum that trains copying alone at 64 tokens first (induction heads form there within a
few hundred steps; at 256 they had not after 1,150), then 70% needle rows at 128, 256 and 512
tokens. In the probe, exact retrieval at 256 tokens jumped to 0.94 at step ~3,100, 1.00 by 3,400.

Every --eval-every steps: exact answers and accuracy per answer token (the phase change shows
digit group by digit group) on fixed needle prompts per length, without and with 3
distractors, and copy accuracy; one JSON line in the log, one short line on stdout. The same
--seed gives the same data and the same curve (at the same --threads).

--out receives config.json, model.safetensors, the tokenizer files, train_log.jsonl and
checksums.json (sha256), all moved into place at the end. During the run it holds
checkpoint.pt (every --save-every steps, and on SIGINT / SIGTERM after the current step) and
train_log.partial.jsonl; --resume continues from the checkpoint exactly.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

import torch

from recipes.demo_data import (
    MIN_PROMPT,
    NeedleRows,
    answer_accuracy,
    copy_accuracy,
    copy_row,
    demo_batch,
    demo_tokenizer,
    tokenizer_from_json,
)
from recipes.launch import fail, run_main

SCRIPT = "pretrain_demo_base.py"
# (from step, sequence length, share of copy rows, batch size): each stage runs after its step
SCHEDULE = "0:64:1.0:64,600:128:0.3:32,2000:256:0.3:16,3500:512:0.3:8"
MAX_POSITIONS = 4096
MAX_MODEL_BYTES = 10 * 2**20  # the base is shipped in the repository
EVAL_SEED = 31  # the evaluation set does not depend on --seed: runs of different seeds score the same prompts
EVAL_DISTRACTORS = 3
EVAL_COPY_LENGTH = 256
# a resumed run must match these to continue the same curve (--steps may grow, --threads may change)
RESUME_KEYS = (
    "seed",
    "schedule",
    "lr",
    "warmup",
    "decay",
    "eval_every",
    "eval_lengths",
    "eval_prompts",
    "eval_copy_rows",
)
CHECKPOINT, PARTIAL_LOG, LOG = "checkpoint.pt", "train_log.partial.jsonl", "train_log.jsonl"


def learning_rate(args, step: int) -> float:
    """Linear warm-up to --lr, constant, then linear decay to 10% over the last --decay steps."""
    warm = min(1.0, step / max(1, args.warmup))
    left = args.steps - step
    decay = 1.0 if left >= args.decay else 0.1 + 0.9 * left / args.decay
    return args.lr * min(warm, decay)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder (the model, tokenizer, log, checksums, checkpoint)")
    p.add_argument("--seed", type=int, default=0, help="seeds the data (python random) and the initial weights (torch)")
    p.add_argument("--steps", type=int, default=6500, help="optimizer steps")
    p.add_argument("--threads", type=int, default=1, help="torch and tokenizers threads")
    p.add_argument("--save-every", type=int, default=500, help="steps between checkpoints")
    p.add_argument("--eval-every", type=int, default=50, help="steps between evaluations (and log lines)")
    p.add_argument("--resume", action="store_true", help="continue from --out's checkpoint")
    p.add_argument("--schedule", default=SCHEDULE, help="stages as STEP:LENGTH:COPY_SHARE:BATCH,... (from step 0)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate between the warm-up and the decay")
    p.add_argument("--warmup", type=int, default=100, help="steps of linear learning-rate warm-up")
    # At a constant rate, accuracy at 512 tokens swung between 0.36 and 0.94 from one evaluation
    # to the next over the last 1,000 of 5,000 steps; a decay at the end settles it.
    p.add_argument("--decay", type=int, default=1500, help="last steps, over which the rate falls linearly to 10%%")
    p.add_argument("--eval-lengths", default="256,512", help="needle prompt lengths of the evaluation, in tokens")
    p.add_argument("--eval-prompts", type=int, default=64, help="prompts per length (and half that with distractors)")
    p.add_argument("--eval-copy-rows", type=int, default=8, help=f"copy rows of {EVAL_COPY_LENGTH} tokens scored")
    args = p.parse_args(argv)
    try:
        args.stages = parse_schedule(args.schedule)
    except ValueError as error:
        fail(SCRIPT, f"--schedule: {error}")
    try:
        args.lengths = [int(x) for x in args.eval_lengths.split(",")]
    except ValueError:
        fail(SCRIPT, f"--eval-lengths takes comma-separated integers, got {args.eval_lengths!r}")
    for flag in ("steps", "threads", "save_every", "eval_every", "eval_prompts"):
        if getattr(args, flag) < 1:
            fail(SCRIPT, f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.eval_copy_rows < 0 or args.warmup < 0 or args.decay < 0 or not args.lr > 0:
        fail(SCRIPT, "--eval-copy-rows, --warmup and --decay must be >= 0 and --lr > 0")
    if not all(2 * MIN_PROMPT <= n <= MAX_POSITIONS for n in args.lengths):
        fail(SCRIPT, f"--eval-lengths must lie within [{2 * MIN_PROMPT}, {MAX_POSITIONS}], got {args.eval_lengths}")
    return args


def parse_schedule(text: str) -> list[tuple[int, int, float, int]]:
    stages = []
    for part in text.split(","):
        try:
            step, length, share, batch = part.split(":")
            stages.append((int(step), int(length), float(share), int(batch)))
        except ValueError:
            raise ValueError(f"a stage is STEP:LENGTH:COPY_SHARE:BATCH (int:int:float:int), got {part!r}") from None
    starts = [s[0] for s in stages]
    if starts[0] != 0 or starts != sorted(set(starts)):
        raise ValueError(f"stages must start at step 0 and in increasing order, got {text!r}")
    for _, length, share, batch in stages:
        if not (0.0 <= share <= 1.0 and batch >= 1 and 16 < length <= MAX_POSITIONS):
            raise ValueError(f"need 0 <= COPY_SHARE <= 1, BATCH >= 1, 16 < LENGTH <= {MAX_POSITIONS} in {text!r}")
        if share < 1.0 and length <= MIN_PROMPT:
            raise ValueError(f"needle rows need LENGTH > {MIN_PROMPT} (or COPY_SHARE 1), in {text!r}")
    return stages


def stage_at(stages, step: int) -> tuple[int, float, int]:
    """(length, copy share, batch) of optimizer step `step` (1-based)."""
    return [stage for stage in stages if step > stage[0]][-1][1:]


def build_model(tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


class EvalSet:
    """Fixed needle prompts (numbers drawn as eval_needle.py draws them) and copy rows."""

    def __init__(self, needles: NeedleRows, args):
        rng = random.Random(EVAL_SEED)
        number = lambda r: str(r.randrange(10**6, 10**7))
        self.eos = needles.eos
        self.needles = {}  # (length, distractors) -> prompts
        for length in args.lengths:
            self.needles[length, 0] = [needles.prompt(rng, length, 0, number) for _ in range(args.eval_prompts)]
            hard = [needles.prompt(rng, length, EVAL_DISTRACTORS, number) for _ in range(args.eval_prompts // 2)]
            self.needles[length, EVAL_DISTRACTORS] = hard
        self.copy = [copy_row(rng, EVAL_COPY_LENGTH) for _ in range(args.eval_copy_rows)]

    def run(self, model) -> dict:
        needle = [
            {"length": length, "distractors": d, **answer_accuracy(model, prompts, self.eos)}
            for (length, d), prompts in self.needles.items()
            if prompts
        ]
        return {"needle": needle, "copy": copy_accuracy(model, self.copy) if self.copy else None}


def weighted_loss(model, ids, weights):
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
    losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    targets = weights[:, 1:].flatten()
    return (losses * targets).sum() / targets.sum()


def atomic_write(path: Path, write) -> None:
    """write(tmp_path), then rename over `path`: a reader (or a resume) never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def load_checkpoint(args, out: Path) -> dict:
    path = out / CHECKPOINT
    if not path.exists():
        fail(SCRIPT, f"--resume: no {CHECKPOINT} in {out} (none there, or the run finished)")
    state = torch.load(path)
    changed = {k: (v, getattr(args, k)) for k, v in state["flags"].items() if v != getattr(args, k)}
    if changed:
        fail(SCRIPT, "--resume: the checkpoint was made with other flags (saved, now): " + json.dumps(changed))
    if state["step"] > args.steps:
        fail(SCRIPT, f"--resume: the checkpoint is at step {state['step']}, past --steps {args.steps}")
    return state


def train(args) -> None:
    torch.set_num_threads(args.threads)
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # tokenizers' pool, read at its first use
    out = Path(args.out)
    if not args.resume and ((out / CHECKPOINT).exists() or (out / "checksums.json").exists()):
        fail(SCRIPT, f"{out} holds a run already: --resume an unfinished one, or choose another --out")
    state = load_checkpoint(args, out) if args.resume else None
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = tokenizer_from_json(state["tokenizer"]) if state else demo_tokenizer()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model = build_model(tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    needles = NeedleRows(tokenizer, max([length for _, length, _, _ in args.stages] + args.lengths))
    evals = EvalSet(needles, args)
    step, seconds, interval = 0, 0.0, [0.0, 0, 0.0]  # interval: loss sum, steps, training seconds
    records = []
    if state:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        rng.setstate(state["python_rng"])
        torch.set_rng_state(state["torch_rng"])
        step, seconds, interval = state["step"], state["seconds"], state["interval"]
        if (out / PARTIAL_LOG).exists():  # evaluations logged after the checkpoint are redone
            lines = (out / PARTIAL_LOG).read_text().splitlines()
            records = [line for line in lines if line.strip() and json.loads(line)["step"] <= step]
        print(f"resumed at step {step} from {out / CHECKPOINT}", flush=True)
    atomic_write(out / PARTIAL_LOG, lambda tmp: tmp.write_text("".join(line + "\n" for line in records)))
    parameters = sum(p.numel() for p in model.parameters())
    print(f"tokenizer {len(tokenizer)} tokens, model {parameters / 1e6:.2f}M parameters", flush=True)

    def save_checkpoint():
        checkpoint = {
            "step": step,
            "seconds": seconds,
            "interval": interval,
            "flags": {key: getattr(args, key) for key in RESUME_KEYS},
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "python_rng": rng.getstate(),
            "torch_rng": torch.get_rng_state(),
            "tokenizer": tokenizer.backend_tokenizer.to_str(),
        }
        atomic_write(out / CHECKPOINT, lambda tmp: torch.save(checkpoint, tmp))

    stop = []  # a signal stops the run after the current step, with a checkpoint
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda signum, frame: stop.append(signum))

    model.train()
    with open(out / PARTIAL_LOG, "a") as log:
        while step < args.steps and not stop:
            started = time.perf_counter()
            length, share, batch = stage_at(args.stages, step + 1)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(args, step + 1)
            ids, weights = demo_batch(rng, needles, length, share, batch)
            loss = weighted_loss(model, ids, weights)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            took = time.perf_counter() - started
            seconds += took
            interval = [interval[0] + loss.item(), interval[1] + 1, interval[2] + took]
            if step % args.eval_every == 0 or step == args.steps:
                started = time.perf_counter()
                scores = evals.run(model)
                seconds += time.perf_counter() - started
                record = {
                    "step": step,
                    "seq_length": length,
                    "batch_size": batch,
                    "copy_share": share,
                    "lr": optimizer.param_groups[0]["lr"],
                    "loss": interval[0] / interval[1],
                    "steps_per_s": interval[1] / interval[2],
                    "eval_seconds": time.perf_counter() - started,
                    "seconds": seconds,
                    **scores,
                }
                log.write(json.dumps(record) + "\n")
                log.flush()
                print(summary(record), flush=True)
                interval = [0.0, 0, 0.0]
            # the last step too: a run killed while writing its final files resumes straight to them
            if step % args.save_every == 0 or step == args.steps:
                save_checkpoint()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)
    if stop and step < args.steps:
        save_checkpoint()
        print(f"stopped by signal {stop[0]} at step {step}; checkpoint saved, continue with --resume", flush=True)
        raise SystemExit(128 + stop[0])
    finish(out, model, tokenizer)


def summary(record: dict) -> str:
    parts = [f"step {record['step']:5d} L={record['seq_length']} loss {record['loss']:.3f}"]
    for score in record["needle"]:
        tokens = "/".join(f"{x:.2f}" for x in score["per_token"])
        name = f"{score['length']}" + (f"+{score['distractors']}d" if score["distractors"] else "")
        parts.append(f"{name} exact {score['exact']:.2f} ({tokens})")
    if record["copy"] is not None:
        parts.append(f"copy {record['copy']:.2f}")
    return " | ".join(parts) + f" | {record['steps_per_s']:.2f} steps/s {record['seconds']:.0f}s"


def finish(out: Path, model, tokenizer) -> None:
    """Write the final files into a staging folder, check them, then move them into --out with
    checksums.json last (its presence marks a finished run) and drop the checkpoint."""
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()  # one bar for one small file
    staging = out / ".final.partial"
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    shutil.copyfile(out / PARTIAL_LOG, staging / LOG)
    weights = staging / "model.safetensors"
    if weights.stat().st_size > MAX_MODEL_BYTES:
        fail(SCRIPT, f"model.safetensors is {weights.stat().st_size} bytes, over {MAX_MODEL_BYTES}", code=1)
    checksums = {
        n: hashlib.sha256((staging / n).read_bytes()).hexdigest() for n in ("model.safetensors", "tokenizer.json")
    }
    (staging / "checksums.json").write_text(json.dumps(checksums, indent=2) + "\n")
    files = sorted(staging.iterdir(), key=lambda f: f.name == "checksums.json")
    if any(f.is_dir() for f in files):
        fail(SCRIPT, f"unexpected folder in the saved model: {[f.name for f in files if f.is_dir()]}", code=1)
    for f in files:
        f.chmod(0o644)  # save_pretrained writes the weights through a private temporary file
        os.replace(f, out / f.name)
    staging.rmdir()
    (out / CHECKPOINT).unlink(missing_ok=True)
    (out / PARTIAL_LOG).unlink()
    size = (out / "model.safetensors").stat().st_size
    print(f"saved {out} (model.safetensors {size / 2**20:.2f} MiB, sha256 {checksums['model.safetensors']})")


def main(argv=None):
    train(parse_args(argv))


if __name__ == "__main__":
    run_main(main)
