#!/usr/bin/env bash
# On a GPU machine: the expert cache on the Qwen3-30B-A3B-shaped model at a VRAM budget, for every named routing
# regime (`moeprep routing generate` at the model's shape, replayed with bench/bench_cache.py --routing): cold, warm
# (counts from the trace's chunks that are not replayed) and the static split (`--cache-plan static`), next to
# llama-bench `-ngl 99 --n-cpu-moe N` at about the same VRAM (built there from the llama-cpp-python sources; its
# decode does not depend on the routing: a static split's experts stay where they are). Then, with ARCHS set, every
# architecture on CUDA against its CPU path with its decode speed beside llama-bench (bench/bench_archs_gpu.py).
# bench/seed_box.py turns the results into the estimate for the reference box (the last lines).
#
#   bash bench/gpu_regimes.sh OUTDIR [WORKDIR]    (bench/gpu_env.sh says what the two folders hold)
#   env: REGIMES (all five), SETTINGS (cold,warm,static), BUDGET (8G), PEER_CPU_MOE (28), GEN (128), THREADS (16),
#        ARCHS (1: run the architectures' table too), SKIP_REGIMES (1: only the architectures)
# The model, traces and build are kept in WORKDIR: a second run with the same folders goes on where one stopped.
source bench/gpu_env.sh "$@"
REGIMES=${REGIMES:-qwen3-30b fine-512 skewed-256 chat-glm trained}
LB=$PEER/llama.cpp/build/bin/llama-bench
RES=$WORK/results  # kept in WORKDIR, so that a second run skips what the first measured; copied to OUTDIR
mkdir -p "$RES"
keep() { cp -r "$RES/." "$OUT/"; }

if [ ! -x "$LB" ] && [ -f "$PEER_SRC" ]; then
( if [ ! -d "$PEER/llama.cpp" ]; then mkdir -p "$PEER" && tar xJf "$PEER_SRC" -C "$PEER"; fi
  cd "$PEER/llama.cpp" &&
  { [ -d build ] || cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DGGML_NATIVE=ON \
        > "$PEER/cmake.log" 2>&1; } &&
  cmake --build build --target llama-bench -j "$(nproc)" >> "$PEER/build.log" 2>&1 && echo built > "$PEER/done"
) &
fi

MODEL=$WORK/bench-30b-regimes.gguf
if [ -z "${SKIP_REGIMES-}" ] && [ ! -f "$MODEL" ]; then
  python3 -m moeprep synth "$MODEL" --preset qwen3-30b-a3b --expert-type Q4_K --attn-type Q8_0 --fast-random-blocks \
      > "$OUT/synth.log" 2>&1 &  # written atomically: the file is there whole or not at all
fi
for R in $REGIMES; do
  [ -f "$WORK/$R.npz" ] || python3 -m moeprep routing generate --regime "$R" --layers 48 --experts 128 --top-k 8 \
      --tokens 4096 --chunk 1024 -o "$WORK/$R.npz" | tee -a "$OUT/traces.log"
done
# the CPU computes the static split's misses: nothing else may load it while they are timed
wait
echo "model and build ready at $((SECONDS - START))s"; [ -x "$LB" ] || tail -3 "$PEER/build.log" 2>/dev/null
head -c 100000 bench/data/heldout.txt > "$WORK/bench.txt"
if [ -z "${SKIP_REGIMES-}" ]; then
  if [ -x "$LB" ] && [ ! -s "$RES/llama-bench.json" ]; then
    $LB -m "$MODEL" -p 512 -n ${GEN:-128} -r 2 -t ${THREADS:-16} -ngl 99 --n-cpu-moe ${PEER_CPU_MOE:-28} -o json \
        > "$RES/llama-bench.json" 2> "$RES/llama-bench.err"
    $LB -m "$MODEL" -p 512 -n ${GEN:-128} -r 1 -t ${THREADS:-16} -ngl 99 -o json > "$RES/llama-bench-resident.json" \
        2>> "$RES/llama-bench.err"
    python3 -c "import json,sys; [print(f, 'pp' if r['n_prompt'] else 'tg', round(r['avg_ts'], 2)) for f in sys.argv[1:]
        for r in json.load(open(f))]" "$RES/llama-bench.json" "$RES/llama-bench-resident.json"
    keep
  fi
  for R in $REGIMES; do
    [ -s "$RES/cache-$R.done" ] && continue
    echo "== regime $R at $((SECONDS - START))s"
    python3 bench/bench_cache.py "$MODEL" --budget ${BUDGET:-8G} -p 512 -n ${GEN:-128} -f "$WORK/bench.txt" \
        --routing "$WORK/$R.npz" --settings ${SETTINGS:-cold,warm,static} --threads ${THREADS:-16} \
        --json "$RES/cache-$R.json" 2>&1 | grep -v Warning > "$RES/cache-$R.log"
    grep -E "^==|^\| (pp|tg)|expert cache|plan|policy|ms per token" "$RES/cache-$R.log" | head -40
    echo done > "$RES/cache-$R.done"; keep
  done
fi
if [ -n "${ARCHS-}" ]; then
  python3 bench/bench_archs_gpu.py "$WORK/archs" --gen ${GEN:-128} $([ -x "$LB" ] && echo --llama-bench "$LB") \
      --json "$RES/archs.json" 2>&1 | grep -v Warning
  keep
fi
if compgen -G "$RES/cache-*.json" > /dev/null; then
  python3 bench/seed_box.py "$MODEL" "$RES"/cache-*.json --peer-cpu-layers ${PEER_CPU_MOE:-28} $(python3 -c "import json
try: print('--peer-gpu-tg', [r['avg_ts'] for r in json.load(open('$RES/llama-bench-resident.json')) if r['n_gen']][0])
except Exception: pass") | tee "$RES/seed-box.md"; keep
fi
echo "total $((SECONDS - START))s"
