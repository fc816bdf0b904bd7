#!/usr/bin/env bash
# Everything a GPU has to show, in one run, into ONE results file. Sized for one 15-minute device
# lease: the sections' limits add up to the 520 s default deadline (one command may run 600 s),
# which leaves, after a machine's start (a minute or more), room for one rerun of the longest
# section (`--only kernels`); a section the deadline leaves no time for is reported as not run.
# scripts/gpu_lease.sh runs the new sections of this script within a lease beside the other
# GPU work (its part a: `--only ... --deadline ... --jsonl ...`).
# On several GPUs it runs, by default, what one GPU cannot (the NCCL sections) and what they
# need, within the same deadline (SEVERAL_GPUS_ONLY below; `--only` chooses others).
#
#   bash scripts/gpu_check.sh                   # on a CUDA machine: results in gpu_check_results/gpu_check.md
#   bash scripts/gpu_check.sh --out DIR         # (the device tool's $OUT is used when set)
#   bash scripts/gpu_check.sh --dry-run         # on CPU: the same sections at CPU sizes (CI runs this)
#   bash scripts/gpu_check.sh --deadline 520    # seconds for the whole run (default 520; dry run 1200)
#   bash scripts/gpu_check.sh --only kernels,train   # just these sections (a rerun of what failed)
#   bash scripts/gpu_check.sh --jsonl FILE      # also one JSON line per section as it finishes
#
# Compile safety: a section that fails while compiling flex (an Inductor or Triton error with
# flex in its log) runs once more with EASY_CONTEXT_FLEX_COMPILE=off (flex eager), within the
# deadline, and its verdict and JSON line say so: one broken compile does not cost every flex
# section its other checks. kernels counts flex's graphs first (they are what compiles), and
# train compares each variant's loss as soon as it has run.
#
# Sections, in the order they run: what no GPU has run yet first (so a run cut short still
# shows it), then what ran on the first H200 run and has changed since, then what has not
# (trimmed). Each has its own time limit; one failing does not stop the others. Every check
# prints its rows as they finish, so a section stopped at its limit keeps the rows it finished.
#   env         torch / CUDA / GPU, the optional packages, the kernel backends usable per dtype,
#               the compile caches (warm or cold)
#   toolchain   the C compiler Triton needs (flex attention, --compile), before anything compiles
#   kernels     tools/check_kernels.py: every backend vs fp64, fp32 and bf16, bound 2x SDPA's error:
#               causal, rectangular, packed documents, and a window a quarter of S (fp32: the
#               band path's tiles, dK/dV summed over them); then flex's compiled graphs counted
#               at two more lengths (the second must compile nothing: flex compiles per structure)
#   softcap     tools/check_exactness.py on Gemma-2 (softcapped logits: flex) with a sliding window
#               a quarter of S on its sliding layers, zigzag_ring_attn, fp32 and bf16
#   generate    tools/check_generate.py: easy_context.generate vs model.generate (1 rank on one
#               GPU, every GPU when there are several, 2 gloo ranks on CPU), left-padded batches,
#               a window, softcap: tokens, logits, ms/token; fp32, and bf16 (the padded slots on
#               the masked kernel, the rest on flash, merged) forced along fp32's tokens
#   compile     train.py --compile vs the eager run, S = 1024, one process (no torchrun):
#               Dynamo's recompiles and graph breaks logged to a file kept in the results, and
#               every thread's stack dumped (faulthandler) before the limit and at the kill
#   masks       tools/check_gpu_paths.py masks: each backend timed on causal, sliding-window and
#               packed-document blocks (SKIP lines say what this device cannot run, and why), and
#               the graphs Dynamo compiled for flex
#   bench       benchmarks/bench_kernels.py: our backends and modes vs flash SDPA, fwd+bwd, S = 8K, 32K
#               (flash_attn and ring_flash_attn rows when they import)
#   train       train.py --from-scratch, 2 steps: plain, every memory option at once (fp32 and
#               under bf16 autocast): final losses must agree
#   modes_p1    tools/check_exactness.py, every mode on one rank: logits, loss, every gradient
#               vs the unpatched model (bf16 on one GPU: fp32 and autocast passed on the first run)
#   modes_pN    every mode on every GPU (NCCL) when there are several; on CPU (--dry-run) 2 gloo ranks
#   collectives_pN  (several GPUs; 2 gloo ranks in the dry run) tools/check_collectives.py: every
#               transfer the modes make (all-gather, broadcast, all-reduce, all-to-all, batched
#               and one-way P2P) over the groups each topology builds: exact, and timed
#   multirank   tools/check_gpu_paths.py multirank: which gloo ops take this device's tensors; the
#               ring modes in a 2-rank simulation (threads, one process) vs one rank; what stays
#               unexercised (NCCL); on one GPU fp32 only, no gloo exactness run (both passed on
#               the first run, their code unchanged since)
#   exit_pN     (several GPUs; gloo in the dry run) a plain training loop and a plain HF Trainer
#               script, which tear nothing down themselves, exit 0 with every rank's process
#               group torn down (the library's exit teardown)
#   timeout_pN  (several GPUs; gloo in the dry run) train.py with rank 1 stuck before a step:
#               every rank ends, non-zero, within --dist-timeout and a margin (NCCL: its watchdog)
#   peers       ring_flash_attn / yunchang: imported and run when installed, else why not
#   two_gpu     on one GPU, what it cannot run (NCCL) and the command that runs it on two
#
# Time limits on one GPU (s): the first H200 run's time of each section (2026-12-04, cold
# caches; docs/benchmarks.md, "GPU check"), with a margin for what was added since; a section
# whose code has not changed since that run is trimmed (less work: a limit below that time).
#   section    first run  limit  since the first run
#   env        11         13     unchanged
#   toolchain  0          3      unchanged
#   kernels    88         150    new: flex compiled once per structure, fp32 and now bf16 too (12 graphs, see below); the window case; graph counts first; no fp16
#   softcap    71         55     new: a window shorter than S, flex compiled; one mode (71: two); bf16 only (4 graphs)
#   generate   38         70     new: bf16 decoding, GQA folded decoding steps, gemma2's flex compiled
#   compile    60         65     new: never finished (killed after about 60 s at S = 8192); S = 1024, one process now
#   masks      35         38     changed: flex compiled once per structure, the fp32 band path
#   bench      46         40     changed: flex's block mask in its compiled call; 3 iterations (46: 5)
#   train      45         40     changed: train.py split into recipes/training; one rank runs without torchrun
#   modes_p1   24         15     unchanged: trimmed to bf16 (24: fp32, bf16, autocast)
#   multirank  41         20     unchanged: trimmed to fp32, no gloo exactness run (41: fp32, bf16, 2 gloo ranks)
#   peers      0          3      unchanged
#   two_gpu    0          2      unchanged
# The compiled sections' limits come from their counted graphs: check_kernels' cases compile 6 of
# Dynamo's graphs (3 mask structures x fp32 / bf16, counted on CPU: EASY_CONTEXT_FLEX_COMPILE=eager
# python -m tools.check_kernels ... --graph-lengths), each a forward and a backward for Inductor: 12
# compiles at about 8 s each (the first run: 48 s for fp32's 6), x 1.25, plus about 30 s of the
# rest = 150 s. softcap: Gemma-2's 2 structures (global, sliding) x fwd / bwd in bf16 = 4
# compiles, 40 s + 15 s. generate: gemma2's prefill and decoding structures in fp32 and bf16,
# about 8 forward compiles, 50 s + 20 s.
# Compiles are cached in .cache/ (ignored by git: Inductor's FX graph and autograd caches,
# Triton's kernels), which a warm device machine keeps between calls: a rerun skips compiling.
# The results file opens with the summary (PASS/FAIL per section) and the speed table.
# Exit status: 0 when no section failed (a section skipped for a missing optional package is
# not a failure; its line says what is missing).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

