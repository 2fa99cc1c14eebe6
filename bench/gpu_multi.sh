#!/usr/bin/env bash
# On a machine with two or more GPUs: the multi-GPU tests, then bench/check_multi_gpu.py (the same greedy tokens on
# one and two GPUs with the expert cache off, at fixed slots and at a budget; per-GPU memory).
#
#   bash bench/gpu_multi.sh OUTDIR [WORKDIR]    (bench/gpu_env.sh says what the two folders hold)
source bench/gpu_env.sh "$@"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee -a "$OUT/machine.txt"
nvidia-smi topo -m | tee -a "$OUT/machine.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider --noconftest tests/runtime/test_multi_gpu.py 2>&1 | tail -30 \
    | tee "$OUT/multi-gpu-tests.log"
timeout 300 python3 bench/check_multi_gpu.py --json "$OUT/check-multi-gpu.json" 2>&1 | tee "$OUT/check-multi-gpu.log"
