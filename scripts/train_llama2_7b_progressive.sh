#!/usr/bin/env bash
# EasyContext's progressive long-context recipe for Llama-2-7B on 8 GPUs (one node),
# DeepSpeed ZeRO-3 with CPU offload, about 1M tokens per optimizer step at every stage:
#   32K / rope_theta 1M (data_parallel) -> 64K / 5M (data_parallel)
#   -> 256K / 10M, 25M, 50M (zigzag ring) -> 512K / 100M, 250M (zigzag ring)
# Each stage starts from the model the previous stage saved.
#   DATASET=path/to/tokenized MODEL=meta-llama/Llama-2-7b-hf bash scripts/train_llama2_7b_progressive.sh
# DATASET rows need at least seq_length + 1 tokens for the stages that use them.
set -euo pipefail
MODEL=${MODEL:-meta-llama/Llama-2-7b-hf}
DATASET=${DATASET:?set DATASET to a tokenized dataset with an input_ids column}
OUT=${OUT:-outputs/llama2-7b-progressive}
STEPS=${STEPS:-90}
GPUS=${GPUS:-8}
LAUNCH="accelerate launch --config_file accelerate_configs/single_node.yaml --num_processes $GPUS --mixed_precision bf16"

stage() {  # name seq_length rope_theta parallel_mode gradient_accumulate_every
  local name=$1 seq=$2 theta=$3 mode=$4 accumulate=$5
  $LAUNCH train.py --model "$MODEL" --dataset "$DATASET" --output-dir "$OUT/$name" \
    --seq-length "$seq" --rope-theta "$theta" --parallel-mode "$mode" \
    --batch-size 1 --gradient-accumulate-every "$accumulate" --max-train-steps "$STEPS" \
    --learning-rate 2e-5 --activation-checkpointing --checkpointing-steps 10 --seed 42
  MODEL="$OUT/$name"
}

#      name          seq      theta      mode              accumulate (x tokens = ~1M/step)
stage  32k-1m        32768    1000000    data_parallel     4   # 8 ranks x 32K x 4
stage  64k-5m        65536    5000000    data_parallel     2   # 8 ranks x 64K x 2
stage  256k-10m      262144   10000000   zigzag_ring_attn  4   # one 256K sequence over 8 ranks x 4
stage  256k-25m      262144   25000000   zigzag_ring_attn  4
stage  256k-50m      262144   50000000   zigzag_ring_attn  4
stage  512k-100m     524288   100000000  zigzag_ring_attn  2
stage  512k-250m     524288   250000000  zigzag_ring_attn  2
echo "final model: $MODEL (set rope_theta to 1e9 in its config.json for inference past 512K, as EasyContext did)"
