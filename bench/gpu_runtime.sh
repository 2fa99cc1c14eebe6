#!/usr/bin/env bash
# On a GPU machine: runtime and calibration benchmarks on the Qwen3-30B-A3B-shaped synthetic model, moerun on CUDA
# next to llama.cpp built there (CUDA, sm_90) on the same file.
#
#   bash bench/gpu_runtime.sh OUTDIR [WORKDIR]    (bench/gpu_env.sh says what the two folders hold)
#
# The llama.cpp build runs in the background while the model is written and moerun is measured; the peer numbers
# are taken if the build finishes before BUILD_DEADLINE seconds (default 420).
source bench/gpu_env.sh "$@"
BUILD_DEADLINE=${BUILD_DEADLINE:-420}

if [ -f "$PEER_SRC" ]; then
( mkdir -p "$PEER" && tar xJf "$PEER_SRC" -C "$PEER" && cd "$PEER/llama.cpp" &&
  cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=ON > "$PEER/cmake.log" 2>&1 &&
  cmake --build build --target llama-bench -j "$(nproc)" > "$PEER/build.log" 2>&1 && echo built > "$PEER/done"
) &
fi

python3 -m pytest -q --noconftest -p no:cacheprovider tests/runtime/test_dequant.py -k cuda 2>&1 | tail -3 | tee "$OUT/dequant-tests.log"
python3 bench/bench_dequant.py --device cuda --dtype bfloat16 2>&1 | tee "$OUT/dequant-bench.log"

MODEL=$WORK/bench-qwen3-30b-a3b.gguf
[ -f "$MODEL" ] || python3 -m moeprep synth "$MODEL" --preset qwen3-30b-a3b --expert-type Q4_K --attn-type Q8_0 \
    --fast-random-blocks
python3 bench/bench_runtime.py "$MODEL" --device cuda --prompt 512 --gen 16 --json "$OUT/runtime-moerun-cuda.json" \
    --no-peer 2>&1 | tee "$OUT/runtime.log" || true
python3 bench/bench_profile.py --model "$MODEL" --device cuda --ctx 512 --chunks 4 --json "$OUT/profile-cuda.json" \
    2>&1 | tee "$OUT/profile.log" || true

while [ -f "$PEER_SRC" ] && [ ! -f "$PEER/done" ] && [ $((SECONDS - START)) -lt "$BUILD_DEADLINE" ]; do sleep 5; done
if [ -f "$PEER/done" ]; then
  LB=$PEER/llama.cpp/build/bin/llama-bench
  $LB -m "$MODEL" -p 512 -n 32 -r 3 -ngl 99 -o json > "$OUT/llama-bench-cuda.json" 2>"$OUT/llama-bench.err"
  $LB -m "$MODEL" -p 512 -n 32 -r 3 -ngl 99 2>&1 | tail -5
  cp "$PEER/build.log" "$OUT/"
elif [ -f "$PEER_SRC" ]; then
  echo "llama.cpp build not finished after ${BUILD_DEADLINE}s"; tail -5 "$PEER/build.log"
else
  echo "no $PEER_SRC (bench/make_peer_tarball.sh makes it): moerun alone"
fi
echo "total $((SECONDS - START))s"
