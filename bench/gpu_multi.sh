#!/usr/bin/env bash
# One call on a two-GPU machine (nvidia-h200-x2): the multi-GPU tests, then bench/check_multi_gpu.py (the same greedy
# tokens on one and two GPUs with the expert cache off, at fixed slots and at a budget; per-GPU memory). Results land
# in $OUT.
#
#   run (kind nvidia-h200-x2): bash bench/gpu_multi.sh      (carry: .whl with the gguf wheel)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkgs && ln -sfn "$PWD/runtime" /tmp/pkgs/moerun
export PYTHONPATH=/tmp/site:/tmp/pkgs:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/machine.txt"
nvidia-smi topo -m | tee -a "$OUT/machine.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider --noconftest tests/runtime/test_multi_gpu.py 2>&1 | tail -30 \
    | tee "$OUT/multi-gpu-tests.log"
timeout 300 python3 bench/check_multi_gpu.py --json "$OUT/check-multi-gpu.json" 2>&1 | tee "$OUT/check-multi-gpu.log"
