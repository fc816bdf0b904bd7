"""What a run leaves: each step's log line, the run's summary, and the trained model."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch

from recipes import fsdp
from recipes.configuration import values_of
from recipes.training.run import Run


class TrainingLog:
    """Each step's loss, learning rate and throughput: on the progress bar, to the tracker, and
    one JSON line per step in <output-dir>/train_log.jsonl (written by the main process)."""

    def __init__(self, run: Run, tracker: str, first_step: int, resumed: bool):
        from tqdm.auto import tqdm

        config, accelerator = run.config, run.accelerator
        self.accelerator = accelerator
        self.path = Path(config.checkpoints.output_dir) / "train_log.jsonl"
        if accelerator.is_main_process:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not resumed:
                self.path.unlink(missing_ok=True)  # a fresh run starts a fresh log
            else:
                keep_steps_up_to(self.path, first_step)
        if accelerator.is_main_process and tracker != "none":
            accelerator.init_trackers(
                config.logging.wandb or "easy-context",
                config={k: v for k, v in vars(values_of(config)).items() if v is not None},
            )
        self.tokens_per_step = (
            config.data.seq_length
            * config.data.batch_size
            * config.optimisation.gradient_accumulate_every
            * run.dp_size
        )
        self.bar = tqdm(
            total=config.optimisation.max_train_steps,
            initial=first_step,
            disable=not accelerator.is_local_main_process,
            desc="train",
        )

    def step(self, step: int, loss: float | None, lr: float, elapsed: float) -> None:
        """Step `step` took `elapsed` seconds; its loss is None when it was skipped."""
        tokens_per_s = self.tokens_per_step / elapsed
        self.bar.update(1)
        record = {"step": step, "lr": lr, "tokens_per_s": tokens_per_s}
        if loss is not None:
            record["loss"] = loss
            self.bar.set_postfix(
                loss=f"{loss:.4f}", ppl=f"{math.exp(min(loss, 50)):.2f}", tok_s=f"{tokens_per_s:.0f}", lr=f"{lr:.2e}"
            )
            self.accelerator.log(
                {"loss": loss, "ppl": math.exp(min(loss, 50)), "tokens_per_s": tokens_per_s, "lr": lr}, step=step
            )
        else:
            record.update(loss=None, skipped=True)
        if self.accelerator.is_main_process:
            with open(self.path, "a") as log:
                log.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self.bar.close()


def keep_steps_up_to(path: Path, step: int) -> None:
    """A resumed run's log: the lines of steps 1..`step` (the checkpoint's), so that the steps
    the run does again after an interrupt or a crash appear once; rewritten whole, then renamed."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):  # a line cut short by a kill
            continue
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(f"{line}\n" for line in kept))
    os.replace(partial, path)


def write_summary(run: Run, step: int, loss: float, skipped: int) -> None:
    """<output-dir>/train_summary.json: steps, final loss, and each rank's peak memory so far
    (training, before the final save), in one gather."""
    from accelerate.utils import gather_object

    accelerator = run.accelerator
    peak_rss = gather_object([peak_rss_mib()])
    device = accelerator.device
    peak_gpu = gather_object(
        [round(torch.cuda.max_memory_allocated(device) / 2**20, 1) if device.type == "cuda" else None]
    )
    if accelerator.is_main_process:
        summary = {
            "steps": step,
            "final_loss": loss if math.isfinite(loss) else None,
            "skipped_steps": skipped,
            "peak_rss_mib_per_rank": peak_rss,
            "peak_cuda_allocated_mib_per_rank": peak_gpu,
        }
        (Path(run.config.checkpoints.output_dir) / "train_summary.json").write_text(json.dumps(summary, indent=1))


def peak_rss_mib() -> float | None:
    """This process's peak resident memory (None where the OS does not report it)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)


def save_model(run: Run, trainable, tokenizer, loss: float) -> None:
    """The trained model (without the loss wrapper) and tokenizer, save_pretrained into --output-dir;
    with --lora-r the PeftModel's save_pretrained writes the adapter only."""
    accelerator, output_dir = run.accelerator, run.config.checkpoints.output_dir
    run.stage.at("saving the model")
    accelerator.wait_for_everyone()
    state_dict = (
        fsdp.full_state_dict(trainable) if run.config.parallelism.fsdp else accelerator.get_state_dict(trainable)
    )
    if accelerator.is_main_process:
        state_dict = {k.removeprefix("model."): v for k, v in state_dict.items()}
        unwrapped = accelerator.unwrap_model(trainable).model
        unwrapped.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(output_dir)
        accelerator.print(f"saved the model to {output_dir} (final loss {loss:.4f})")
