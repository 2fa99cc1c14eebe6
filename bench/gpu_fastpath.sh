#!/usr/bin/env bash
# One call on the GPU machine: the fast path's GPU tests, then moerun's decode/prefill on the Qwen3-30B-A3B-shaped
# model next to llama-bench (built here from the llama-cpp-python sources) on the same file. Results land in $OUT.
#
#   run: bash bench/gpu_fastpath.sh    (carry: .whl, the gguf wheel; .peer, from bench/make_peer_tarball.sh)
source bench/gpu_env.sh
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/machine.txt"

( mkdir -p /tmp/peer && tar xJf .peer/llama.cpp-src.tar.xz -C /tmp/peer && cd /tmp/peer/llama.cpp &&
  cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DGGML_NATIVE=ON > /tmp/peer/cmake.log 2>&1 &&
  cmake --build build --target llama-bench -j 12 > /tmp/peer/build.log 2>&1 && echo built > /tmp/peer/done
) &

MODEL=/tmp/bench-qwen3-30b-a3b.gguf
python3 -c "from moeprep.synth import write_synth_model as w; w('$MODEL', 'qwen3moe', preset='qwen3-30b-a3b',
    expert_type='Q4_K', attn_type='Q8_0', fast_random_blocks=True)" > "$OUT/synth.log" 2>&1 &
SYNTH=$!
python3 -m pytest -q -p no:cacheprovider --noconftest ${TESTS:-tests/runtime/test_gpu_path.py tests/runtime/test_gguf_matmul.py} 2>&1 \
    | tail -15 | tee "$OUT/gpu-tests.log"
wait $SYNTH || { tail -5 "$OUT/synth.log"; exit 1; }
python3 bench/bench_runtime.py "$MODEL" --device cuda --prompt 512 --gen 64 --no-peer --json "$OUT/moerun-cuda.json" \
    2>&1 | tail -6 | tee "$OUT/runtime.log"
python3 bench/profile_decode.py "$MODEL" --steps 32 --ctx 512 --json "$OUT/profile-decode.json" 2>&1 | tail -30
while [ ! -f /tmp/peer/done ] && [ $((SECONDS - START)) -lt ${BUILD_DEADLINE:-420} ]; do sleep 5; done
if [ -f /tmp/peer/done ]; then
  LB=/tmp/peer/llama.cpp/build/bin/llama-bench
  $LB -m "$MODEL" -p 512 -n 64 -r 3 -ngl 99 2>&1 | tail -6 | tee "$OUT/llama-bench.log"
  $LB -m "$MODEL" -p 512 -n 64 -r 2 -ngl 99 --n-cpu-moe ${PEER_CPU_MOE:-28} 2>&1 | tail -4 | tee -a "$OUT/llama-bench.log"
else
  echo "llama.cpp build not finished after $((SECONDS - START))s"; tail -3 /tmp/peer/build.log
fi
echo "total $((SECONDS - START))s"
