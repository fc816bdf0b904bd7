#!/usr/bin/env bash
# Everything a GPU has to show, in one run, into ONE results file. Sized for one H200 within a
# 480 s deadline (an estimate: it has not run on a GPU yet); sections that the deadline leaves
# no time for are reported as not run.
#
#   bash scripts/gpu_check.sh                   # on a CUDA machine: results in gpu_check_results/gpu_check.md
#   bash scripts/gpu_check.sh --out DIR         # (the device tool's $OUT is used when set)
#   bash scripts/gpu_check.sh --dry-run         # on CPU: the same sections at CPU sizes (CI runs this)
#   bash scripts/gpu_check.sh --deadline 480    # seconds for the whole run (default 480; dry run 900)
#
# Sections (each with its own time limit; one failing does not stop the others):
#   env         torch / CUDA / GPU, the optional packages, the kernel backends usable per dtype
#   kernels     tools/check_kernels.py: every backend vs fp64, fp32/bf16/fp16, bound 2x SDPA's error
#   masks       tools/check_gpu_paths.py masks: each backend timed on causal, sliding-window and
#               packed-document blocks (SKIP lines say what this device cannot run, and why)
#   multirank   tools/check_gpu_paths.py multirank: which gloo ops take this device's tensors; every
#               mode they can carry on 2 ranks over gloo sharing the GPU; the ring modes in a
#               2-rank simulation (threads, one process) vs one rank; what stays unexercised (NCCL)
#   modes_p1    tools/check_exactness.py, every mode on one rank: logits, loss, every gradient
#               vs the unpatched model (fp32, bf16 weights, fp32 under bf16 autocast)
#   modes_pN    the same on every GPU (NCCL) when there are several; on CPU (--dry-run) 2 gloo ranks
#   bench       benchmarks/bench_kernels.py: our backends and modes vs flash SDPA, fwd+bwd, S = 8K-64K
#               (flash_attn and ring_flash_attn rows when they import)
#   train       train.py --from-scratch, 2 steps per memory option (none, checkpointing, + offload,
#               tiled MLP, loss chunk 1024, all; all under bf16 autocast): final losses must agree
#   peers       ring_flash_attn / yunchang: imported and run when installed, else why not
# Exit status: 0 when no section failed (a section skipped for a missing optional package is
# not a failure; its line says what is missing).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

DRY_RUN=0
DEADLINE=
OUT_DIR=${OUT:-gpu_check_results}
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --out) OUT_DIR=${2:?--out needs a folder}; shift ;;
    --deadline) DEADLINE=${2:?--deadline needs seconds}; shift ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (takes --dry-run, --out DIR, --deadline SECONDS)" >&2; exit 2 ;;
  esac
  shift
done
case "$DEADLINE" in ''|*[!0-9]*) [ -z "$DEADLINE" ] || { echo "gpu_check.sh: --deadline takes whole seconds, got '$DEADLINE'" >&2; exit 2; } ;; esac
DEADLINE=${DEADLINE:-$([ "$DRY_RUN" = 1 ] && echo 900 || echo 480)}  # the device tool allows 600 s per command
mkdir -p "$OUT_DIR"
RESULTS="$OUT_DIR/gpu_check.md"
WORK=$(mktemp -d)
PY=${PYTHON:-$(command -v python || command -v python3)}
if ! "$PY" -c "import torch, transformers" 2>/dev/null; then
  echo "gpu_check.sh: $PY cannot import torch and transformers; activate the environment (or set PYTHON=...)" >&2
  exit 2
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

if [ "$DRY_RUN" = 1 ]; then
  export CUDA_VISIBLE_DEVICES=""  # what runs without a GPU, at CPU sizes
  NGPU=0
  KERNEL_ARGS="--device cpu --dtypes fp32,bf16 --seq-len 256"
  EXACT_ARGS="--seq-length 256"
  BENCH_ARGS="--device cpu --seq-len 512,1024 --heads 8 --kv-heads 2 --head-dim 64 --iters 2"
  TRAIN_LEN=512
  MULTI=2
  MASK_ARGS="--device cpu --dtypes fp32 --seq-len 256 --iters 1"
  MULTIRANK_ARGS="--device cpu --dtypes fp32 --seq-len 256 --gloo-runs 1"  # modes_p2 runs every mode over gloo
else
  NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  if [ "$NGPU" = 0 ]; then
    echo "gpu_check.sh: torch sees no CUDA device; on a CPU machine run it with --dry-run" >&2
    exit 2
  fi
  KERNEL_ARGS="--device cuda --dtypes fp32,bf16,fp16 --seq-len 2048 --head-dim 128"
  EXACT_ARGS="--seq-length 4096"
  BENCH_ARGS="--device cuda --seq-len 8192,16384,32768,65536 --iters 5"
  TRAIN_LEN=16384
  MULTI=$NGPU
  MASK_ARGS="--device cuda --dtypes bf16,fp32 --seq-len 8192 --head-dim 128 --iters 3"
  MULTIRANK_ARGS="--device cuda --dtypes fp32,bf16 --seq-len 4096"
fi

FAILED=0
SUMMARY=()
{
  echo "# gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ)$([ "$DRY_RUN" = 1 ] && echo ' (dry run on CPU)')"
  echo
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
} > "$RESULTS"

