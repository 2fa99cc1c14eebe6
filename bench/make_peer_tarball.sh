#!/usr/bin/env bash
# Makes .peer/llama.cpp-src.tar.xz, the peer's sources the bench/gpu_*.sh scripts build llama-bench and llama-server
# from on a GPU machine that may have no package registry: llama.cpp as vendored by the llama-cpp-python sdist the
# test extra pins, cut to what those two tools need so that it is small enough to copy along with the working tree
# (about 2.6 MB).
#
#   bash bench/make_peer_tarball.sh        (needs the package registry; the scripts read PEER_SRC, default this file)
#
# Kept: ggml with its CPU and CUDA backends (x86 only), src, common, include, cmake, vendor, and the tools llama-bench,
# server (with mtmd, which it links, and ui, configured with no assets: -DLLAMA_BUILD_UI=OFF
# -DLLAMA_USE_PREBUILT_UI=OFF). Dropped: docs, models, tests, examples, python, other backends and tools, media.
set -euo pipefail
VERSION=${VERSION:-0.3.36}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK"
tar xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
cd "$SRC"
rm -rf docs media models examples tests gguf-py benches pocs skills conversion app .github ci requirements
find . -name "*.py" -delete
for d in ggml/src/*/; do
  case $d in ggml/src/ggml-cpu/|ggml/src/ggml-cuda/) ;; *) [ -f "$d/CMakeLists.txt" ] && rm -rf "$d" ;; esac
done
rm -rf ggml/src/ggml-cpu/arch/{arm,riscv,loongarch,powerpc,s390,wasm} ggml/src/ggml-cpu/{spacemit,kleidiai}
for d in tools/*/; do
  case $d in tools/llama-bench/|tools/server/|tools/mtmd/|tools/ui/) ;; *) rm -rf "$d" ;; esac
done
rm -rf tools/ui/src tools/ui/tests tools/ui/static tools/ui/package-lock.json tools/server/tests tools/server/bench \
       tools/server/public* tools/server/themes tools/mtmd/tests
rm -f tools/mtmd/*.mp4 tools/mtmd/*.jpg tools/mtmd/*.png tools/mtmd/*.mp3 tools/mtmd/*.wav AUTHORS
find scripts -type f ! -name ui-assets.cmake -delete  # (the ui's CMake names that one)
printf 'find_package(Threads REQUIRED)\nllama_add_compile_flags()\nadd_subdirectory(llama-bench)\nif (LLAMA_BUILD_SERVER)\n    add_subdirectory(ui)\n    add_subdirectory(server)\nendif()\nadd_subdirectory(mtmd)\n' \
  > tools/CMakeLists.txt
cd "$OLDPWD"
mkdir -p .peer
# xz -9e: the smallest tarball, for copies of the working tree that are limited in size
tar cf - -C "$(dirname "$SRC")" llama.cpp | xz -9e > .peer/llama.cpp-src.tar.xz
ls -la .peer/llama.cpp-src.tar.xz
