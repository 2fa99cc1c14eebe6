"""Held-out perplexity of bench GGUFs in llama.cpp (llama-cpp-python) and moerun, side by side.

    python -m bench.train_moe.evaluate MODEL.gguf [MODEL.gguf ...] [-f bench/data/heldout.txt] [-c 512] [--chunks N]

Both engines score the way llama-perplexity does (moerun.perplexity's definition): the text's tokens are cut into
chunks of n_ctx, each evaluated as a fresh sequence, and only the second half of each chunk is scored, so every
scored token has at least n_ctx/2 tokens of context. The bench vocabulary adds no BOS.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np

import moerun


def open_llama(model_path: Path, n_ctx: int):
    """llama_cpp.Llama with all logits kept and without repacked/AMX weight buffers (tests/conftest.py says why:
    some VMs advertise AMX without granting it, and quantized weights then die with SIGILL)."""
    import llama_cpp
    import llama_cpp.llama_cpp as api  # the name llama_cpp.Llama looks the defaults up under

    default_params = api.llama_model_default_params

    def params():
        p = default_params()
        p.use_extra_bufts = False
        return p

    api.llama_model_default_params = params
    try:
        return llama_cpp.Llama(str(model_path), n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, verbose=False, seed=0)
    finally:
        api.llama_model_default_params = default_params


def llama_cpp_perplexity(model_path: Path, text: str, n_ctx: int, chunks: int | None) -> tuple[float, int]:
    """-> (perplexity, scored tokens) through llama.cpp's CPU backend."""
    llm = open_llama(model_path, n_ctx)
    try:
        tokens = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        n_chunks = len(tokens) // n_ctx if chunks is None else min(chunks, len(tokens) // n_ctx)
        first = n_ctx // 2
        nll, count = 0.0, 0
        for c in range(n_chunks):
            chunk = tokens[c * n_ctx : (c + 1) * n_ctx]
            llm.reset()
            llm.eval(chunk)
            logits = np.asarray(llm.scores[first : n_ctx - 1], dtype=np.float64)  # [n_ctx/2 - 1, V]
            logits -= logits.max(-1, keepdims=True)
            log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
            targets = np.asarray(chunk[first + 1 :])
            nll -= float(log_probs[np.arange(len(targets)), targets].sum())
            count += len(targets)
    finally:
        llm.close()
    return math.exp(nll / count), count


def moerun_perplexity(model_path: Path, text: str, n_ctx: int, chunks: int | None) -> float:
    model = moerun.load_model(model_path, n_ctx=n_ctx)
    tokens = model.tokenizer.encode(text, add_bos=False)
    if chunks is not None:
        tokens = tokens[: chunks * n_ctx]
    return moerun.perplexity(model, tokens, n_ctx)


def main() -> None:
    here = Path(__file__).resolve().parent
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("models", type=Path, nargs="+")
    p.add_argument("-f", "--file", type=Path, default=here.parent / "data" / "heldout.txt")
    p.add_argument("-c", "--ctx-size", type=int, default=512)
    p.add_argument("--chunks", type=int, help="score only the first N chunks (default: all)")
    p.add_argument("--json", type=Path, help="append one JSON line per model here")
    a = p.parse_args()
    text = a.file.read_text(encoding="utf-8")
    print("| model | size (MB) | llama.cpp PPL | moerun PPL | scored tokens |")
    print("| --- | --- | --- | --- | --- |")
    for path in a.models:
        t0 = time.perf_counter()
        ppl_llama, count = llama_cpp_perplexity(path, text, a.ctx_size, a.chunks)
        t1 = time.perf_counter()
        ppl_moerun = moerun_perplexity(path, text, a.ctx_size, a.chunks)
        t2 = time.perf_counter()
        print(
            f"| {path.name} | {path.stat().st_size / 1e6:.2f} | {ppl_llama:.4f} | {ppl_moerun:.4f} | {count} |",
            flush=True,
        )
        if a.json:
            with open(a.json, "a") as f:
                f.write(
                    json.dumps(
                        {
                            "model": path.name,
                            "bytes": path.stat().st_size,
                            "llama_cpp_ppl": ppl_llama,
                            "moerun_ppl": ppl_moerun,
                            "scored_tokens": count,
                            "ctx": a.ctx_size,
                            "llama_cpp_seconds": round(t1 - t0, 1),
                            "moerun_seconds": round(t2 - t1, 1),
                        }
                    )
                    + "\n"
                )


if __name__ == "__main__":
    main()
