"""Prefill and decode speed of moerun next to llama.cpp on the same file and machine.

    python bench/bench_runtime.py MODEL [--device cpu|cuda] [--prompt 512] [--gen 64] [--threads N]
                                        [--llama-bench PATH] [--peer-gpu-layers 99] [--json OUT]

Ours: moerun.load_model, one prefill of --prompt seeded random tokens (logits of the last only, after one warm-up
prefill of the same tokens), then --gen greedy decode steps (tokens/s of each). Peer: llama.cpp's own `llama-bench`
binary when --llama-bench is given (-p/-n the same sizes, -r 3, median), otherwise llama-cpp-python on the CPU (one
prefill, then decode steps through its low-level decode, the same counts). Prints one table; --json writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

import moerun

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests.conftest


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_moerun(path: str, device: str, n_prompt: int, n_gen: int) -> dict[str, float]:
    start = time.perf_counter()
    model = moerun.load_model(path, device=device, n_ctx=n_prompt + n_gen + 16)
    sync(device)
    load_s = time.perf_counter() - start
    vocab = model.args.n_vocab
    tokens = torch.randint(1, vocab, (n_prompt,), generator=torch.Generator().manual_seed(0))
    # warm-up: the same prefill once (allocator, kernel compiles, cuBLAS's first call at these shapes), as
    # llama-bench warms up; like its pp test, the prefill wants the last token's logits only
    model.forward(tokens, 0, last_only=True)
    sync(device)
    start = time.perf_counter()
    logits = model.forward(tokens, 0, last_only=True)
    sync(device)
    prefill_s = time.perf_counter() - start
    token = int(logits[-1].argmax())
    model.decode(token, n_prompt)  # warm-up: captures the decode step's CUDA graph where it can be captured
    start = time.perf_counter()
    for i in range(n_gen):
        token = int(model.decode(token, n_prompt + i).argmax())
    sync(device)
    decode_s = time.perf_counter() - start
    return {"load_s": load_s, "prefill_tok_s": n_prompt / prefill_s, "decode_tok_s": n_gen / decode_s}


def bench_llama_bench(binary: str, path: str, n_prompt: int, n_gen: int, threads: int, gpu_layers: int) -> dict:
    out = subprocess.run(
        [
            binary,
            "-m",
            path,
            "-p",
            str(n_prompt),
            "-n",
            str(n_gen),
            "-r",
            "3",
            "-t",
            str(threads),
            "-ngl",
            str(gpu_layers),
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = json.loads(out.stdout)
    speed = {("prefill" if r["n_prompt"] else "decode"): r["avg_ts"] for r in rows}
    return {"prefill_tok_s": speed["prefill"], "decode_tok_s": speed["decode"]}


def bench_llama_cpp_python(path: str, n_prompt: int, n_gen: int, threads: int) -> dict[str, float]:
    import llama_cpp

    import tests.conftest  # noqa: F401  (llama.cpp without the AMX buffers some VMs advertise but do not grant)

    llm = llama_cpp.Llama(
        path,
        n_ctx=n_prompt + n_gen + 16,
        n_batch=n_prompt,
        n_threads=threads,
        n_threads_batch=threads,
        logits_all=True,
        verbose=False,
    )
    tokens = torch.randint(1, llm.n_vocab(), (n_prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    llm.eval(tokens[:16])
    llm.reset()
    start = time.perf_counter()
    llm.eval(tokens)
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(n_gen):
        llm.eval([int(llm.scores[llm.n_tokens - 1].argmax())])
    decode_s = time.perf_counter() - start
    return {"prefill_tok_s": n_prompt / prefill_s, "decode_tok_s": n_gen / decode_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--llama-bench", help="path of llama.cpp's llama-bench binary (else llama-cpp-python, CPU)")
    ap.add_argument("--peer-gpu-layers", type=int, default=0, help="-ngl for llama-bench (99: all on the GPU)")
    ap.add_argument("--no-peer", action="store_true", help="measure moerun only (the peer runs separately)")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ours = bench_moerun(args.model, args.device, args.prompt, args.gen)
    if args.no_peer:
        peer, peer_name = {"prefill_tok_s": float("nan"), "decode_tok_s": float("nan")}, "(peer not run)"
    elif args.llama_bench:
        peer = bench_llama_bench(
            args.llama_bench, args.model, args.prompt, args.gen, args.threads, args.peer_gpu_layers
        )
        peer_name = f"llama-bench -ngl {args.peer_gpu_layers}"
    else:
        peer = bench_llama_cpp_python(args.model, args.prompt, args.gen, args.threads)
        peer_name = "llama-cpp-python (CPU)"
    print(f"\n{Path(args.model).name}: prompt {args.prompt}, decode {args.gen}, {args.threads} threads")
    print(f"{'engine':<34}{'prefill tok/s':>15}{'decode tok/s':>15}")
    print(f"{'moerun --device ' + args.device:<34}{ours['prefill_tok_s']:>15.1f}{ours['decode_tok_s']:>15.2f}")
    print(f"{peer_name:<34}{peer['prefill_tok_s']:>15.1f}{peer['decode_tok_s']:>15.2f}")
    print(f"moerun load: {ours['load_s']:.1f} s")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"moerun": ours, "peer": {"name": peer_name, **peer}, **vars(args)}, indent=2)
        )


if __name__ == "__main__":
    main()