DRY_RUN=0
DEADLINE=
ONLY=
JSONL=
OUT_DIR=${OUT:-gpu_check_results}
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --out) OUT_DIR=${2:?--out needs a folder}; shift ;;
    --deadline) DEADLINE=${2:?--deadline needs seconds}; shift ;;
    --only) ONLY=${2:?--only needs section names, comma-separated}; shift ;;
    --jsonl) JSONL=${2:?--jsonl needs a file}; shift ;;
    -h|--help) sed -n '2,/^set -uo pipefail/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (takes --dry-run, --out DIR, --deadline SECONDS, --only SECTIONS, --jsonl FILE)" >&2; exit 2 ;;
  esac
  shift
done
SECTIONS="env toolchain kernels softcap generate compile masks bench train modes multirank peers two_gpu"
SEVERAL_GPU_SECTIONS="collectives exit timeout"  # (and modes_pN) only with several ranks
# On several GPUs, the default: what one GPU could not run, within the default deadline (tests
# hold it there).
SEVERAL_GPUS_ONLY="env,toolchain,modes,collectives,generate,train,exit,timeout"
case "$DEADLINE" in ''|*[!0-9]*) [ -z "$DEADLINE" ] || { echo "gpu_check.sh: --deadline takes whole seconds, got '$DEADLINE'" >&2; exit 2; } ;; esac
DEADLINE=${DEADLINE:-$([ "$DRY_RUN" = 1 ] && echo 1200 || echo 520)}  # the device tool allows 600 s per command
PY=${PYTHON:-$(command -v python || command -v python3)}
if ! "$PY" -c "import torch, transformers" 2>/dev/null; then
  echo "gpu_check.sh: $PY cannot import torch and transformers; activate the environment (or set PYTHON=...)" >&2
  exit 2
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# Inductor's and Triton's caches in the repository's .cache/ (ignored by git), which a warm device
# machine keeps between calls: a rerun (`--only kernels`) loads what the first run compiled.
CACHE_DIR=${GPU_CHECK_CACHE:-$REPO/.cache}
export TORCHINDUCTOR_CACHE_DIR="$CACHE_DIR/inductor" TRITON_CACHE_DIR="$CACHE_DIR/triton"
export TORCHINDUCTOR_FX_GRAPH_CACHE=1 TORCHINDUCTOR_AUTOGRAD_CACHE=1

