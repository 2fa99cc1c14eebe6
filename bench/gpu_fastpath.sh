#!/usr/bin/env bash
# On a GPU machine: the fast path's GPU tests, then moerun's decode/prefill on the Qwen3-30B-A3B-shaped model next
# to llama-bench (built there from the llama-cpp-python sources) on the same file.
#
#   bash bench/gpu_fastpath.sh OUTDIR [WORKDIR]    (bench/gpu_env.sh says what the two folders hold)
#   env: TESTS (the GPU tests to run first), PEER_CPU_MOE (28), BUILD_DEADLINE (420 s)
source bench/gpu_env.sh "$@"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/machine.txt"

[ -f "$PEER_SRC" ] && ( mkdir -p "$PEER" && tar xJf "$PEER_SRC" -C "$PEER" && cd "$PEER/llama.cpp" &&
  cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DGGML_NATIVE=ON > "$PEER/cmake.log" 2>&1 &&
  cmake --build build --target llama-bench -j 12 > "$PEER/build.log" 2>&1 && echo built > "$PEER/done"
) &

MODEL=$WORK/bench-qwen3-30b-a3b.gguf
python3 -c "from moeprep.synth import write_synth_model as w; w('$MODEL', 'qwen3moe', preset='qwen3-30b-a3b',
    expert_type='Q4_K', attn_type='Q8_0', fast_random_blocks=True)" > "$OUT/synth.log" 2>&1 &
SYNTH=$!
python3 -m pytest -q -p no:cacheprovider --noconftest ${TESTS:-tests/runtime/test_gpu_path.py tests/runtime/test_gguf_matmul.py} 2>&1 \
    | tail -15 | tee "$OUT/gpu-tests.log"
wait $SYNTH || { tail -5 "$OUT/synth.log"; exit 1; }
python3 bench/bench_runtime.py "$MODEL" --device cuda --prompt 512 --gen 64 --no-peer --json "$OUT/moerun-cuda.json" \
    2>&1 | tail -6 | tee "$OUT/runtime.log"
python3 bench/profile_decode.py "$MODEL" --steps 32 --ctx 512 --json "$OUT/profile-decode.json" 2>&1 | tail -30
while [ -f "$PEER_SRC" ] && [ ! -f "$PEER/done" ] && [ $((SECONDS - START)) -lt ${BUILD_DEADLINE:-420} ]; do sleep 5; done
if [ -f "$PEER/done" ]; then
  LB=$PEER/llama.cpp/build/bin/llama-bench
  $LB -m "$MODEL" -p 512 -n 64 -r 3 -ngl 99 2>&1 | tail -6 | tee "$OUT/llama-bench.log"
  $LB -m "$MODEL" -p 512 -n 64 -r 2 -ngl 99 --n-cpu-moe ${PEER_CPU_MOE:-28} 2>&1 | tail -4 | tee -a "$OUT/llama-bench.log"
else
  echo "no llama-bench (build not finished after $((SECONDS - START))s, or no $PEER_SRC)"; tail -3 "$PEER/build.log" 2>/dev/null
fi
echo "total $((SECONDS - START))s"
