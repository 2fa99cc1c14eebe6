"""The GPU path's decode against llama.cpp on the trained bench model, with the matrix-vector kernel's 8-bit route on
and off: perplexity over teacher-forced decode steps, top-1 agreement, median relative logit difference.

    python bench/bench_route_agreement.py [--device cuda] [--positions 24] [--prompt 16]
    python bench/bench_route_agreement.py --device cuda --chunks 128 [--ctx 512] [--peer-only]

With --chunks, the held-out text is scored the way llama-perplexity scores it (moerun.perplexity: chunks of --ctx
tokens, each a fresh sequence, the second half scored), but every scored logit comes from a decode step: a chunk's
first half runs as a prompt, then one teacher-forced decode step per position. That is the long sample the 0.1%
criterion needs (a hundred positions spread the perplexity by tenths of a percent); moerun's prompt path (one forward
per chunk) is scored beside it. llama.cpp's figure is computed where llama-cpp-python imports (`--peer-only`: that
alone, on a machine without a GPU); it does not depend on moerun's device.

On a CPU (`--device cpu`, the default) the GPU path's modules are built there and their Triton kernels run in the
interpreter, on tiles that cover a matrix in few programs (its cost is per program): a decode step of the 6-layer
model takes tens of seconds, so keep --positions small. llama.cpp (llama-cpp-python, CPU) computes the same tokens'
logits in one evaluation. The text is held-out text (bench/data/heldout.txt) the model was not trained on.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

if "--device" not in sys.argv or "cpu" in sys.argv:  # Triton reads the variable when it decorates a kernel
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import torch

import moerun
from moeprep.gguf.reader import open_gguf
from moerun.kernels import tuning
from moerun.options import RuntimeOptions
from moerun.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "bench" / "models" / "bench-qwen3moe-q4k.gguf"


def interpreted_gpu_path() -> None:
    """The GPU path's modules on the CPU (bench/count_decode_ops.py's emulation) on wide tiles."""
    sys.path.insert(0, str(ROOT / "bench"))
    from count_decode_ops import emulate_gpu_path

    emulate_gpu_path()
    tuning.GEMV_BY_BLOCK_VALUES = {
        256: tuning.GemvTiles(rows=64, blocks=4, num_warps=32),
        32: tuning.GemvTiles(rows=64, blocks=32, num_warps=32),
    }
    tuning.GEMM_BY_BLOCK_VALUES = {256: tuning.GemmTiles(64, 64, 4), 32: tuning.GemmTiles(64, 64, 32)}
    for name in (
        "GEMV_OVERRIDES",
        "GEMV_GROUPED_OVERRIDES",
        "GEMV_I8_OVERRIDES",
        "GEMV_I8_GROUPED_OVERRIDES",
        "DENSE_GEMM_OVERRIDES",
        "GROUPED_GEMM_OVERRIDES",
    ):
        setattr(tuning, name, {})


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
    scores = torch.from_numpy(np.array(llm.scores[prompt - 1 : prompt + positions - 1], dtype=np.float32))
    llm.close()
    return scores


def decoded_perplexity(model: moerun.Model, tokens: list[int], n_ctx: int) -> float:
    """moerun.perplexity's chunks and scored positions, each scored logit from a decode step: a chunk's first half as
    a prompt, then one teacher-forced step per position."""
    first, nll, count = n_ctx // 2, 0.0, 0
    for start in range(0, len(tokens) // n_ctx * n_ctx, n_ctx):
        chunk = tokens[start : start + n_ctx]
        model.forward(torch.tensor(chunk[:first]), 0, last_only=True)
        logits = torch.stack([model.decode(chunk[p], p).float() for p in range(first, n_ctx - 1)])
        targets = torch.tensor(chunk[first + 1 :], device=logits.device)
        nll -= float(torch.log_softmax(logits.double(), dim=-1).gather(-1, targets[:, None]).sum())
        count += len(targets)
    return math.exp(nll / count)


def chunk_perplexities(args: argparse.Namespace, error: Callable[[str], None]) -> None:
    """--chunks: perplexity over the first args.chunks chunks of the held-out text, llama.cpp's (as
    bench/train_moe/evaluate.py computes it, each engine tokenizing the text itself) and moerun's decode and prompt
    paths."""
    sys.path.insert(0, str(ROOT))
    from bench.train_moe.evaluate import llama_cpp_perplexity

    text = (ROOT / "bench" / "data" / "heldout.txt").read_text(encoding="utf-8")
    has_peer = importlib.util.find_spec("llama_cpp") is not None
    if args.chunks < 2:
        error("--chunks takes 2 or more (moerun.perplexity scores at least two chunks)")
    if args.peer_only and not has_peer:
        error("--peer-only needs llama-cpp-python")
    tokens = Tokenizer(open_gguf(MODEL)).encode(text, add_bos=False)
    if len(tokens) < args.chunks * args.ctx:
        error(f"the held-out text has {len(tokens) // args.ctx} chunks of {args.ctx} tokens, not {args.chunks}")
    tokens = tokens[: args.chunks * args.ctx]
    print(
        f"{MODEL.name}: {args.chunks} chunks of {args.ctx} tokens, {args.chunks * (args.ctx // 2 - 1)} scored "
        f"positions, device {args.device}",
        flush=True,
    )
    if has_peer:
        start = time.time()
        ppl, count = llama_cpp_perplexity(MODEL, text, args.ctx, args.chunks)
        print(
            f"llama.cpp (llama-cpp-python, CPU): perplexity {ppl:.4f} over {count} positions "
            f"({time.time() - start:.0f} s)",
            flush=True,
        )
    else:
        print(
            "llama.cpp: not run (llama-cpp-python does not import here); its figure does not depend on the device: "
            "run this command with --peer-only where it does"
        )
    if args.peer_only:
        return
    for name, int8, score in [
        (f"decode steps, 8-bit route {'on' if int8 else 'off'}", int8, decoded_perplexity) for int8 in (True, False)
    ] + [("prompt path (one forward per chunk)", True, moerun.perplexity)]:
        # anew for each path: a CUDA model keeps the decode graphs it captured first
        model = moerun.load_model(
            MODEL,
            device=args.device,
            dtype=torch.bfloat16,
            n_ctx=args.ctx,
            options=RuntimeOptions(triton_on_cpu=args.device == "cpu", gemv_int8=int8),
        )
        start = time.time()
        ppl = score(model, tokens, args.ctx)
        print(f"moerun {name}: perplexity {ppl:.4f} ({time.time() - start:.0f} s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--positions", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--chunks", type=int, help="score this many whole chunks of the held-out text instead")
    ap.add_argument("--ctx", type=int, default=512, help="tokens per chunk with --chunks")
    ap.add_argument("--peer-only", action="store_true", help="with --chunks: llama.cpp's perplexity alone")
    args = ap.parse_args()
    if args.chunks:
        chunk_perplexities(args, ap.error)
        return
    if args.device == "cpu":
        interpreted_gpu_path()
    model = moerun.load_model(
        MODEL,
        device=args.device,
        dtype=torch.bfloat16,
        n_ctx=args.prompt + args.positions + 8,
        options=RuntimeOptions(triton_on_cpu=args.device == "cpu"),
    )
    text = (ROOT / "bench" / "data" / "heldout.txt").read_text()[20000:30000]
    tokens = model.tokenizer.encode(text)[: args.prompt + args.positions]
    target = torch.tensor(tokens[args.prompt : args.prompt + args.positions])
    ref = llama_cpp_logits(tokens, args.prompt, args.positions)

    def perplexity(logits: torch.Tensor) -> float:
        return float(torch.exp(torch.nn.functional.cross_entropy(logits, target)))

    print(
        f"{MODEL.name}: {args.positions} decoded positions after a {args.prompt}-token prompt, device "
        f"{args.device}{' (GPU path in the interpreter)' if args.device == 'cpu' else ''}"
    )
    print(f"llama.cpp (llama-cpp-python, CPU): perplexity {perplexity(ref):.4f}")
    for int8 in (True, False):
        # anew: the decode graphs captured first would replay the first route
        model = moerun.load_model(
            MODEL,
            device=args.device,
            dtype=torch.bfloat16,
            n_ctx=args.prompt + args.positions + 8,
            options=RuntimeOptions(triton_on_cpu=args.device == "cpu", gemv_int8=int8),
        )
        start = time.time()
        logits = decoded_logits(model, tokens, args.prompt, args.positions)
        agree = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
        rel = float(((logits - ref).norm(dim=-1) / ref.norm(dim=-1)).median())
        print(
            f"moerun, 8-bit route {'on ' if int8 else 'off'}: perplexity {perplexity(logits):.4f} "
            f"({100 * (perplexity(logits) / perplexity(ref) - 1):+.2f}% of llama.cpp's), top-1 agreement "
            f"{agree:.3f}, median relative logit difference {rel:.4f} ({time.time() - start:.0f} s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