if [ "$DRY_RUN" = 1 ]; then
  export CUDA_VISIBLE_DEVICES=""  # what runs without a GPU, at CPU sizes
  NGPU=0
  # flex runs only when forced on CPU: its graphs are counted with Dynamo's eager backend
  KERNEL_ARGS="--device cpu --dtypes fp32,bf16 --seq-len 256 --graph-lengths 320,384"
  KERNEL_ENV="EASY_CONTEXT_FLEX_COMPILE=eager"
  EXACT_ARGS="--seq-length 256"
  SOFTCAP_ARGS="--seq-length 256 --sliding-window 64"
  SOFTCAP_DTYPES=fp32,bf16
  MODES_P1_DTYPES="fp32,bf16 --autocast"
  COMPILE_LEN=256
  BENCH_ARGS="--device cpu --seq-len 512,1024 --heads 8 --kv-heads 2 --head-dim 64 --iters 2"
  TRAIN_LEN=512
  MULTI=2
  MASK_ARGS="--device cpu --dtypes fp32 --seq-len 256 --iters 1"
  MULTIRANK_ARGS="--device cpu --dtypes fp32 --seq-len 256 --gloo-runs 1"  # modes_p2 runs every mode over gloo
  GENERATE_ARGS="--prompt-length 128 --new-tokens 8 --dtypes fp32,bf16"
  GENERATE_RANKS=2
  STUCK_TIMEOUT=15
else
  NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  if [ "$NGPU" = 0 ]; then
    echo "gpu_check.sh: torch sees no CUDA device; on a CPU machine run it with --dry-run" >&2
    exit 2
  fi
  # fp16: bf16's kernels again; the window case: S = 2048, 512 keys per query, 8 band tiles
  KERNEL_ARGS="--device cuda --dtypes fp32,bf16 --seq-len 2048 --head-dim 128 --graph-lengths 1024,1536"
  KERNEL_ENV=
  EXACT_ARGS="--seq-length 4096"
  SOFTCAP_ARGS="--seq-length 4096 --sliding-window 1024"  # Gemma-2's own window is 4096: S would not see it
  SOFTCAP_DTYPES=bf16  # trimmed: fp32 softcap through compiled flex passed on the first run (no window then)
  MODES_P1_DTYPES=bf16  # trimmed: fp32 and autocast passed on the first run, the modes' code unchanged since
  COMPILE_LEN=1024
  BENCH_ARGS="--device cuda --seq-len 8192,32768 --iters 3"
  TRAIN_LEN=8192
  MULTI=$NGPU
  MASK_ARGS="--device cuda --dtypes bf16 --seq-len 8192 --head-dim 128 --iters 3"
  # trimmed: gloo's exactness run and bf16 passed on the first run, their code unchanged since
  MULTIRANK_ARGS="--device cuda --dtypes fp32 --seq-len 4096 --gloo-runs 0"
  GENERATE_ARGS="--prompt-length 4096 --new-tokens 24 --dtypes fp32,bf16"
  # one GPU: 1 rank (gloo's point-to-point takes no CUDA tensors, and NCCL wants a GPU per rank)
  GENERATE_RANKS=$NGPU
  STUCK_TIMEOUT=30
  if [ "$NGPU" -ge 2 ] && [ -z "$ONLY" ]; then
    ONLY=$SEVERAL_GPUS_ONLY
    echo "gpu_check.sh: $NGPU GPUs: running --only $ONLY (the paths one GPU cannot run); --only chooses others"
  fi
fi
# --only: the names of sections that run here (a base name like modes covers modes_p1 and modes_pN)
RUNNABLE="$SECTIONS modes_p1"
[ "$MULTI" -lt 2 ] || RUNNABLE="$RUNNABLE $SEVERAL_GPU_SECTIONS modes_p$MULTI collectives_p$MULTI exit_p$MULTI timeout_p$MULTI"
for name in ${ONLY//,/ }; do
  case " $RUNNABLE " in *" $name "*) ;; *)
    echo "gpu_check.sh: --only: no section '$name' runs here (sections: ${RUNNABLE// /, })" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT_DIR" "$TORCHINDUCTOR_CACHE_DIR" "$TRITON_CACHE_DIR"
