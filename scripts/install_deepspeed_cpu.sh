#!/usr/bin/env bash
# DeepSpeed for a CPU-only machine (the ops are built for the CPU accelerator and the installed
# torch: rerun after a torch upgrade), with the two ops its CPU path uses compiled now, once:
# cpu_adam (ZeRO offload's optimizer) and shm_comm (loaded at every CPU init). Without this
# the first use JIT-builds them into ~/.cache/torch_extensions (~3 minutes on 2 cores).
# Needs torch installed first (--no-build-isolation builds the ops against it).
#   bash scripts/install_deepspeed_cpu.sh            # into the active environment
set -euo pipefail
VERSION="${DEEPSPEED_VERSION:-0.19.8}"
DS_BUILD_OPS=0 DS_BUILD_CPU_ADAM=1 DS_BUILD_SHM_COMM=1 DS_ACCELERATOR=cpu \
    pip install -q --no-build-isolation --no-cache-dir "deepspeed==${VERSION}"
DS_ACCELERATOR=cpu python -c "import deepspeed.ops.adam.cpu_adam_op, deepspeed.ops.comm.deepspeed_shm_comm_op" \
    && echo "deepspeed ${VERSION} installed with prebuilt cpu_adam and shm_comm"
