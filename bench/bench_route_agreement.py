"""The GPU path's decode against llama.cpp on the trained bench model, with the matrix-vector kernel's 8-bit route on
and off: perplexity over teacher-forced decode steps, top-1 agreement, median relative logit difference.

    python bench/bench_route_agreement.py [--device cuda] [--positions 24] [--prompt 16]

On a CPU (`--device cpu`, the default) the GPU path's modules are built there and their Triton kernels run in the
interpreter, on tiles that cover a matrix in few programs (its cost is per program): a decode step of the 6-layer
model takes tens of seconds, so keep --positions small. llama.cpp (llama-cpp-python, CPU) computes the same tokens'
logits in one evaluation. The text is held-out text (bench/data/heldout.txt) the model was not trained on.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if "--device" not in sys.argv or "cpu" in sys.argv:  # Triton reads the variable when it decorates a kernel
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import torch

import moerun
from moerun import layers
from moerun.kernels import tuning

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "bench" / "models" / "bench-qwen3moe-q4k.gguf"


def interpreted_gpu_path() -> None:
    """The GPU path's modules on the CPU (bench/count_decode_ops.py's emulation) on wide tiles."""
    sys.path.insert(0, str(ROOT / "bench"))
    from count_decode_ops import emulate_gpu_path

    emulate_gpu_path()
    tuning.GEMV_BY_BLOCK_VALUES = {256: tuning.GemvTiles(rows=64, blocks=4, num_warps=32),
                                   32: tuning.GemvTiles(rows=64, blocks=32, num_warps=32)}
    tuning.GEMM_BY_BLOCK_VALUES = {256: tuning.GemmTiles(64, 64, 4), 32: tuning.GemmTiles(64, 64, 32)}
    for name in ("GEMV_OVERRIDES", "GEMV_GROUPED_OVERRIDES", "GEMV_I8_OVERRIDES", "GEMV_I8_GROUPED_OVERRIDES",
                 "DENSE_GEMM_OVERRIDES", "GROUPED_GEMM_OVERRIDES"):
        setattr(tuning, name, {})
    chosen = layers.fused_kernels()
    layers.kernels_for = lambda device: chosen


def decoded_logits(model: moerun.Model, tokens: list[int], prompt: int, positions: int) -> torch.Tensor:
    """(positions, vocab): the prompt's last logits, then one decode step per token."""
    logits = [model.forward(torch.tensor(tokens[:prompt]), 0)[-1].float().reshape(-1)]
    for i in range(prompt, prompt + positions - 1):
        logits.append(model.decode(tokens[i], i).float().reshape(-1).cpu())
    return torch.stack([t.cpu() for t in logits])


def llama_cpp_logits(tokens: list[int], prompt: int, positions: int) -> torch.Tensor:
    from llama_cpp import Llama

    llm = Llama(model_path=str(MODEL), n_ctx=prompt + positions + 8, logits_all=True, verbose=False)
    llm.eval(tokens[: prompt + positions - 1])
    scores = torch.from_numpy(np.array(llm.scores[prompt - 1: prompt + positions - 1], dtype=np.float32))
    llm.close()
    return scores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--positions", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=16)
    args = ap.parse_args()
    if args.device == "cpu":
        interpreted_gpu_path()
    model = moerun.load_model(MODEL, device=args.device, dtype=torch.bfloat16, n_ctx=args.prompt + args.positions + 8)
    text = (ROOT / "bench" / "data" / "heldout.txt").read_text()[20000:30000]
    tokens = model.tokenizer.encode(text)[: args.prompt + args.positions]
    target = torch.tensor(tokens[args.prompt: args.prompt + args.positions])
    ref = llama_cpp_logits(tokens, args.prompt, args.positions)

    def perplexity(logits: torch.Tensor) -> float:
        return float(torch.exp(torch.nn.functional.cross_entropy(logits, target)))

    print(f"{MODEL.name}: {args.positions} decoded positions after a {args.prompt}-token prompt, device "
          f"{args.device}{' (GPU path in the interpreter)' if args.device == 'cpu' else ''}")
    print(f"llama.cpp (llama-cpp-python, CPU): perplexity {perplexity(ref):.4f}")
    for int8 in (True, False):
        tuning.GEMV_INT8 = int8
        start = time.time()
        logits = decoded_logits(model, tokens, args.prompt, args.positions)
        agree = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
        rel = float(((logits - ref).norm(dim=-1) / ref.norm(dim=-1)).median())
        print(f"moerun, 8-bit route {'on ' if int8 else 'off'}: perplexity {perplexity(logits):.4f} "
              f"({100 * (perplexity(logits) / perplexity(ref) - 1):+.2f}% of llama.cpp's), top-1 agreement "
              f"{agree:.3f}, median relative logit difference {rel:.4f} ({time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
