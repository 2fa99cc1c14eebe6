#!/usr/bin/env bash
# On a GPU machine: the 60 GB benchmark-shaped model (`moeprep synth --preset bench-60g`: 46 layers, 128 experts of
# 9.28 MiB, routed by the qwen3-30b regime), moerun's expert cache at a 24 GiB budget cold and warmed by expert
# counts, moerun with every weight on the GPU, and llama-bench on the same file with the experts of 29 layers in host
# RAM (about the same VRAM) and all on the GPU.
#
#   bash bench/gpu_60g.sh OUTDIR [WORKDIR]    (bench/gpu_env.sh says what the two folders hold)
#   env: ROUTING (qwen3-30b: a `moeprep synth --routing` choice), BUDGET (24G), PEER_CPU_MOE (29), GEN (128),
#        THREADS (16), STEPS ("cold peer resident-warm peer-resident"; also
#        cpu, warm-64, cpu-experts, gpu-tests: the GPU tests, run first, beside the model's writing and before the
#        build), TEST_TIMEOUT (420 s), BUILD_DEADLINE (420 s)
#
# Where WORKDIR has less than the whole model's 60 GB free, the model keeps as many of its 46 layers as fit (each
# 1.29 GB) and says so; both runtimes read the same file, so the comparison stays fair. Each step is skipped when its
# output is in OUTDIR already, so running the script again with the same folders goes on where a run stopped.
source bench/gpu_env.sh "$@"
free -g | head -2

MODEL=$WORK/bench-60g-${ROUTING:-qwen3-30b}.gguf
if [ ! -f "$MODEL" ]; then  # written beside the GPU tests (it is mostly disk time)
  FREE_GB=$(df -BG --output=avail "$WORK" | tail -1 | tr -dc 0-9)
  LAYERS=$(( (FREE_GB - 4) * 100 / 129 )); [ "$LAYERS" -gt 46 ] && LAYERS=46
  echo "free ${FREE_GB} GB: the model gets $LAYERS of 46 layers"
  python3 -c "from moeprep.synth import write_synth_model as w; w('$MODEL', 'qwen3moe', preset='bench-60g',
      fast_random_blocks=True, n_layer=$LAYERS, routing='${ROUTING:-qwen3-30b}')" > "$OUT/synth.log" 2>&1 &
  SYNTH=$!
fi
# The GPU tests first, before the llama.cpp build takes the cores: the cache tests time uploads against steps, and
# beside a 12-job compile they ran past any sane limit (15 of 26 in 200 s).
if [[ " ${STEPS:-} " == *" gpu-tests "* ]] && [ ! -f "$OUT/gpu-tests.log" ]; then
  timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q --noconftest -p no:cacheprovider -W ignore tests/runtime/test_gpu_path.py \
      tests/runtime/test_gguf_matmul.py tests/runtime/test_fused.py -k "not with_fused_kernels" > "$OUT/gpu-tests.log" 2>&1
  tail -3 "$OUT/gpu-tests.log"; echo "GPU tests done at $((SECONDS - START))s"
fi
# configured with the server too, so that bench/gpu_serve.sh on the same machine builds llama-server in this tree
BUILD_START=$SECONDS
if [ -f "$PEER_SRC" ] && [ ! -f "$PEER/done" ]; then
( mkdir -p "$PEER" && { [ -d "$PEER/llama.cpp" ] || tar xJf "$PEER_SRC" -C "$PEER"; } &&
  cd "$PEER/llama.cpp" &&
  cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_APP=OFF -DGGML_NATIVE=ON > "$PEER/cmake.log" 2>&1 &&
  cmake --build build --target llama-bench -j 12 > "$PEER/build.log" 2>&1 && echo built > "$PEER/done"
) &
fi
[ -n "${SYNTH:-}" ] && { wait $SYNTH || { tail -5 "$OUT/synth.log"; exit 1; }; }
ls -la "$MODEL"; echo "model there at $((SECONDS - START))s"
head -c 260000 bench/data/heldout.txt > "$WORK/warm.txt"
tail -c 270000 bench/data/heldout.txt > "$WORK/bench.txt"
wait_build() {  # numba's OpenMP threads stall when the build takes their cores: time nothing while it runs
  while [ -f "$PEER_SRC" ] && [ ! -f "$PEER/done" ] && [ $((SECONDS - BUILD_START)) -lt ${BUILD_DEADLINE:-420} ]; do
    sleep 5; done; }
cache() {  # $1: settings, $2: json name
  [ -f "$OUT/$2.json" ] && return
  wait_build
  echo "== bench_cache $1 at $((SECONDS - START))s"
  python3 bench/bench_cache.py "$MODEL" --budget ${BUDGET:-24G} -p 512 -n ${GEN:-128} -f "$WORK/bench.txt" \
      --warm-text "$WORK/warm.txt" --threads ${THREADS:-16} --settings "$1" --json "$OUT/$2.json" 2>&1 | grep -v Warning | tail -40
}
peer() {  # $@: llama-bench options
  wait_build
  [ -f "$PEER/done" ] || { echo "no llama-bench (build not finished after $((SECONDS - START))s, or no $PEER_SRC)"; tail -3 "$PEER/build.log" 2>/dev/null; return; }
  echo "== llama-bench $* at $((SECONDS - START))s"
  "$PEER/llama.cpp/build/bin/llama-bench" -m "$MODEL" -p 512 -n 64 -r 1 -t ${THREADS:-16} "$@" 2>&1 \
      | grep -E "pp512|tg64|error" | tee -a "$OUT/llama-bench.log"
}
for STEP in ${STEPS:-cold peer resident-warm peer-resident}; do
  case $STEP in
    cold) cache cold cache-cold ;;
    cpu) cache cold-cpu,warm-cpu cache-cpu ;;
    warm-64) cache warm-64,cold-64 cache-64 ;;
    gpu-tests) ;;  # ran first, above
    peer) peer -ngl 99 --n-cpu-moe ${PEER_CPU_MOE:-29} ;;
    resident-warm) cache resident,warm cache-warm ;;
    peer-resident) peer -ngl 99 ;;
    cpu-experts) wait_build  # moerun's CPU expert path on this host's cores, on the peer build's ggml row dots
        [ -f "$OUT/cpu-experts.json" ] || MOERUN_GGML_CPU_LIB=$PEER/llama.cpp/build/bin/libggml-cpu.so \
            python3 bench/bench_cpu_experts.py --threads 1,${THREADS:-16} --shapes 60gb,30b --repeat 10 \
            --json "$OUT/cpu-experts.json" 2>&1 | grep -v Warning | tail -20 ;;
  esac
done
echo "total $((SECONDS - START))s"
