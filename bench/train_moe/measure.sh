#!/usr/bin/env bash
# The bench model's measurements (docs/BENCHMARKS.md: perplexity and routing; docs/history/benchmarks-log.md: all of
# them), from the committed models, on CPU (about 30 minutes on 2 idle cores).
# Variants and profiles go to bench/train_moe/work/ (git-ignored); the trace and the stats are committed.
set -euo pipefail
cd "$(dirname "$0")/../.."
W=bench/train_moe/work
M=bench/models
mkdir -p $W/variants

# Routing trace and statistics on the held-out text (moerun's routing hook).
python -m bench.train_moe.routing -m $M/bench-qwen3moe-f16.gguf -f bench/data/heldout.txt \
    --trace bench/data/routing-trace.npz --stats bench/train_moe/routing-stats.json

# Importance matrix from training-split text only (moeprep/data/calibration.txt: nine stdlib modules, all in train).
python -m moeprep profile run $M/bench-qwen3moe-f16.gguf --dataset moeprep/data/calibration.txt --holdout 0 \
    -o $W/calibration.moeprof --imatrix-out $W/bench-imatrix.gguf

# The Q4_K-attention variants of the committed Q8_0-attention / Q4_K-experts model.
python -m moeprep quantize $M/bench-qwen3moe-q4k.gguf $W/variants/bench-qwen3moe-q4k-attnq4k.gguf --attn Q4_K
python -m moeprep quantize $M/bench-qwen3moe-q4k.gguf $W/variants/bench-qwen3moe-q4k-attnq4k-imatrix.gguf \
    --attn Q4_K --imatrix $W/bench-imatrix.gguf

# Held-out perplexity, llama.cpp and moerun side by side, on the first 128 of the 258 chunks (32k scored tokens).
rm -f bench/train_moe/perplexity.jsonl
python -m bench.train_moe.evaluate $M/bench-qwen3moe-f16.gguf $M/bench-qwen3moe-q4k.gguf \
    $W/variants/bench-qwen3moe-q4k-attnq4k.gguf $W/variants/bench-qwen3moe-q4k-attnq4k-imatrix.gguf \
    --chunks 128 --json bench/train_moe/perplexity.jsonl

# The profile of the held-out text (20% of its chunks replayed through simulated caches).
python -m moeprep profile run $M/bench-qwen3moe-f16.gguf --dataset bench/data/heldout.txt -o $W/heldout.moeprof
python -m moeprep profile show $W/heldout.moeprof > $W/heldout-profile.txt