# section NAME SECONDS COMMAND...: runs it, its output into the results file, PASS/FAIL/SKIP.
# Exit status 3 from a command means "skipped: an optional package is missing".
section() {
  local name=$1 limit=$2; shift 2
  local start=$SECONDS status left=$((DEADLINE - SECONDS - 5))
  echo "== $name"
  if [ "$left" -lt 10 ]; then  # out of time: say so rather than be killed mid-way
    SUMMARY+=("| $name | FAIL (not run: the ${DEADLINE} s deadline was reached) | 0 |"); FAILED=1
    echo "   not run: deadline"; return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  # bash -c: the command may be one of the functions below (exported), which timeout cannot run
  timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" > "$WORK/$name.log" 2>&1
  status=$?
  local verdict=PASS
  if [ $status = 3 ]; then verdict=SKIP
  elif [ $status = 124 ] || [ $status = 137 ]; then verdict="FAIL (over its ${limit} s limit)"; FAILED=1
  elif [ $status != 0 ]; then verdict="FAIL (exit $status)"; FAILED=1
  fi
  SUMMARY+=("| $name | $verdict | $((SECONDS - start)) |")
  {
    echo
    echo "## $name: $verdict ($((SECONDS - start)) s)"
    echo
    echo '```'
    # keep the file readable: a section's last 200 lines (the tables are at the end)
    tail -n 200 "$WORK/$name.log"
    echo '```'
  } >> "$RESULTS"
  echo "   $verdict ($((SECONDS - start)) s)"
}

# The summary is written however the run ends (a kill from outside included), so the file
# always says which sections ran and how they went.
finish() {
  [ -n "${FINISHED:-}" ] && return
  FINISHED=1
  {
    echo
    echo "## Summary"
    echo
    echo "| section | result | seconds |"
    echo "|---|---|---|"
    printf '%s\n' "${SUMMARY[@]}"
    echo
    echo "total ${SECONDS} s"
  } >> "$RESULTS"
  printf '%s\n' "${SUMMARY[@]}"
  echo "total ${SECONDS} s; results in $RESULTS"
  rm -rf "$WORK"
}
trap 'finish; exit $FAILED' EXIT
trap 'FAILED=1; SUMMARY+=("| (stopped) | FAIL (killed after ${SECONDS} s) | 0 |"); exit 1' TERM INT

env_report() {
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

modes_exact() {  # modes_exact NPROC
  local nproc=$1 status=0 mode
  for mode in zigzag_ring_attn dist_flash_attn ulysses_attn usp_attn; do
    "$PY" -m torch.distributed.run --standalone --nproc_per_node "$nproc" -m tools.check_exactness \
      --mode "$mode" --dtypes fp32,bf16 --autocast $EXACT_ARGS || status=1
  done
  return $status
}

train_options() {
  # Each memory option changes where activations live, never the numbers: after 2 steps from
  # one seed every variant's loss must agree with the plain run (rel. 1e-3: fp32, and
  # non-deterministic GPU reductions across 2 optimizer steps).
  local nproc=$(( NGPU > 0 ? NGPU : 2 )) name flags
  local variants=(
    "plain|"
    "checkpointing|--activation-checkpointing"
    "checkpointing_offload|--activation-checkpointing --offload-checkpoints"
    "tiled_mlp|--tiled-mlp 1024"
    "loss_chunk_1024|--loss-chunk-size 1024"
    "all|--activation-checkpointing --offload-checkpoints --tiled-mlp 1024 --loss-chunk-size 1024"
  )
  for entry in "${variants[@]}"; do
    name=${entry%%|*}; flags=${entry#*|}
    echo "-- $name: $flags"
    "$PY" -m torch.distributed.run --standalone --nproc_per_node "$nproc" train.py --from-scratch \
      --seq-length "$TRAIN_LEN" --max-train-steps 2 --log-with none --output-dir "$WORK/train_$name" \
      $flags || return 1
  done
  echo "-- all, bf16 autocast (accelerate mixed precision)"
  ACCELERATE_MIXED_PRECISION=bf16 "$PY" -m torch.distributed.run --standalone --nproc_per_node "$nproc" train.py \
    --from-scratch --seq-length "$TRAIN_LEN" --max-train-steps 2 --log-with none \
    --output-dir "$WORK/train_all_bf16" \
    --activation-checkpointing --offload-checkpoints --tiled-mlp 1024 --loss-chunk-size 1024 || return 1
  "$PY" - "$WORK" <<'EOF'
import json, math, sys
work = sys.argv[1]
names = ["plain", "checkpointing", "checkpointing_offload", "tiled_mlp", "loss_chunk_1024", "all", "all_bf16"]
runs = {n: json.load(open(f"{work}/train_{n}/train_summary.json")) for n in names}
base = runs["plain"]["final_loss"]
ok = True
print("| variant | final loss | rel. diff vs plain | peak GPU MiB/rank | peak RSS MiB/rank |\n|---|---|---|---|---|")
for n, r in runs.items():
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

export -f env_report modes_exact train_options peers
export PY WORK NGPU EXACT_ARGS TRAIN_LEN
section env 45 env_report
section kernels 90 "$PY" -m tools.check_kernels $KERNEL_ARGS
section masks 60 "$PY" -m tools.check_gpu_paths masks $MASK_ARGS
section multirank 120 "$PY" -m tools.check_gpu_paths multirank $MULTIRANK_ARGS
section modes_p1 150 modes_exact 1
if [ "$MULTI" -ge 2 ]; then section "modes_p$MULTI" 150 modes_exact "$MULTI"; fi
section bench 120 "$PY" -m benchmarks.bench_kernels $BENCH_ARGS
section train 240 train_options
section peers 60 peers

finish  # (also run by the EXIT trap if the run is stopped)
