#!/usr/bin/env bash
# On a GPU machine: the expert cache on the Qwen3-30B-A3B-shaped model routed by the qwen3-30b regime,
# `moerun bench` all resident / at a VRAM budget cold / warmed by a profile, next to llama-bench (built there from the
# llama-cpp-python sources) all on the GPU and with --n-cpu-moe for about the same VRAM.
#
#   bash bench/gpu_cache.sh OUTDIR [WORKDIR]    (bench/gpu_env.sh says what the two folders hold)
#   env: ROUTING (qwen3-30b: a `moeprep synth --routing` choice), BUDGET (8G), PEER_CPU_MOE (28), GEN (128),
#        THREADS (16), TESTS (the GPU tests to run first; "" for none),
#        CLI (also time `moerun bench` on the command line), FUSED_BENCH (also run bench_fused.py),
#        PEER_RESIDENT (also llama-bench with every expert on the GPU)
source bench/gpu_env.sh "$@"
moerun() { python3 -c "from moerun.cli import main; main()" "$@"; }

if [ -f "$PEER_SRC" ]; then
( mkdir -p "$PEER" && tar xJf "$PEER_SRC" -C "$PEER" && cd "$PEER/llama.cpp" &&
  cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DGGML_NATIVE=ON > "$PEER/cmake.log" 2>&1 &&
  cmake --build build --target llama-bench -j 12 > "$PEER/build.log" 2>&1 && echo built > "$PEER/done"
) &
fi

MODEL=$WORK/bench-30b-${ROUTING:-qwen3-30b}.gguf
python3 -c "from moeprep.synth import write_synth_model as w; w('$MODEL', 'qwen3moe', preset='qwen3-30b-a3b',
    expert_type='Q4_K', attn_type='Q8_0', fast_random_blocks=True, routing='${ROUTING:-qwen3-30b}', n_vocab=32000)" > "$OUT/synth.log" 2>&1 &
SYNTH=$!
timeout 90 python3 -m pytest -q -p no:cacheprovider --noconftest tests/runtime/test_fused.py -k "not with_fused_kernels" 2>&1 | tail -8 | tee "$OUT/fused-tests.log"
if ! grep -q " passed" "$OUT/fused-tests.log" || grep -q "failed\|error" "$OUT/fused-tests.log"; then
  echo "fused kernels fail on this GPU: the benchmarks run with MOERUN_FUSED=0"; export MOERUN_FUSED=0
fi
if [ -n "${TESTS-tests/runtime/test_gpu_path.py}" ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider --noconftest ${TESTS:-tests/runtime/test_gpu_path.py} 2>&1 | tail -30 | tee "$OUT/gpu-tests.log"
fi
wait $SYNTH || { tail -5 "$OUT/synth.log"; exit 1; }
echo "model written at $((SECONDS - START))s"
# the held-out text: its first part counts the experts for the warm start, the rest is what decode is
# teacher-forced over
head -c 260000 bench/data/heldout.txt > "$WORK/warm.txt"
tail -c 270000 bench/data/heldout.txt > "$WORK/bench.txt"
# the CPU computes the misses: nothing else may load it while they are timed (numba's OpenMP threads stall
# when a core is taken: ~30x, measured with timings that overlapped llama.cpp's build)
while [ -f "$PEER_SRC" ] && [ ! -f "$PEER/done" ] && [ $((SECONDS - START)) -lt ${BUILD_DEADLINE:-400} ]; do sleep 5; done
echo "benchmarks start at $((SECONDS - START))s"
python3 bench/bench_cache.py "$MODEL" --budget ${BUDGET:-8G} -p 512 -n ${GEN:-128} -f "$WORK/bench.txt" --warm-text "$WORK/warm.txt" \
    --threads ${THREADS:-16} --json "$OUT/cache.json" 2>&1 | grep -v Warning | tail -60
if [ -n "${CLI-}" ]; then
  echo "== the command line: moerun bench (cold)"
  moerun bench -m "$MODEL" --device cuda -t ${THREADS:-16} -p 512 -n 64 -f "$WORK/bench.txt" --vram-budget ${BUDGET:-8G} 2>&1 | tail -8
fi
[ -n "${FUSED_BENCH-}" ] && timeout 120 python3 bench/bench_fused.py "$MODEL" --ctx 512 --steps 32 --json "$OUT/fused.json" 2>&1 | tail -25
while [ -f "$PEER_SRC" ] && [ ! -f "$PEER/done" ] && [ $((SECONDS - START)) -lt ${BUILD_DEADLINE:-480} ]; do sleep 5; done
if [ -f "$PEER/done" ]; then
  LB=$PEER/llama.cpp/build/bin/llama-bench
  [ -n "${PEER_RESIDENT-}" ] && $LB -m "$MODEL" -p 512 -n 64 -r 1 -t 16 -ngl 99 2>&1 | grep -E "pp512|tg64" | tee "$OUT/llama-bench.log"
  $LB -m "$MODEL" -p 512 -n 64 -r 2 -t 16 -ngl 99 --n-cpu-moe ${PEER_CPU_MOE:-28} 2>&1 | grep -E "pp512|tg64" | tee -a "$OUT/llama-bench.log"
else
  echo "no llama-bench (build not finished after $((SECONDS - START))s, or no $PEER_SRC)"; tail -3 "$PEER/build.log" 2>/dev/null
fi
echo "total $((SECONDS - START))s"
