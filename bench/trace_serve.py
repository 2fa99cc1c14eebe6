"""`moerun serve` with its engine's steps and the scheduler's passes timed, in the server's own process: where a
serving level's time goes (bench_serve.py --trace FILE starts ours through this).

    python bench/trace_serve.py --summary FILE serve -m MODEL ...    (the arguments of `moerun serve`)

When the server stops (Ctrl-C or SIGTERM) it writes to FILE: the passes through the model by (sequences, tokens),
a decode pass being one token of each sequence and a prompt pass chunks of up to prefill_chunk tokens, each with its
count, mean and total time (host work, GPU time and the wait for it: a pass ends when its tokens are sampled); the
engine's time between two steps and a step's time outside its passes (admission, replies to the HTTP side), by the
jobs running. Timing costs two clock reads a pass.
"""

from __future__ import annotations

import signal
import statistics
import sys
import time
from collections import defaultdict

from moerun.cli import main as moerun_main
from moerun.serve.engine import Engine
from moerun.serve.scheduler import Scheduler

steps: list[tuple[float, float, int]] = []  # (start, end, jobs running or waiting before it)
passes: list[tuple[float, float, int, int]] = []  # (start, end, sequences, tokens)


def traced_step(step):
    def run(engine: Engine) -> None:
        jobs = sum(s.job is not None for s in engine.scheduler.sequences) + len(engine.scheduler.waiting)
        start = time.perf_counter()
        step(engine)
        steps.append((start, time.perf_counter(), jobs))

    return run


def traced_pass(one_pass):
    def run(scheduler: Scheduler, chunks: list[tuple[int, list[int]]], *args):
        start = time.perf_counter()
        outputs = one_pass(scheduler, chunks, *args)
        passes.append((start, time.perf_counter(), len(chunks), sum(len(chunk) for _, chunk in chunks)))
        return outputs

    return run


def table(title: str, groups: dict) -> list[str]:
    lines = [f"{title}: count, mean ms, total s"]
    for key in sorted(groups):
        times = groups[key]
        lines.append(f"  {key}: {len(times)}, {1e3 * statistics.fmean(times):.3f}, {sum(times):.3f}")
    return lines


def summary() -> str:
    by_pass, between, outside = defaultdict(list), defaultdict(list), defaultdict(list)
    for start, end, sequences, tokens in passes:
        by_pass[sequences, tokens].append(end - start)
    for (_, end, _), (start, _, jobs) in zip(steps, steps[1:]):
        if start - end < 0.05:  # the engine went on at once (a longer gap: it waited for requests)
            between[jobs].append(start - end)
    i = 0
    for start, end, jobs in steps:  # passes come in order, inside their steps
        inside = 0.0
        while i < len(passes) and passes[i][0] < end:
            inside += passes[i][1] - passes[i][0]
            i += 1
        outside[jobs].append(end - start - inside)
    span = steps[-1][1] - steps[0][0] if steps else 0.0
    return (
        "\n".join(
            [
                f"{len(steps)} steps over {span:.2f} s, {sum(e - s for s, e, _ in steps):.2f} s in them",
                *table("passes by (sequences, tokens)", by_pass),
                *table("engine time between steps, by the jobs of the next", between),
                *table("step time outside its passes, by its jobs", outside),
            ]
        )
        + "\n"
    )


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[1] != "--summary":
        print("usage:" + __doc__.split("\n\n")[1], file=sys.stderr)
        sys.exit(2)
    path = sys.argv[2]
    sys.argv = ["moerun", *sys.argv[3:]]
    Engine._step = traced_step(Engine._step)
    Scheduler._pass = traced_pass(Scheduler._pass)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop as Ctrl-C does, so that the summary is written
    try:
        moerun_main()
    finally:
        with open(path, "w") as f:
            f.write(summary())


if __name__ == "__main__":
    main()
