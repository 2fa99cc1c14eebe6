"""moerun with the expert cache at a VRAM budget, next to the same model all resident: `moerun bench`'s tests
(runtime/bench.py) for each setting in one process, so the numbers share a machine state.

    python bench/bench_cache.py MODEL --budget 8G [-p 512] [-n 128] -f TEXT [--warm-text TEXT] [--routing TRACE]
                                [--json OUT]

Settings: `resident` (every expert on the GPU), `cold` (the cache at the budget, starting empty), `warm` (the cache
warmed by expert counts, as `--expert-profile` warms it; the counts are taken here over --warm-text with a routing
hook on the resident model, which is what `moeprep profile` records, so the GPU machine needs no profile file), and
`warm-64` / `cold-64` (the first 64 decode tokens only: the warm start's gain), and `cold-cpu` / `warm-cpu` (decode's
misses not streamed from host RAM but computed on the CPU: CacheConfig.stream off). Each cached setting runs in a
process of its own (`--setting NAME`), so one setting's pinned memory, threads and compiled kernels do not weigh
on the next. `--settings cold` runs just that one (a model near the machine's RAM: no resident load first).

`--routing TRACE` replays a routing trace in every setting (runtime/replay.py: `moerun bench --routing`): the
routers run, the MoE layers use the trace's experts, so the cache meets that routing with the real kernels; a trace
of another shape than the model's is refused. With a trace, the warm settings' counts come from the trace's other
chunks (those not replayed: held out, as a profile's counts are), so the warm start and the decode share a routing.
`static` is the cold setting with the cache's plan forced to the static split (`--cache-plan static`: whole layers'
experts on the GPU, the rest computed by the CPU), the plan llama.cpp's `--n-cpu-moe` makes, for the comparison.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

import moerun
from moeprep.errors import MoeprepError
from moeprep.profile.tracefile import read_trace
from moeprep.units import parse_size
from moerun.bench import format_result, run_bench
from moerun.cache.config import CacheConfig
from moerun.cache.controller import describe_cache


def trace_counts(trace, n_layers: int, moe_layers: tuple[int, ...], n_tokens: int) -> np.ndarray:
    """[L, E] how often each layer selected each expert over the trace's chunks that the replay does not read (the
    replay reads the first chunk of at least n_tokens: moerun.replay.pick_chunk)."""
    from moerun.replay import pick_chunk

    replayed = pick_chunk(trace, n_tokens, "the trace")
    counts = np.zeros((n_layers, trace.n_expert), np.int64)
    for c in range(trace.n_chunks):
        if c == replayed:
            continue
        ids = trace.ids[trace.starts[c] : trace.starts[c + 1]]  # [n, M, K]
        for m, layer in enumerate(moe_layers):
            counts[layer] += np.bincount(ids[:, m].ravel(), minlength=trace.n_expert)
    if not counts.any():
        raise MoeprepError("the trace has no chunk besides the replayed one to warm the cache from: write more tokens")
    return counts


def expert_counts(model, text: str, chunk: int = 512, max_tokens: int = 16384) -> np.ndarray:
    """[L, E] how often each layer selected each expert over the text, as `moeprep profile` counts them."""
    from moeprep.profile.collect import collect
    from moeprep.profile.identity import identify_model

    tokens = model.tokenizer.encode(text)[:max_tokens]
    chunks = np.array(tokens[: len(tokens) // chunk * chunk]).reshape(-1, chunk)
    identity = identify_model(model.gguf)
    counts, _ = collect(
        model, chunks, np.zeros(len(chunks), bool), identity.moe_layers, identity.n_expert, identity.n_expert_used
    )
    return counts.block_table(model.args.n_layers)


SETTINGS = {
    "cold": (False, None, {}),
    "warm": (True, None, {}),
    "warm-64": (True, 64, {}),
    "cold-64": (False, 64, {}),
    "cold-cpu": (False, None, {"stream": False}),
    "static": (False, None, {"plan": "static"}),
    "warm-cpu": (True, None, {"stream": False}),
}
# (warm, decode tokens, CacheConfig fields)
ALL_SETTINGS = ("resident", *SETTINGS)


def run_setting(args, name: str, text: str) -> dict:
    """One cached setting in this process: load at the budget, bench, print, return the results."""
    warm, gen, fields = SETTINGS[name]
    usage = np.load(args.usage) if warm else None
    n_prompt, n_gen = (0, gen) if gen else (args.prompt, args.gen)
    config = CacheConfig(budgets=[parse_size(args.budget)], usage=usage, cpu_threads=args.threads, **fields)
    model = moerun.load_model(args.model, device="cuda", n_ctx=args.prompt + args.gen + 8, cache=config)
    print(f"== {name}\n{describe_cache(model.expert_cache)}", flush=True)
    result = run_bench(model, n_prompt, n_gen, text, **routing_args(args))
    print(format_result(result), flush=True)
    return {**result.as_dict(), "share_cached": model.expert_cache.placement.share}


def routing_args(args) -> dict:
    """run_bench's routing arguments: the trace of --routing, or none."""
    return {"routing": read_trace(args.routing), "routing_name": args.routing} if args.routing else {}


