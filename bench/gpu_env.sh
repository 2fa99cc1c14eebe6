# Sourced by the bench/gpu_*.sh scripts with their arguments: OUTDIR, where the results go (created if missing), and
# WORKDIR, scratch space for the synthetic models and the peer's build (default ${TMPDIR:-/tmp}/moeprep-bench; the
# 60 GB model needs that much free there). Wheels in .whl/ (for a machine without a package registry) are installed
# into WORKDIR/site, moerun is made importable from runtime/, $START counts elapsed time, and the GPU is written down.
# Sets OUT, WORK, PEER (the peer's build folder) and PEER_SRC (its sources' tarball, from bench/make_peer_tarball.sh;
# default .peer/llama.cpp-src.tar.xz: where it is missing, moerun is measured alone).
bench_usage() {
  echo "usage: bash $0 OUTDIR [WORKDIR]   (results in OUTDIR; models and builds in WORKDIR," \
       "default \${TMPDIR:-/tmp}/moeprep-bench)" >&2
  exit 2
}
{ [ $# -ge 1 ] && [ $# -le 2 ] && [ -n "$1" ] && [ "${1#-}" = "$1" ]; } || bench_usage
mkdir -p "$1" 2>/dev/null || { echo "$0: cannot create the output folder $1" >&2; bench_usage; }
OUT=$(cd "$1" && pwd)
WORK=${2:-${TMPDIR:-/tmp}/moeprep-bench}
mkdir -p "$WORK" 2>/dev/null || { echo "$0: cannot create the work folder $WORK" >&2; bench_usage; }
WORK=$(cd "$WORK" && pwd)
set -uo pipefail
START=$SECONDS
PEER=$WORK/peer
PEER_SRC=${PEER_SRC:-.peer/llama.cpp-src.tar.xz}
if [ -z "${SKIP_WHEELS:-}" ] && compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" .whl/*.whl || exit 1
fi
mkdir -p "$WORK/pkgs" && ln -sfn "$PWD/runtime" "$WORK/pkgs/moerun"
export PYTHONPATH=$WORK/site:$WORK/pkgs:$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  lscpu | grep -E "Model name|^CPU\(s\)"; df -h "$WORK" | tail -1; } | tee "$OUT/machine.txt"
echo "results in $OUT, work files in $WORK"
