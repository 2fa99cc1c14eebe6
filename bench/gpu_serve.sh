#!/usr/bin/env bash
# On a GPU machine: `moerun serve` next to llama-server (built there from the llama.cpp sources, CUDA sm_90) at 1, 4
# and 8 streams, on the trained bench model and on the Qwen3-30B-A3B-shaped synthetic model (bench/bench_serve.py:
# aggregate tok/s, time to first token, per-token latency).
#
#   bash bench/gpu_serve.sh OUTDIR [WORKDIR]    (bench/gpu_env.sh says what the two folders hold)
#
# The llama.cpp build (llama-server only, about 5 minutes on 16 cores) runs while the synthetic model is written and
# the GPU tests run (TESTS, "" for none), before anything is measured. The synthetic model and the build are kept in
# WORKDIR, so a second run with the same folders goes on where a first one stopped (the build resumes). Without
# the peer's sources (PEER_SRC), moerun alone is measured.
# MODELS overrides the models, DEVICE the device (a dry run: DEVICE=cpu MODELS=bench/models/bench-qwen3moe-q4k.gguf).
# Answers run to 32 tokens (bench_serve.py --ignore-eos, both servers); IGNORE_EOS="" lets them end early on an
# end-of-generation token.
source bench/gpu_env.sh "$@"
LLAMA_SERVER=$PEER/llama.cpp/build/bin/llama-server
BIG=$WORK/bench-qwen3-30b-a3b.gguf
MODELS=${MODELS:-"bench/models/bench-qwen3moe-q4k.gguf $BIG"}

if [[ " $MODELS " == *" $BIG "* ]] && [ ! -f "$BIG" ]; then
  python3 -m moeprep synth "$BIG" --preset qwen3-30b-a3b --expert-type Q4_K --attn-type Q8_0 --fast-random-blocks \
      > "$OUT/synth.log" 2>&1 &  # written atomically: the file is there whole or not at all
fi
if [ ! -x "$LLAMA_SERVER" ] && [ -f "$PEER_SRC" ]; then
  ( if [ ! -d "$PEER/llama.cpp/build" ]; then
      mkdir -p "$PEER" && tar xJf "$PEER_SRC" -C "$PEER" &&
      (cd "$PEER/llama.cpp" && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA=OFF \
          -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF \
          -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DGGML_NATIVE=ON \
          > "$PEER/cmake.log" 2>&1) || { tail -5 "$PEER/cmake.log"; exit 1; }
    fi
    cd "$PEER/llama.cpp" && cmake --build build --target llama-server -j "$(nproc)" >> "$PEER/build.log" 2>&1 \
        || { tail -5 "$PEER/build.log"; echo "llama-server did not build: moerun alone"; } ) &
fi
# while llama.cpp builds: the GPU tests of the decode graphs (one sequence and batches, with and without the cache)
[ -n "${TESTS-tests/runtime/test_gpu_path.py}" ] && timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider \
    --noconftest ${TESTS:-tests/runtime/test_gpu_path.py} 2>&1 | tail -15 | tee "$OUT/gpu-tests.log"
wait  # the synthetic model and the build

for MODEL in $MODELS; do
  [ -f "$MODEL" ] || { echo "$MODEL is missing (see $OUT/synth.log)"; continue; }
  NAME=$(basename "$MODEL" .gguf)
  python3 bench/bench_serve.py "$MODEL" --device "${DEVICE:-cuda}" --streams 1,4,8 --requests 8 --rounds 3 --prompt 64 \
      --gen 32 ${IGNORE_EOS---ignore-eos} $([ -x "$LLAMA_SERVER" ] && echo --llama-server "$LLAMA_SERVER") \
      --json "$OUT/serve-$NAME.json" 2>&1 \
      | tee "$OUT/serve-$NAME.log"
done
echo "total $((SECONDS - START)) s"
