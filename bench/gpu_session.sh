#!/usr/bin/env bash
# One call on the GPU machine: runtime and calibration benchmarks on the Qwen3-30B-A3B-shaped synthetic model,
# moerun on CUDA next to llama.cpp built there (CUDA, sm_90) on the same file. Results land in $OUT.
#
#   run: bash bench/gpu_session.sh      (carry: .whl with gguf/zstandard/datasets wheels, .peer with llama.cpp-src.tar.xz)
#
# The llama.cpp build runs in the background while the model is written and moerun is measured; the peer numbers
# are taken if the build finishes before BUILD_DEADLINE seconds.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BUILD_DEADLINE=${BUILD_DEADLINE:-420}
START=$SECONDS
[ -n "${SKIP_WHEELS:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkgs && ln -sfn "$PWD/runtime" /tmp/pkgs/moerun
export PYTHONPATH=/tmp/site:/tmp/pkgs:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
lscpu | grep -E "Model name|^CPU\(s\)" | tee -a "$OUT/machine.txt"

( mkdir -p /tmp/peer && tar xJf .peer/llama.cpp-src.tar.xz -C /tmp/peer && cd /tmp/peer/llama.cpp &&
  cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON > /tmp/peer/cmake.log 2>&1 &&
  cmake --build build --target llama-bench -j 14 > /tmp/peer/build.log 2>&1 && echo built > /tmp/peer/done
) &

python3 -m pytest -q --noconftest -p no:cacheprovider tests/runtime/test_dequant.py -k cuda 2>&1 | tail -3 | tee "$OUT/dequant-tests.log"
python3 bench/bench_dequant.py --device cuda --dtype bfloat16 2>&1 | tee "$OUT/dequant-bench.log"

MODEL=/tmp/bench-qwen3-30b-a3b.gguf
python3 -m moeprep synth "$MODEL" --preset qwen3-30b-a3b --expert-type Q4_K --attn-type Q8_0 --fast-random-blocks
python3 bench/bench_runtime.py "$MODEL" --device cuda --prompt 512 --gen 16 --json "$OUT/runtime-moerun-cuda.json" \
    --no-peer 2>&1 | tee "$OUT/runtime.log" || true
python3 bench/bench_profile.py --model "$MODEL" --device cuda --ctx 512 --chunks 4 --json "$OUT/profile-cuda.json" \
    2>&1 | tee "$OUT/profile.log" || true

while [ ! -f /tmp/peer/done ] && [ $((SECONDS - START)) -lt "$BUILD_DEADLINE" ]; do sleep 5; done
if [ -f /tmp/peer/done ]; then
  LB=/tmp/peer/llama.cpp/build/bin/llama-bench
  $LB -m "$MODEL" -p 512 -n 32 -r 3 -ngl 99 -o json > "$OUT/llama-bench-cuda.json" 2>"$OUT/llama-bench.err"
  $LB -m "$MODEL" -p 512 -n 32 -r 3 -ngl 99 2>&1 | tail -5
else
  echo "llama.cpp build not finished after ${BUILD_DEADLINE}s"; tail -5 /tmp/peer/build.log
fi
cp /tmp/peer/build.log "$OUT/" 2>/dev/null
echo "total ${SECONDS}s"
