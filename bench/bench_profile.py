"""Calibration throughput of `moeprep profile` (moerun forward + routing hook) next to llama.cpp's prompt evaluation
of the same file and the same ctx-token chunks.

    python bench/bench_profile.py [--model M.gguf | --synth n_layer=8,n_embd=1024,...] [--device cpu|cuda]
                                  [--ctx 512] [--chunks 8] [--imatrix] [--llama-bench BIN] [--ngl 99] [--json OUT]

moeprep: the chunks run through `collect` exactly as `moeprep profile` runs them (one warm-up chunk first, not
timed); tokens/s = chunk tokens / seconds. llama.cpp: through llama-cpp-python's low-level API when it is importable
(CPU; every chunk from position 0 after clearing the KV cache, logits for every token as llama-imatrix asks), and
with `--llama-bench BIN` through llama.cpp's own llama-bench (`-p ctx -n 0`, prompt processing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from moeprep.profile.collect import ActivationRecorder, collect
from moeprep.profile.dataset import make_chunks, tokenize
from moeprep.profile.identity import identify_model

_quiet = None  # llama.cpp's log callback, alive for the whole run
CALIBRATION = Path(__file__).resolve().parents[1] / "moeprep" / "data" / "calibration.txt"


def synth_model(spec: str, folder: Path) -> Path:
    from moeprep.synth import write_synth_model

    options = {
        k: (v if k.endswith("_type") or k == "preset" else float(v) if "." in v else int(v))
        for k, v in (item.split("=") for item in spec.split(","))
    }
    return write_synth_model(folder / "bench.gguf", **options)


def time_moeprep(path: Path, device: str, ctx: int, chunks: int, imatrix: bool) -> dict:
    import moerun

    t0 = time.perf_counter()
    model = moerun.load_model(path, device=device, n_ctx=ctx)
    load_s = time.perf_counter() - t0
    identity = identify_model(model.gguf)
    tok = model.tokenizer
    # the shipped text tokenized in one piece (no `datasets` needed where the benchmark runs)
    bos = tok.bos_id if tok.add_bos else None
    tokens = tokenize(iter([CALIBRATION.read_text()]), tok.encode, bos is not None, (chunks + 1) * ctx)
    data = make_chunks(tokens, ctx, bos, chunks + 1)
    assert len(data) == chunks + 1, f"the calibration text has too few tokens for {chunks + 1} chunks of {ctx}"
    if imatrix:
        model.add_activation_hook(
            ActivationRecorder({t.name: t.shape[0] if len(t.shape) == 3 else 1 for t in model.gguf.tensors})
        )
    args = (identity.moe_layers, identity.n_expert, identity.n_expert_used)
    collect(model, data[:1], np.zeros(1, bool), *args)  # warm-up: allocations, kernels, caches
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    collect(model, data[1:], np.zeros(len(data) - 1, bool), *args)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {
        "device": device,
        "load_s": round(load_s, 2),
        "tokens": int(data[1:].size),
        "seconds": round(seconds, 3),
        "tokens_per_s": round(data[1:].size / seconds, 1),
        "threads": torch.get_num_threads(),
        "imatrix": imatrix,
        "chunks": data[1:].tolist(),
    }


def time_llama_cpp(path: Path, chunks: list[list[int]], threads: int) -> dict | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    global _quiet
    _quiet = llama_cpp.llama_log_callback(lambda *a: None)  # kept referenced: llama.cpp calls it later
    llama_cpp.llama_log_set(_quiet, None)
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    mparams.use_extra_bufts = False  # AMX/repacked buffers stop some VMs with an illegal instruction
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
    ctx_len = len(chunks[0])
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = ctx_len
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    batch = llama_cpp.llama_batch_init(ctx_len, 0, 1)
    seconds = []
    try:
        for chunk in [chunks[0], *chunks]:  # the first run warms up
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
            for i, tok in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, i, 1, True
                batch.seq_id[i][0] = 0
            batch.n_tokens = len(chunk)
            t0 = time.perf_counter()
            assert llama_cpp.llama_decode(ctx, batch) == 0
            seconds.append(time.perf_counter() - t0)
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    total = sum(seconds[1:])
    return {
        "tool": "llama-cpp-python (CPU)",
        "threads": threads,
        "tokens": ctx_len * len(chunks),
        "seconds": round(total, 3),
        "tokens_per_s": round(ctx_len * len(chunks) / total, 1),
    }


def time_llama_bench(binary: str, path: Path, ctx: int, ngl: int, threads: int) -> dict:
    out = subprocess.run(
        [
            binary,
            "-m",
            str(path),
            "-p",
            str(ctx),
            "-n",
            "0",
            "-r",
            "3",
            "-ngl",
            str(ngl),
            "-fa",
            "0",
            "-t",
            str(threads),
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    row = json.loads(out)[0]
    return {
        "tool": f"llama-bench (-ngl {ngl})",
        "threads": threads,
        "tokens": ctx,
        "tokens_per_s": round(row["avg_ts"], 1),
        "backend": row.get("backends") or row.get("backend"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--synth", help="write a synthetic model with these options, e.g. n_layer=8,n_embd=1024")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--imatrix", action="store_true", help="also collect the importance matrix (as --imatrix-out)")
    parser.add_argument("--llama-bench", help="path of llama.cpp's llama-bench binary")
    parser.add_argument("--ngl", type=int, default=0, help="llama-bench: layers on the GPU")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-profile-"))
    path = args.model or synth_model(args.synth, folder)
    threads = torch.get_num_threads()
    ours = time_moeprep(path, args.device, args.ctx, args.chunks, args.imatrix)
    chunks = ours.pop("chunks")
    results = {
        "model": str(path),
        "file_size": os.path.getsize(path),
        "ctx": args.ctx,
        "moeprep": ours,
        "llama_cpp": [r for r in (time_llama_cpp(path, chunks, threads),) if r],
    }
    if args.llama_bench:
        results["llama_cpp"].append(time_llama_bench(args.llama_bench, path, args.ctx, args.ngl, threads))
    text = json.dumps(results, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
