#!/usr/bin/env bash
# The from-scratch job on a CPU machine: a random tiny Llama on the Python standard library's
# sources (byte tokenizer), 2 processes, sequence parallel. Then the same under DeepSpeed
# ZeRO-3 + CPU offload.
set -euo pipefail
MODE=${MODE:-zigzag_ring_attn}
OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 train.py --from-scratch --parallel-mode "$MODE" --output-dir outputs/tiny-llama
if python -c "import deepspeed" 2>/dev/null; then
  DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 accelerate launch --config_file accelerate_configs/cpu_zero3_offload.yaml \
    train.py --from-scratch --parallel-mode "$MODE" --output-dir outputs/tiny-llama-zero3 --max-train-steps 10
fi
