# Sourced by the bench/gpu_*.sh scripts on the GPU machine: the carried gguf wheel installed beside the machine's
# torch, moerun importable from runtime/, $OUT for results, $START for elapsed time, the GPU written down.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
START=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/pkgs && ln -sfn "$PWD/runtime" /tmp/pkgs/moerun
export PYTHONPATH=/tmp/site:/tmp/pkgs:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
