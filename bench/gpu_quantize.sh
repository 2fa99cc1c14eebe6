#!/usr/bin/env bash
# On a GPU machine, for the quantizer: per-core speed against libggml on its CPU, the CUDA quantizers through moeprep's
# registry on adversarial rows (the NaN-scale CPU fallback included), and whole-file quantize with --device cuda and
# --device cpu against a plain copy and llama.cpp's quantizer.
#
#   bash bench/gpu_quantize.sh OUTDIR [WORKDIR]    (bench/gpu_env.sh says what the two folders hold)
#   env: THREADS (the machine's core count)
# The peer is llama-cpp-python (libggml included): installed, or carried as .peer/llama_cpp_py.tar.xz (its package
# folder) for a machine without a package registry.
source bench/gpu_env.sh "$@"
if [ -f .peer/llama_cpp_py.tar.xz ]; then
  mkdir -p "$WORK/site" && tar xJf .peer/llama_cpp_py.tar.xz -C "$WORK/site" || exit 1
fi
THREADS=${THREADS:-$(nproc)}

python3 bench/bench_quant.py --repeat 3 2>&1 | tee "$OUT/bench-quant.log"

python3 - <<'PY' 2>&1 | tee "$OUT/cuda-registry.log"
import numpy as np
from moeprep.quant import registry
from tests.quant.test_kquants import KTYPES, adversarial_rows, make_imatrix
rng = np.random.default_rng(7)
rows = np.concatenate(list(adversarial_rows(512, rng).values()))
for qtype in KTYPES:
    for kind in (None, "random", "sparse"):
        qw = make_imatrix(kind, 512, rng)
        cpu = registry.quantize_rows(rows, qtype, qw, device="cpu")
        gpu = registry.quantize_rows(rows, qtype, qw, device="cuda")
        print(f"{qtype.name} imatrix={kind}: cuda {'equal' if np.array_equal(cpu, gpu) else 'DIFFERS'} ({rows.shape[0]} rows)")
PY

python3 bench/bench_quantize_file.py --workdir "$WORK" --threads "$THREADS" --device cuda --skip-verify 2>&1 \
    | grep -v "^llama_model_loader\|^\[ *[0-9]*/" | tee "$OUT/whole-file-cuda.log"
python3 bench/bench_quantize_file.py "$WORK/bench-qwen3-30b-a3b.gguf" --workdir "$WORK" --threads "$THREADS" --device cpu \
    --no-peer --skip-verify 2>&1 | tee "$OUT/whole-file-cpu.log"
echo "total $((SECONDS - START))s"