RESULTS="$OUT_DIR/gpu_check.md"
WORK=$(mktemp -d)

FAILED=0
SUMMARY=()
{
  echo "# gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ)$([ "$DRY_RUN" = 1 ] && echo ' (dry run on CPU)')"
  echo
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
} > "$RESULTS"

# --- the section runner (tests/recipes/test_gpu_check.py runs this block on its own) ---
# section NAME SECONDS COMMAND...: runs it, its output into the results file, PASS/FAIL/SKIP.
# Exit status 3 from a command means "skipped: an optional package is missing". A failure while
# compiling flex reruns it once with flex eager (the header says why).
section() {
  local name=$1 limit=$2; shift 2
  local start=$SECONDS status left=$((DEADLINE - SECONDS - 5)) flex=compiled failure
  if [ -n "$ONLY" ] && [[ ",$ONLY," != *",${name%%_p[0-9]*},"* && ",$ONLY," != *",$name,"* ]]; then return; fi
  echo "== $name"
  if [ "$left" -lt 10 ]; then  # out of time: say so rather than be killed mid-way
    SUMMARY+=("| $name | FAIL (not run: the ${DEADLINE} s deadline was reached) | 0 |"); FAILED=1
    json_row "$name" "FAIL (not run: the ${DEADLINE} s deadline was reached)" 0 "$limit" "not run"
    echo "   not run: deadline"; return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  run_limited "$name" "$limit" "" "$@"
  status=$?
  if [ $status != 0 ] && [ $status != 3 ] && [ "${EASY_CONTEXT_FLEX_COMPILE:-}" != off ] \
    && failure=$(flex_compile_failure "$WORK/$name.log"); then
    mv "$WORK/$name.log" "$WORK/$name.compiled.log"  # kept in the results beside the rerun's
    left=$((DEADLINE - SECONDS - 5))
    if [ "$left" -ge 10 ]; then
      echo "   flex failed to compile ($failure): once more with EASY_CONTEXT_FLEX_COMPILE=off"
      [ "$limit" -le "$left" ] || limit=$left
      run_limited "$name" "$limit" EASY_CONTEXT_FLEX_COMPILE=off "$@"
      status=$?
      flex="off: compiled flex failed ($failure); rerun with EASY_CONTEXT_FLEX_COMPILE=off"
    else
      cp "$WORK/$name.compiled.log" "$WORK/$name.log"
      flex="failed to compile ($failure); no time left for a rerun with flex eager"
    fi
  fi
  local verdict=PASS
  if [ $status = 3 ]; then verdict=SKIP
  elif [ $status = 124 ] || [ $status = 137 ]; then verdict="FAIL (over its ${limit} s limit)"; FAILED=1
  elif [ $status != 0 ]; then verdict="FAIL (exit $status)"; FAILED=1
  fi
  [[ $flex != off:* ]] || verdict="$verdict (flex eager: its compile failed)"
  SUMMARY+=("| $name | $verdict | $((SECONDS - start)) |")
  json_row "$name" "$verdict" $((SECONDS - start)) "$limit" "$flex"
  {
    echo
    echo "## $name: $verdict ($((SECONDS - start)) s)"
    echo
    [ "$flex" = compiled ] || { echo "flex: $flex"; echo; }
    echo '```'
    # keep the file readable: a section's last 200 lines (the tables are at the end)
    tail -n 200 "$WORK/$name.log"
    echo '```'
    # what a section logs beside its output (compile: a run's stderr, its stack dumps, its
    # TORCH_LOGS; a rerun with flex eager: the compiled run's output), however it ended
    local extra what
    for extra in compiled stderr stacks torch; do
      [ -s "$WORK/$name.$extra.log" ] || continue
      case $extra in
        compiled) what="the run with flex compiled, which failed to compile" ;;
        stderr) what="stderr (the TORCH_LOGS lines left out: they follow)" ;;
        stacks) what="stack dumps (faulthandler, before the limit)" ;;
        torch) what="torch logs (TORCH_LOGS=$TORCH_LOG_KINDS)" ;;
      esac
      echo
      echo "### $name: $what, the last 150 lines"
      echo
      echo '```'
      if [ $extra = stderr ]; then grep -Ev '^[DIVWEC][0-9]{4} [0-9:.]+ +[0-9]+ ' "$WORK/$name.$extra.log"
      else cat "$WORK/$name.$extra.log"; fi | tail -n 150
      echo '```'
    done
  } >> "$RESULTS"
  echo "   $verdict ($((SECONDS - start)) s)"
}

# run_limited NAME SECONDS SETTING COMMAND...: the command (a function of this script too: bash -c)
# with SETTING (VAR=value, or "") in its environment, its output into $WORK/NAME.log, stopped at
# SECONDS; SECTION_LIMIT tells it when (compile dumps its stacks before that).
run_limited() {
  local name=$1 limit=$2 setting=$3; shift 3
  SECTION_LIMIT=$limit timeout --kill-after=10 "$limit" env $setting bash -c '"$@"' "$name" "$@" \
    > "$WORK/$name.log" 2>&1
}

