#!/usr/bin/env bash
# Every benchmark behind docs/benchmarks.md, in the order the docs present them, one after
# the other (they time 2 cores: never run two at once).
#
#   bash scripts/run_benchmarks.sh --list          # names, expected minutes on 2 cores, commands
#   bash scripts/run_benchmarks.sh                 # all of them (about 3.5 hours on 2 cores)
#   bash scripts/run_benchmarks.sh attention peers # only these
#   bash scripts/run_benchmarks.sh --quick         # every script at smoke size (a few minutes)
#
# Each full run rewrites its CSV under docs/ (the tables in docs/benchmarks.md are copied from
# them by hand, with the date); its console output goes to bench_logs/NAME.log. The minutes
# are what the runs took on the 2-core development machine, 2026-11/12.
set -uo pipefail
cd "$(dirname "$0")/.."

# name | minutes | command
BENCHMARKS=(
  "attention|8|python -m benchmarks.bench_attention --seq-len 4096,8192,16384 --world-sizes 2 --wait-idle 120 --retry-busy 2 --csv docs/bench_attention.csv --plot docs/bench_attention.png"
  "attention_gqa|3|python -m benchmarks.bench_attention --seq-len 8192 --kv-heads 2 --world-sizes 2 --wait-idle 300 --retry-busy 4 --csv docs/bench_attention_gqa.csv"
  "peers|33|python -m benchmarks.bench_attention --seq-len 4096 --world-sizes 2,4 --iters 2 --wait-idle 20 --retry-busy 1 --csv bench_logs/peers_4k.csv && python -m benchmarks.bench_attention --seq-len 8192 --world-sizes 2,4 --iters 2 --wait-idle 5 --retry-busy 1 --csv bench_logs/peers_8k.csv && python -m benchmarks.bench_attention --seq-len 16384 --world-sizes 2 --iters 2 --wait-idle 5 --retry-busy 1 --csv bench_logs/peers_16k.csv && python -m benchmarks.bench_attention --from-csv bench_logs/peers_4k.csv,bench_logs/peers_8k.csv,bench_logs/peers_16k.csv --csv docs/bench_attention_peers.csv"
  "ulysses_memory|9|python -m benchmarks.bench_attention --seq-len 8192,16384 --iters 1 --exact-memory --world-sizes 2,4 --modes ulysses_attn,usp_attn,deepspeed_ulysses,zigzag_ring_attn"
  "attention_memory|6|python -m benchmarks.bench_attention --seq-len 8192 --iters 1 --exact-memory --world-sizes 1,2,4 --wait-idle 120 --retry-busy 1 --csv docs/bench_attention_memory.csv"
  "masks_balance|1|python -m benchmarks.mask_balance --seeds 10"
  "layouts|2|python -m benchmarks.bench_layouts --steps 2 --dp-rows 0"
  "masks|10|python -m benchmarks.bench_attention --seq-len 16384 --world-sizes 2 --modes baseline,zigzag_ring_attn,dist_flash_attn,ulysses_attn --masks causal,packed-1k,long-tail,window-1k --iters 3 --wait-idle 60 --retry-busy 1 --csv docs/bench_attention_masks.csv"
  "train|35|python -m benchmarks.bench_train --seq-lengths 4096,8192,16384 --exact-memory --verify-length 65536 --csv docs/bench_train.csv"
  "sharding|90|python -m benchmarks.bench_sharding --seq-lengths 16384,32768 --exact-memory --csv docs/bench_sharding.csv"
  "features|5|python -m benchmarks.bench_features"
  "features_memory|6|python -m benchmarks.bench_features --exact-memory"
  "generate|7|python -m benchmarks.bench_generate --csv docs/bench_generate.csv"
  "rl|19|python -m benchmarks.bench_rl --completion-lengths 8192,16384,32768 --csv docs/bench_rl.csv"
  "mixers|16|python -m benchmarks.bench_mixers --seq-lengths 16384,32768 --repeats 2 --csv docs/bench_mixers.csv"
  "replica_check|1|torchrun --standalone --nproc_per_node 2 -m benchmarks.bench_replica_check"
  "planner|1|python -m tools.validate_plan --calibrate"
  "gpu_check_dry_run|3|bash scripts/gpu_check.sh --dry-run --out bench_logs"
  "long_context_dry_run|1|python -m benchmarks.bench_long_context --dry-run"
)
QUICK=(
  "attention|1|python -m benchmarks.bench_attention --smoke"
  "masks|1|python -m benchmarks.bench_attention --smoke-masks"
  "layouts|1|python -m benchmarks.bench_layouts --smoke"
  "train|2|python -m benchmarks.bench_train --smoke"
  "sharding|2|python -m benchmarks.bench_sharding --smoke"
  "generate|2|python -m benchmarks.bench_generate --smoke"
  "rl|1|python -m benchmarks.bench_rl --smoke"
  "mixers|1|python -m benchmarks.bench_mixers --seq-lengths 256 --repeats 1"
  "kernels|1|python -m benchmarks.bench_kernels --device cpu --seq-len 512,1024 --heads 8 --kv-heads 2 --head-dim 64 --iters 2"
  "planner|1|python -m tools.validate_plan"
  "long_context|1|python -m benchmarks.bench_long_context --dry-run"
)

list=0 quick=0 wanted=()
for arg in "$@"; do
  case "$arg" in
    --list) list=1 ;;
    --quick) quick=1 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    -*) echo "run_benchmarks.sh: unknown option '$arg' (takes --list, --quick, names)" >&2; exit 2 ;;
    *) wanted+=("$arg") ;;
  esac
done
if [ $quick = 1 ]; then table=("${QUICK[@]}"); else table=("${BENCHMARKS[@]}"); fi
names=()
for entry in "${table[@]}"; do names+=("${entry%%|*}"); done
for name in "${wanted[@]}"; do
  if ! printf '%s\n' "${names[@]}" | grep -qx "$name"; then
    echo "run_benchmarks.sh: no benchmark named '$name'; choose from: ${names[*]}" >&2
    exit 2
  fi
done

mkdir -p bench_logs
failed=0 total=0
for entry in "${table[@]}"; do
  IFS='|' read -r name minutes command <<< "$entry"
  if [ ${#wanted[@]} -gt 0 ] && ! printf '%s\n' "${wanted[@]}" | grep -qx "$name"; then continue; fi
  if [ $list = 1 ]; then printf '%-17s ~%3s min  %s\n' "$name" "$minutes" "$command"; total=$((total + minutes)); continue; fi
  echo "== $name (about $minutes min): $command"
  start=$SECONDS
  if bash -c "$command" > "bench_logs/$name.log" 2>&1; then verdict=ok; else verdict="FAILED (see bench_logs/$name.log)"; failed=1; fi
  echo "   $verdict in $(( (SECONDS - start) / 60 ))m$(( (SECONDS - start) % 60 ))s"
done
if [ $list = 1 ]; then echo "total ~$total min"; fi
exit $failed
