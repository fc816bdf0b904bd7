"""The recipes: what train.py, the eval scripts and the planner need beyond the library.

They use easy_context as any user does (its public names and rooms); the library never imports
them. Command lines, the data pipelines, checkpoints and the repository's shipped files
(models/demo-base, configs/) live here, not in the library.

training/      train.py's steps (run, model, batches, report) and its configuration (config.py)
configuration.py  settings as dataclasses -> the command line, --help and the docs' flag tables;
               the parallelism section the scripts share
evaluation_config.py  the eval scripts' and tools/generate.py's settings (NeedleConfig, ...),
               their shared sections declared once
launch.py      start (accelerator, --dist-timeout), fail (exit codes), shut down cleanly
stopping.py    why a run stopped, said once: a rank's stop recorded for its peers; Ctrl-C / SIGTERM
faults.py      a test hook: EASY_CONTEXT_FAULT's deterministic failures (hang, die in a save, ...)
data/          datasets to packed rows; the embedded default corpus
models/        load or build a model for a supported type; the pretrained models fetched by name
               (python -m recipes.models get NAME) and model_source, which maps --model names to them
checkpointing.py  train.py's resumable checkpoints: atomic saves, pruning, resume checks
tiled_mlp.py   MLPs run in sequence tiles (activation memory)
lora.py        LoRA adapters (peft, lazily): train.py --lora-r, adapter folders for the evals
needle.py      needle / passkey prompts for any tokenizer
ruler.py       RULER-style tasks (needles of several kinds, variable tracking, word extraction),
               exact token lengths, offline; ruler_tasks/ holds them as lm-eval task files
demo_data.py   the demo base's tokenizer, copy and needle rows, accuracies (scripts/pretrain_demo_base.py)
evaluation.py  score whole sequences over an SP group (no grad, per-token results)
lm_eval_model.py  lm-evaluation-harness's model `easy_context` (imports lm-eval: eval_harness.py)
plots.py       heatmaps and curves
plan/          the planner: memory and time per mode for a model, length and cluster
fsdp.py        train.py --fsdp: PyTorch FSDP2 applied directly, one unit per decoder layer
manifest.py    a checkpoint folder's manifest: every file's size and SHA-256, written last
"""