# flex_compile_failure LOG: the first line of a compile error (Inductor, Triton, a backend) in a
# log that names flex; fails when there is none.
flex_compile_failure() {
  grep -qE 'flex' "$1" || return 1
  grep -m 1 -E 'BackendCompilerFailed|InductorError|LoweringException|CompilationError|InvalidBackend|torch\._inductor\.exc|triton\.compiler' "$1" \
    | cut -c1-200 | grep .
}

# json_row NAME RESULT SECONDS LIMIT FLEX: one JSON line into --jsonl's file (if given)
json_row() {
  [ -n "$JSONL" ] || return 0
  printf '{"source": "gpu_check", "section": "%s", "result": "%s", "seconds": %d, "limit_s": %d, "flex_compile": "%s"}\n' \
    "$(json_text "$1")" "$(json_text "$2")" "$3" "$4" "$(json_text "$5")" >> "$JSONL"
}

json_text() { printf '%s' "$1" | tr -d '\000-\037' | sed 's/\\/\\\\/g; s/"/\\"/g'; }
# --- the section runner: end ---

# The summary is written however the run ends (a kill from outside included), so the file
# always says which sections ran and how they went.
finish() {
  [ -n "${FINISHED:-}" ] && return
  FINISHED=1
  # The file reads in a minute: the title, the summary and the speed table first, the sections'
  # own output after them.
  local details
  details=$(tail -n +4 "$RESULTS")
  {
    head -n 3 "$RESULTS"
    echo
    echo "## Summary"
    echo
    echo "| section | result | seconds |"
    echo "|---|---|---|"
    printf '%s\n' "${SUMMARY[@]}"
    echo
    echo "total ${SECONDS} s"
    if grep -qs '^|' "$WORK/bench.log"; then
      echo
      echo "## Speed against flash SDPA (bench)"
      echo
      grep '^|' "$WORK/bench.log"
    fi
    echo
    echo "# The sections' output"
    printf '%s\n' "$details"
  } > "$RESULTS.new" && mv "$RESULTS.new" "$RESULTS"
  printf '%s\n' "${SUMMARY[@]}"
  echo "total ${SECONDS} s; results in $RESULTS"
  rm -rf "$WORK"
}
trap 'finish; exit $FAILED' EXIT
trap 'FAILED=1; SUMMARY+=("| (stopped) | FAIL (killed after ${SECONDS} s) | 0 |"); json_row "(stopped)" "FAIL (killed after ${SECONDS} s)" 0 0 "-"; exit 1' TERM INT

env_report() {
  local entries
  entries=$(find "$TORCHINDUCTOR_CACHE_DIR" "$TRITON_CACHE_DIR" -type f 2>/dev/null | wc -l)
  echo "compile caches: $TORCHINDUCTOR_CACHE_DIR, $TRITON_CACHE_DIR ($entries files: $([ "$entries" -gt 0 ] && echo warm || echo cold))"
  "$PY" - <<'EOF'
import importlib, importlib.metadata as md, platform, torch
from easy_context.core import kernels
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda)
for package in ("transformers", "accelerate", "datasets", "deepspeed", "flash-attn", "ring-flash-attn", "yunchang", "triton"):
    try:
        print(f"{package:16} {md.version(package)}")
    except md.PackageNotFoundError:
        print(f"{package:16} not installed")
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs")
device = "cuda" if torch.cuda.is_available() else "cpu"
capability = torch.cuda.get_device_capability() if device == "cuda" else None
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    for head_dim in (64, 128):
        names = kernels.available_backends(device, dtype, head_dim, capability)
        masked = kernels.available_backends(device, dtype, head_dim, capability, masked=True)
        print(f"backends {device} {str(dtype)[6:]:9} head dim {head_dim}: {names} (masked: {masked})")
EOF
}

modes_exact() {  # modes_exact NPROC [DTYPE ARGUMENTS]: every mode, one process group
  "$PY" -m torch.distributed.run --standalone --nproc_per_node "$1" -m tools.check_exactness \
    --mode zigzag_ring_attn,dist_flash_attn,ulysses_attn,usp_attn --dtypes ${2:-fp32,bf16 --autocast} $EXACT_ARGS
}

kernel_check() {  # the dry run compiles flex with Dynamo's eager backend (KERNEL_ENV), unless a rerun turned it off
  if [ "${EASY_CONTEXT_FLEX_COMPILE:-}" = off ]; then "$PY" -m tools.check_kernels $KERNEL_ARGS
  else env $KERNEL_ENV "$PY" -m tools.check_kernels $KERNEL_ARGS; fi
}