def refuse(message: str) -> None:
    """Bad input: one line on stderr, exit code 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--budget", required=True)
    ap.add_argument("-p", "--prompt", type=int, default=512)
    ap.add_argument("-n", "--gen", type=int, default=128)
    ap.add_argument("-f", "--text", required=True, help="Text to teacher-force prefill and decode over.")
    ap.add_argument("--warm-text", help="Text to count expert use over for the warm start (default: none).")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--json")
    ap.add_argument(
        "--settings",
        help=f"Which of {','.join(ALL_SETTINGS)} to run, in this order (default: all, "
        "or resident,cold without --warm-text).",
    )
    ap.add_argument("--setting", choices=SETTINGS, help="Run only this cached setting (the driver's child).")
    ap.add_argument("--usage", help="With --setting: the warm start's counts (.npy).")
    ap.add_argument("--routing", help="Replay this routing trace (moeprep routing generate/extract) in every setting.")
    args = ap.parse_args()
    try:
        if args.routing:
            read_trace(args.routing)  # a damaged or foreign trace: refused before any model is loaded
    except MoeprepError as e:
        refuse(str(e))
    text = Path(args.text).read_text(encoding="utf-8", errors="replace")
    if args.setting:
        result = run_setting(args, args.setting, text)
        if args.json:
            Path(args.json).write_text(json.dumps(result))
        return
    settings = args.settings.split(",") if args.settings else ALL_SETTINGS if args.warm_text else ("resident", "cold")
    unknown = sorted(set(settings) - set(ALL_SETTINGS))
    if unknown:
        refuse(f"unknown settings {', '.join(unknown)}; choose from {', '.join(ALL_SETTINGS)}")
    warm = any(SETTINGS[name][0] for name in settings if name in SETTINGS)
    if warm and not (args.warm_text or args.routing):
        refuse("the warm settings need --warm-text (or a --routing trace to count over)")
    results, usage = {}, None
    if warm and args.routing:
        from moeprep.gguf.reader import open_gguf
        from moeprep.profile.identity import identify_model

        identity = identify_model(open_gguf(args.model))
        try:
            usage = trace_counts(
                read_trace(args.routing), identity.n_layer, identity.moe_layers, args.prompt + args.gen
            )
        except MoeprepError as e:
            refuse(str(e))
        warm = False  # counted: the resident model is not needed for them
    if "resident" in settings or warm:
        resident = moerun.load_model(args.model, device="cuda", n_ctx=max(args.prompt + args.gen + 8, 520))
        if warm:
            usage = expert_counts(resident, Path(args.warm_text).read_text(errors="replace"))
        if "resident" in settings:
            result = run_bench(resident, args.prompt, args.gen, text, **routing_args(args))
            print("== resident\n" + format_result(result), flush=True)
            results["resident"] = result.as_dict()
            save(args.json, results)
        del resident
        torch.cuda.empty_cache()
    folder = Path(tempfile.mkdtemp())
    child = (
        [
            sys.executable,
            __file__,
            args.model,
            "--budget",
            args.budget,
            "-p",
            str(args.prompt),
            "-n",
            str(args.gen),
            "-f",
            args.text,
        ]
        + (["--threads", str(args.threads)] if args.threads else [])
        + (["--routing", args.routing] if args.routing else [])
    )
    if usage is not None:
        np.save(folder / "usage.npy", usage)
        child += ["--usage", str(folder / "usage.npy")]
    for name in (s for s in settings if s in SETTINGS):
        out = folder / f"{name}.json"
        subprocess.run([*child, "--setting", name, "--json", str(out)], check=False)
        if out.exists():
            results[name] = json.loads(out.read_text())
            save(args.json, results)


def save(path: str | None, results: dict) -> None:
    """The results so far (a run cut short by a time limit keeps what it measured)."""
    if path:
        Path(path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
