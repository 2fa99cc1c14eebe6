"""The CPU expert path's speed inside a whole decode step, next to llama.cpp's, on the same machine and threads.

    python bench/bench_cpu_expert_share.py MODEL_K MODEL_2K [--threads 1,2] [--rounds 8] [--steps 16] [--json OUT]

The two models differ only in the experts each token uses (`moeprep synth ... --experts-used K`, and 2K): an
engine's decode step on the second minus its step on the first is what K more experts per layer cost it, so (those
experts' bytes per token) / (that difference) is the engine's expert throughput as its decode steps run it, whatever
else a step does (attention, router, norms, dispatch). bench/bench_cpu_experts.py times moerun's kernels alone;
llama.cpp has no such entry point, hence this. Each engine runs each model in a process of its own (no other
engine's threads on its cores), and the four take turns: rounds of --steps decode steps (moerun's Model.decode;
llama.cpp through llama-cpp-python's eval), the median per step reported, so that the machine's load drifts through
all four alike.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

import torch

import moerun
from moeprep.gguf.reader import open_gguf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests.conftest


def expert_bytes_per_token(path: str) -> tuple[int, int]:
    """(experts used per token, bytes of one token's experts over all layers) of a GGUF."""
    g = open_gguf(path)
    per_expert = sum(t.n_bytes // t.shape[0] for t in g.tensors if t.name.endswith("_exps.weight"))
    k = int(g.get(f"{g.arch}.expert_used_count"))
    return k, k * per_expert


class Llama:
    """llama.cpp's CPU decode of one file through llama-cpp-python."""

    def __init__(self, path: str, threads: int, n_ctx: int) -> None:
        import llama_cpp

        import tests.conftest  # noqa: F401  (llama.cpp without the AMX buffers some VMs advertise but do not grant)

        self.llm = llama_cpp.Llama(path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
        self.llm.eval(list(range(1, 17)))

    def decode(self, token: int, pos: int) -> None:
        self.llm.eval([token])


class Moerun:
    def __init__(self, path: str, threads: int, n_ctx: int) -> None:
        self.model = moerun.load_model(path, device="cpu", n_ctx=n_ctx)
        self.model.warm_up()
        self.model.forward(torch.arange(1, 17), 0)

    def decode(self, token: int, pos: int) -> None:
        self.model.decode(token, pos)


def _worker(engine: str, path: str, threads: int, n_ctx: int, steps: int, conn) -> None:
    """One engine on one model in a process of its own (so that no other engine's threads share its cores): loads,
    then runs a round of `steps` decode steps at the positions each message names and answers ms per step."""
    torch.set_num_threads(threads)
    runner = {"moerun": Moerun, "llama.cpp": Llama}[engine](path, threads, n_ctx)
    conn.send("ready")
    while (first := conn.recv()) is not None:
        start = time.perf_counter()
        for i in range(steps):
            runner.decode(7 + i, first + i)
        conn.send((time.perf_counter() - start) / steps * 1000)


def measure(paths: list[str], threads: int, rounds: int, steps: int) -> dict:
    n_ctx = 16 + rounds * steps + 8
    context = multiprocessing.get_context("spawn")
    workers = {}
    for name in ("moerun", "llama.cpp"):
        for i, path in enumerate(paths):
            ours, theirs = context.Pipe()
            process = context.Process(target=_worker, args=(name, path, threads, n_ctx, steps, theirs))
            process.start()
            assert ours.recv() == "ready"
            workers[name, i] = process, ours
    ms = {key: [] for key in workers}
    for r in range(rounds):
        for key, (_, conn) in workers.items():
            time.sleep(0.2)  # the process before lets go of the cores (OpenMP threads spin a while after a region)
            conn.send(16 + r * steps)
            ms[key].append(conn.recv())
    for process, conn in workers.values():
        conn.send(None)
        process.join()
    (k, bytes_k), (k2, bytes_2k) = (expert_bytes_per_token(p) for p in paths)
    result = {"threads": threads, "experts_used": [k, k2], "extra_expert_MB": (bytes_2k - bytes_k) / 1e6}
    for name in ("moerun", "llama.cpp"):
        step = [statistics.median(ms[name, i]) for i in range(2)]
        result[name] = {
            "ms_per_step": [round(v, 2) for v in step],
            "rounds": [ms[name, i] for i in range(2)],
            "expert_GB_s": round((bytes_2k - bytes_k) / 1e6 / (step[1] - step[0]), 1),
        }
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_k")
    ap.add_argument("model_2k")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--json")
    args = ap.parse_args()
    results = []
    for threads in (int(t) for t in args.threads.split(",")):
        r = measure([args.model_k, args.model_2k], threads, args.rounds, args.steps)
        results.append(r)
        k, k2 = r["experts_used"]
        print(f"{threads} threads, {k} -> {k2} experts per token ({r['extra_expert_MB']:.0f} MB more per token):")
        for name in ("moerun", "llama.cpp"):
            step = r[name]["ms_per_step"]
            print(
                f"  {name:9} decode step {step[0]:.2f} -> {step[1]:.2f} ms: the extra experts at "
                f"{r[name]['expert_GB_s']:.1f} GB/s",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