softcap_exact() {  # Gemma-2: softcapped logits, a sliding window shorter than S (flex without flash_attn)
  "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 -m tools.check_exactness \
    --model-type gemma2 --mode zigzag_ring_attn --dtypes "$SOFTCAP_DTYPES" $SOFTCAP_ARGS
}

toolchain() {
  # Triton (flex on CUDA, torch.compile) compiles a C launcher at its first kernel: without a C
  # compiler every compiled path fails there, so say so before any of them runs.
  local cc
  cc=$(command -v "${CC:-cc}" || command -v gcc || command -v clang) || {
    echo "no C compiler: Triton cannot build its kernels (flex attention, --compile)."
    echo "install one (apt-get install gcc, or set CC=/path/to/compiler) and run again"
    return 1
  }
  echo "C compiler: $cc ($("$cc" --version 2>/dev/null | head -n 1))"
  "$PY" -c "import triton; print('triton', triton.__version__)" 2>/dev/null || echo "triton: not installed"
}

two_gpu_paths() {
  # What one GPU cannot run: NCCL refuses two ranks on one device.
  if [ "$MULTI" -ge 2 ]; then
    echo "ran on $MULTI ranks ($([ "$NGPU" -ge 2 ] && echo NCCL || echo 'gloo, dry run')): modes_p$MULTI, collectives_p$MULTI, generate, train, exit_p$MULTI, timeout_p$MULTI"
    return 0
  fi
  echo "not run on one GPU (NCCL needs a GPU per rank); on a machine with 2 GPUs they all run, within the default deadline, with:"
  echo "  bash scripts/gpu_check.sh --only $SEVERAL_GPUS_ONLY"
  echo "  modes_p2        every mode exact over NCCL: torchrun --standalone --nproc_per_node 2 -m tools.check_exactness --mode zigzag_ring_attn,dist_flash_attn,ulysses_attn,usp_attn"
  echo "  collectives_p2  the groups, every transfer, batched and one-way P2P: torchrun --standalone --nproc_per_node 2 -m tools.check_collectives"
  echo "  generate        the sharded cache over NCCL: torchrun --standalone --nproc_per_node 2 -m tools.check_generate"
  echo "  train           train.py over NCCL: torchrun --standalone --nproc_per_node 2 train.py --from-scratch --max-train-steps 2"
  echo "  exit_p2         user scripts exit 0, their process groups torn down: torchrun --standalone --nproc_per_node 2 tests/user_scripts/plain_loop.py"
  echo "  timeout_p2      a stuck rank ends every rank within --dist-timeout (the NCCL watchdog)"
}

exit_clean() {  # exit_clean NPROC: user scripts that tear nothing down exit 0, every rank's group down
  local script reports rc ranks still_up failed=0
  for script in plain_loop plain_trainer; do
    reports="$WORK/exit_$script"
    mkdir -p "$reports"
    # sitecustomize: an exit hook that runs after every other one writes whether the group is up
    EXIT_REPORT_DIR="$reports" PYTHONPATH="$REPO/tests/user_scripts/exit_report:$PYTHONPATH" \
      "$PY" -m torch.distributed.run --standalone --nproc_per_node "$1" "tests/user_scripts/$script.py" \
      > "$reports.log" 2>&1
    rc=$?
    ranks=$(find "$reports" -name 'rank*' | wc -l)
    still_up=$(grep -L "process group up: False" "$reports"/rank* 2>/dev/null | wc -l)
    if [ "$rc" = 0 ] && [ "$ranks" = "$1" ] && [ "$still_up" = 0 ]; then
      echo "$script: exit 0, the process group torn down on all $1 ranks"
    else
      echo "$script: exit $rc, $ranks of $1 ranks reported, $still_up with the process group still up"
      tail -n 30 "$reports.log"
      failed=1
    fi
  done
  return $failed
}

stuck_rank() {  # stuck_rank: rank 1 sleeps before step 2's forward; every rank must end in time
  local start=$SECONDS rc took
  EASY_CONTEXT_FAULT="hang@2:1:$((STUCK_TIMEOUT + 600))" train_variant stuck no --dist-timeout "$STUCK_TIMEOUT" \
    > "$WORK/stuck.log" 2>&1
  rc=$?
  took=$((SECONDS - start))
  tr '\r' '\n' < "$WORK/stuck.log" | grep -E "error:|exitcode|[Ww]atchdog|[Tt]imed out|timeout" | cut -c1-300 | head -n 20
  echo "exit $rc after $took s, rank 1 stuck, --dist-timeout $STUCK_TIMEOUT s (bound: the timeout + 80 s)"
  [ "$rc" != 0 ] && [ "$took" -le $((STUCK_TIMEOUT + 80)) ]  # under the section's limit: the lines above print
}

