#!/usr/bin/env bash
# One call on the GPU machine for the quantizer (issue 3): per-core speed against libggml on its Xeon, the CUDA
# quantizers through moeprep's registry on adversarial rows (the NaN-scale CPU fallback included), and whole-file
# quantize with --device cuda and --device cpu against a plain copy and llama.cpp's quantizer. Results in $OUT.
#
#   run: bash bench/gpu_quantize.sh   (carry: .whl with the gguf/zstandard/datasets/diskcache wheels,
#                                      .peer with llama_cpp_py.tar.xz: llama-cpp-python's package, libggml included)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
tar xJf .peer/llama_cpp_py.tar.xz -C /tmp/site || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; lscpu | grep -E "Model name|^CPU\(s\)"; df -h /tmp | tail -1; } | tee "$OUT/machine.txt"

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

mkdir -p /tmp/bq
python3 bench/bench_quantize_file.py --workdir /tmp/bq --threads 16 --device cuda --skip-verify 2>&1 \
    | grep -v "^llama_model_loader\|^\[ *[0-9]*/" | tee "$OUT/whole-file-cuda.log"
python3 bench/bench_quantize_file.py /tmp/bq/bench-qwen3-30b-a3b.gguf --workdir /tmp/bq --threads 16 --device cpu \
    --no-peer --skip-verify 2>&1 | tee "$OUT/whole-file-cpu.log"
echo "total ${SECONDS}s"