train_options() {
  # The memory options change where activations live, never the numbers: after 2 steps from one
  # seed each variant's loss must agree with the plain run (rel. 1e-3: fp32, and non-deterministic
  # GPU reductions across 2 optimizer steps). tests/ prove each option alone; here they run
  # together, on the device.
  local variants=(  # name|mixed precision|flags; a variant that fails is a row, the others still run
    "plain|no|"
    "all|no|--activation-checkpointing --offload-checkpoints --tiled-mlp 1024 --loss-chunk-size 1024"
    "all_bf16|bf16|--activation-checkpointing --offload-checkpoints --tiled-mlp 1024 --loss-chunk-size 1024"
  )
  local entry name precision flags ran=() failed=0
  for entry in "${variants[@]}"; do
    IFS='|' read -r name precision flags <<< "$entry"
    train_variant "$name" "$precision" $flags
    ran+=("$name")
    # compared as soon as it has run: a section stopped at its limit keeps every comparison before
    if [ "${#ran[@]}" -ge 2 ]; then compare_losses "${ran[0]}" "$name" || failed=1; fi
  done
  echo "-- every variant against ${ran[0]}"
  compare_losses "${ran[@]}" || failed=1
  return $failed
}

compile_train() {
  # train.py --compile: the patched decoder under torch.compile, 2 steps, against the eager run,
  # both at a short S on one rank without torchrun (one process to diagnose). Its first run on a
  # GPU did not reach a step in about 60 s and left nothing to read, so: Dynamo's recompiles,
  # graph breaks and per-frame compile steps go to a file, faulthandler dumps every thread's
  # stack into another 10 s before the section's limit, and the run's stderr (train.py's own
  # dump of every stack when it is stopped) into a third; the section puts all three into the
  # results however it ends (files, not pipes: a kill loses none of them).
  TRAIN_RANKS=1 TRAIN_SEQ=$COMPILE_LEN train_variant compile_eager no || return 1
  TORCH_LOGS=$TORCH_LOG_KINDS TORCH_LOGS_OUT="$WORK/compile.torch.log" FAULT_LOG="$WORK/compile.stacks.log" \
    DUMP_AFTER=$(( ${SECTION_LIMIT:-120} - SECONDS - 10 )) TRAIN_RANKS=1 TRAIN_SEQ=$COMPILE_LEN \
    train_variant compiled no --compile 2> "$WORK/compile.stderr.log"
  compare_losses compile_eager compiled
}

# train_variant NAME MIXED_PRECISION FLAGS...: 2 steps into $WORK/train_NAME; 1 if it fails.
# TRAIN_RANKS (default: a rank per GPU, 2 on CPU) and TRAIN_SEQ (default TRAIN_LEN) choose. One
# rank runs without torchrun, under faulthandler: every thread's stack into FAULT_LOG (default
# stderr) after DUMP_AFTER seconds (when set) and when the process is stopped.
train_variant() {
  local name=$1 precision=$2 nproc=${TRAIN_RANKS:-$(( NGPU > 0 ? NGPU : 2 ))}; shift 2
  local launch=("$PY" -m torch.distributed.run --standalone --nproc_per_node "$nproc")
  if [ "$nproc" = 1 ]; then
    launch=("$PY" -X faulthandler -c '
import faulthandler, os, runpy, signal, sys
out = open(os.environ["FAULT_LOG"], "w") if os.environ.get("FAULT_LOG") else sys.stderr
after = int(os.environ.get("DUMP_AFTER") or 0)
if after > 0:
    faulthandler.dump_traceback_later(after, file=out)  # where it is when time runs out
faulthandler.register(signal.SIGTERM, file=out, chain=True)  # and where it was when stopped
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")')
  fi
  echo "-- $name: $* (mixed precision: $precision, $nproc rank(s), S = ${TRAIN_SEQ:-$TRAIN_LEN})"
  ACCELERATE_MIXED_PRECISION=$precision "${launch[@]}" \
    train.py --from-scratch --seq-length "${TRAIN_SEQ:-$TRAIN_LEN}" --max-train-steps 2 --log-with none \
    --output-dir "$WORK/train_$name" "$@" || { echo "-- $name: train.py failed"; return 1; }
}

compare_losses() {  # compare_losses BASE NAME...: each final loss vs BASE's; a table
  "$PY" - "$WORK" "$@" <<'EOF'
import json, math, sys
work, names = sys.argv[1], sys.argv[2:]
def summary(name):
    try:
        return json.load(open(f"{work}/train_{name}/train_summary.json"))
    except OSError:
        return None
runs = {n: summary(n) for n in names}
base = (runs[names[0]] or {}).get("final_loss")
ok = True
print(f"| variant | final loss | rel. diff vs {names[0]} | peak GPU MiB/rank | peak RSS MiB/rank |\n|---|---|---|---|---|")
for n, r in runs.items():
    if r is None:
        ok = False
        print(f"| {n} | failed (see above) | | | |")
        continue
    if r["final_loss"] is None or base is None:  # train.py writes null for a non-finite loss
        ok = False
        print(f"| {n} | non-finite | | | |")
        continue
    diff = abs(r["final_loss"] - base) / abs(base)
    bound = 2e-2 if n.endswith("bf16") else 1e-3  # bf16 autocast: reported, loosely bounded
    ok &= math.isfinite(r["final_loss"]) and diff <= bound
    print(f"| {n} | {r['final_loss']:.5f} | {diff:.1e} (<= {bound:g}) | {r.get('peak_cuda_allocated_mib_per_rank')} | {r['peak_rss_mib_per_rank']} |")
sys.exit(0 if ok else 1)
EOF
}

peers() {
  local found=0 package
  for package in ring_flash_attn yunchang; do
    if "$PY" -c "import $package" 2>/dev/null; then found=1; echo "$package imports"; else echo "$package: not installed (needs flash_attn built for this torch/CUDA; carry wheels to test it)"; fi
  done
  [ $found = 1 ] || return 3
  # ring_flash_attn has a row in the kernel benchmark; yunchang: one call on one rank vs SDPA
  "$PY" - <<'EOF'
import os, tempfile, torch, torch.distributed as dist, torch.nn.functional as F
try:
    from yunchang import LongContextAttention, set_seq_parallel_pg
except Exception as exc:
    print("yunchang: not usable:", exc); raise SystemExit(0)
dist.init_process_group("nccl", init_method="file://" + os.path.join(tempfile.mkdtemp(), "init"), rank=0, world_size=1)
set_seq_parallel_pg(1, 1, 0, 1)
q, k, v = (torch.randn(1, 8192, 32, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
out = LongContextAttention()(q, k, v, causal=True)
ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=True).transpose(1, 2)
print(f"yunchang LongContextAttention P=1 vs SDPA: max err {(out - ref).abs().max().item():.1e}")
EOF
}

export -f env_report toolchain kernel_check modes_exact softcap_exact train_options compile_train train_variant compare_losses peers \
  two_gpu_paths exit_clean stuck_rank
TORCH_LOG_KINDS="recompiles,graph_breaks,dynamo"  # dynamo: its INFO lines time each frame's trace and compile
export PY WORK NGPU MULTI REPO EXACT_ARGS SOFTCAP_ARGS SOFTCAP_DTYPES KERNEL_ARGS KERNEL_ENV TRAIN_LEN COMPILE_LEN STUCK_TIMEOUT SEVERAL_GPUS_ONLY \
  TORCH_LOG_KINDS
# limit SECONDS_GPU SECONDS_DRY_RUN: a section's limit. The GPU column is the table in the header
# (the first H200 run's times, with margins; the trimmed sections below them) and adds up to at
# most the 520 s default deadline; the dry-run column is sized from CPU runs (docs/benchmarks.md
# has the budget table). The order: new on a GPU first, then changed, then unchanged.
limit() { if [ "$DRY_RUN" = 1 ]; then echo "$2"; else echo "$1"; fi; }
section env "$(limit 13 30)" env_report
section toolchain "$(limit 3 10)" toolchain
section kernels "$(limit 150 120)" kernel_check
section softcap "$(limit 55 60)" softcap_exact
section generate "$(limit 70 60)" "$PY" -m torch.distributed.run --standalone --nproc_per_node "$GENERATE_RANKS" \
  -m tools.check_generate $GENERATE_ARGS
section compile "$(limit 65 120)" compile_train  # killed: the torch logs and stack dumps say where
section masks "$(limit 38 60)" "$PY" -m tools.check_gpu_paths masks $MASK_ARGS
section bench "$(limit 40 60)" "$PY" -m benchmarks.bench_kernels $BENCH_ARGS
section train "$(limit 40 120)" train_options
section modes_p1 "$(limit 15 60)" modes_exact 1 "$MODES_P1_DTYPES"
if [ "$MULTI" -ge 2 ]; then
  section "modes_p$MULTI" "$(limit 60 60)" modes_exact "$MULTI"
  section "collectives_p$MULTI" "$(limit 30 60)" "$PY" -m torch.distributed.run --standalone --nproc_per_node "$MULTI" \
    -m tools.check_collectives
fi
section multirank "$(limit 20 90)" "$PY" -m tools.check_gpu_paths multirank $MULTIRANK_ARGS
if [ "$MULTI" -ge 2 ]; then
  section "exit_p$MULTI" "$(limit 60 120)" exit_clean "$MULTI"
  section "timeout_p$MULTI" "$(limit 120 120)" stuck_rank
fi
section peers "$(limit 3 10)" peers
section two_gpu "$(limit 2 5)" two_gpu_paths

finish  # (also run by the EXIT trap if the run is stopped)
